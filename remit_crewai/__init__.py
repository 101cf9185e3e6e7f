"""Remit for CrewAI Flows: `RemitFlowPersistence`, a drop-in `FlowPersistence`.

    from remit_crewai import RemitFlowPersistence

    @persist(RemitFlowPersistence("postgresql://..."))
    class OrderFlow(Flow[OrderState]): ...

Flow code stays as it is; effects that must happen once are declared with
`remit_core.effect`. `fork_token` lets `kickoff(restore_from_state_id=...)` fork.

Importing the package registers its CrewAI hooks and wrappers (`_hooks.install`; they
act only on Remit-backed flows): a persistence first made in the middle of CrewAI's
`from_pending` (Remit as CrewAI's default persistence, `set_flow_persistence_factory`)
would otherwise come after the wrapper that makes that call claim the flow. It also
gives every process forked from then on a CrewAI event bus of its own (`_after_fork`).
"""

from remit_crewai import _after_fork, _hooks
from remit_crewai._session import fork_token
from remit_crewai.persistence import RemitFlowPersistence, SavedCheckpoint

_hooks.install()
_after_fork.install()

__all__ = ["RemitFlowPersistence", "SavedCheckpoint", "fork_token"]
