"""Remit for LlamaIndex Workflows: `RemitRuntime` for the core runtime.

from remit_llamaindex import RemitRuntime
wf = MyWorkflow(runtime=RemitRuntime("postgresql://..."))
"""

from remit_llamaindex.runtime import RemitRuntime, RunCheckpoint

__all__ = ["RemitRuntime", "RunCheckpoint"]
