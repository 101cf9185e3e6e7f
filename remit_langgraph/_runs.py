"""Placeholder: the run-loop hooks come next."""

from __future__ import annotations

from typing import Any


class Runs:
    def __init__(self, saver: Any) -> None:
        self.saver = saver

    def calling_loop(self, frame: Any) -> Any:
        return None

    def start(self, loop: Any, config: Any) -> Any:
        return self.saver.read(config)

    def active(self, thread: str) -> Any:
        return None

    def validate_state(self, *a: Any, **k: Any) -> None:
        return None

    def validate_writes(self, *a: Any, **k: Any) -> None:
        return None

    def before_writes(self, *a: Any) -> None:
        return None

    def after_writes(self, *a: Any) -> None:
        return None

    def upgrade(self, record: Any, values: Any) -> Any:
        return values

    def close(self) -> None:
        return None
