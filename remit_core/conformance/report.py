"""The matrix as text, JSON, Markdown and a self-contained HTML heat-map."""

from __future__ import annotations

import html
import json
from collections.abc import Iterator

from remit_core.conformance.cells import BY_ID
from remit_core.conformance.runner import CellResult, Column, Matrix


def _short(r: CellResult | None) -> str:
    if r is None:
        return "-"
    sat = f" s={r.saturation:.2f}" if r.saturation is not None else ""
    return f"{r.status}{sat}"


def _long(r: CellResult | None) -> str:
    if r is None:
        return "-"
    sat = f" (saturation {r.saturation:.2f})" if r.saturation is not None else ""
    if r.status == "PASS":
        return f"PASS{sat}"
    return f"{r.status}: {r.measured}{sat}"


def _ran(matrix: Matrix) -> list[Column]:
    return [c for c in matrix.columns if not c.note]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _size(matrix: Matrix) -> str:
    """How much ran: cells x columns, a column being one framework on one target."""
    columns = _ran(matrix)
    frameworks = len({c.framework for c in columns})
    targets = len({c.target for c in columns})
    return (
        f"{_plural(len(matrix.cells), 'cell')} x {_plural(len(columns), 'column')} "
        f"({_plural(frameworks, 'framework')} on {_plural(targets, 'target')})"
    )


def _repeated(matrix: Matrix) -> str:
    return f", racy cells x{matrix.repeat}" if matrix.repeat > 1 else ""


def text(matrix: Matrix) -> str:
    """The matrix for a terminal: a grid of statuses, then every FAIL and N/A explained."""
    columns = _ran(matrix)
    width = max([22] + [len(c.label) + 2 for c in columns])
    head = f"{'id':>3} {'scenario':<24}{'checks':<8}" + "".join(
        f"{c.label:<{width}}" for c in columns
    )
    # Remit's columns share a label across frameworks: name each column's framework above it.
    above = " " * 36 + "".join(f"{'[' + c.framework + ']':<{width}}" for c in columns)
    lines = [above.rstrip(), head, "-" * len(head)]
    for cell_id in matrix.cells:
        cell = BY_ID[cell_id]
        row = f"{cell_id:>3} {cell.scenario:<24}{cell.checks:<8}"
        row += "".join(f"{_short(c.cells.get(cell_id)):<{width}}" for c in columns)
        lines.append(row.rstrip())
    details = [
        f"  {cell_id:>2} {BY_ID[cell_id].scenario} / {c.label}: {_long(r)}"
        for c in columns
        for cell_id, r in c.cells.items()
        if r.status != "PASS"
    ]
    if details:
        lines += ["", "FAIL, ERROR and N/A, with what was measured:", *details]
    lines += ["", "Verdicts:", *(f"  {c.verdict()}" for c in matrix.columns)]
    if matrix.notes:
        lines += ["", "Notes:", *(f"  {n}" for n in matrix.notes)]
    lines.append(f"\n{_size(matrix)} in {matrix.elapsed:.0f}s" + _repeated(matrix))
    return "\n".join(lines)


def to_json(matrix: Matrix) -> str:
    return json.dumps(matrix.to_dict(), indent=2)


def _md_escape(s: str, limit: int = 240) -> str:
    s = s.replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def markdown(matrix: Matrix) -> str:
    """A Markdown table: one row per cell, one column per target, measured values inline."""
    columns = _ran(matrix)
    out = [
        "| id | scenario | checks | passes when | "
        + " | ".join(_md_escape(f"{c.label} [{c.framework}]") for c in columns)
        + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for cell_id in matrix.cells:
        cell = BY_ID[cell_id]
        out.append(
            f"| {cell_id} | {cell.scenario} | {cell.checks} | {_md_escape(cell.passes_when)} | "
            + " | ".join(_md_escape(_long(c.cells.get(cell_id))) for c in columns)
            + " |"
        )
    out += ["", *(f"- {c.verdict()}" for c in matrix.columns)]
    if matrix.notes:
        out += ["", *(f"- note: {n}" for n in matrix.notes)]
    return "\n".join(out) + "\n"


_COLORS = {"PASS": "#2e7d32", "FAIL": "#c62828", "ERROR": "#6a1b9a", "N/A": "#9e9e9e"}


def _heat_cells(matrix: Matrix, columns: list[Column]) -> Iterator[str]:
    for cell_id in matrix.cells:
        cell = BY_ID[cell_id]
        tds = []
        for c in columns:
            r = c.cells.get(cell_id)
            status = r.status if r else "-"
            color = _COLORS.get(status, "#eeeeee")
            sat = ""
            if r is not None and r.saturation is not None:
                sat = f"<br><small>s={r.saturation:.2f}</small>"
            title = html.escape(r.measured if r else "", quote=True)
            tds.append(
                f'<td style="background:{color}" title="{title}">{html.escape(status)}{sat}</td>'
            )
        yield (
            f"<tr><th>{cell_id}</th><td class=l>{html.escape(cell.scenario)}</td>"
            f"<td class=l>{html.escape(cell.checks)}</td>"
            f"<td class=l>{html.escape(cell.passes_when)}</td>{''.join(tds)}</tr>"
        )


def to_html(matrix: Matrix) -> str:
    """A self-contained page: the heat-map of cells x targets, then the measured values."""
    columns = _ran(matrix)
    heads = "".join(
        f"<th>{html.escape(c.label)}<br><small>{html.escape(c.framework)}</small></th>"
        for c in columns
    )
    details = "".join(
        f"<li><b>{cell_id} {html.escape(BY_ID[cell_id].scenario)}</b> / "
        f"{html.escape(c.label)}: {html.escape(_long(r))}</li>"
        for c in columns
        for cell_id, r in c.cells.items()
        if r.status != "PASS"
    )
    verdicts = "".join(f"<li>{html.escape(c.verdict())}</li>" for c in matrix.columns)
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in matrix.notes)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Remit conformance matrix</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #212121; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #fff; padding: 4px 8px; text-align: center; }}
td {{ color: #fff; font-weight: 600; }}
td.l {{ color: #212121; background: #f5f5f5; font-weight: normal; text-align: left; }}
th {{ background: #eceff1; }}
</style></head><body>
<h1>Remit conformance matrix</h1>
<p>The Resume Contract's 39 cells, measured on real processes.
<code>{html.escape(matrix.command)}</code>: {_size(matrix)} in {matrix.elapsed:.0f}s{
        _repeated(matrix)
    }.
Hover a cell for what was measured.</p>
<table><tr><th>id</th><th>scenario</th><th>checks</th><th>passes when</th>{heads}</tr>
{"".join(_heat_cells(matrix, columns))}
</table>
<h2>Verdicts</h2><ul>{verdicts}</ul>
<h2>FAIL, ERROR and N/A</h2><ul>{details or "<li>none</li>"}</ul>
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body></html>
"""
