"""TMA idioms shared by the stages (sm_90a and sm_100a): global → shared loads.

Every stage loads its operands the same way: a row-major global tensor, a
staged shared-memory layout (the MMA's operand layout with a trailing
"stages" mode), one TMA box = one whole tile of that layout, one CTA (no
multicast), and an mbarrier that counts the bytes the box deposits.  The helpers are that
idiom (transpose_view, sm90_tma_load, sm100_tma_load, prefetch_descriptors,
tma_partition_tile, tma_produce) and add no synchronisation of their own.
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, tcgen05


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """The same memory as `t` with its two modes exchanged: a row-major V [n, hd]
    becomes Vᵀ (hd, n), hd contiguous, the MN-major B operand of P·V (N = hd)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def sm90_tma_load(gmem: cute.Tensor, smem_layout, tile):
    """Hopper TMA load of `tile` (a box of `gmem`) into ONE stage of `smem_layout` ((rows, cols,
        stages), swizzled).  Returns (atom, tma_tensor, box_bytes: the transaction count)."""
    one = cute.slice_(smem_layout, (None, None, 0))
    atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem, one, tile)
    return atom, tma_tensor, cute.size_in_bytes(gmem.element_type, one)


def sm100_tma_load(operand: str, mma: cute.TiledMma, gmem: cute.Tensor, smem_layout, tiler):
    """Blackwell TMA load of operand "A" or "B" of the tcgen05 `mma` over `tiler` into ONE stage of
        `smem_layout` (from make_smem_layout_a/b); one CTA.  Returns as `sm90_tma_load`."""
    one = cute.select(smem_layout, mode=[0, 1, 2])
    make = {"A": cute.nvgpu.make_tiled_tma_atom_A, "B": cute.nvgpu.make_tiled_tma_atom_B}[operand]
    op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
    atom, tma_tensor = make(op, gmem, one, tiler, mma)
    return atom, tma_tensor, cute.size_in_bytes(gmem.element_type, one)


def prefetch_descriptors(*atoms) -> None:
    """prefetch.tensormap for each TMA atom's descriptor.  Call it from the one
    warp that will issue the loads (the caller's `if`)."""
    for atom in atoms:
        cpasync.prefetch_descriptor(atom)


def tma_partition_tile(atom, smem: cute.Tensor, gmem: cute.Tensor, tile_modes: int):
    """(tXsX, tXgX) = cpasync.tma_partition for one CTA, no multicast; the first `tile_modes` modes
        form one box (2 for (rows, cols, …), 3 for a tcgen05 operand), the rest index slots / tiles."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_modes), cute.group_modes(gmem, 0, tile_modes)
    )


def tma_produce(pipe, state, *loads) -> None:
    """Producer step of a PipelineTmaAsync slot: wait until slot `state.index` is empty, then issue
        each load (atom, tXgX, tXsX) of global tile `state.count` on its full barrier.  The caller
        advances `state` itself (the tracer carries names, not objects a helper mutates)."""
    pipe.producer_acquire(state)
    bar = None
    for atom, gmem, smem in loads:
        src, dst = gmem[(None, state.count)], smem[(None, state.index)]
        if bar is None:
            bar = pipe.producer_get_barrier(state)
        cute.copy(atom, src, dst, tma_bar_ptr=bar)
