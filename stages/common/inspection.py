"""What a kernel shows `dsv4-lab inspect`: named layouts, recorded while it is traced.

A kernel calls `expose(self, name=value, ...)` at trace time with the objects it wants
inspected; outside `dsv4-lab inspect` it emits nothing, during one a recorder describes them on
the spot (harness/execution/kernelinspect.py holds the checks).  Names understood:
    qk_mma, pv_mma    (tiled_mma, (M, N, K) tile) of S = Q·Kᵀ and O = P·V
    p_path            "registers", "smem" or "tmem"
    smem              {name: layout} shared-memory layouts
    p_write_smem, p_read_smem   P's write layout and the PV MMA's read layout (SMEM-P)
    p_store, p_store_src, p_store_dst   the copy that writes P and its (row, key) coordinates
    pv_a_coords       the PV MMA's A-operand partition of (row, key) coordinates
    tmem              a TMEM plan (column offsets, s/p/o layouts)
    tmem_pair         (load, load_coords, store, store_coords): the S load and P store pair"""

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
