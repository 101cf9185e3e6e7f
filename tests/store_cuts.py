"""Cutting a store's own server connections, for tests of connection loss mid-run:
a URL whose connections carry a name of their own, and the end of every connection
of that name (PostgreSQL backends terminated, Redis clients killed)."""

from __future__ import annotations

import uuid

import psycopg
import redis
from conftest import PG_URL, REDIS_URL


def tagged(engine: str) -> tuple[str, str]:
    """A URL of `engine` whose connections carry a name of their own, and that name."""
    name = f"remit-cut-{uuid.uuid4().hex[:12]}"
    if engine == "postgresql":
        return f"{PG_URL}?application_name={name}", name
    return f"{REDIS_URL}?client_name={name}", name


def cut(engine: str, name: str) -> int:
    """End every server connection named `name`; how many were ended."""
    if engine == "postgresql":
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (name,),
            ).fetchall()
        return len(rows)
    admin = redis.Redis.from_url(REDIS_URL)
    try:
        ids = [c["id"] for c in admin.client_list() if c.get("name") == name]
        for client_id in ids:
            admin.execute_command("CLIENT", "KILL", "ID", client_id)
        return len(ids)
    finally:
        admin.close()
