"""`remit`: the command line. `remit conformance` runs the Resume Contract's matrix.

With no options it runs every installed framework's probe adapter on the
framework's own backend ("vanilla") and on Remit over SQLite, in a temporary
folder, and prints the matrix. Exit status 0 only if no Remit cell failed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from remit_core.conformance import report
from remit_core.conformance.adapter import Target
from remit_core.conformance.cells import select
from remit_core.conformance.runner import discover, run_matrix
from remit_core.core import checked_lease

FRAMEWORKS = ("langgraph", "llamaindex", "crewai", "pydantic-graph")


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if done == total or not sys.stderr.isatty() else ""
    sys.stderr.write(f"\r[{bar}] {done}/{total} {what[:60]:<60}{end}")
    sys.stderr.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conf = sub.add_parser(
        "conformance",
        help="run the 39-cell conformance matrix on real processes",
        description="Run the Resume Contract's conformance matrix (CONTRACT.md) for the "
        "installed frameworks, on their own backends and on Remit.",
    )
    conf.add_argument(
        "--framework",
        action="append",
        choices=FRAMEWORKS,
        help="framework to probe (repeatable; default: every installed one)",
    )
    conf.add_argument(
        "--target",
        action="append",
        help="vanilla, vanilla+postgresql://..., sqlite, postgresql://..., "
        "redis://... (repeatable; default: vanilla and sqlite)",
    )
    conf.add_argument(
        "--cells",
        action="append",
        help="cells to run: ids, ranges or scenario names, e.g. 1-8,K8-PROC",
    )
    conf.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the racy cells N times; a cell passes only if every run does",
    )
    conf.add_argument(
        "--lease",
        type=float,
        default=2.0,
        help="claim lease in seconds for Remit targets (default 2)",
    )
    conf.add_argument("--jobs", type=int, default=3, help="scenarios run at once (default 3)")
    conf.add_argument(
        "--folder", type=Path, help="keep the scenario folders here (default: a temporary folder)"
    )
    conf.add_argument("--json", type=Path, help="write the matrix as JSON")
    conf.add_argument("--markdown", type=Path, help="write the matrix as Markdown")
    conf.add_argument(
        "--html", type=Path, help="write a self-contained HTML report with a heat-map"
    )
    conf.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def conformance(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the matrix as asked; 0 if no Remit cell failed, 1 if one did, 2 on bad usage."""
    targets = args.target or ["vanilla", "sqlite"]
    try:
        cells = select(args.cells)
        for spec in targets:
            Target.parse(spec, Path("."), "check")
    except ValueError as exc:
        print(f"remit conformance: {exc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("remit conformance: --repeat must be at least 1", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("remit conformance: --jobs must be at least 1", file=sys.stderr)
        return 2
    try:
        checked_lease(args.lease)
    except ValueError as exc:
        print(f"remit conformance: --lease: {exc}", file=sys.stderr)
        return 2
    adapters, notes = discover(args.framework)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not adapters:
        print("remit conformance: no probe adapter could run", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="remit-conformance-") as tmp:
        folder = args.folder or Path(tmp)
        matrix = run_matrix(
            adapters,
            targets,
            cells,
            folder,
            repeat=args.repeat,
            lease=args.lease,
            jobs=args.jobs,
            notes=notes,
            progress=None if args.quiet else _progress,
        )
    matrix.command = "remit " + shlex.join(argv)
    print(report.text(matrix))
    for path, render in (
        (args.json, report.to_json),
        (args.markdown, report.markdown),
        (args.html, report.to_html),
    ):
        if path is not None:
            path.write_text(render(matrix), encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    return 0 if matrix.remit_ok() else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `remit` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "conformance":
        return conformance(args, argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
