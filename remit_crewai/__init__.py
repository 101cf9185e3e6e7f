"""Remit for CrewAI Flows: `RemitFlowPersistence`, a drop-in `FlowPersistence`.

    from remit_crewai import RemitFlowPersistence

    @persist(RemitFlowPersistence("postgresql://..."))
    class OrderFlow(Flow[OrderState]): ...

Flow code stays as it is; effects that must happen once are declared with
`remit_core.effect`. `fork_token` lets `kickoff(restore_from_state_id=...)` fork.
"""

from remit_crewai._session import fork_token
from remit_crewai.persistence import RemitFlowPersistence, SavedCheckpoint

__all__ = ["RemitFlowPersistence", "SavedCheckpoint", "fork_token"]
