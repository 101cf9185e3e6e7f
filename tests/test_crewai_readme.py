"""README.md's CrewAI example runs as written (in a forked child, in a scratch directory)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from test_crewai_flows import run

README = Path(__file__).resolve().parent.parent / "README.md"


def crewai_example() -> str:
    section = README.read_text().split("\n## CrewAI\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the CrewAI section has no python example"
    return match.group(1)


def test_readme_example_runs(tmp_path: Path) -> None:
    code = crewai_example()

    def body() -> dict[str, object]:
        os.chdir(tmp_path)
        os.environ["XDG_DATA_HOME"] = str(tmp_path / "data")  # CrewAI's memory store
        scope: dict[str, object] = {"__name__": "__main__"}
        exec(compile(code, "README.md#crewai", "exec"), scope)
        flow = scope["flow"]
        return {
            "approved_by": flow.state.approved_by,  # type: ignore[attr-defined]
            "payments": list(scope["payments"].values()),  # type: ignore[attr-defined]
        }

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {"approved_by": "alice", "payments": [42]}
    assert (tmp_path / "orders.db").exists()
