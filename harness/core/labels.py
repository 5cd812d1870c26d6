"""A case's label, built in one place: `hd=64,n=128,m=128` (axis order of the matrix;
booleans lower-case). Baselines are keyed by it and the terminal shows it."""

from __future__ import annotations

from typing import Any, Mapping


def value_text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def case_label(case: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={value_text(v)}" for k, v in case.items())


def printable(text: str, limit: int | None = None) -> str:
    """`text` with every control character shown escaped, cut to `limit` characters: text from
        elsewhere can neither redraw the terminal nor break a line."""
    out = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    if limit is not None and len(out) > limit:
        out = out[: limit - 1] + "…"
    return out
