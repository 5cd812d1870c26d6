"""Identity coordinates of a partition, evaluated in plain Python.

`identity_coords(t)` gives what `t[i]` gives for every i of an identity-coordinate tensor (a
thread's partition of make_identity_tensor((M, N))), from its base coordinate and ScaledBasis
strides, without one traced operation per element — the sm100 trace-time agreement checks
(sm100_idioms.py) compare thousands per compile; kernelinspect.py uses it too.  Kept apart
from inspection.py so that no sm90 kernel's source hash depends on it."""

from typing import Any

class NotStatic(ValueError):
    """The tensor is not a static identity-coordinate partition that `identity_coords`
    can evaluate in Python (a dynamic base or stride, a nested or fractional basis)."""


def _basis(step: Any) -> tuple[int, int] | None:
    """(value, mode) of a ScaledBasis stride v@m over a flat coordinate; None for a plain
    0 stride (a broadcast mode).  Anything else raises NotStatic."""
    if hasattr(step, "value") and hasattr(step, "mode"):
        mode = list(step.mode) if isinstance(step.mode, (list, tuple)) else [step.mode]
        value = step.value
        if len(mode) != 1 or not isinstance(mode[0], int) or not isinstance(value, int):
            raise NotStatic(f"not a flat static basis: {step}")
        return value, mode[0]
    if isinstance(step, int) and step == 0:
        return None
    raise NotStatic(f"not a coordinate stride: {step}")


def _modes(shape: Any, stride: Any) -> list[tuple[int, Any]]:
    """(extent, stride) of every leaf mode, first mode first (index order)."""
    if isinstance(shape, tuple):
        if not isinstance(stride, tuple) or len(stride) != len(shape):
            raise NotStatic(f"shape {shape} and stride {stride} do not nest alike")
        out: list[tuple[int, Any]] = []
        for s, d in zip(shape, stride):
            out += _modes(s, d)
        return out
    if not isinstance(shape, int):
        raise NotStatic(f"dynamic extent {shape}")
    return [(shape, stride)]


def identity_coords(t: Any) -> list[tuple[int, ...]]:
    """[t[0], …, t[size − 1]] of an identity-coordinate tensor `t`, computed in Python:

            t[i] = base + Σ_modes ((i / prefix_m) mod extent_m) · value_m · e_{mode_m}

        base: t's iterator; every stride a ScaledBasis value_m@mode_m (or 0, a broadcast); modes
        first-mode-fastest, as CuTe indexes.  NotStatic for anything else (callers index instead)."""
    base = t.iterator
    base = base if isinstance(base, tuple) else (base,)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in base):
        raise NotStatic(f"base coordinate {base} is not a flat tuple of ints")
    coords = [tuple(base)]
    for extent, step in _modes(t.layout.shape, t.layout.stride):
        b = _basis(step)
        if b is None:
            coords = [c for _ in range(extent) for c in coords]
            continue
        value, mode = b
        if mode >= len(base):
            raise NotStatic(f"basis mode {mode} outside the {len(base)}-d coordinate")
        nxt = []
        for i in range(extent):
            for c in coords:
                c2 = list(c)
                c2[mode] += i * value
                nxt.append(tuple(c2))
        coords = nxt
    return coords
