"""Hopper (sm_90a) SMEM-P: P through shared memory from the warpgroup that computes S and the
softmax to the warpgroups that split O by column (stage D1 onwards).

At hd = 512 a 64 × hd fp32 O tile is 256 registers a thread, so O's columns are split over
`num_wg` warpgroups, which all need the same P.  Warpgroup 0 alone computes S and the softmax,
stores P (bf16, the SS P·V wgmma's K-major A operand) and the per-row factor (α, at the end
1/ℓ) to shared memory (`smem_p_mmas`, `vt_slice_layout`).

The handshake (named barriers, stages/common/barriers.py; `threads` = every warpgroup meeting)
    publish     warpgroup 0: bf16(S) → registers, then publish_p
    publish_p   warpgroup 0, P already bf16 in S's accumulator layout: [wait P_EMPTY];
                stmatrix P (a copy tiled like the S accumulator); one lane of each row's quad
                writes the row factor; fence.proxy.async.shared::cta
    arrive_full warpgroup 0, when it does not wait for the others: arrive on P_FULL
    wait_full   everyone (or the readers only, after arrive_full): P_FULL
    row_factors this thread's rows' factors into registers
    rescale     O[row, :] *= the row factor, this thread's rows of its O part
    release     a warpgroup other than 0, after its P·V: arrive on P_EMPTY
    wait_empty  warpgroup 0: wait on P_EMPTY before overwriting P or the factors
    publish_rows / wait_epilogue
                the end: warpgroup 0 writes 1/ℓ as the row factor, then EPILOGUE (all)
Met aligned (`bar.sync` / `bar.arrive`) unless the kernel passes other `sync` / `arrive`
(stage E: unaligned, stages/common/unaligned_barriers.py)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warp, warpgroup

from stages.common.barriers import NamedBarrier
from stages.common.inspection import expose
from stages.common.sm90_idioms import acc_rows_cols, qk_tiled_mma
from stages.common.softmax import scale_rows


def aligned_sync(barrier: int, threads: int) -> None:
    """bar.sync: wait at named barrier `barrier` until `threads` threads have arrived."""
    cute.arch.barrier(barrier_id=int(barrier), number_of_threads=threads)


def aligned_arrive(barrier: int, threads: int) -> None:
    """bar.arrive: arrive at named barrier `barrier` without waiting."""
    cute.arch.barrier_arrive(barrier_id=int(barrier), number_of_threads=threads)


def smem_p_mmas(dtype, block_m: int, block_n: int, hd: int, num_wg: int):
    """(qk_mma, pv_mma) of SMEM-P attention, fp32 accumulators: S = Q · Kᵀ, SS wgmma
        m{block_m}n{block_n}k16 on one warpgroup; O = P · V, SS wgmma m{block_m}n{hd/num_wg}k16,
        atoms (1, num_wg, 1) (warpgroup w owns O columns [w·hd/num_wg, (w+1)·hd/num_wg)), A = P
        K-major, B = Vᵀ (hd, keys) MN-major."""
    qk_mma = qk_tiled_mma(dtype, (1, 1, 1), block_m, block_n)
    pv_mma = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K,  # P [rows, keys]: keys contiguous
        warpgroup.OperandMajorMode.MN,  # Vᵀ (hd, keys): hd contiguous
        cutlass.Float32,
        (1, num_wg, 1),
        tiler_mn=(block_m, hd // num_wg),
    )
    return qk_mma, pv_mma


def vt_slice_layout(dtype, hd: int, block_n: int, stages: int, slice_n: int):
    """Shared-memory layout of Vᵀ tiles (hd, block_n, stages), hd contiguous; the swizzle atom fits
        ONE warpgroup's slice (slice_n columns), so every slice is a valid wgmma descriptor alone;
        atoms repeat along the keys first."""
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.COL_MAJOR, dtype, slice_n)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, (hd, block_n, stages), order=(1, 0, 2))


class SmemP:
    """One CTA's P buffer `sP` (rows, keys), its row-factor buffer `s_row` (rows fp32) and the
    handshake between warpgroup 0 (the writer) and the P·V warpgroups (see the module doc).
    Build it in every thread (`create`); the writer's pieces are meaningful in warpgroup 0."""

    def __init__(self, p_store, thr_p_store, tPsP, tScS_rc, s_row, threads: int, sync=aligned_sync,
                 arrive=aligned_arrive):
        self.p_store, self.thr_p_store, self.tPsP = p_store, thr_p_store, tPsP
        self.tScS_rc = tScS_rc  # (row, key) of this thread's S accumulator, as (rows, columns)
        self.s_row = s_row
        self.threads = threads
        self.sync, self.arrive = sync, arrive  # how the named barriers are met (see the module doc)

    @staticmethod
    def create(kernel, qk_mma, sP: cute.Tensor, s_row: cute.Tensor, tid_wg, threads: int, sync=aligned_sync,
               arrive=aligned_arrive) -> "SmemP":
        """`sP` (block_m, block_n); `tid_wg` the thread's index in its warpgroup; `kernel` is shown the
                P store (inspect); `sync` / `arrive` meet a named barrier (aligned by default;
                unaligned_barriers.py's for warpgroups meeting from different code)."""
        tile = cute.size(sP, mode=[0]), cute.size(sP, mode=[1])
        p_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), sP.element_type), qk_mma
        )
        thr_p_store = p_store.get_slice(tid_wg)
        expose(kernel, p_store=(p_store, qk_mma, tile, tile))  # dsv4-lab inspect; no code
        tScS_rc = acc_rows_cols(qk_mma.get_slice(tid_wg).partition_C(cute.make_identity_tensor(tile)))
        return SmemP(p_store, thr_p_store, thr_p_store.partition_D(sP), tScS_rc, s_row, threads, sync, arrive)

    @cute.jit
    def publish(self, acc_s: cute.Tensor, row_factor: cute.Tensor, wait_empty) -> None:
        """Warpgroup 0: P = bf16(acc_s) and `row_factor` (one per row of this thread) into
        shared memory, after waiting for P_EMPTY when `wait_empty` (not on the first tile)."""
        r_p = cute.make_rmem_tensor(acc_s.shape, self.tPsP.element_type)
        r_p.store(acc_s.load().to(self.tPsP.element_type))
        self.publish_p(r_p, row_factor, wait_empty)

    @cute.jit
    def publish_p(self, r_p: cute.Tensor, row_factor: cute.Tensor, wait_empty) -> None:
        """Warpgroup 0: P (`r_p`, already bf16, laid out as S's accumulator) and `row_factor`
        into shared memory, after waiting for P_EMPTY when `wait_empty`; fenced for the wgmma."""
        if wait_empty:  # the other warpgroups are done with the previous P and factors
            self.wait_empty()
        cute.copy(self.p_store, self.thr_p_store.retile(r_p), self.tPsP)
        self.publish_rows(row_factor)
        cute.arch.fence_proxy("async.shared", space="cta")  # P: generic writes → wgmma reads

    @cute.jit
    def publish_rows(self, values: cute.Tensor) -> None:
        """One lane of each row's quad writes values[r] as the row factor of its row r."""
        for r in cutlass.range_constexpr(cute.size(self.tScS_rc, mode=[0])):
            if self.tScS_rc[r, 0][1] == 0:
                self.s_row[self.tScS_rc[r, 0][0]] = values[r]

    @cute.jit
    def rescale(self, acc_o_rc: cute.Tensor, tOcO_rc: cute.Tensor, factors=None) -> None:
        """O[row, :] *= the row factor (or `factors[row]`, another per-row buffer of shared
        memory), over this thread's rows of its O part (`acc_o_rc` and its (row, col)
        coordinates `tOcO_rc`, both as (rows, columns))."""
        rows = self.s_row if factors is None else factors
        for r in cutlass.range_constexpr(cute.size(acc_o_rc, mode=[0])):
            scale_rows(acc_o_rc, r, rows[tOcO_rc[r, 0][0]])

    @cute.jit
    def row_factors(self, tOcO_rc: cute.Tensor) -> cute.Tensor:
        """The row factors of this thread's rows of its O part, in registers (fp32)."""
        out = cute.make_rmem_tensor(cute.size(tOcO_rc, mode=[0]), cutlass.Float32)
        for r in cutlass.range_constexpr(cute.size(tOcO_rc, mode=[0])):
            out[r] = self.s_row[tOcO_rc[r, 0][0]]
        return out

    # Loop-invariant: nothing of it changes in the kernel's loops, so it carries no values
    # through them (the tracer still asks, because its methods are called there).
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def arrive_full(self) -> None:
        self.arrive(NamedBarrier.P_FULL, self.threads)

    def wait_full(self) -> None:
        self.sync(NamedBarrier.P_FULL, self.threads)

    def wait_empty(self) -> None:
        self.sync(NamedBarrier.P_EMPTY, self.threads)

    def release(self) -> None:
        self.arrive(NamedBarrier.P_EMPTY, self.threads)

    def wait_epilogue(self) -> None:
        self.sync(NamedBarrier.EPILOGUE, self.threads)
