"""Breadth-first exploration of `spec.model`: TLC's numbers, from the Python encoding.

    python -m spec.bfs counts        # distinct states and transitions, as TLC counts them

`explore` counts states and generated transitions the way TLC does (initial
states count as generated; every enabled disjunct of `Next` is one generated
state, new or not) and checks the invariants and action properties, so that
on shared bounds both encodings must print the same numbers. `label` turns a
TLC counterexample into the actions that produce it, which both checks that
TLC's trace is a behavior of this encoding and lets the trace be replayed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

from spec.configs import CONFIGS, Config
from spec.model import Model, State, init

Trace = list[tuple[str, State]]


@dataclass
class Explored:
    distinct: int
    generated: int
    depth: int
    seconds: float
    violation: str | None = None
    trace: Trace | None = None


def _path(parent: dict[State, tuple[State | None, str]], s: State) -> Trace:
    out: Trace = []
    cur: State | None = s
    while cur is not None:
        prev, label = parent[cur]
        out.append((label, cur))
        cur = prev
    return out[::-1]


def explore(cfg: Config, *, max_states: int = 2_000_000) -> Explored:
    """Every reachable state of `cfg`, checking the contract on each (stops at a violation)."""
    t0 = time.perf_counter()
    model = Model(cfg)
    invariants = model.invariants()
    actions = model.action_properties()
    s0 = init(model.cfg)
    parent: dict[State, tuple[State | None, str]] = {s0: (None, "Init")}
    depth_of = {s0: 1}
    queue = deque([s0])
    generated, depth = 1, 1

    def stop(name: str, s: State) -> Explored:
        return Explored(
            len(parent), generated, depth, time.perf_counter() - t0, name, _path(parent, s)
        )

    for name, inv in invariants.items():
        if not inv(s0):
            return stop(name, s0)
    while queue:
        s = queue.popleft()
        d = depth_of.pop(s)
        for label, t in model.successors(s):
            generated += 1
            for name, prop in actions.items():
                if not prop(s, t):
                    parent.setdefault(t, (s, label))
                    return stop(name, t)
            if t in parent:
                continue
            parent[t] = (s, label)
            depth_of[t] = d + 1
            depth = max(depth, d + 1)
            for name, inv in invariants.items():
                if not inv(t):
                    return stop(name, t)
            queue.append(t)
            if len(parent) > max_states:
                raise RuntimeError(f"more than {max_states} states: bounds too large")
    return Explored(len(parent), generated, depth, time.perf_counter() - t0)


def label(cfg: Config, states: list[State]) -> Trace:
    """Name the action behind each step of a state sequence (a TLC counterexample).

    Raises ValueError if a step is not a transition of this encoding.
    """
    model = Model(cfg)
    if states[0] != init(model.cfg):
        raise ValueError("the trace does not start in the initial state")
    out: Trace = [("Init", states[0])]
    for n, (s, t) in enumerate(zip(states, states[1:], strict=False), 2):
        names = [lab for lab, u in model.successors(s) if u == t]
        if not names:
            raise ValueError(f"state {n} of the trace is no successor of state {n - 1}")
        out.append((names[0], t))
    return out


def random_walk(cfg: Config, rng: random.Random, length: int) -> Trace:
    """A random behavior of `cfg` of up to `length` steps."""
    model = Model(cfg)
    s = init(model.cfg)
    out: Trace = [("Init", s)]
    for _ in range(length):
        options = list(model.successors(s))
        if not options:
            break
        lab, s = rng.choice(options)
        out.append((lab, s))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", choices=sorted(CONFIGS))
    a = ap.parse_args(argv)
    cfg = CONFIGS[a.config]
    res = explore(cfg)
    print(
        f"{res.distinct:,} distinct states, {res.generated:,} generated, depth {res.depth}, "
        f"{res.seconds:.1f} s"
    )
    if res.violation and res.trace:
        print(
            f"violated: {res.violation} after {len(res.trace) - 1} steps: "
            + ", ".join(lab for lab, _ in res.trace[1:])
        )
    return 0 if res.violation == cfg.expect else 1


if __name__ == "__main__":
    sys.exit(main())
