"""Probes of the core and its engines, round 17: a PostgreSQL transaction idle past
`idle_txn_timeout_ms`.

The server ends such a session (a process paused, SIGSTOP, inside a write). The next
statement got psycopg's own `IdleInTransactionSessionTimeout`, not a Remit error:
it is `StoreUnavailable`, naming the option, nothing of the write is kept, and the
store goes on with a new connection.
"""

from __future__ import annotations

import uuid

import pytest
from conftest import PG_URL

from remit_core import Remit, failpoints
from remit_core.errors import StoreUnavailable
from remit_core.stores import open_store


def test_a_write_idle_past_the_servers_timeout_is_store_unavailable_and_kept_out() -> None:
    sep = "&" if "?" in PG_URL else "?"
    remit = Remit(open_store(f"{PG_URL}{sep}idle_txn_timeout_ms=200"))
    run_id = f"run-{uuid.uuid4().hex}"
    try:
        remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
        remit.open_interrupts(run_id, {"i1": None}, checkpoint_id="c1")
        failpoints.arm("interrupt.in_consume", "sleep:1.0")
        try:
            with pytest.raises(StoreUnavailable) as caught:
                remit.consume(run_id, "i1", b"v")
        finally:
            failpoints.disarm()
        assert "idle_txn_timeout_ms" in str(caught.value), caught.value
        # Nothing of the consume was kept, and the store answers on a new connection.
        (pending,) = remit.interrupts(run_id)
        assert pending.status == "pending", pending
        assert remit.consume(run_id, "i1", b"v").status == "consumed"
    finally:
        remit.close()
