"""Store URL option values that the database's client takes as they are and that fail
only at the first connection or command (libpq's integer options and `sslmode`, a Redis
timeout that is not above 0, a client name Redis refuses) are refused when the store
is opened: a `ValueError` naming the option and the URL, without a password, not a
`StoreUnavailable` that reads as a failure to retry. Good values of the same options open
a working store."""

from __future__ import annotations

import uuid

import pytest

from remit_core import Remit
from remit_core.errors import StoreUnavailable

PG = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("url", "option"),
    [
        (f"{PG}?connect_timeout=abc", "connect_timeout='abc'"),
        (f"{PG}?connect_timeout=1_0", "connect_timeout='1_0'"),
        (f"{PG}?keepalives=yes", "keepalives='yes'"),
        (f"{PG}?keepalives_idle=1.5", "keepalives_idle='1.5'"),
        (f"{PG}?tcp_user_timeout=", "tcp_user_timeout=''"),
        (f"{PG}?port=x", "port='x'"),
        (f"{PG}?port=5432,x", "port='5432,x'"),
        (f"{PG}?sslmode=bogus", "sslmode='bogus'"),
        (f"{PG}?sslmode=Require", "sslmode='Require'"),
        (f"{REDIS}?socket_timeout=-1", "socket_timeout=-1.0"),
        (f"{REDIS}?socket_timeout=0", "socket_timeout=0.0"),
        (f"{REDIS}?socket_timeout=nan", "socket_timeout=nan"),
        (f"{REDIS}?socket_timeout=inf", "socket_timeout=inf"),
        (f"{REDIS}?socket_connect_timeout=-0.5", "socket_connect_timeout=-0.5"),
        (f"{REDIS}?client_name=a%20b", "client_name='a b'"),
        (f"{REDIS}?client_name=a%0Ab", "client_name='a\\nb'"),
        (f"{REDIS}?client_name=caf%C3%A9", "client_name='café'"),
    ],
)
def test_an_option_value_refused_at_connect_is_refused_at_open_naming_it(
    url: str, option: str
) -> None:
    with pytest.raises(ValueError, match="URL option") as caught:
        Remit(url)
    assert not isinstance(caught.value, StoreUnavailable)
    assert option in str(caught.value)
    assert url in str(caught.value)


def test_the_option_names_its_url_without_the_password() -> None:
    url = "postgresql://postgres:s3cr3t-pw@127.0.0.1:5432/test?connect_timeout=soon"
    with pytest.raises(ValueError, match="connect_timeout='soon'") as caught:
        Remit(url)
    assert "s3cr3t-pw" not in str(caught.value)
    assert "postgres:***@127.0.0.1" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        f"{PG}?connect_timeout=5&keepalives=1&keepalives_idle=30&port=5432&sslmode=prefer",
        f"{PG}?sslmode=disable&tcp_user_timeout=%2010%20",
        f"{REDIS}?socket_timeout=2.5&socket_connect_timeout=3&client_name=remit-worker",
        f"{REDIS}?client_name=",
    ],
)
def test_good_values_of_the_same_options_open_a_working_store(url: str) -> None:
    run = f"probe23-{uuid.uuid4().hex}"
    with Remit(url) as remit:
        try:
            remit.commit(run_id=run, checkpoint_id="c1", parent_id=None, state=b"s")
            head = remit.head(run)
            assert head is not None and head.state == b"s"
        finally:
            remit.delete_run(run)
