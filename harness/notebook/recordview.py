"""A record's one-line view in the terminal (a finished case: status, stage, arch, label, its worst
cosine, its time beside its PyTorch peer's, its note or first error line) — everything taken from
the record escaped. Shared by `run`'s report, `run --target`, Slurm runs, the gate and history."""

from __future__ import annotations

from rich.markup import escape

from harness.core.labels import case_label, printable
from harness.core.statuses import STYLE
from harness.notebook.records import Record, run_peer_us


def worst(rec: Record, key: str, pick=min) -> float | None:
    """The worst value of metric `key` over a record's outputs (None when none has it)."""
    vals = [m.get(key) for m in rec.metrics.values() if m.get(key) is not None]
    return pick(vals) if vals else None


def case_line(rec: Record) -> str:
    """One finished case as rich markup; everything taken from the record is escaped."""
    glyph, style = STYLE.get(rec.status, ("?", "white"))
    parts = [f"[{style}]{glyph} {escape(rec.status):<13}[/]", f"{escape(rec.stage):<3} {escape(rec.arch):<8}",
             escape(printable(case_label(rec.case), 200))]
    cos = worst(rec, "cosine")
    if cos is not None:
        parts.append(f"cos {cos:.7f}")
    timing = rec.timing or {}
    if isinstance(timing.get("us"), (int, float)):
        parts.append(f"{timing['us']:.2f} µs")
        peer = run_peer_us(rec)
        if peer is not None:
            parts.append(f"(torch {peer:.2f} µs)")
    if rec.status in ("compiled", "prepared") and rec.note:
        parts.append(f"[dim]{escape(printable(rec.note, 200))}[/]")
    elif rec.error and rec.status != "pass":
        first = rec.error.splitlines()[0] if rec.error.strip() else rec.error
        parts.append(f"[dim]{escape(printable(first, 120))}[/]")
    return "  ".join(parts)
