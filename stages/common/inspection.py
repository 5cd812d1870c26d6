"""What a kernel shows `dsv4-lab inspect`: named layouts, recorded while it is traced.

A kernel calls `expose(self, name=value, ...)` at trace time with the objects it wants
inspected (tiled MMAs, shared-memory layouts, TMEM plans, tiled copies, identity partitions).
Outside `dsv4-lab inspect` it returns at once and emits nothing; during one
(harness/execution/kernelinspect.py, which holds the checks) a recorder describes the objects
on the spot (they live only as long as the trace).

Names the inspector understands (see harness/execution/kernelinspect.py for the checks):
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
    """Install (or, with None, remove) the inspection's recorder; harness/execution/kernelinspect.py only."""
    global _recorder
    _recorder = recorder
