"""Remit for LlamaIndex Workflows.

`RemitRuntime` plugs into the core runtime (`Workflow(runtime=...)`);
`RemitWorkflowStore` is the workflow server's store (`WorkflowServer(workflow_store=...)`,
needs the server extra, imported from `remit_llamaindex.server`).

    from remit_llamaindex import RemitRuntime
    wf = MyWorkflow(runtime=RemitRuntime("postgresql://..."))
"""

from typing import Any

from remit_llamaindex._child import RunFailed
from remit_llamaindex.runtime import PauseAnswered, RemitRuntime, RunCheckpoint


def __getattr__(name: str) -> Any:
    if name == "RemitWorkflowStore":
        from remit_llamaindex.server import RemitWorkflowStore

        return RemitWorkflowStore
    raise AttributeError(name)


__all__ = ["PauseAnswered", "RemitRuntime", "RemitWorkflowStore", "RunCheckpoint", "RunFailed"]
