"""Hopper (sm_90a) idioms shared by the attention stages.

P in registers between two WGMMAs: the m64nNk16 accumulator holds per thread ((2 adjacent
columns), (rows r, r+8), (N/8 blocks of 8)) and the RS wgmma's A fragment ((2 adjacent k), (rows
r, r+8), (k, k+8)) per 16-wide K-block, so two 8-column blocks of S are one K-block of P: the
retile is a re-indexing of the same registers plus fp32 → bf16.  `check_accumulator_is_a_operand`
proves it for a kernel's two tiled MMAs; `accumulator_to_a_operand` does it; `register_p_mmas`
builds the pair and runs the check.

Also: `wgmma_sync`, `qk_tiled_mma`, `store_accumulator`, `tma_pipeline`, `acc_rows_cols`."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from stages.common import hang_guard

# Lanes whose fragment coordinates are compared at trace time: one full warp
# (every lane pattern) in the first warpgroup, and one lane of the second.
_CHECK_THREADS = tuple(range(32)) + (128 + 37,)


def check_accumulator_is_a_operand(tiled_mma_c, tiled_mma_a, tile_mn):
    """Trace-time proof that the C fragment of `tiled_mma_c` over `tile_mn`
    and the A fragment of `tiled_mma_a` over the same (M, K) tile map every
    register index to the same (row, column)."""
    ident = cute.make_identity_tensor(tile_mn)
    for t in _CHECK_THREADS:
        thr_c = tiled_mma_c.get_slice(t)
        thr_a = tiled_mma_a.get_slice(t)
        coord_c = thr_c.partition_C(ident)
        coord_a = thr_a.partition_A(ident)
        regs_c = thr_c.make_fragment_C(thr_c.partition_shape_C(tile_mn)).layout
        regs_a = thr_a.make_fragment_A(thr_a.partition_shape_A(tile_mn)).layout
        by_reg_c = {regs_c(i): coord_c[i] for i in range(cute.size(coord_c))}
        by_reg_a = {regs_a(i): coord_a[i] for i in range(cute.size(coord_a))}
        if by_reg_c != by_reg_a:
            raise ValueError(
                f"sm90: accumulator and A-operand fragments disagree for thread {t}; "
                "P cannot be retiled in registers for this MMA pair"
            )


def check_rows_shared(qk_mma, pv_mma, tile_mn, hd: int) -> None:
    """Trace time, every thread of warpgroup 0: S's accumulator rows are O's rows in the same order,
        so α, computed beside S, scales O in registers."""
    ident_s = cute.make_identity_tensor(tile_mn)
    ident_o = cute.make_identity_tensor((tile_mn[0], hd))
    for t in range(128):
        thr_s, thr_o = qk_mma.get_slice(t), pv_mma.get_slice(t)
        rows_s, rows_o = acc_rows_cols(thr_s.partition_C(ident_s)), acc_rows_cols(thr_o.partition_C(ident_o))
        if [rows_s[r, 0][0] for r in range(cute.size(rows_s, mode=[0]))] != [rows_o[r, 0][0] for r in range(cute.size(rows_o, mode=[0]))]:
            raise ValueError(f"sm90: S's and O's accumulator rows differ for thread {t}")


def qk_tiled_mma(dtype, atoms: tuple, block_m: int, block_n: int):
    """The tiled wgmma of S = Q · Kᵀ, fp32 accumulator: SS (both operands from shared
    memory), Q [rows, hd] and K [keys, hd] row-major, i.e. both K-major; `atoms` the
    (M, N, 1) arrangement of m{block_m}n{block_n}k16 atoms over the warpgroups."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K,  # Q [m, hd]: hd contiguous
        warpgroup.OperandMajorMode.K,  # K [n, hd]: hd contiguous
        cutlass.Float32,
        atoms,
        tiler_mn=(block_m, block_n),
    )


def register_p_mmas(dtype, num_warpgroups: int, block_n: int, hd: int):
    """(qk_mma, pv_mma) with P in registers, fp32 accumulators, `num_warpgroups` warpgroups along M:
        S = Q · Kᵀ, SS wgmma m64n{block_n}k16, both K-major; O = P · V, RS wgmma m64n{hd}k16, A = P
        from registers, B = Vᵀ MN-major — and the proof (`check_accumulator_is_a_operand`) that S's
        accumulator is P's A fragment."""
    qk_mma = qk_tiled_mma(dtype, (num_warpgroups, 1, 1), 64, block_n)
    pv_mma = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K,  # P in registers
        warpgroup.OperandMajorMode.MN,  # V [n, hd] as B (N = hd, K = keys): hd contiguous
        cutlass.Float32,
        (num_warpgroups, 1, 1),
        tiler_mn=(64, hd),
        a_source=warpgroup.OperandSource.RMEM,
    )
    check_accumulator_is_a_operand(qk_mma, pv_mma, (64 * num_warpgroups, block_n))
    return qk_mma, pv_mma


@cute.jit
def accumulator_to_a_operand(
    acc: cute.Tensor,
    thr_mma_a: cute.ThrMma,
    tile_mk: cutlass.Constexpr[tuple],
    dtype: cutlass.Constexpr[type],
) -> cute.Tensor:
    """This thread's register A fragment (`thr_mma_a` over `tile_mk`) holding `dtype(acc)`, `acc`
        the first MMA's fp32 accumulator over the same tile; valid where
        `check_accumulator_is_a_operand` passed."""
    frag_a = thr_mma_a.make_fragment_A(thr_mma_a.partition_shape_A(tile_mk))
    # The same registers, indexed like the accumulator.
    frag_a_as_acc = cute.make_tensor(frag_a.iterator, acc.layout)
    frag_a_as_acc.store(acc.load().to(dtype))
    return frag_a


def tma_pipeline(mbar, stages: int, tx_bytes: int, consumer_warps: int, defer_sync: bool = True, name: str = ""):
    """PipelineTmaAsync over `mbar` (2 × `stages` Int64): one producer thread (its TMA bytes,
        `tx_bytes` a slot, complete the full barrier), `consumer_warps` arrivals a release.
        defer_sync=True leaves the init fence and CTA barrier to the caller (once all pipelines
        exist)."""
    return pipeline.PipelineTmaAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        barrier_storage=mbar.data_ptr(),
        defer_sync=defer_sync,
        name=hang_guard.name(name),  # "" unless a --debug-hangs build (stages/common/hang_guard.py)
    )


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator fragment ((2, 2, N/8), MMA_M, MMA_N), or a tensor partitioned like one,
        as this thread's (rows, columns): rows (r, r + 8) × MMA_M, columns (2 adjacent) × (N/8) ×
        MMA_N; no data moves.  A row's columns span a quad: reduce, then butterfly over 4 lanes."""
    s, d = t.layout.shape, t.layout.stride
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
            stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
        ),
    )


@cute.jit
def store_accumulator(acc: cute.Tensor, dst: cute.Tensor) -> None:
    """Epilogue: the fp32 accumulator `acc` converted to `dst`'s element type and stored
    into `dst` (this thread's partition of the output, partitioned like `acc`)."""
    out = cute.make_rmem_tensor(dst.shape, dst.element_type)
    out.store(acc.load().to(dst.element_type))
    cute.autovec_copy(out, dst)


@cute.jit
def wgmma_sync(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    a: cute.Tensor,
    b: cute.Tensor,
    a_slot=None,
    b_slot=None,
    zero_init: cutlass.Constexpr[bool] = False,
):
    """acc = A · B (zero_init) or acc += A · B on the warpgroup tensor cores, complete on return.
        `a`, `b`: operand fragments (MMA, MMA_M/N, K steps[, slots]); `a_slot` / `b_slot`: the slot,
        or None.  warpgroup.fence, one wgmma per K step (scale-d = 0 on the first when zero_init),
        commit_group, wait_group(0).  Fragments are indexed a[None, None, k, slot] in one go (the
        descriptor arithmetic, and the PTX, depend on it)."""
    warpgroup.fence()
    tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        a_k = a[None, None, k] if cutlass.const_expr(a_slot is None) else a[None, None, k, a_slot]
        b_k = b[None, None, k] if cutlass.const_expr(b_slot is None) else b[None, None, k, b_slot]
        cute.gemm(tiled_mma, acc, a_k, b_k, acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
