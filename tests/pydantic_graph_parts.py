"""What the pydantic-graph probe files share: a persistence set to a graph, and a
run's line as (node, status) pairs."""

from __future__ import annotations

from typing import Any

from pydantic_graph.graph import Graph
from pydantic_graph.persistence import Snapshot

from remit_pydantic_graph import RemitStatePersistence

#: A lease short enough that a dead holder's claim runs out within a test.
LEASE = 1.0


def persistence(
    url: str, run_id: str, graph: Graph[Any, Any, Any], fork_token: str | None = None
) -> RemitStatePersistence[Any, Any]:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
        url, run_id, lease=LEASE, fork_token=fork_token
    )
    p.set_graph_types(graph)
    return p


def shape(line: list[Snapshot[Any, Any]]) -> list[tuple[str, str]]:
    """Each snapshot as (node class, status), an End as ("End", "end")."""
    return [(type(s.node).__name__, s.status) if s.kind == "node" else ("End", "end") for s in line]
