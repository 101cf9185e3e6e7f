"""Remit for LangGraph: `RemitSaver`, a drop-in checkpointer that keeps the Resume Contract.

    from remit_langgraph import RemitSaver
    with RemitSaver.from_conn_string("sqlite:///remit.db") as saver:  # or postgresql://, redis://
        graph = builder.compile(checkpointer=saver)                  # graph code unchanged

`RemitSaver(store, *, state_schema=None, allowlist=(), lease=None,
workflow_version="", accept_versions=None, serde=None)` is a
`BaseCheckpointSaver` with every sync method and its async twin (`ainvoke`,
`astream` work on the same object); `from_conn_string(url, **options)` is a
context manager for `with` and `async with`.

- `store`: a Remit store URL or a `remit_core.Remit`.
- `state_schema`: the state type to validate every write against (P4). By
  default the schema of the graph that runs is used (`StateGraph(State)`, with
  the private keys its input and output schemas and its nodes' input types
  declare; an `update_state` of a subgraph's state, by the subgraph's); pass
  one (a type or a `remit_core.StateSchema` with a version and migrations) to
  override it or for graphs without one (its keys are state channels: an
  `@entrypoint` has none, and is not checked). A node's output is checked as the node
  returns it, in every durability mode: a refused output fails its node with
  `CheckpointInvalid` (a `ValueError`: a `retry_policy` runs it again only if its
  `retry_on` takes that), before any next step, and nothing of it is stored.
  A checkpoint of an older schema version is read migrated: the migration gets
  the state as it was written (keys the new version dropped or renamed
  included; a thread's input checkpoint may hold none yet), and the keys it
  adds or changes are carried into every checkpoint committed after it.
- `allowlist`: extra types ((module, name) or classes) the serializer may store.
  Pickle is never used; types of the graph's state schema (of an `@entrypoint`:
  its input, return and saved types) are allowed automatically; any other type
  is refused at write time (`CheckpointInvalid`).
- `lease`: seconds a run's claim lives without a heartbeat (L1); default the
  core's `DEFAULT_LEASE`.
- `workflow_version` / `accept_versions`: the version label recorded on every
  checkpoint and the other labels a reader accepts (`VersionMismatch` otherwise);
  a saver always reads its own `workflow_version`, so `accept_versions=["v1"]` on a
  "v2" saver reads both.

Options are checked where the saver is made: a `store` that is no URL or `Remit`,
a `workflow_version` that is no str, `accept_versions` given as one string (write
`["v1"]`) or holding anything but str, an `allowlist` that is a string or has an
entry neither a class nor a (module, name) tuple, a `state_schema` with no keys to
check, and a `serde` without `dumps_typed`/`loads_typed` raise `TypeError` naming
the option, before any node runs.
- `serde`: a serializer of your own (LangGraph's `SerializerProtocol`, e.g. its
  `EncryptedSerializer`) in place of Remit's. Values still pass the allowlist at
  write time, and pickle is neither stored nor loaded, whatever it is configured to do.

Config keys (`config["configurable"]`):

- `thread_id`: the Remit run id (`str` of it); `None` or a missing id is refused
  (`RemitError`) before any node runs.
- `checkpoint_id`: continue from this checkpoint. If it is not the head of its
  branch, the run is a fork and needs `fork_token` (else `ForkWithoutIntent`
  before any node runs). Applies to time travel and to `update_state`. A head
  (or a token's branch) is continued as without the id: not replayed. An id the
  thread does not have (another thread's, a typo) is `UnknownRecord`.
- `fork_token`: the fork-intent token (P3). With `checkpoint_id` (a head
  included) its first use forks one named branch from that checkpoint; the
  same token again, from any process, returns that branch at its head instead
  of growing another. Without `checkpoint_id`, a token selects its branch's
  head for reads and runs (`{"thread_id": t, "fork_token": tok}`; `list` of it is
  the fork's line, of the graph's namespace "" if the config sets none); a token that
  names no branch yet (a typo, or a fork not made) is refused by `invoke` and by
  `get_state`/`get_state_history` (`UnknownRecord`), never read as main, while
  an `update_state` with it forks main's head. `update_state(config, None,
  as_node="__copy__")` stores a copy beside the checkpoint it copies, a fork:
  with the token it makes (or, again, returns) that token's branch, whose head
  is the copy; without one, or for a thread's first checkpoint (it has no
  parent), `ForkWithoutIntent`. A fork has its own interrupts and re-asks them
  (L3). A `bulk_update_state` whose later superstep loses a race with another
  write gets `HeadMoved`: the supersteps before it stay stored, nothing of it is.

A run (`invoke`/`stream`, sync or async) takes the thread's claim before any
node runs, holds it with a heartbeat and releases it when the run returns;
a concurrent run gets `ResumeConflict` (P5, L1). Every write carries the
claim's fence, so a paused holder whose lease was taken over gets `Fenced`
(L2) and stops at its next step or effect. `Command(resume=v)` consumes the
pending interrupt atomically, and a value for an interrupt already consumed is
refused with `ResumeConflict` and not stored, as is one for an interrupt whose node
the running graph lacks (recompiled without it); `Command(resume={interrupt_id: v,
...})` consumes each named interrupt. An `update_state` of a pause makes the
paused tasks ask again under new interrupt ids: a map by the old ids, or a plain
value that would answer a node's earlier question in place of the pending one,
is refused (`ResumeConflict`); `invoke(None, config)` asks again. A value is
checked against the interrupt's `response_schema` (`interrupt(prompt,
response_schema=T)`) before it is consumed (`CheckpointInvalid`, interrupt still
pending). After a crash,
`invoke(None, config)` continues after the head and re-delivers an accepted
resume value.

Effects (P2): decorate the function that touches the outside world with
`remit_core.effect(reconcile=...)` (or `idempotent=True`) and call it from a
node; no other change. Its ledger key is the node's task identity (branch,
namespace, step, task path), so a re-run node gets the recorded outcome. The
calls of one attempt of a node are numbered together wherever they run
(`ToolNode`'s threads or gathered tasks, a node's own `asyncio.gather`); a retry
numbers them from 0 again. Calls run at once may reach the effect in another
order on a replay: give such an effect a `key=` of its own (a tool call's id).

Storage: each channel value is stored once per channel version; a checkpoint
names the versions it holds. `DeltaChannel` keys (beta in LangGraph) work as
with LangGraph's own savers: snapshots every few updates, the writes between
them replayed on read, and each write checked against the key's type.
"""

from remit_langgraph.saver import RemitSaver

#: The same class under the name LangGraph's async savers use (`AsyncSqliteSaver`):
#: `async with AsyncRemitSaver.from_conn_string(url) as saver` works as with `RemitSaver`.
AsyncRemitSaver = RemitSaver

__all__ = ["AsyncRemitSaver", "RemitSaver"]
