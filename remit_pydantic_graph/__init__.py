"""Remit for pydantic-graph 1.x: `RemitStatePersistence`, a drop-in `BaseStatePersistence`.

from remit_pydantic_graph import RemitStatePersistence
persistence = RemitStatePersistence("sqlite:///remit.db", run_id="order-42")
await graph.run(Start(), state=state, persistence=persistence)
"""

from remit_pydantic_graph.persistence import EndNotRunnable, RemitStatePersistence, UnknownPause

__all__ = ["EndNotRunnable", "RemitStatePersistence", "UnknownPause"]
