"""The conformance harness: the Resume Contract's 39 cells, run on real processes.

Framework-agnostic: it imports no framework. Shims implement
`adapter.ProbeAdapter` (found through the `remit.probe_adapters` entry
points); `runner.run_matrix` runs the cells and `report` renders them. The
`remit conformance` command (`remit_core.cli`) drives both.
"""

from remit_core.conformance.adapter import (
    NotApplicable,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    RunResult,
    Snapshot,
    Target,
)
from remit_core.conformance.runner import Matrix, discover, run_matrix

__all__ = [
    "Matrix",
    "NotApplicable",
    "ProbeAdapter",
    "ProbeEnv",
    "ProbeSession",
    "RunResult",
    "Snapshot",
    "Target",
    "discover",
    "run_matrix",
]
