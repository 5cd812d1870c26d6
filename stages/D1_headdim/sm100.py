"""Stage D1 on Blackwell (sm_100a): online-softmax attention for head dims 64 … 512, tcgen05 MMAs
with S and O in tensor memory (TMEM); P in TMEM at hd = 64 and in shared memory above.
Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math: stage C's (stages/C_online_softmax/sm100.py) with KV tiles of `kv_tile` keys,
scale = 1/sqrt(hd): O = bf16(O_last / l_last), LSE = (m_last · c + log2 l_last) · ln 2.
    Q [m, hd], K, V [n, hd], O [m, hd] bf16 row-major; LSE [m] fp32.  m = 128,
    hd ∈ {64, 128, 256, 512}, n a multiple of kv_tile.

Why hd = 512 takes two CTAs (the TMEM budget)
    TMEM is 128 lanes × 512 columns of 32 bit; with one query row a lane, S needs kv_tile
    columns and O hd, so at hd = 512 O alone fills TMEM.  O is split by head-dim columns: CTA b
    (grid = hd / hd_per_cta, hd_per_cta = min(hd, 256)) owns O[:, b·hd_per_cta : (b+1)·hd_per_cta];
    every CTA computes the full S and the same softmax, only its P·V slab differs, CTA 0 alone
    writes LSE (cost at hd = 512: one extra Q·Kᵀ and a second SM; cta_group::2 as in CUTLASS's
    MLA decode example needs hardware to test).  O is accumulated as hd_per_cta / pv_n PV tiles
    (pv_n ≤ 256, default hd_per_cta).  `tmem_budget(hd, kv_tile)` gives the columns; the
    constructor raises ValueError("TMEM budget: S … + O … = N columns > 512 …") (e.g.
    Kernel(m=128, n=128, hd=512, hd_per_cta=512): S 64 + O 512 = 576), and the traced kernel
    re-derives every column count from the MMA fragments (find_tmem_tensor_col_offset).

    Configurations (defaults; TMEM columns per CTA, dynamic SMEM incl. barriers)
      hd   CTAs kv_tile  P     S + O (alloc)     K slots        V slots        SMEM
      64    1    128    TMEM  128 + 64  (256)   2 × 16 KiB     2 × 16 KiB      81 KiB
      128   1    128    SMEM  128 + 128 (256)   2 × 32 KiB     2 × 32 KiB     193 KiB
      256   1     64    SMEM   64 + 256 (512)   4 × 16 KiB     2 × 32 KiB     209 KiB
      512   2     64    SMEM   64 + 256 (512)   3 × 16 KiB     1 × 32 KiB     225 KiB
    Q stays resident; K streams in chunks of min(hd, 128) columns; V slots hold this CTA's Vᵀ
    slab (hd_per_cta × kv_tile); SMEM-P is 128 × kv_tile bf16.  Limit 227 KiB (232448 bytes):
    the constructor checks an estimate, the traced kernel the real struct size.

P between the two MMAs
    hd = 64 (TMEM-P, stage C's path): P (bf16) is tcgen05.st into the upper half of S's
    columns, viewed as the PV MMA's K-major A operand in TMEM (`TmemPlan`).
    hd > 64 (SMEM-P): the softmax threads store their bf16 P row with 128-bit st.shared through
    a tiled copy built from the S tcgen05.ld (make_tiled_copy_D) into an (M, K) view of the PV
    MMA's A-operand layout (make_smem_layout_a, K-major, 128-byte swizzle), then
    fence.proxy.async.shared::cta and arrive on "P full" (128 arrivals).  Trace-time checks
    (`check_smem_p`): register i of the tcgen05.ld fragment and of the SMEM copy hold the same
    (row, key), and the (M, K) view is the identity on (row, key).

New in this rung (stage C + head dims 64 … 512): the TMEM and SMEM budgets, SMEM-P, K in
head-dim chunks, O split over CTAs, chunked O passes.  The set-up, load and MMA warps and the
O rescale are stages/common/sm100_setup.py's (shared with B and C); this module keeps its
plans, the softmax warps and the epilogue.

Warp roles and pipelines: stage C's (sm100_setup.py) — warp 5 TMA (Q; per tile the K chunks and
this CTA's Vᵀ slab), warp 4 MMA (S chunk by chunk; O += P_j·V_j as hd_per_cta / pv_n PV tiles a
K step), warps 0-3 softmax and the epilogue (O / l, LSE by CTA 0).  TMEM-P: P_j lives in S's
columns, so S is handed back only after PV_j.  SMEM-P: S is handed back once loaded
(tcgen05.wait::ld); P_j's buffer is rewritten after PV_{j-1}'s commit.

DSV4.md's lessons ("What the first attempt taught"), as handled here
    1  Values used by several roles are built before the role `if`s; each role its own
       @cute.jit function; unused values set to None; const choices use const_expr.
    2  Thread sides of a pipeline count threads (CooperativeGroup(Thread, 128)).
    3  TMEM stores → tcgen05.wait::st + fence::before_thread_sync before the arrive; the MMA
       warp fences after_thread_sync; SMEM-P adds fence.proxy.async.shared::cta.
    4  Column offsets from find_tmem_tensor_col_offset, checked against tmem_budget().
    5  P's TMEM view and SMEM layout are the PV MMA's A-operand layout, never a composition
       of the QK accumulator's.
    6  P spans the PV tiler's K extent (kv_tile).
    7  SMEM-P: a copy partitioned by the QK accumulator's thread layout, then fence, mbarrier.
    8  QK N = kv_tile, PV N = pv_n, never N > 256.
    9  Q, K, V, O get a unit L mode before tiling.
    10 Not used: V has its own TMA and ring.
    11 hd = 64 keeps stage C's data path; only the O epilogue is chunked."""

import math
from types import SimpleNamespace

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05

from stages.common import hang_guard
from stages.common.inspection import expose
from stages.common.sm100_idioms import (
    TMEM_COL_BITS,
    check_same_fragment_coords,
    check_smem_p,
    mk_view,
    online_softmax_update,
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    tmem_alloc_cols,
    tmem_copy,
)
from stages.common.sm100_setup import (
    KernelOperands,
    AttentionCta,
    AttentionOperands,
    TmemP,
    WarpRoles,
    attention_views,
    free_tmem,
    launch,
    producer_warps,
    rescale_o,
)
from stages.common.tma import prefetch_descriptors
from stages.common.device import SMEM_LIMIT  # the largest dynamic shared memory of a CTA

BF16 = cutlass.BFloat16
F32 = cutlass.Float32

TILE_M = 128  # query rows per CTA = UMMA M = TMEM lanes
TMEM_COLUMNS = 512  # TMEM columns per SM (32 bit each)
MMA_N_MAX = 256  # tcgen05 kind::f16 with M = 128: N ∈ {16, 32, …, 256}
K_CHUNK = 128  # head-dim columns of K per shared slot (one Q·Kᵀ chunk)
HEAD_DIMS = (64, 128, 256, 512)
TMEM_P_HD = 64  # the head dim that keeps P in TMEM (stage C's path)

# hd → (kv_tile, K slots, V slots).  hd_per_cta defaults to min(hd, 256).
_DEFAULTS = {
    64: (128, 2, 2),
    128: (128, 2, 2),
    256: (64, 4, 2),
    512: (64, 3, 1),
}

def default_hd_per_cta(hd: int) -> int:
    """O columns owned by one CTA: the whole head dim up to 256, else 256."""
    return min(hd, MMA_N_MAX)


def _acc_cols(width: int, dtype_bits: int) -> int:
    """TMEM columns of a 128-row accumulator/operand `width` elements wide."""
    return width * dtype_bits // TMEM_COL_BITS


def tmem_budget(hd: int, kv_tile: int, hd_per_cta: int | None = None) -> dict:
    """TMEM columns per CTA for S, P and O (plain Python): S the fp32 Q·Kᵀ accumulator (kv_tile
        columns), O this CTA's fp32 slab (hd_per_cta, default min(hd, 256)), P bf16 inside S's
        columns at hd = 64 (no extra space), in shared memory above.  `total` = S + O ≤ 512."""
    if hd_per_cta is None:
        hd_per_cta = default_hd_per_cta(hd)
    s = _acc_cols(kv_tile, F32.width)
    p = _acc_cols(kv_tile, BF16.width) if hd == TMEM_P_HD else 0
    o = _acc_cols(hd_per_cta, F32.width)
    total = s + o  # P adds nothing: inside S (TMEM-P) or in SMEM
    return {
        "S": s,
        "P": p,
        "P_in": "TMEM (inside S)" if p else "SMEM",
        "O": o,
        "total": total,
        "alloc": tmem_alloc_cols(total),
        "limit": TMEM_COLUMNS,
        "ctas": hd // hd_per_cta,
    }


def _tmem_budget_error(hd, kv_tile, hd_per_cta, s, o, total) -> ValueError:
    return ValueError(
        f"TMEM budget: S {s} + O {o} = {total} columns > {TMEM_COLUMNS} "
        f"(hd={hd}, kv_tile={kv_tile}, hd_per_cta={hd_per_cta}): a 128-row fp32 accumulator "
        f"takes one column per element of a row, so S needs kv_tile and O needs hd_per_cta "
        f"columns; split O over more CTAs (hd_per_cta ≤ 256, the default) or shrink kv_tile"
    )


def smem_budget(hd: int, kv_tile: int, hd_per_cta: int, k_slots: int, v_slots: int) -> dict:
    """Dynamic shared memory estimate in bytes (buffers + barrier block)."""
    k_chunk = min(hd, K_CHUNK)
    q = TILE_M * hd * 2
    k = kv_tile * k_chunk * 2
    v = kv_tile * hd_per_cta * 2
    p = 0 if hd == TMEM_P_HD else TILE_M * kv_tile * 2
    barriers = 1024  # mbarriers + TMEM address, padded to the 1024-byte buffer alignment
    total = barriers + q + k_slots * k + v_slots * v + p
    return {"Q": q, "K_slot": k, "K_slots": k_slots, "V_slot": v, "V_slots": v_slots,
            "P": p, "total": total, "limit": SMEM_LIMIT}


class _SmemPTmemPlan:
    """TMEM columns when P lives in shared memory: S (the QK accumulator) [0, s_cols), O (this CTA's
        PV slab) [s_cols, s_cols + o_cols), both from the fragments."""

    def __init__(self, qk_mma, pv_mma, s_shape_mn, o_shape_mn):
        s_frag = qk_mma.make_fragment_C(qk_mma.partition_shape_C(s_shape_mn))
        o_frag = pv_mma.make_fragment_C(pv_mma.partition_shape_C(o_shape_mn))
        self.s_cols = tcgen05.find_tmem_tensor_col_offset(s_frag)
        self.o_cols = tcgen05.find_tmem_tensor_col_offset(o_frag)
        self.p_cols = 0
        self.s_col = 0
        self.o_col = self.s_col + self.s_cols
        self.alloc_cols = tmem_alloc_cols(self.o_col + self.o_cols)
        self.s_layout = s_frag.layout
        self.o_layout = o_frag.layout

    def views(self, tmem_ptr):
        """(tStS, tOtO) as TMEM tensors, given the fp32 base pointer."""
        tStS = cute.make_tensor(tmem_ptr + self.s_col, self.s_layout)
        tOtO = cute.make_tensor(tmem_ptr + self.o_col, self.o_layout)
        return tStS, tOtO


class Kernel(WarpRoles):
    """O = softmax(Q·Kᵀ / sqrt(hd))·V and LSE, online softmax, tcgen05 + TMEM, sm_100a.

        Options beyond the stage's axes (defaults: the module docstring's table): kv_tile (keys
        per KV tile, 64/128/256), hd_per_cta (O columns per CTA), pv_n (N of one PV MMA tile).  An
        impossible combination raises ValueError in the constructor (e.g. the TMEM budget)."""

    TILE_M = TILE_M

    def __init__(self, *, m: int, n: int, hd: int,
                 kv_tile: int | None = None, hd_per_cta: int | None = None, pv_n: int | None = None):
        if m != TILE_M:
            raise ValueError(f"stage D1 sm100: m must be {TILE_M}, got {m}")
        if hd not in HEAD_DIMS:
            raise ValueError(f"stage D1 sm100: hd must be one of {HEAD_DIMS}, got {hd}")
        d_kv, k_slots, v_slots = _DEFAULTS[hd]
        kv_tile = d_kv if kv_tile is None else kv_tile
        hd_per_cta = default_hd_per_cta(hd) if hd_per_cta is None else hd_per_cta
        pv_n = min(hd_per_cta, MMA_N_MAX) if pv_n is None else pv_n
        self.tmem_p = hd == TMEM_P_HD

        if kv_tile not in (64, 128, 256):
            raise ValueError(f"stage D1 sm100: kv_tile must be 64, 128 or 256, got {kv_tile}")
        if self.tmem_p and kv_tile != 128:
            raise ValueError("stage D1 sm100: TMEM-P (hd = 64) keeps stage C's kv_tile = 128")
        if n <= 0 or n % kv_tile != 0:
            raise ValueError(f"stage D1 sm100: n must be a positive multiple of {kv_tile}, got {n}")
        if hd_per_cta not in (64, 128, 256, 512) or hd_per_cta > hd or hd % hd_per_cta != 0:
            raise ValueError(f"stage D1 sm100: hd_per_cta must be a power-of-two divisor of hd ≥ 64, got {hd_per_cta}")
        if pv_n % 64 != 0 or pv_n > MMA_N_MAX or hd_per_cta % pv_n != 0:
            raise ValueError(f"stage D1 sm100: pv_n must be 64, 128 or 256 and divide hd_per_cta, got {pv_n}")
        if self.tmem_p and pv_n != hd:
            raise ValueError("stage D1 sm100: TMEM-P (hd = 64) uses one PV tile of N = 64")

        budget = tmem_budget(hd, kv_tile, hd_per_cta)
        if budget["total"] > TMEM_COLUMNS:
            raise _tmem_budget_error(hd, kv_tile, hd_per_cta, budget["S"], budget["O"], budget["total"])
        # Non-default tiles: keep the preferred ring depths if they fit, else fewer slots.
        for k_try in range(k_slots, 0, -1):
            fits = [v for v in range(v_slots, 0, -1)
                    if smem_budget(hd, kv_tile, hd_per_cta, k_try, v)["total"] <= SMEM_LIMIT]
            if fits:
                k_slots, v_slots = k_try, fits[0]
                break
        smem = smem_budget(hd, kv_tile, hd_per_cta, k_slots, v_slots)
        if smem["total"] > SMEM_LIMIT:
            raise ValueError(
                f"SMEM budget: Q {smem['Q']} + K {k_slots}×{smem['K_slot']} + V {v_slots}×{smem['V_slot']}"
                f" + P {smem['P']} + barriers = {smem['total']} bytes > {SMEM_LIMIT}"
                f" (hd={hd}, kv_tile={kv_tile}, hd_per_cta={hd_per_cta})"
            )

        self.m, self.n, self.hd = m, n, hd
        self.kv_tile, self.hd_per_cta, self.pv_n = kv_tile, hd_per_cta, pv_n
        self.k_slots, self.v_slots = k_slots, v_slots
        self.k_chunk = min(hd, K_CHUNK)
        self.n_chunks = hd // self.k_chunk
        self.ctas = hd // hd_per_cta
        self.n_tiles = n // kv_tile
        self.budget = budget
        self.smem_estimate = smem["total"]
        self.q_tiler = (TILE_M, kv_tile, hd)  # (M, N, K) of S = Q·Kᵀ, Q's view (whole hd)
        self.k_tiler = (TILE_M, kv_tile, self.k_chunk)  # the same MMA, one K chunk
        self.pv_tiler = (TILE_M, hd_per_cta, kv_tile)  # (M, N, K) of O_slab = P·V_slab
        self.scale_log2 = math.log2(math.e) / math.sqrt(hd)  # softmax scale folded with log2(e)

    # ------------------------------------------------------------------ host side
    def _smem_struct(self, ops: AttentionOperands):
        """The shared-storage struct (stage C's, plus a P buffer on the SMEM-P path),
        checked against the shared-memory limit."""
        Smem = ops.smem_struct(tmem_p=self.tmem_p)
        size = int(Smem.size_in_bytes())
        if size > SMEM_LIMIT:
            raise ValueError(f"SMEM budget: the shared-storage struct takes {size} bytes > {SMEM_LIMIT}")
        return Smem

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        K: cute.Tensor,
        V: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        # (rows, cols, L = 1) views.  PV's B operand is Vᵀ: (N = hd, K = n), MN-major.
        mQ, mK, mV, mO = attention_views(Q, K, V, O, "stage D1 sm100")
        # P is K-major either way; it is read from TMEM (hd = 64) or from SMEM.
        p_source = tcgen05.OperandSource.TMEM if cutlass.const_expr(self.tmem_p) else tcgen05.OperandSource.SMEM
        ops = AttentionOperands(mQ, mK, mV, q_tiler=self.q_tiler, k_tiler=self.k_tiler, pv_tiler=self.pv_tiler,
                                pv_n=self.pv_n, k_slots=self.k_slots, v_slots=self.v_slots, p_source=p_source)
        self.plan = ops.plan
        self.smem_struct = self._smem_struct(ops)
        # CTA b owns O columns [b·hd_per_cta, (b+1)·hd_per_cta)
        launch(self.kernel(ops.args(), mO, LSE), (self.ctas, 1, 1), stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        ops: KernelOperands,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
    ):
        qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_smem = ops
        tidx, _, _ = cute.arch.thread_idx()
        cta_idx, _, _ = cute.arch.block_idx()  # which head-dim slab of O
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k, tma_v)

        cta = AttentionCta(self.smem_struct, self.plan, qk_mma, pv_mma, q_smem, k_smem, v_smem)
        # Q (TMA), K (TMA, n_tiles, chunks), Vᵀ (TMA, n_tiles): this CTA's head-dim slab.
        loads = cta.tma_partitions(tma_q, mQ, tma_k, mK, tma_v, mV, self.q_tiler, self.k_tiler, self.pv_tiler,
                                   cta_idx)

        # ---- TMEM plan (from the fragments, checked against tmem_budget()) and the P path.
        s_mn = (TILE_M, self.kv_tile)
        o_mn = (TILE_M, self.hd_per_cta)
        pp = self.p_path(cta, qk_mma, pv_mma, p_smem, s_mn, o_mn)
        tStS, tOrP, tOtO = pp.tStS, pp.tOrP, pp.tOtO
        expose(self, qk_mma=(qk_mma, self.q_tiler), pv_mma=(pv_mma, self.pv_tiler), tmem=pp.plan,  # inspect
               smem={"Q": q_smem, "K": k_smem, "V": v_smem, "P (A layout)": p_smem})

        # ---- O: load/store in chunks of 32 columns (rescale, epilogue).
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        cO = cta.pv_thr.partition_C(cute.make_identity_tensor(o_mn))  # ((128, pv_n), 1, PV tiles)
        check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale")  # trace time
        gO = cute.flat_divide(mO, cute.select(self.pv_tiler, mode=[0, 1]))[None, None, 0, cta_idx, 0]
        tOgO = cta.pv_thr.partition_C(gO)  # (128, hd_cta) slab of O, partitioned like tOtO

        producer_warps(warp_idx, cta, loads, qk_mma, pv_mma, tStS, tOrP, tOtO, self.n_tiles, self.n_chunks)
        if warp_idx < self.MMA_WARP:
            row_max, row_sum = self.softmax_role(cta.s_cons, cta.p_prod, pp.s_load, pp.p_store, pp.p_copy, o_load,
                                                 o_store, pp.tS_src, pp.cS_src, tOrP, pp.sP_mk, pp.cA, tOtO, cO, tidx)
            self.epilogue(cta.o_cons, o_load, tOtO, tOgO, cO, mLSE, row_max, row_sum, cta_idx, tidx)
            free_tmem(cta, pp.tmem_ptr, pp.plan.alloc_cols)  # all four warps are done with TMEM: warp 0 frees it

    def p_path(self, cta: AttentionCta, qk_mma, pv_mma, p_smem, s_mn, o_mn) -> SimpleNamespace:
        """The TMEM plan, its allocation and P's path, built before the role `if`s (the other path's
                fields None).  TMEM-P (hd = 64): TmemP.  SMEM-P: S and O in TMEM (`_SmemPTmemPlan`), P in
                sP (the PV MMA's A-operand layout) written through `p_copy` into its (M, K) view `sP_mk`,
                proven by `check_smem_p`.  Either plan is checked against tmem_budget()."""
        pp = SimpleNamespace(plan=None, tmem_ptr=None, tStS=None, tOtO=None,
                             tOrP=None,  # the PV MMA's A operand, (MMA, MMA_M, kv_tile / 16)
                             s_load=None,  # tcgen05.ld of this thread's S row
                             tS_src=None, cS_src=None,  # S as s_load sees it; its (row, key) coordinates
                             p_store=None,  # TMEM-P: tcgen05.st of P
                             p_copy=None, sP_mk=None)  # SMEM-P: st.shared of P; P's (M, K) SMEM view
        pp.cA = cta.pv_thr.partition_A(cute.make_identity_tensor(s_mn))  # ((128, 16), 1, kv / 16)
        if self.tmem_p:
            tmem = TmemP(cta, qk_mma, pv_mma, self.q_tiler, self.pv_tiler, p_smem)
            pp.plan, pp.tmem_ptr = tmem.plan, tmem.ptr
            pp.tStS, pp.tOrP, pp.tOtO, pp.s_load, pp.p_store = tmem.tStS, tmem.tOrP, tmem.tOtO, tmem.s_load, tmem.p_store
            pp.tS_src, pp.cS_src = tmem.tStS, tmem.cS
            expose(self, p_path="tmem", tmem_pair=(pp.s_load, pp.cS_src, pp.p_store, pp.cA))  # inspect; no code
        else:
            pp.plan = _SmemPTmemPlan(qk_mma, pv_mma, s_mn, o_mn)
            pp.tmem_ptr = cta.allocate_tmem(pp.plan.alloc_cols)  # tcgen05.alloc by the allocator warp (0)
            pp.tStS, pp.tOtO = pp.plan.views(pp.tmem_ptr)
            sP = cta.storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)  # (MMA, MMA_M, MMA_K, 1)
            pp.tOrP = pv_mma.make_fragment_A(sP)[None, None, None, 0]
            pp.tS_src = pp.tStS[(None, None), 0, 0]  # (128, kv)
            pp.cS_src = cta.qk_thr.partition_C(cute.make_identity_tensor(s_mn))[(None, None), 0, 0]
            pp.s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, pp.tS_src)
            pp.p_copy = cute.make_tiled_copy_D(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128), pp.s_load
            )
            pp.sP_mk = mk_view(sP[None, None, None, 0])  # (128, kv) in the A-operand layout
            check_smem_p(pp.s_load, pp.cS_src, pp.p_copy, pp.cA, TILE_M, self.kv_tile)  # trace time
            expose(self, p_path="smem", p_store=(pp.p_copy, pp.s_load, pp.cS_src, s_mn),  # inspect; no code
                   p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=s_mn)
        self._check_tmem_plan(pp.plan)
        return pp

    @cute.jit
    def softmax_role(self, s_cons, p_prod, s_load, p_store, p_copy, o_load, o_store, tS_src, cS_src, tOrP, sP_mk,
                     cA, tOtO, cO, tidx):
        """Warps 0-3, per KV tile: S row → max, exp2, sum → bf16 P; wait for PV_{j-1}; store P; rescale O
                if the warp's max moved; tcgen05.wait::st; signal.  Returns the row's (max, sum)."""
        hang_guard.role("softmax")  # names this role's waits in a --debug-hangs build
        thr_s = s_load.get_slice(tidx)
        thr_o = o_load.get_slice(tidx)
        tTR_tS = thr_s.partition_S(tS_src)  # this thread's row of S in TMEM
        tTR_tO = thr_o.partition_S(tOtO)  # (V, 32-col chunks, 1, PV tiles) of O in TMEM
        tRT_tO = o_store.get_slice(tidx).partition_D(tOtO)  # the same, for tcgen05.st
        tTR_cO = thr_o.partition_D(cO)  # its (row, d) coordinates
        rS = cute.make_rmem_tensor(thr_s.partition_D(cS_src).shape, F32)
        rP = cute.make_rmem_tensor(rS.shape, BF16)  # P in S's register order
        o_chunks = cute.size(tTR_cO, mode=[1])  # tcgen05.ld/st of 32 columns each
        pv_tiles = cute.size(tTR_cO, mode=[3])
        rO = cute.make_rmem_tensor(tTR_cO[None, 0, None, 0].shape, F32)

        tRT_tP = None  # TMEM-P destination
        rP_tmem = None
        tRS_sP = None  # SMEM-P destination
        rP_smem = None
        if cutlass.const_expr(self.tmem_p):
            thr_p = p_store.get_slice(tidx)
            tRT_tP = thr_p.partition_D(tOrP)
            # Same registers, indexed like the tcgen05.st fragment (both compact; the
            # trace-time check proved index i is the same (row, key) in both).
            rP_tmem = cute.make_tensor(rP.iterator, cute.make_layout(thr_p.partition_S(cA).shape))
        else:
            thr_pc = p_copy.get_slice(tidx)
            tRS_sP = thr_pc.partition_D(sP_mk)
            rP_smem = thr_pc.retile(rP)

        c = F32(self.scale_log2)
        row_max = F32(-math.inf)  # m_{j-1}, raw-score units
        row_sum = F32(0.0)  # l_{j-1}
        for j in cutlass.range(self.n_tiles, unroll=1):
            s_full = s_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            cute.copy(s_load, tTR_tS, rS)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: rS valid
            if cutlass.const_expr(not self.tmem_p):
                # S is in registers and P goes elsewhere: QK_{j+1} may overwrite S.
                tcgen05_fence_before_sync()
                s_full.release()

            # m_j, α_j = 2^(m_{j-1}·c − m_j·c), P_j = 2^(S_j·c − m_j·c), l_j = α_j·l_{j-1} + Σ P_j.
            p, new_max, alpha, row_sum = online_softmax_update(rS.load(), row_max, row_sum, c)
            rP.store(p.to(BF16))

            # P slot free ⇔ PV_{j-1} complete ⇔ O_{j-1} final in TMEM and P's
            # buffer no longer read; PV_j waits for this slot's commit.
            p_slot = p_prod.acquire_and_advance()
            tcgen05_fence_after_sync()
            if cutlass.const_expr(self.tmem_p):
                cute.copy(p_store, rP_tmem, tRT_tP)  # tcgen05.st into S's upper columns
            else:
                cute.copy(p_copy, rP_smem, tRS_sP)  # st.shared into the A-operand layout
            if j > 0:
                # Rescale O_{j-1} by alpha, warp-uniform decision (tcgen05.ld/st are
                # warp-collective); rows whose max did not move multiply by 1.
                if cute.arch.vote_any_sync(new_max > row_max):
                    rescale_o(o_load, o_store, tTR_tO, tRT_tO, rO, alpha, pv_tiles, o_chunks)
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: P / O in TMEM
            if cutlass.const_expr(not self.tmem_p):
                cute.arch.fence_view_async_shared()  # fence.proxy.async.shared::cta: P for the MMA
            tcgen05_fence_before_sync()
            p_slot.commit()  # 128 arrivals → the MMA warp may run PV_j
            row_max = new_max
            if cutlass.const_expr(self.tmem_p):
                # P_j sits in S_j's columns: hand S back for QK_{j+1} only once
                # PV_j has read P_j (the P slot's "free" is a tcgen05.commit after PV_j).
                p_prod.acquire()
                tcgen05_fence_before_sync()
                s_full.release()
        return row_max, row_sum

    @cute.jit
    def epilogue(self, o_cons, o_load, tOtO, tOgO, cO, mLSE, row_max, row_sum, cta_idx, tidx):
        """Warps 0-3, once the last PV completed: O row / l → bf16 → global, 32 columns
        at a time; LSE (natural log) from CTA 0."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        thr_o = o_load.get_slice(tidx)
        tTR_tO = thr_o.partition_S(tOtO)
        tTR_gO = thr_o.partition_D(tOgO)  # this thread's row of the O slab in global memory
        tTR_cO = thr_o.partition_D(cO)
        o_chunks = cute.size(tTR_cO, mode=[1])
        pv_tiles = cute.size(tTR_cO, mode=[3])
        rO = cute.make_rmem_tensor(tTR_cO[None, 0, None, 0].shape, F32)
        rO_out = cute.make_rmem_tensor(tTR_cO[None, 0, None, 0].shape, BF16)
        row = tTR_cO[0][0]  # the query row this thread owns
        c = F32(self.scale_log2)
        o_full = o_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        inv_sum = F32(1.0) / row_sum
        for t in cutlass.range_constexpr(pv_tiles):
            for ch in cutlass.range_constexpr(o_chunks):
                cute.copy(o_load, tTR_tO[None, ch, None, t], rO)
                cute.arch.fence_view_async_tmem_load()
                rO_out.store((rO.load() * inv_sum).to(BF16))
                cute.autovec_copy(rO_out, tTR_gO[None, ch, None, t])
        if cta_idx == 0:
            mLSE[row] = (row_max * c + cute.math.log2(row_sum, fastmath=True)) * F32(math.log(2.0))
        tcgen05_fence_before_sync()
        o_full.release()

    def _check_tmem_plan(self, plan):
        """Trace time: the fragment-derived columns must equal tmem_budget() and fit in 512."""
        b = self.budget
        derived = {"S": plan.s_cols, "P": plan.p_cols, "O": plan.o_cols}
        expected = {"S": b["S"], "P": b["P"], "O": b["O"]}
        total = plan.s_cols + plan.o_cols
        if total > TMEM_COLUMNS:
            raise _tmem_budget_error(self.hd, self.kv_tile, self.hd_per_cta, plan.s_cols, plan.o_cols, total)
        if derived != expected or plan.alloc_cols != b["alloc"]:
            raise ValueError(
                f"TMEM plan: fragments give {derived} (alloc {plan.alloc_cols}), "
                f"tmem_budget gives {expected} (alloc {b['alloc']})"
            )
