"""The contract's probe workflow in LangGraph, for `remit conformance`.

One graph, built the same way for every target (a user swaps the checkpointer
and keeps the graph): LangGraph's own `SqliteSaver` / `PostgresSaver`
("vanilla"), or `RemitSaver` on SQLite, PostgreSQL or Redis. Effects go
through `env.effect`, which on Remit targets is a `remit_core` effect with a
reconcile hook, and on vanilla targets a plain call.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from remit_core.conformance.adapter import (
    CheckpointRef,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    ProbeState,
    ResumeValue,
    RunResult,
    Snapshot,
    Target,
    initial_state,
)
from remit_core.conformance.storage import (
    backup_sqlite,
    copy_remit_run,
    corrupt_remit_checkpoint,
    create_schema,
    flip_middle_byte,
    sqlite_path,
)

RESUME = "__resume__"


def build_graph(env: ProbeEnv, checkpointer: Any) -> Any:
    """The probe graph: prepare -> approve (interrupt) -> charge -> notify."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    def prepare(state: ProbeState) -> dict[str, Any]:
        env.enter("prepare")
        amount = -5 if env.variant.invalid_step_write else 100
        return {"amount": amount, "log": [*state["log"], "prepare"]}

    def approve(state: ProbeState) -> dict[str, Any]:
        value = interrupt({"ask": "approve the order"}, response_schema=ResumeValue)
        if env.variant.multi_interrupt:
            second = interrupt({"ask": "confirm the order"}, response_schema=ResumeValue)
            value = f"{value}+{second}"
        env.enter("approve")
        env.point("resume.after_accept")
        return {"approved_by": value, "log": [*state["log"], "approve"]}

    def charge(state: ProbeState) -> dict[str, Any]:
        env.enter("charge")
        env.point("charge.before_effect")
        env.effect("charge")
        env.point("charge.after_effect")
        return {"charged": True, "log": [*state["log"], "charge"]}

    def notify(state: ProbeState) -> dict[str, Any]:
        env.enter("notify")
        env.point("notify.before_effect")
        env.effect("notify")
        return {"log": [*state["log"], "notify"]}

    builder = StateGraph(ProbeState)
    for name, fn in (
        ("prepare", prepare),
        ("approve", approve),
        ("charge", charge),
        ("notify", notify),
    ):
        builder.add_node(name, fn)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "approve")
    builder.add_edge("approve", "charge")
    builder.add_edge("charge", "notify")
    builder.add_edge("notify", END)
    return builder.compile(checkpointer=checkpointer)


def _probed(saver_cls: type, env: ProbeEnv) -> type:
    """`saver_cls` with the `charge.after_step` point right after charge's writes are stored."""

    class Probed(saver_cls):  # type: ignore[misc, valid-type]
        def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
            super().put_writes(config, writes, task_id, task_path)
            if any(channel == "charged" for channel, _ in writes):
                env.point("charge.after_step")

    Probed.__name__ = saver_cls.__name__
    return Probed


class _Session(ProbeSession):
    """The probe graph on one target, in one worker process."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        self.target, self.env = target, env
        self._conn: Any = None
        self.saver = self._open(target, env)
        self.graph = build_graph(env, self.saver)

    # -- checkpointers --------------------------------------------------------
    def _open(self, target: Target, env: ProbeEnv) -> Any:
        if target.kind == "remit":
            from remit_langgraph import RemitSaver

            return _probed(RemitSaver, env)(
                target.url,
                lease=env.lease,
                workflow_version=env.variant.workflow_version,
            )
        if target.engine == "sqlite":
            from langgraph.checkpoint.sqlite import SqliteSaver

            self._conn = sqlite3.connect(sqlite_path(target.url), check_same_thread=False)
            return _probed(SqliteSaver, env)(self._conn)
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg import Connection
        from psycopg.rows import dict_row

        self._conn = Connection.connect(
            target.url, autocommit=True, prepare_threshold=0, row_factory=dict_row
        )
        return _probed(PostgresSaver, env)(self._conn)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    # -- configs and results -------------------------------------------------------
    def _config(self, run: str, branch: str | None = None) -> dict[str, Any]:
        conf: dict[str, Any] = {"thread_id": run}
        if branch is not None:
            if self.target.kind == "remit":
                conf["fork_token"] = branch
            else:
                conf["checkpoint_id"] = self._branch_tip(run, branch)
        return {"configurable": conf}

    def _tree(self, run: str) -> dict[str, str | None]:
        """Every stored checkpoint of the thread -> its parent."""
        out: dict[str, str | None] = {}
        for t in self.saver.list({"configurable": {"thread_id": run}}):
            parent = t.parent_config["configurable"]["checkpoint_id"] if t.parent_config else None
            out[t.config["configurable"]["checkpoint_id"]] = parent
        return out

    def _branch_tip(self, run: str, start: str) -> str:
        """The newest checkpoint descending from `start` (a fork's line, without branches)."""
        tree = self._tree(run)

        def descends(cid: str | None) -> bool:
            while cid is not None:
                if cid == start:
                    return True
                cid = tree.get(cid)
            return False

        return max((c for c in tree if descends(c)), default=start)

    @staticmethod
    def _result(out: Any, branch: str | None = None) -> RunResult:
        values = dict(out or {})
        paused = bool(values.pop("__interrupt__", None))
        done = "notify" in values.get("log", ())
        if paused:
            return RunResult("paused", values, branch)
        return RunResult("done" if done else "other", values, branch)

    def _invoke(self, value: Any, config: Any) -> Any:
        # Every target runs with durability="sync": under LangGraph's default "async",
        # a step's writes may still be in flight when the next step starts, for any
        # saver, so a crash there re-runs a step that looked complete. "sync" is the
        # mode a user who needs prefix continuation chooses; vanilla gets it too.
        return self.graph.invoke(value, config, durability="sync")

    # -- operations ----------------------------------------------------------------
    def start(self, run: str) -> RunResult:
        if self.target.kind == "vanilla" and self.target.engine == "postgresql":
            self._setup_postgres(self.saver)
        return self._result(self._invoke(initial_state(), self._config(run)))

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        from langgraph.types import Command

        out = self._invoke(Command(resume=value), self._config(run, branch))
        return self._result(out, branch)

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        return self._result(self._invoke(None, self._config(run, branch)), branch)

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        conf: dict[str, Any] = {"thread_id": run, "checkpoint_id": checkpoint}
        if self.target.kind == "remit":
            if token is not None:
                conf["fork_token"] = token
            return self._result(self._invoke(None, {"configurable": conf}), token)
        before = set(self._tree(run))
        out = self._invoke(None, {"configurable": conf})
        created = sorted(set(self._tree(run)) - before)
        return self._result(out, created[0] if created else checkpoint)

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        self.graph.update_state(self._config(run), dict(patch))

    def corrupt_head(self, run: str) -> str:
        head = self.saver.get_tuple(self._config(run))
        checkpoint_id = str(head.config["configurable"]["checkpoint_id"])
        if self.target.kind == "remit":
            corrupt_remit_checkpoint(self.target, run, checkpoint_id)
        elif self.target.engine == "sqlite":
            (blob,) = self._conn.execute(
                "SELECT checkpoint FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = '' "
                "AND checkpoint_id = ?",
                (run, checkpoint_id),
            ).fetchone()
            self._conn.execute(
                "UPDATE checkpoints SET checkpoint = ? WHERE thread_id = ? AND checkpoint_ns = '' "
                "AND checkpoint_id = ?",
                (flip_middle_byte(blob), run, checkpoint_id),
            )
            self._conn.commit()
        else:  # PostgresSaver keeps lists in checkpoint_blobs (primitives stay inline)
            version = str(head.checkpoint["channel_versions"]["log"])
            where = (
                "WHERE thread_id = %s AND checkpoint_ns = '' AND channel = 'log' AND version = %s"
            )
            row = self._conn.execute(
                f"SELECT blob FROM checkpoint_blobs {where}", (run, version)
            ).fetchone()
            self._conn.execute(
                f"UPDATE checkpoint_blobs SET blob = %s {where}",
                (flip_middle_byte(bytes(row["blob"])), run, version),
            )
        return checkpoint_id

    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        config = self._config(run, branch)
        snap = self.graph.get_state(config)
        head = snap.config["configurable"].get("checkpoint_id") if snap.config else None
        checkpoints = [
            CheckpointRef(s.config["configurable"]["checkpoint_id"], tuple(s.next))
            for s in self.graph.get_state_history(config)
        ]
        resume_values = [
            value
            for t in self.saver.list({"configurable": {"thread_id": run}})
            for _, channel, value in (t.pending_writes or ())
            if channel == RESUME
        ]
        if self.target.kind == "remit":
            branches = len(self.saver.remit.branches(run))
        else:
            tree = self._tree(run)
            branches = len(set(tree) - set(tree.values()))
        return Snapshot(
            state=dict(snap.values) if head else None,
            head=head,
            branches=branches,
            checkpoints=checkpoints,
            pending_interrupts=len(snap.interrupts),
            resume_values=resume_values,
        )

    def copy_store(self, run: str, dest: Target) -> None:
        if self.target.kind == "remit":
            copy_remit_run(self.target, dest, run)
        elif self.target.engine == "sqlite":
            self._conn.commit()
            backup_sqlite(sqlite_path(self.target.url), sqlite_path(dest.url))
        else:
            self._copy_postgres(run, dest)

    def _setup_postgres(self, saver: Any) -> None:
        """`PostgresSaver.setup()`, retried when another process runs the same migration."""
        from psycopg import errors

        for attempt in range(10):
            try:
                saver.setup()
                return
            except (errors.UniqueViolation, errors.DeadlockDetected):
                time.sleep(0.1 * (attempt + 1))
        saver.setup()

    def _copy_postgres(self, run: str, dest: Target) -> None:
        from langgraph.checkpoint.postgres import PostgresSaver

        create_schema(dest)
        with PostgresSaver.from_conn_string(dest.url) as saver:
            self._setup_postgres(saver)
        for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
            self._conn.execute(
                f'INSERT INTO "{dest.schema}".{table} SELECT * FROM {table} WHERE thread_id = %s',
                (run,),
            )


class LangGraphAdapter(ProbeAdapter):
    """The probe in LangGraph: vanilla SqliteSaver/PostgresSaver, or RemitSaver."""

    framework = "langgraph"

    def preload(self) -> None:
        import langgraph.checkpoint.sqlite  # noqa: F401
        import langgraph.graph  # noqa: F401
        import langgraph.types  # noqa: F401

        try:
            import remit_langgraph  # noqa: F401
        except ImportError:
            pass  # the Remit columns will say why

    def describe(self, target: Target) -> str:
        if target.kind == "remit":
            return f"Remit ({target.engine})"
        savers = {"sqlite": "LangGraph SqliteSaver", "postgresql": "LangGraph PostgresSaver"}
        return savers.get(target.engine, f"LangGraph's own saver on {target.engine}")

    def unsupported(self, target: Target) -> str | None:
        if target.kind == "vanilla" and target.engine not in ("sqlite", "postgresql"):
            return f"LangGraph's own savers do not include {target.engine}"
        if target.kind == "vanilla" and target.engine == "postgresql":
            try:
                import langgraph.checkpoint.postgres  # noqa: F401
            except ImportError as exc:
                return f"langgraph-checkpoint-postgres is not installed ({exc})"
        if target.kind == "remit":
            try:
                from remit_langgraph import RemitSaver  # noqa: F401
            except ImportError as exc:
                return f"remit_langgraph.RemitSaver is not importable ({exc})"
        return None

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        return _Session(target, env)


adapter = LangGraphAdapter()
