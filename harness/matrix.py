"""A stage's test matrix: expansion into cases, and filters by axis (`--hd 512`,
`--where hd=512,n=256`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable

from harness.spec import Stage


class FilterError(ValueError):
    """A filter that names an unknown axis or a value outside the matrix (one line)."""


@dataclass(frozen=True)
class Case:
    """One point of a stage's matrix, with its parameters in axis order."""

    stage: str
    params: tuple[tuple[str, Any], ...]

    @property
    def dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={_fmt(v)}" for k, v in self.params)

    def kernel_args(self, names: Iterable[str]) -> dict[str, Any]:
        d = self.dict
        return {n: d[n] for n in names}


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def expand(stage: Stage) -> list[Case]:
    axes = list(stage.matrix)
    return [
        Case(stage.id, tuple(zip(axes, values)))
        for values in itertools.product(*(stage.matrix[a] for a in axes))
    ]


def _coerce(stage: Stage, axis: str, text: str) -> Any:
    """Turn a filter's text into the axis's own value type (`512` -> 512, `true` -> True)."""
    for value in stage.matrix[axis]:
        if _fmt(value) == text.strip().lower() or str(value) == text.strip():
            return value
    shown = ", ".join(_fmt(v) for v in stage.matrix[axis])
    raise FilterError(f"{stage.name}: {axis}={text} is not in the matrix — {axis} takes {shown}")


def parse_filters(stage: Stage, pairs: list[tuple[str, str]]) -> dict[str, set[Any]]:
    """[("hd", "512"), ("n", "128,256")] -> {"hd": {512}, "n": {128, 256}}, validated."""
    out: dict[str, set[Any]] = {}
    for axis, text in pairs:
        if axis not in stage.matrix:
            raise FilterError(
                f"{stage.name}: no axis '{axis}' — filter by one of: {', '.join(stage.matrix)}"
            )
        out.setdefault(axis, set()).update(_coerce(stage, axis, t) for t in text.split(",") if t.strip())
    return out


def parse_where(text: str) -> list[tuple[str, str]]:
    """`hd=512,n=256` -> [("hd","512"), ("n","256")]; `hd=64|128` gives several values."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise FilterError(f"--where: '{part}' is not axis=value (e.g. --where hd=512,n=256)")
        axis, value = part.split("=", 1)
        pairs.append((axis.strip(), value.replace("|", ",")))
    return pairs


def parse_axis_flags(args: list[str]) -> list[tuple[str, str]]:
    """Extra command-line words like ['--hd', '512', '--n=256'] -> [("hd","512"), ("n","256")]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--") or word == "--":
            raise FilterError(f"unexpected argument '{word}' — filters look like --hd 512")
        name = word[2:]
        if "=" in name:
            name, value = name.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise FilterError(f"--{name} needs a value (e.g. --{name} 512)")
            i += 1
            value = args[i]
        pairs.append((name.replace("-", "_"), value))
        i += 1
    return pairs


def select(cases: list[Case], filters: dict[str, set[Any]]) -> list[Case]:
    return [c for c in cases if all(c.dict[a] in vals for a, vals in filters.items())]
