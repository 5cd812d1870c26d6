"""Blackwell (sm_100a) set-up of the warp-specialised two-MMA attention kernels.

Every sm100 rung from stage B on runs the same CTA of 192 threads:
    warps 0-3  softmax warpgroup: thread t ↔ TMEM lane t ↔ query row t (warp w only lanes
               32w … 32w + 31); warp 0 allocates and frees TMEM
    warp 4     MMA: S = Q·Kᵀ (SMEM × SMEM → TMEM), O += P·V (A from TMEM or SMEM)
    warp 5     TMA: Q once, then per KV tile the K chunks and the Vᵀ slab
Here once: host side `attention_views`, `AttentionOperands`, `attention_smem_struct`, `launch`;
device side `AttentionCta`, `TmemP`, `TmemPAttention` (B and C), `producer_warps` (warp 5 →
`load_role`, warp 4 → `mma_role`), `rescale_o`.
Pipelines (mbarriers via cutlass.pipeline; arrive counts in threads)
    q, k, v   PipelineTmaUmma   load warp (TMA tx bytes) → MMA warp (tcgen05.commit)
    s         PipelineUmmaAsync MMA warp commit → 128 softmax threads
    p         PipelineAsyncUmma 128 softmax threads → MMA warp; its release is a
              tcgen05.commit, so "P slot free" also means "PV_j complete"
    o         PipelineUmmaAsync MMA warp commit after the last PV → 128 threads
Named barriers: TMEM_ALLOC (the base address published), TMEM_FREE (before warp 0 frees TMEM).

Roles are module functions taking the pipeline participants as arguments: the tracer carries
through a staged `if` or loop only names the body assigns or calls a method on.  (No
`from __future__ import annotations`: cute.struct reads `attention_smem_struct`'s annotations.)"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.memory import TmemAllocator

from stages.common import hang_guard
from stages.common.sm100_idioms import (
    TmemPlan,
    check_same_fragment_coords,
    tcgen05_fence_after_sync,
    threads_to_umma_pipeline,
    tma_umma_pipeline,
    tmem_allocate,
    tmem_copy,
    tmem_free,
    umma_to_threads_pipeline,
)
from stages.common.barriers import NamedBarrier
from stages.common.inspection import expose
from stages.common.tma import sm100_tma_load, tma_partition_tile

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


class WarpRoles:
    """The warp roles of the six-warp CTA (a kernel class inherits these names)."""

    SOFTMAX_WARPS = (0, 1, 2, 3)
    MMA_WARP = 4
    LOAD_WARP = 5
    THREADS = 32 * 6
    SOFTMAX_THREADS = 32 * 4


# ---------------------------------------------------------------------------------------
# Host side


def attention_views(Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor, O: cute.Tensor, who: str):
    """(mQ, mK, mV, mO): (rows, cols, 1) views of row-major Q [m, hd], K [n, hd], O [m, hd], and V
        seen as Vᵀ (hd, n, 1), PV's MN-major B operand.  ValueError("{who}: Q, K, V must be
        row-major") otherwise."""
    unit = cute.make_layout(1)
    mQ = cute.make_tensor(Q.iterator, cute.append(Q.layout, unit))
    mK = cute.make_tensor(K.iterator, cute.append(K.layout, unit))
    mV = cute.make_tensor(V.iterator, cute.append(cute.select(V.layout, mode=[1, 0]), unit))
    mO = cute.make_tensor(O.iterator, cute.append(O.layout, unit))
    if (
        LayoutEnum.from_tensor(mQ).mma_major_mode() != OperandMajorMode.K
        or LayoutEnum.from_tensor(mK).mma_major_mode() != OperandMajorMode.K
        or LayoutEnum.from_tensor(mV).mma_major_mode() != OperandMajorMode.MN
    ):
        raise ValueError(f"{who}: Q, K, V must be row-major")
    return mQ, mK, mV, mO


def attention_smem_struct(dtype, q_smem, k_smem, v_smem, k_stages: int, v_stages: int, p_smem=None):
    """The shared-storage struct: mbarrier blocks of the q (1 slot), k, v (`k_stages`, `v_stages`), s,
        p and o pipelines, the TMEM base address, then the Q, K, V buffers and (SMEM-P, `p_smem`) P,
        each 1024-byte aligned, sized by the cosize of each layout's outer part."""

    @cute.struct
    class Smem:
        q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * k_stages]
        v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * v_stages]
        s_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        p_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        o_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        tmem_addr: cutlass.Int32
        sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem.outer)], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem.outer)], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(v_smem.outer)], 1024]
        if p_smem is not None:  # SMEM-P only: the field exists only then
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(p_smem.outer)], 1024]

    return Smem


@dataclass(frozen=True)
class PipelinePlan:
    """The Python ints the device-side pipelines need: bytes one TMA load of Q, of a
    K chunk and of a Vᵀ slab deposits on its slot's full barrier, and the ring depths."""

    q_bytes: int
    k_bytes: int
    v_bytes: int
    k_slots: int
    v_slots: int


class KernelOperands(NamedTuple):
    """The MMAs, TMA atoms and coordinate tensors of Q, K and Vᵀ, and the staged shared-memory
    layouts an sm100 attention kernel receives as one argument (AttentionOperands.args)."""

    qk_mma: cute.TiledMma
    pv_mma: cute.TiledMma
    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_k: cute.CopyAtom
    mK: cute.Tensor
    tma_v: cute.CopyAtom
    mV: cute.Tensor
    q_smem: cute.ComposedLayout
    k_smem: cute.ComposedLayout
    v_smem: cute.ComposedLayout
    p_smem: cute.ComposedLayout


class AttentionOperands:
    """Host side of S = Q·Kᵀ → P → O = P·V with tcgen05 (one CTA, cta_group::1).

        q_tiler (128, kv_tile, hd): S over Q's whole head dim; k_tiler the same MMA over one K
        chunk; pv_tiler (128, O columns of the CTA, kv_tile); pv_n the N of one PV MMA tile (≤ 256);
        p_source TMEM or SMEM.  Q, K K-major, Vᵀ MN-major; P the PV MMA's K-major A operand, layout
        `p_smem` (make_smem_layout_a of the PV tiler) in TMEM or SMEM."""

    def __init__(self, mQ, mK, mV, *, q_tiler, k_tiler, pv_tiler, pv_n: int,
                 k_slots: int, v_slots: int, p_source):
        cta = tcgen05.CtaGroup.ONE
        self.qk_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.K, F32, cta, q_tiler[:2]
        )
        self.pv_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.MN, F32, cta, (pv_tiler[0], pv_n), p_source
        )
        self.q_smem = sm100_utils.make_smem_layout_a(self.qk_mma, q_tiler, BF16, 1)
        self.k_smem = sm100_utils.make_smem_layout_b(self.qk_mma, k_tiler, BF16, k_slots)
        self.v_smem = sm100_utils.make_smem_layout_b(self.pv_mma, pv_tiler, BF16, v_slots)
        self.p_smem = sm100_utils.make_smem_layout_a(self.pv_mma, pv_tiler, BF16, 1)  # P's A-operand layout
        self.tma_q, self.tma_Q, q_bytes = sm100_tma_load("A", self.qk_mma, mQ, self.q_smem, q_tiler)
        self.tma_k, self.tma_K, k_bytes = sm100_tma_load("B", self.qk_mma, mK, self.k_smem, k_tiler)
        self.tma_v, self.tma_V, v_bytes = sm100_tma_load("B", self.pv_mma, mV, self.v_smem, pv_tiler)
        self.plan = PipelinePlan(q_bytes, k_bytes, v_bytes, k_slots, v_slots)

    def args(self) -> "KernelOperands":
        """What the kernel receives first, as ONE argument (a NamedTuple, as sm90's
        AttentionOperands): qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem,
        v_smem, p_smem."""
        return KernelOperands(self.qk_mma, self.pv_mma, self.tma_q, self.tma_Q, self.tma_k, self.tma_K,
                              self.tma_v, self.tma_V, self.q_smem, self.k_smem, self.v_smem, self.p_smem)

    def smem_struct(self, tmem_p: bool):
        """attention_smem_struct of these layouts (a P buffer unless P lives in TMEM)."""
        return attention_smem_struct(BF16, self.q_smem, self.k_smem, self.v_smem, self.plan.k_slots,
                                     self.plan.v_slots, p_smem=None if tmem_p else self.p_smem)


def launch(kernel_call, grid, stream, threads: int = WarpRoles.THREADS) -> None:
    """Launch a warp-specialised kernel: `grid` CTAs of `threads` threads, .minnctapersm 1 (ptxas may
        use more than 168 registers rather than spill)."""
    kernel_call.launch(grid=grid, block=(threads, 1, 1), stream=stream, min_blocks_per_mp=1)


# ---------------------------------------------------------------------------------------
# Device side


@dataclass
class TmaLoads:
    """The TMA atoms and their (global, shared) partitions: tQgQ (TMA), tKgK (TMA,
    n_tiles, chunks), tVgV (TMA, n_tiles); tXsX (TMA, slots)."""

    tma_q: object
    tQgQ: object
    tQsQ: object
    tma_k: object
    tKgK: object
    tKsK: object
    tma_v: object
    tVgV: object
    tVsV: object


class AttentionCta:
    """Device side: what every role shares, built before the role `if`s: storage; sQ, sK, sV; the
        pipeline participants q_prod, q_cons, k_…, v_…, s_…, p_…, o_…; tmem_alloc (warp 0
        allocates; the address read after TMEM_ALLOC) and tmem_done (TMEM_FREE); the MMA slices
        qk_thr, pv_thr and the descriptors tSrQ, tSrK, tOrV."""

    def __init__(self, smem_struct, plan: PipelinePlan, qk_mma, pv_mma, q_smem, k_smem, v_smem):
        storage = utils.SmemAllocator().allocate(smem_struct)
        self.storage = storage
        self.sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        self.sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)
        self.sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)

        threads = WarpRoles.SOFTMAX_THREADS
        self.q_prod, self.q_cons = tma_umma_pipeline(storage.q_mbar, 1, plan.q_bytes, name="q")
        self.k_prod, self.k_cons = tma_umma_pipeline(storage.k_mbar, plan.k_slots, plan.k_bytes, name="k")
        self.v_prod, self.v_cons = tma_umma_pipeline(storage.v_mbar, plan.v_slots, plan.v_bytes, name="v")
        self.s_prod, self.s_cons = umma_to_threads_pipeline(storage.s_mbar, threads, name="s")
        self.p_prod, self.p_cons = threads_to_umma_pipeline(storage.p_mbar, threads, name="p")
        self.o_prod, self.o_cons = umma_to_threads_pipeline(storage.o_mbar, threads, name="o")

        self.tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                                       num_threads=WarpRoles.THREADS),
            allocator_warp_id=WarpRoles.SOFTMAX_WARPS[0],
        )
        self.tmem_done = pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_FREE), num_threads=threads)

        self.qk_thr = qk_mma.get_slice(0)
        self.pv_thr = pv_mma.get_slice(0)
        self.tSrQ = qk_mma.make_fragment_A(self.sQ)  # (MMA, MMA_M, hd / 16, 1)
        self.tSrK = qk_mma.make_fragment_B(self.sK)  # (MMA, MMA_N, k_chunk / 16, slots)
        self.tOrV = pv_mma.make_fragment_B(self.sV)  # (MMA, PV tiles, kv_tile / 16, slots)

    def tma_partitions(self, tma_q, mQ, tma_k, mK, tma_v, mV, q_tiler, k_tiler, pv_tiler, v_slab):
        """TmaLoads: where one TMA copy moves Q, the K chunk c of KV tile j
        (tKgK[None, j, c]) and this CTA's Vᵀ slab `v_slab` of KV tile j (tVgV[None, j]);
        the shared sides are indexed by slot."""
        gQ = cute.flat_divide(mQ, cute.select(q_tiler, mode=[0, 2]))  # (128, hd, 1, 1, 1)
        gK = cute.flat_divide(mK, cute.select(k_tiler, mode=[1, 2]))  # (kv, chunk, n_tiles, chunks, 1)
        gV = cute.flat_divide(mV, cute.select(pv_tiler, mode=[1, 2]))  # (hd_cta, kv, slabs, n_tiles, 1)
        tQsQ, tQgQ = tma_partition_tile(tma_q, self.sQ, self.qk_thr.partition_A(gQ), 3)
        tKsK, tKgK = tma_partition_tile(tma_k, self.sK, self.qk_thr.partition_B(gK), 3)
        tVsV, tVgV = tma_partition_tile(tma_v, self.sV, self.pv_thr.partition_B(gV), 3)
        return TmaLoads(tma_q, tQgQ[None, 0, 0, 0], tQsQ, tma_k, tKgK[None, None, None, 0], tKsK,
                        tma_v, tVgV[None, v_slab, None, 0], tVsV)

    def allocate_tmem(self, cols: int):
        """tcgen05.alloc of `cols` columns by warp 0; every thread gets the fp32 base pointer."""
        return tmem_allocate(self.tmem_alloc, cols)



def free_tmem(cta: AttentionCta, tmem_ptr, cols: int) -> None:
    """The softmax warps meet on TMEM_FREE (each fenced before_thread_sync after its last TMEM
        access), then warp 0 deallocates.  A function: a method on `cta` inside a role `if` would
        make the tracer carry `cta`."""
    tmem_free(cta.tmem_alloc, tmem_ptr, cols, cta.tmem_done)


class TmemP:
    """TMEM-P (P = f(S) in TMEM, inside S's columns; sm100_idioms.TmemPlan): the plan, allocated;
        tStS, tOrP, tOtO; s_load (tcgen05.ld 32x32b.x32, fp32), p_store (tcgen05.st 32x32b.x16,
        bf16) and the identity coordinates cS, cP, the two fragments proven to agree at trace time."""

    def __init__(self, cta: AttentionCta, qk_mma, pv_mma, qk_tiler, pv_tiler, p_layout):
        self.plan = TmemPlan(qk_mma, pv_mma, qk_tiler, pv_tiler, p_layout, F32, BF16)
        self.cols = self.plan.alloc_cols
        self.ptr = cta.allocate_tmem(self.cols)  # tcgen05.alloc by the allocator warp (0)
        self.tStS, self.tOrP, self.tOtO = self.plan.views(self.ptr)
        self.s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, self.tStS)
        self.p_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x16, BF16, self.tOrP)
        self.cS = cta.qk_thr.partition_C(cute.make_identity_tensor(qk_tiler[:2]))  # (row, key)
        self.cP = cta.pv_thr.partition_A(cute.make_identity_tensor((pv_tiler[0], pv_tiler[2])))  # (row, key)
        check_same_fragment_coords(self.s_load, self.cS, self.p_store, self.cP, "TMEM-P (S → P)")  # trace time


class TmemPAttention(WarpRoles):
    """The hd = 64 TMEM-P rungs (B, C): one CTA of 128 query rows, KV tiles of 128 keys, K and V in
        2-slot rings, S, P (inside S) and O in TMEM.  A subclass names itself (WHO) and calls
        `operands()` in its __call__, `setup()` at the top of its kernel."""

    WHO = "sm100"
    TILE_M = 128  # query rows = UMMA M
    KV_TILE = 128  # keys per KV tile = N of QK = K of PV
    KV_STAGES = 2  # shared-memory slots for K and for V

    def __init__(self, *, m: int, n: int, hd: int):
        if m != self.TILE_M:
            raise ValueError(f"{self.WHO}: m must be {self.TILE_M}, got {m}")
        if hd != 64:
            raise ValueError(f"{self.WHO}: TMEM-P needs hd = 64, got {hd} (SMEM-P is stage D1)")
        if n <= 0 or n % self.KV_TILE != 0:
            raise ValueError(f"{self.WHO}: n must be a positive multiple of {self.KV_TILE}, got {n}")
        self.m, self.n, self.hd = m, n, hd
        self.n_tiles = n // self.KV_TILE
        self.qk_tiler = (self.TILE_M, self.KV_TILE, hd)  # (M, N, K) of S = Q·Kᵀ
        self.pv_tiler = (self.TILE_M, hd, self.KV_TILE)  # (M, N, K) of O = P·V

    def operands(self, Q, K, V, O):
        """Host side: (ops, mO) — the views, the AttentionOperands with P from TMEM, the plan and the
                shared-storage struct."""
        mQ, mK, mV, mO = attention_views(Q, K, V, O, self.WHO)
        ops = AttentionOperands(mQ, mK, mV, q_tiler=self.qk_tiler, k_tiler=self.qk_tiler, pv_tiler=self.pv_tiler,
                                pv_n=self.hd, k_slots=self.KV_STAGES, v_slots=self.KV_STAGES,
                                p_source=tcgen05.OperandSource.TMEM)
        self.plan = ops.plan
        self.smem_struct = ops.smem_struct(tmem_p=True)
        return ops, mO

    def setup(self, qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_layout):
        """Device side, before the role `if`s: (cta, loads, tmem) — AttentionCta, its
        TmaLoads and TmemP (S, P inside S, O; the S → P pair proven at trace time),
        shown to `dsv4-lab inspect`."""
        cta = AttentionCta(self.smem_struct, self.plan, qk_mma, pv_mma, q_smem, k_smem, v_smem)
        loads = cta.tma_partitions(tma_q, mQ, tma_k, mK, tma_v, mV, self.qk_tiler, self.qk_tiler, self.pv_tiler, 0)
        tmem = TmemP(cta, qk_mma, pv_mma, self.qk_tiler, self.pv_tiler, p_layout)
        expose(self, p_path="tmem", qk_mma=(qk_mma, self.qk_tiler), pv_mma=(pv_mma, self.pv_tiler),
               smem={"Q": q_smem, "K": k_smem, "V": v_smem, "P (A layout)": p_layout},
               tmem=tmem.plan, tmem_pair=(tmem.s_load, tmem.cS, tmem.p_store, tmem.cP))
        return cta, loads, tmem


# ---------------------------------------------------------------------------------------
# Roles shared unchanged by the rungs


@cute.jit
def load_role(q_prod, k_prod, v_prod, loads: TmaLoads, n_tiles: cutlass.Constexpr, n_chunks: cutlass.Constexpr):
    """Warp 5: Q once; per KV tile j its n_chunks K chunks into the K ring, then its Vᵀ
    slab into the V ring.  Waits at the end for the MMA warp's last releases, so no
    arrive lands after the warp exits."""
    hang_guard.role("load")  # names this role's waits in a --debug-hangs build
    q_slot = q_prod.acquire_and_advance()
    cute.copy(loads.tma_q, loads.tQgQ, loads.tQsQ[None, 0], tma_bar_ptr=q_slot.barrier)
    for j in cutlass.range(n_tiles, unroll=1):
        for c in cutlass.range_constexpr(n_chunks):
            k_slot = k_prod.acquire_and_advance()
            cute.copy(loads.tma_k, loads.tKgK[None, j, c], loads.tKsK[None, k_slot.index],
                      tma_bar_ptr=k_slot.barrier)
        v_slot = v_prod.acquire_and_advance()
        cute.copy(loads.tma_v, loads.tVgV[None, j], loads.tVsV[None, v_slot.index], tma_bar_ptr=v_slot.barrier)
    q_prod.tail()
    k_prod.tail()
    v_prod.tail()


@cute.jit
def mma_role(q_cons, k_cons, v_cons, s_prod, p_cons, o_prod, qk_mma, pv_mma, tSrQ, tSrK, tOrV,
             tStS, tOrP, tOtO, n_tiles: cutlass.Constexpr, n_chunks: cutlass.Constexpr):
    """Warp 4, per KV tile j:
            S_j = Q·K_jᵀ     once the S buffer is handed back (TMEM-P: after PV_{j-1}), chunk by
                             chunk, each K slot released by tcgen05.commit once read
            O  += P_j·V_j    once P_j is ready (and O rescaled); accumulate off for j = 0
        then commits "O final" after the last PV."""
    hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
    q_full = q_cons.wait_and_advance()
    kb_per_chunk = cute.size(tSrK, mode=[2])
    num_kb_pv = cute.size(tOrV, mode=[2])
    for j in cutlass.range(n_tiles, unroll=1):
        s_free = s_prod.acquire_and_advance()
        for c in cutlass.range_constexpr(n_chunks):
            k_full = k_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            for kb in cutlass.range_constexpr(kb_per_chunk):
                qk_mma.set(tcgen05.Field.ACCUMULATE, c * kb_per_chunk + kb != 0)
                cute.gemm(qk_mma, tStS, tSrQ[None, None, c * kb_per_chunk + kb, 0],
                          tSrK[None, None, kb, k_full.index], tStS)
            k_full.release()  # tcgen05.commit → K slot free once read
        s_free.commit()  # tcgen05.commit → S_j ready for the softmax warps
        v_full = v_cons.wait_and_advance()
        p_full = p_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        for kb in cutlass.range_constexpr(num_kb_pv):
            if cutlass.const_expr(kb == 0):
                pv_mma.set(tcgen05.Field.ACCUMULATE, j != 0)
            else:
                pv_mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(pv_mma, tOtO, tOrP[None, None, kb], tOrV[None, None, kb, v_full.index], tOtO)
        p_full.release()  # tcgen05.commit → P slot free = PV_j complete
        v_full.release()
    o_slot = o_prod.acquire_and_advance()
    o_slot.commit()  # tcgen05.commit → every MMA done, O final
    q_full.release()


@cute.jit
def producer_warps(warp_idx, cta: AttentionCta, loads: TmaLoads, qk_mma, pv_mma, tStS, tOrP, tOtO,
                   n_tiles: cutlass.Constexpr, n_chunks: cutlass.Constexpr):
    """Hands warp 5 to `load_role` and warp 4 to `mma_role` (the softmax warps are the
    rung's own)."""
    if warp_idx == WarpRoles.LOAD_WARP:
        load_role(cta.q_prod, cta.k_prod, cta.v_prod, loads, n_tiles, n_chunks)
    if warp_idx == WarpRoles.MMA_WARP:
        mma_role(cta.q_cons, cta.k_cons, cta.v_cons, cta.s_prod, cta.p_cons, cta.o_prod, qk_mma, pv_mma,
                 cta.tSrQ, cta.tSrK, cta.tOrV, tStS, tOrP, tOtO, n_tiles, n_chunks)


@cute.jit
def rescale_o(o_load, o_store, tTR_tO, tRT_tO, rO, alpha, pv_tiles: cutlass.Constexpr,
              o_chunks: cutlass.Constexpr):
    """O_{j-1} ← α_j · O_{j-1} in TMEM: per PV tile and 32-column chunk, tcgen05.ld → wait::ld →
        × α → tcgen05.st (tTR_tO / tRT_tO: this thread's row of O).  The caller issues
        tcgen05.wait::st before it signals the MMA warp."""
    for t in cutlass.range_constexpr(pv_tiles):
        for ch in cutlass.range_constexpr(o_chunks):
            cute.copy(o_load, tTR_tO[None, ch, None, t], rO)
            cute.arch.fence_view_async_tmem_load()
            rO.store(rO.load() * alpha)
            cute.copy(o_store, rO, tRT_tO[None, ch, None, t])
