"""Run README.md's examples as written: each in a forked child, in a scratch directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
import traceback
import types
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def examples(heading: str) -> list[str]:
    """The python code blocks of README.md's `## <heading>` section, in order."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_example(code: str, label: str, folder: Path, timeout: float = 120) -> None:
    """Run `code` as `python example.py` would, in `folder`; fail with its traceback."""
    errors = mp.get_context("fork").Queue()

    def body() -> None:
        os.chdir(folder)
        try:
            # dont_inherit: this file's `from __future__ import annotations` must not leak in.
            program = compile(code, f"README.md#{label}", "exec", dont_inherit=True)
            # The example is the importable `__main__` module, so a serializer that
            # finds classes by qualified name finds the example's own.
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(program, main.__dict__)
        except BaseException:
            errors.put(traceback.format_exc())
            raise
        errors.put("")

    proc = mp.get_context("fork").Process(target=body)
    proc.start()
    proc.join(timeout)
    assert errors.get(timeout=5) == ""
    assert proc.exitcode == 0
