"""What a kernel shows `dsv4-lab inspect`: named layouts, recorded while it is traced.

A kernel calls `expose(self, name=value, ...)` at trace time (in its host-side
`__call__` or in its `@cute.kernel` body) with the objects it builds and wants
inspected: tiled MMAs, shared-memory layouts, TMEM plans, tiled copies and the
identity-coordinate partitions they act on.  Outside an inspection (every compile
and every run) `expose` returns at once: it emits no operation, so the generated
code is the same with or without the hook.

During `dsv4-lab inspect` (harness/inspect.py) a recorder is installed for the
one traced kernel; it describes the objects on the spot (CuTe objects live only
as long as the trace) and keeps plain-Python data for the report and its checks.

Names the inspector understands (see harness/inspect.py for the checks):
    qk_mma, pv_mma    (tiled_mma, (M, N, K) tile) of S = Q·Kᵀ and O = P·V
    p_path            "registers" (P is the PV MMA's register A fragment),
                      "smem" or "tmem"
    smem              {name: layout} shared-memory layouts (swizzle shown)
    p_write_smem, p_read_smem
                      the layout P is written into SMEM with and the layout
                      the PV MMA reads it with (SMEM-P)
    p_store, p_store_src, p_store_dst
                      the copy that writes P, and the identity coordinates
                      (row, key) of its source registers and destination
    pv_a_coords       the PV MMA's A-operand partition of (row, key) coordinates
    tmem              a TMEM plan (s_col/s_cols/…/alloc_cols, s/p/o layouts)
    tmem_pair         (load, load_coords, store, store_coords): tcgen05.ld of S
                      and tcgen05.st of P whose register fragments must agree

`identity_coords(t)` evaluates an identity-coordinate partition (what `t[i]` would
give for every i) in plain Python from its base coordinate and its ScaledBasis
strides: the kernels' trace-time agreement checks (stages/common/sm100_idioms.py)
and the inspector use it instead of indexing element by element, which emits one
traced operation per element.
"""

from __future__ import annotations

from typing import Any, Callable

_recorder: Callable[[Any, dict[str, Any]], None] | None = None


def expose(kernel: Any, **named: Any) -> None:
    """Show `named` objects to an active inspection; a no-op otherwise (nothing is
    traced, nothing is stored on the kernel)."""
    if _recorder is not None:
        _recorder(kernel, named)


def set_recorder(recorder: Callable[[Any, dict[str, Any]], None] | None) -> None:
    """Install (or, with None, remove) the inspection's recorder; harness/inspect.py only."""
    global _recorder
    _recorder = recorder


# ---------------------------------------------------------------------------------------
# Identity coordinates, evaluated in plain Python


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
    """[t[0], t[1], …, t[size − 1]] of an identity-coordinate tensor `t` (e.g. a thread's
    partition of make_identity_tensor((M, N))), computed in Python:

        t[i] = base + Σ_modes ((i / prefix_m) mod extent_m) · value_m · e_{mode_m}

    where base is t's iterator (a coordinate tuple), every stride is a ScaledBasis
    value_m@mode_m (or 0: a broadcast mode), and modes count first-mode-fastest, as CuTe
    indexes.  No traced operation is emitted.  Raises NotStatic for anything that is not
    that (callers fall back to indexing)."""
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
