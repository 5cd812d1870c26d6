"""A suite stage's case list (stages.yaml `suite: {cases: MODULE:FUNCTION, criterion: …}`): the
function, called once when stages.yaml loads, returns the cases (dicts with the same keys in the
same order).  The matrix is then each key's values in order of first appearance (so filters work
as on a matrix), and `expand` gives the listed cases.  Every problem is one line."""

from __future__ import annotations

import importlib
import keyword
import math
import sys
from pathlib import Path
from typing import Any

BAD_WORD_CHARS = set(",=|")  # they separate filters and case labels


class SuiteCasesError(Exception):
    """What is wrong with a suite's case list, one line ending in the fix."""


def load_cases(root: Path, module: str, name: str) -> list[dict[str, Any]]:
    """`module:name()` imported from the lab at `root` and called: its list of cases."""
    from harness.core.userfault import describe

    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        fn = getattr(importlib.import_module(module), name)
        cases = fn()
    except Exception as exc:
        raise SuiteCasesError(f"{module}:{name}() failed: {describe(exc, root)} — fix the suite module") from None
    return check_cases(cases, f"{module}:{name}()")


def _value_problem(value: Any) -> str | None:
    if isinstance(value, bool) or isinstance(value, int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not finite"
    if isinstance(value, str):
        if not value or value != value.strip() or not value.isprintable() or BAD_WORD_CHARS & set(value):
            return f"{value!r} cannot be a case value (a word without outer spaces, control characters or , = |)"
        return None
    return f"{type(value).__name__} {value!r:.40} is not a number, true/false or a word"


def check_cases(cases: Any, what: str, reserved: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """`cases` validated: a non-empty list of dicts with the same identifier keys in the same
    order, scalar values, no case twice."""
    from harness.core.labels import case_label

    if not isinstance(cases, (list, tuple)) or not cases:
        raise SuiteCasesError(f"{what} returned {type(cases).__name__ if cases is not None else 'None'}"
                              f"{' (empty)' if isinstance(cases, (list, tuple)) else ''}, expected a non-empty "
                              "list of case dicts — return the supported cases")
    keys: list[str] | None = None
    seen: set[str] = set()
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise SuiteCasesError(f"{what}: case {i} is {type(case).__name__}, not a dict — return dicts")
        if keys is None:
            keys = list(case)
            for k in keys:
                if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k) or k in reserved:
                    raise SuiteCasesError(f"{what}: case key {k!r} is not an axis name (a Python identifier, "
                                          "not one of the lab's options) — rename it")
        elif list(case) != keys:
            raise SuiteCasesError(f"{what}: case {i} has keys {list(case)}, case 0 has {keys} — give every case "
                                  "the same keys in the same order")
        for k, v in case.items():
            why = _value_problem(v)
            if why:
                raise SuiteCasesError(f"{what}: case {i}, {k}: {why} — give a number, true/false or a word")
        label = case_label(case)
        if label in seen:
            raise SuiteCasesError(f"{what}: case {i} ({label}) is listed twice — list each case once")
        seen.add(label)
    return [dict(c) for c in cases]


def matrix_of(cases: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each key's values over the cases, in order of first appearance."""
    matrix: dict[str, list[Any]] = {k: [] for k in cases[0]}
    seen: dict[str, set] = {k: set() for k in cases[0]}
    for c in cases:
        for k, v in c.items():
            if (type(v), v) not in seen[k]:
                seen[k].add((type(v), v))
                matrix[k].append(v)
    return matrix


# ---------------------------------------------------------------------------------------
# `dsv4-lab suite NAME --list`: what a ported suite holds and what the stages take of it.


class UnknownSuite(Exception):
    """A suite name oracles/suites/ does not declare: one line naming the known ones."""


def suite_modules(root: Path, name: str) -> list[Any]:
    """The modules of suite `name` (oracles/suites/__init__.py's SUITES), imported."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    suites = importlib.import_module("oracles.suites").SUITES
    if name not in suites:
        raise UnknownSuite(f"no suite '{name}' — known: {', '.join(sorted(suites))} (oracles/suites/__init__.py)")
    return [importlib.import_module(m) for m in suites[name]]


def summary(module: Any, kernel_params: tuple[str, ...] = ()) -> dict[str, Any]:
    """{'upstream', 'stage', 'total', 'supported', 'shapes', 'reasons': {reason: cases}} of a suite
        module: every upstream case, the ones the stage takes, the kernels they compile, and the
        cases kept out per reason."""
    cases = module.upstream()
    reasons: dict[str, int] = {}
    supported = 0
    for u in cases:
        why = module.reasons(u)
        supported += not why
        for w in why:
            reasons[w] = reasons.get(w, 0) + 1
    listed = module.cases()
    # one compile per kernel parameters and tensor shapes (the compile cache's key, less the source)
    shapes = len({(tuple(c.get(k) for k in kernel_params), tuple((t.name, tuple(t.shape)) for t in module.tensors(c)))
                  for c in listed})
    return {"upstream": module.UPSTREAM, "stage": module.STAGE, "total": len(cases), "supported": supported,
            "listed": len(listed), "shapes": shapes,
            "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}
