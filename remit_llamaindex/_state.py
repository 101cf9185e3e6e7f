"""The state store of a Remit-backed run: validated on every write (P4).

It keeps the live state in memory like the framework's own store; the
next committed checkpoint stores it as it is. That is usually the step's own
completion, but a tick of a parallel step reduced while this step still runs
commits its writes made so far too: a step that crashes after such a commit
re-runs on a state that holds its earlier writes (the README's limits say
how to write such a step). Every writer
(`set`, `set_state`, `edit_state`, `clear`) goes through `_write_state`,
where the state is re-validated against the run's declared model, so a value
that slipped past the model (`validate_assignment` off, `model_construct`)
is refused with `CheckpointInvalid` and the stored state stays as it was. A
`set` of a path the model has no field for (or of a value a model that validates
assignments refuses) is refused the same way, naming the path. A
value the checkpoint could not hold as it is (a datetime or bytes in an
untyped store, a tuple that would come back as a list) is refused there too,
inside the step, naming its key, rather than failing the commit afterwards.
A write to a parked run is committed at once (`after_write`); when that
commit is refused, the live state is put back as it was, so the refused value
never reaches a later checkpoint.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from workflows.context.serializers import BaseSerializer, JsonSerializer
from workflows.context.state_store import MODEL_T, InMemoryStateStore

from remit_core.schema import StateSchema
from remit_llamaindex._storable import checked_state, set_path


class RemitStateStore(InMemoryStateStore[MODEL_T]):
    """A run's state: in memory, validated on write, serialized to a Remit handle.

    `to_dict` returns the handle (run, branch, checkpoint) rather than the
    values, so a context snapshot restored later continues the same Remit
    run instead of starting an untracked copy of it.
    """

    def __init__(
        self,
        initial_state: MODEL_T,
        *,
        schema: StateSchema | None,
        serializer: JsonSerializer,
        ids: Callable[[], dict[str, Any]],
        handle: Callable[[], dict[str, Any]],
        after_write: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(initial_state)
        self._schema = schema
        self._checkpoint_serializer = serializer
        self._ids = ids
        self._handle = handle
        self._after_write = after_write

    async def _write_state(self, state: BaseModel, storage: Any = None) -> None:
        state = self.checked(state)
        previous = self._memory_storage.load_sync()
        await super()._write_state(state, storage)
        if self._after_write is None:
            return
        try:
            await self._after_write()
        except BaseException:
            # Refused (another resumer holds the run or moved it on): the write must not
            # stay in memory, where the run's next checkpoint would commit it after all.
            if previous is not None:
                await self._memory_storage.save(previous)
            raise

    async def set(self, path: str, value: Any) -> None:
        """The framework's `set`, but a path the model has no field for (or a value it
        refuses on assignment) is `CheckpointInvalid` naming the path, as every other
        refused write is, rather than the framework's `ValueError`; nothing is stored."""
        async with self._lock.acquire_write():
            async with self._storage.session() as storage:
                state = await self._load_state(storage)
                edited = set_path(state, path, value, "nothing was stored", **self._ids())
                await self._save_state(edited, storage)

    def checked(self, state: BaseModel) -> BaseModel:
        """`state` as a write stores it: validated, storable, a typed value in the form its
        model reads it (`checked_state`), or `CheckpointInvalid` naming the field."""
        return checked_state(state, self._schema, self._checkpoint_serializer, **self._ids())

    def check_live(self) -> None:
        """Validate the live state as a checkpoint stores it: a value changed in place
        after `get` reached it without a write (`CheckpointInvalid` naming it)."""
        record = self._memory_storage.load_sync()
        if self._schema is not None and record is not None:
            self._schema.validate(record.data, **self._ids())

    def payload(self, serializer: BaseSerializer) -> dict[str, Any]:
        """The in-memory payload of the current state (what a checkpoint stores)."""
        return super().to_dict(serializer)

    def to_dict(self, serializer: BaseSerializer) -> dict[str, Any]:
        return self._handle()
