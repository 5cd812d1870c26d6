"""A case's label, built in one place: `hd=64,n=128,m=128` (axis order of the matrix;
booleans lower-case). Baselines are keyed by it and the terminal shows it."""

from __future__ import annotations

from typing import Any, Mapping


def value_text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def case_label(case: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={value_text(v)}" for k, v in case.items())
