"""A stage's test matrix: expansion into cases, and filters by axis (`--hd 512`,
`--where hd=512,n=256`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from harness.core.labels import case_label, value_text
from harness.spec.spec import MAX_CASES, Stage


class FilterError(ValueError):
    """A filter that names an unknown axis or a value outside the matrix (one line)."""


class MatrixSizeError(FilterError):
    """More cases than MAX_CASES at once (one line saying how many and how to narrow)."""


MAX_RUN_CASES = 50_000  # the most cases one command plans across its stages and archs (e.g. `run --all`)


def check_run_size(sizes: list[tuple[str, int]]) -> None:
    """Refuse, in one line, a command whose (stage name, cases) add up to more than
    MAX_RUN_CASES: counted with `count`, before a case is built."""
    total = sum(n for _, n in sizes)
    if total <= MAX_RUN_CASES:
        return
    big = sorted((s for s in sizes if s[1]), key=lambda s: -s[1])
    shown = ", ".join(f"{name} {n}" for name, n in big[:6]) + (", …" if len(big) > 6 else "")
    raise MatrixSizeError(
        f"{total} cases in one command ({shown}) — more than {MAX_RUN_CASES} at once; run fewer stages or narrow "
        "them with --arch and axis filters (e.g. dsv4-lab run STAGE --hd 64, or --where hd=64)")


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
        return case_label(dict(self.params))

    def kernel_args(self, names: Iterable[str]) -> dict[str, Any]:
        d = self.dict
        return {n: d[n] for n in names}


_fmt = value_text


def _axis_values(stage: Stage, filters: Mapping[str, set[Any]] | None) -> dict[str, list[Any]]:
    """Each axis's values that pass the filters, in matrix order."""
    filters = filters or {}
    for axis in filters:
        if axis not in stage.matrix:
            raise FilterError(f"{stage.name}: no axis '{axis}' — filter by one of: {', '.join(stage.matrix)}")
    return {a: [v for v in vals if a not in filters or v in filters[a]] for a, vals in stage.matrix.items()}


def _listed(stage: Stage, filters: Mapping[str, set[Any]] | None) -> list[Case]:
    """A suite stage's listed cases, or a matrix's with `more:`, that pass the filters (stage.cases,
    not a product)."""
    values = _axis_values(stage, filters)
    assert stage.cases is not None
    return [Case(stage.id, params) for params in stage.cases
            if all(any(v == w and type(v) is type(w) for w in values[a]) for a, v in params)]


def count(stage: Stage, filters: Mapping[str, set[Any]] | None = None) -> int:
    """How many cases `expand(stage, filters)` gives, without building them."""
    if stage.cases is not None:
        return len(_listed(stage, filters))
    return math.prod(len(v) for v in _axis_values(stage, filters).values())


def expand(stage: Stage, filters: Mapping[str, set[Any]] | None = None) -> list[Case]:
    """The matrix's cases passing `filters` (applied per axis before the product), in axis order; more
        than MAX_CASES refused first.  A suite stage: its listed cases; `more:`: the matrix's cases,
        then the further products' (spec.py `_more`)."""
    if stage.cases is not None:
        return _listed(stage, filters)
    values = _axis_values(stage, filters)
    n = math.prod(len(v) for v in values.values())
    if n > MAX_CASES:
        sizes = " × ".join(f"{a} {len(v)}" for a, v in values.items())
        widest = max(values, key=lambda a: len(values[a]))
        raise MatrixSizeError(
            f"{stage.name}: {n} cases ({sizes}) — more than {MAX_CASES} at once; narrow it with filters "
            f"(e.g. --{widest} {_fmt(values[widest][0])}, or --where {widest}={_fmt(values[widest][0])}) "
            "or list fewer values in stages.yaml")
    axes = list(values)
    return [Case(stage.id, tuple(zip(axes, combo))) for combo in itertools.product(*values.values())]


def _coerce(stage: Stage, axis: str, text: str) -> Any:
    """A filter's text as the axis's own value (`512` -> 512, `true` -> True, `1e-5` -> 1e-05): the
        value written exactly so, else the one number equal to it, else the one equal ignoring case."""
    t = text.strip()
    values = stage.matrix[axis]
    for value in values:
        if _fmt(value) == t or str(value) == t:
            return value
    try:
        number: float | None = float(t)
    except ValueError:
        number = None
    for match in (
        [v for v in values if number is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
         and v == number],
        [v for v in values if _fmt(v).lower() == t.lower()],
    ):
        if len(match) == 1:
            return match[0]
    shown = ", ".join(_fmt(v) for v in values)
    raise FilterError(f"{stage.name}: {axis}={t} is not in the matrix — {axis} takes {shown}")


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
