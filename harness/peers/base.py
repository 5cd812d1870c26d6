"""What a peer needs to know about a stage's tensors: the problem's sizes, read from the
stage's tensor specs (harness.peers names the problems and their layouts)."""

from __future__ import annotations

import importlib
from typing import Any


def tensor_shape(problem: str, by: dict[str, Any], name: str, rank: int, dtype: str,
                 role: str = "in") -> tuple[int, ...] | str:
    """The shape of tensor `name` in `by` (name -> TensorSpec) when it has this rank, dtype and
    role; else one phrase saying how it differs from what `problem` wants."""
    s = by.get(name)
    if s is None:
        return f"no tensor {name}"
    if len(s.shape) != rank or s.dtype != dtype or s.role != role:
        return f"{name} is {list(s.shape)} {s.dtype} ({s.role}); {problem} wants rank {rank} {dtype} ({role})"
    return tuple(s.shape)


def shapes(problem: str, by: dict[str, Any], *wanted: tuple) -> list[tuple[int, ...]] | str:
    """tensor_shape for each (name, rank, dtype[, role]) in turn: the shapes, or the first phrase."""
    got = []
    for w in wanted:
        g = tensor_shape(problem, by, *w)
        if isinstance(g, str):
            return g
        got.append(g)
    return got


def importable(module: str) -> str | None:
    """None when `module` imports; "missing" when it is not there; else why it does not load."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        return "missing" if exc.name and exc.name.split(".")[0] == top else f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a package that is there but will not load (ABI, CUDA libraries)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return None
