"""`remit`: the command line. `remit conformance` runs the Resume Contract's matrix.

With no options it runs every installed framework's probe adapter on the
framework's own backend ("vanilla") and on Remit over SQLite, in a temporary
folder, and prints the matrix. Exit status 0 only if no Remit cell failed.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from remit_core.conformance import report
from remit_core.conformance.adapter import Target
from remit_core.conformance.cells import select
from remit_core.conformance.runner import discover, run_matrix, unreachable
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


class _Stopped(Exception):
    """SIGTERM or SIGHUP reached the parent: stop like Ctrl-C, killing every scenario."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _usage_error(args: argparse.Namespace, targets: Sequence[str]) -> str | None:
    """What is wrong with the options that a run cannot fix (None: nothing)."""
    reports: dict[Path, str] = {}
    for option, path in (
        ("--json", args.json),
        ("--markdown", args.markdown),
        ("--html", args.html),
    ):
        if path is None:
            continue
        if path.is_dir() or not path.absolute().parent.is_dir():
            return f"cannot write {path}: not a file in an existing folder"
        same = reports.setdefault(path.resolve(), option)
        if same != option:
            return f"{same} and {option} both name {path}: one report would overwrite the other"
    if args.folder is not None:
        if args.folder.exists() and (not args.folder.is_dir() or any(args.folder.iterdir())):
            return (
                f"--folder {args.folder} is not an empty folder: an earlier run's journals "
                "would mix with this one's; give a new or empty folder"
            )
        try:
            args.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--folder {args.folder}: {exc.strerror or exc}"
    for spec in targets:
        problem = unreachable(spec)
        if problem is not None:
            return f"target {problem}"
    return None


def conformance(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the matrix as asked; 0 if no Remit cell failed, 1 if one did, 2 on bad usage.

    Interrupted (Ctrl-C, SIGTERM, SIGHUP), it kills every scenario, removes
    its temporary folder and exits 128 + the signal's number.
    """
    targets = list(dict.fromkeys(args.target or ["vanilla", "sqlite"]))
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
    problem = _usage_error(args, targets)
    if problem is not None:
        print(f"remit conformance: {problem}", file=sys.stderr)
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
            try:
                path.write_text(render(matrix), encoding="utf-8")
            except OSError as exc:
                print(f"remit conformance: cannot write {path}: {exc}", file=sys.stderr)
                return 2
            print(f"wrote {path}", file=sys.stderr)
    if not any(c.cells for c in matrix.columns):
        print("remit conformance: no framework could run on these targets", file=sys.stderr)
        return 2
    return 0 if matrix.remit_ok() else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `remit` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command != "conformance":
        return 2
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return conformance(args, argv)
    except (KeyboardInterrupt, _Stopped) as exc:
        signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
        print("\nremit conformance: interrupted; every scenario was stopped", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
