"""Hopper (sm_90a) idioms shared by the attention stages.

P in registers between two WGMMAs
    The first MMA leaves S = Q·Kᵀ in an fp32 accumulator fragment; the second
    MMA (register-sourced A, "RS" wgmma) wants P = f(S) as a bf16 A fragment.
    For wgmma the two fragments place the same (row, column) at the same
    register index: the accumulator of m64nNk16 holds, per thread, values
    ((2 adjacent columns), (rows r, r+8), (N/8 column blocks of 8)), and the A
    fragment of m64n*k16 holds ((2 adjacent k), (rows r, r+8), (k, k+8)) per
    16-wide K-block, so two consecutive 8-column blocks of S are exactly one
    K-block of P.  Retiling is therefore a pure re-indexing of the same
    registers plus an fp32 → bf16 conversion; no data moves between threads.

    `check_accumulator_is_a_operand` proves the claim at trace time for the two
    tiled MMAs a kernel builds (call it in the host-side `__call__`): if the
    fragments ever disagreed, compilation fails instead of the kernel quietly
    computing with a permuted P.  `accumulator_to_a_operand` then does the
    re-indexing and the conversion inside the kernel.
"""

import cutlass
import cutlass.cute as cute

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


@cute.jit
def accumulator_to_a_operand(
    acc: cute.Tensor,
    thr_mma_a: cute.ThrMma,
    tile_mk: cutlass.Constexpr[tuple],
    dtype: cutlass.Constexpr[type],
) -> cute.Tensor:
    """Return this thread's register A fragment (of `thr_mma_a` over the
    (M, K) tile `tile_mk`) holding `dtype(acc)`, where `acc` is the fp32
    accumulator of the first MMA over the same tile read as (M, N).
    Valid only where `check_accumulator_is_a_operand` passed."""
    frag_a = thr_mma_a.make_fragment_A(thr_mma_a.partition_shape_A(tile_mk))
    # The same registers, indexed like the accumulator.
    frag_a_as_acc = cute.make_tensor(frag_a.iterator, acc.layout)
    frag_a_as_acc.store(acc.load().to(dtype))
    return frag_a
