"""The Blackwell (sm_100a) decode house of stages D2–D5: DSV4 MQA decode attention — batches,
tokens, query heads folded into M, one latent KV head read once for both GEMMs, split-KV with
an LSE combine.  tcgen05 MMAs, S and O in tensor memory (TMEM), P through shared memory.
Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

A rung (D2_decode, D3_swa, D4_causal_swa, D5_sink_merge) subclasses `DecodeSm100`: its
constructor calls `setup_plan`, its @cute.jit `__call__` checks its tensors and calls `prepare` /
`kv_atom` / `start` / `combine`, its `kernel()` picks the keys a CTA visits (stages/common/
sm100_keys.py: `DenseKeys` for D2, `BranchKeys` for D3–D5) and hands over to `attend` (shared
set-up, then load_role, mma_role, softmax_role → epilogue).  `row_scale`: the rung's per-row
factor on the final O (D5's sink).  A rung whose keys do not arrive by a tiled TMA (stage E)
replaces only the producer side through hooks: `kv_pipeline`, `smem_fields` + setup_plan's
`smem_reserved`, `bind_keys`, `is_producer` + `load_role`, THREADS.

Contract (oracles/decode.py's tensors, in this order; the case axes are `shape` and `splits`)
    Q   [b, s_q, h_q, d]  bf16      KV  [b, n_alloc, d] bf16 (K = V, one latent head; rows
    O   [b, s_q, h_q, d]  bf16                          n … n_alloc−1 are never read)
    LSE [b, h_q, s_q]     fp32, natural log
    O_part   [cap, b, s_q, h_q, d] fp32   scratch: split s's normalised partial O_s
    LSE_part [cap, b, s_q, h_q]    fp32   scratch: split s's partial LSE_s (−inf: empty split)
    d ∈ {64, 128, 256, 512}; n a multiple of kv_tile (64).

Math: the online softmax of stages/common/sm100_softmax.py (one thread a row, its lonely-row
rule) over the split's KV tiles j, scale = 1/sqrt(d), V_j = K_j (the same bytes, viewed MN-major).
One split: O = bf16(O_last / l_last), LSE = (c·m_last + log2 l_last) · ln 2.  Split-KV: split s
writes O_s = O_last / l_last (fp32) and LSE_s (an empty split O_s = 0, LSE_s = −inf, without
touching TMEM); combine.py's SplitCombine merges them (no key at all: O = 0, LSE = +inf).

Head packing: 128 rows per CTA (tcgen05 M = 128)
    Row r of a row block ↔ (t = r // h_q, h = r % h_q), rb = ceil(s_q·h_q / 128) row blocks: all
    rows attend the same keys (MQA).  With M = 128 and cta_group::1 accumulator row r is TMEM
    lane r (thread t owns row t whole), and K/V tiles are read once per 128 rows.  Padding rows
    are zero-filled by TMA and never stored.

TMEM plan (128 lanes × 512 columns of 32 bit; checked at trace time)
    S double-buffered (2 × kv_tile columns: Q·K_{j+1}ᵀ overlaps the softmax of S_j), O d_cta
    columns, P in shared memory (0 columns).
        d = 64:   S 2×64 + O  64 = 192 (alloc 256)
        d = 128:  S 2×64 + O 128 = 256 (alloc 256)
        d = 256:  S 2×64 + O 256 = 384 (alloc 512)
        d = 512:  S 2×64 + O 512 = 640 > 512 — does not fit in one CTA.
    d = 512 splits O by columns over two CTAs (o_split = 2, as stage D1): half h owns
    O[:, 256h : 256h + 256]; both halves compute the full S and the same softmax, only the P·V
    slab differs, half 0 alone writes LSE.  `tmem_budget()` gives the plan (ValueError("TMEM
    budget: … > 512 …") when it does not fit); the traced kernel re-derives every column count
    from the MMA fragments and re-checks it.

K and V: one tensor, one shared-memory copy
    KV tiles of kv_tile = 64 keys load as d / chunk chunks of chunk = min(d, 128) columns
    (16 KiB), K-major with the 128-byte swizzle (Q·Kᵀ's B); the same bytes in the PV MMA's
    MN-major 128-byte-swizzle B layout are V_chunkᵀ.  `check_kv_same_bytes` proves at trace time
    that both views give every (key, column) the same offset.  Shared memory:
        d    Q        KV ring              P        total (incl. 1 KiB barriers)
        64   16 KiB   3 ×  8 KiB chunks    16 KiB    57 KiB
        128  32 KiB   3 × 16 KiB           16 KiB    97 KiB
        256  64 KiB   5 × 16 KiB           16 KiB   161 KiB
        512  128 KiB  5 × 16 KiB           16 KiB   225 KiB   (limit 227 KiB)
    A tile's chunks load with this CTA's V chunks last; a K-only chunk is released after its
    Q·Kᵀ, a V chunk after P·V.  With R slots, n_chunks a tile and n_v of them V, the first
    min(n_chunks, R − n_v) chunks of Q·K_{j+1}ᵀ are issued before P·V_j (d = 512: 3 of 4).

Grid and scheduling (stages/common/scheduler.py)
    DecodeGrid(head_blocks = 1, tokens = rb, batches = b, splits, T = n / 64); grid
    (rb · o_split, splits, b): blockIdx.x = row block · o_split + half, .y = split, .z = batch;
    split s owns KV tiles [s·c, min((s+1)·c, T)), c = ceil(T / splits).  `splits` =
    resolve_splits(axis, ctas, T, sm_count = 148): 1, "auto", "many" (T + 3: the last three
    empty) or an int.  splits > 1 writes the partials (flat row = s·(b·s_q·h_q) +
    (batch·s_q + token)·h_q + head) and runs the combine.

Warp roles (192 threads)
    warp 5      TMA: Q once; per KV tile the chunks into the KV ring.
    warp 4      MMA: Q·K_jᵀ into S buffer j mod 2; P·V_j (A = P from SMEM, B = the V view)
                into O; releases ring slots by tcgen05.commit.
    warps 0-3   softmax, thread t ↔ TMEM lane t ↔ row t: tcgen05.ld S_j, release the S buffer;
                max / exp2 / sum; wait for P·V_{j-1}; P → SMEM (a copy tiled like the
                tcgen05.ld, into the PV A-operand layout); rescale O if the warp's max moved;
                tcgen05.wait::st, fence.proxy.async, arrive.  Epilogue: O / l, LSE.
    Named barriers: barriers.NamedBarrier.TMEM_ALLOC, .TMEM_FREE.

Synchronisation (mbarriers via cutlass.pipeline; arrive counts in THREADS)
    q        PipelineTmaUmma     load → MMA (1 slot)
    kv       PipelineTmaUmma     load → MMA (R slots; chunk g: slot g mod R, phase ⌊g / R⌋
                                 mod 2, because releases are out of order across tiles)
    s        PipelineUmmaAsync   MMA commit → 128 softmax threads (2 S buffers)
    p        PipelineAsyncUmma   128 softmax threads → MMA; release = tcgen05.commit after
                                 P·V_j, so "P slot free" ⇔ P·V_j complete
    o        PipelineUmmaAsync   MMA commit after the last P·V → 128 threads
    DSV4.md's lessons hold as in stage D1 (stages/D1_headdim/sm100.py).

Masks (D3–D5; stages/common/sm100_keys.py, sm100_masks.py)
    keys.masked is a compile-time switch (D2 emits nothing).  A masked rung visits only tiles
    with a valid key; on a boundary tile the MMA warp zeroes the V rows past the fill level
    (clean_v) and each softmax thread sets its row's invalid scores to −∞ before the max."""


import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.memory import TmemAllocator

from stages.common import hang_guard
from stages.common.barriers import NamedBarrier
from stages.common.combine import SplitCombine
from stages.common.scheduler import DecodeGrid, DecodeShape, resolve_splits
from stages.common.sm100_idioms import (
    TMEM_COL_BITS,
    check_same_fragment_coords,
    check_smem_p,
    fragment_coords,
    mk_view,
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    threads_to_umma_pipeline,
    tma_umma_pipeline,
    tmem_alloc_cols,
    tmem_allocate,
    tmem_copy,
    tmem_free,
    umma_to_threads_pipeline,
)
from stages.common.sm100_keys import Branch, BranchKeys
from stages.common.sm100_setup import WarpRoles, launch, rescale_o
from stages.common.sm100_masks import check_lines, line_view, row_key_columns
from stages.common.sm100_softmax import final_row_lse, row_inv_sum, row_lse, row_softmax_update
from stages.common.tma import prefetch_descriptors, sm100_tma_load, tma_partition_tile
from stages.common.device import DEFAULT_SM_COUNT, SMEM_LIMIT

BF16 = cutlass.BFloat16
F32 = cutlass.Float32

ROWS = 128  # query rows per CTA = tcgen05 M = TMEM lanes
TMEM_COLUMNS = 512  # TMEM columns per SM (32 bit each)
HEAD_DIMS = (64, 128, 256, 512)
CHUNK_MAX = 128  # head-dim columns of one KV ring chunk
KV_TILE = 64
B200_SMS = DEFAULT_SM_COUNT["sm_100a"]  # the SM count the "auto" split chooser assumes for sm_100a (B200)


# ---------------------------------------------------------------------------------------
# Plans (plain Python: no tracing needed)


def default_o_split(d: int, kv_tile: int = KV_TILE, s_stages: int = 2) -> int:
    """CTAs that share one row block's O by columns: 1 when S and the whole O fit in
    TMEM, else the smallest power of two that makes them fit."""
    split = 1
    while s_stages * kv_tile + d // split > TMEM_COLUMNS and split < d // 64:
        split *= 2
    return split


def tmem_budget(d: int, kv_tile: int = KV_TILE, o_split: int = 1, s_stages: int = 2) -> dict:
    """TMEM columns per CTA: S (fp32, `s_stages` buffers of kv_tile columns) and O (fp32,
    d / o_split columns; one column per element of a 128-lane row).  P lives in SMEM."""
    s = kv_tile * F32.width // TMEM_COL_BITS
    o = (d // o_split) * F32.width // TMEM_COL_BITS
    total = s_stages * s + o
    return {"S": s, "S_stages": s_stages, "O": o, "P": 0, "total": total,
            "alloc": tmem_alloc_cols(total), "limit": TMEM_COLUMNS}


def tmem_budget_error(d: int, kv_tile: int, o_split: int, s_stages: int, s: int, o: int) -> ValueError:
    total = s_stages * s + o
    return ValueError(
        f"TMEM budget: S {s_stages}×{s} + O {o} = {total} columns > {TMEM_COLUMNS} "
        f"(d={d}, kv_tile={kv_tile}, o_split={o_split}, s_stages={s_stages}): with 128 rows an fp32 "
        f"accumulator takes one column per element of a row; split O over more CTAs "
        f"(o_split={default_o_split(d, kv_tile, s_stages)}) or use fewer S buffers"
    )


def ring_plan(d: int, o_split: int, kv_tile: int = KV_TILE, reserved: int = 0) -> dict:
    """Chunking of a KV tile and the ring depth that fits shared memory (less `reserved`
    bytes a rung keeps for buffers of its own)."""
    chunk = min(d, CHUNK_MAX)
    n_chunks = d // chunk
    n_v = n_chunks // o_split  # chunks that are V for this CTA
    q = ROWS * d * 2
    c = kv_tile * chunk * 2
    p = ROWS * kv_tile * 2
    barriers = 1024
    fit = (SMEM_LIMIT - barriers - reserved - q - p) // c
    slots = min(fit, 2 * n_chunks + 1)
    return {"chunk": chunk, "n_chunks": n_chunks, "n_v": n_v, "n_nonv": n_chunks - n_v,
            "slots": slots, "qk_early": max(0, min(n_chunks, slots - n_v)),
            "smem": barriers + reserved + q + p + slots * c, "Q": q, "chunk_bytes": c, "P": p}


# ---------------------------------------------------------------------------------------
# Trace-time checks


def check_kv_same_bytes(k_smem, v_smem, k_coords, v_coords) -> int:
    """Prove that the K view (QK's K-major B operand) and the V view (PV's MN-major B operand)
        of one ring slot address the same bytes: same swizzle, same slot stride, offset_K(key, col)
        == offset_V(col, key) over the chunk (k_coords / v_coords: identity tensors partitioned like
        the two layouts).  Returns the elements compared; ValueError names the first mismatch."""
    if str(k_smem.inner) != str(v_smem.inner):
        raise ValueError(f"K/V same bytes: swizzles differ ({k_smem.inner} vs {v_smem.inner})")
    k_outer, v_outer = k_smem.outer, v_smem.outer
    k_one = cute.select(k_outer, mode=[0, 1, 2])
    v_one = cute.select(v_outer, mode=[0, 1, 2])
    k_slot = cute.select(k_outer, mode=[3])
    v_slot = cute.select(v_outer, mode=[3])
    if cute.size(k_slot) != cute.size(v_slot) or (cute.size(k_slot) > 1 and k_slot(1) != v_slot(1)):
        raise ValueError("K/V same bytes: the ring slots of the two views differ")
    if cute.size(k_one) != cute.size(v_one) or cute.cosize(k_one) != cute.cosize(v_one):
        raise ValueError("K/V same bytes: the two views span different sizes")
    offset_of = {}
    kc, vc = fragment_coords(k_coords), fragment_coords(v_coords)  # evaluated in Python
    for i in range(cute.size(k_coords)):
        key, col = kc[i]
        offset_of[(key, col)] = k_one(i)
    for i in range(cute.size(v_coords)):
        col, key = vc[i]
        if offset_of.get((key, col)) != v_one(i):
            raise ValueError(
                f"K/V same bytes: key {key}, column {col} is at {offset_of.get((key, col))} in K's view "
                f"and at {v_one(i)} in V's view"
            )
    return cute.size(v_coords)


class _TmemPlan:
    """S buffers (fp32) at columns [i·s_cols, (i+1)·s_cols), O (fp32) after them; every
    count from the MMA fragments."""

    def __init__(self, qk_mma, pv_mma, s_mn, o_mn, o_sub_mn, s_stages):
        s_frag = qk_mma.make_fragment_C(qk_mma.partition_shape_C(s_mn))
        o_frag = pv_mma.make_fragment_C(pv_mma.partition_shape_C(o_mn))
        self.s_cols = tcgen05.find_tmem_tensor_col_offset(s_frag)
        self.o_cols = tcgen05.find_tmem_tensor_col_offset(o_frag)
        self.s_stages = s_stages
        self.o_col = s_stages * self.s_cols
        self.total = self.o_col + self.o_cols
        self.alloc_cols = tmem_alloc_cols(self.total)
        self.s_layout = s_frag.layout
        self.o_layout = o_frag.layout
        sub = pv_mma.make_fragment_C(pv_mma.partition_shape_C(o_sub_mn))
        self.o_sub_cols = tcgen05.find_tmem_tensor_col_offset(sub)
        self.o_sub_layout = sub.layout
        if self.o_sub_cols * (o_mn[1] // o_sub_mn[1]) != self.o_cols:
            raise ValueError(f"TMEM plan: {o_mn[1] // o_sub_mn[1]} PV tiles of {self.o_sub_cols} columns "
                             f"do not tile O's {self.o_cols} columns")
        # The accumulator tiles the MMAs write are the TMEM tiles the plan places (issue 34
        # item 4): an O tile narrower than the PV MMA's N would let two tiles' MMAs overlap.
        for name, cols, mma in (("an O tile", self.o_sub_cols, pv_mma), ("an S buffer", self.s_cols, qk_mma)):
            n = mma.get_tile_size(1)
            if cols != n * F32.width // TMEM_COL_BITS:
                raise ValueError(f"TMEM plan: {name} takes {cols} columns, its MMA's tile is N = {n} fp32 "
                                 f"({n * F32.width // TMEM_COL_BITS} columns)")


# ---------------------------------------------------------------------------------------


class DecodeSm100(WarpRoles):
    """DSV4 MQA decode attention with split-KV, tcgen05 + TMEM, sm_100a: the house of D2–D5.

        Options beyond a stage's axes (setup_plan): o_split (CTAs sharing one row block's O by
        columns; default 1, or 2 at d = 512), s_stages (S buffers in TMEM, default 2), sm_count
        (the SM count the split chooser assumes).  An impossible plan raises ValueError (e.g.
        o_split=1 at d 512: "TMEM budget: S 2×64 + O 512 = 640 columns > 512 …")."""

    NAME = "sm100 decode"

    def setup_plan(self, p: DecodeShape, splits, sm_count: int, o_split: int | None, s_stages: int,
                   n_tiles: int | None = None, smem_reserved: int = 0) -> None:
        """Every compile-time choice from the shape: TMEM plan (refused over 512 columns), KV ring,
                split count.  `n_tiles` (default n / 64): the tiles the splits divide; `smem_reserved`:
                bytes of the rung's own buffers (`smem_fields`)."""
        b, s_q, h_q, n, d = p.b, p.s_q, p.h_q, p.n, p.d
        if d not in HEAD_DIMS:
            raise ValueError(f"{self.NAME}: d must be one of {HEAD_DIMS}, got {d}")
        if n % KV_TILE != 0:
            raise ValueError(f"{self.NAME}: n must be a multiple of {KV_TILE}, got {n}")
        if s_stages not in (1, 2):
            raise ValueError(f"{self.NAME}: s_stages must be 1 or 2, got {s_stages}")
        o_split = default_o_split(d, KV_TILE, s_stages) if o_split is None else o_split
        if o_split not in (1, 2, 4) or d // o_split < 64 or (d // o_split) % min(d, CHUNK_MAX):
            raise ValueError(f"{self.NAME}: o_split must divide d into whole chunks, got {o_split}")
        budget = tmem_budget(d, KV_TILE, o_split, s_stages)
        if budget["total"] > TMEM_COLUMNS:
            raise tmem_budget_error(d, KV_TILE, o_split, s_stages, budget["S"], budget["O"])
        ring = ring_plan(d, o_split, KV_TILE, smem_reserved)
        if ring["slots"] < ring["n_v"] + 1 or ring["smem"] > SMEM_LIMIT:
            raise ValueError(f"SMEM budget: {ring['smem']} bytes with {ring['slots']} chunk slots (d={d})")

        self.p = p
        self.b, self.s_q, self.h_q, self.n, self.d = b, s_q, h_q, n, d
        self.rows = s_q * h_q  # query rows of one sequence
        self.row_blocks = math.ceil(self.rows / ROWS)  # per sequence
        self.kv_tile = KV_TILE
        self.n_tiles = n // KV_TILE if n_tiles is None else n_tiles
        self.o_split = o_split
        self.s_stages = s_stages
        self.budget = budget
        self.ring = ring
        self.splits_axis = splits
        ctas = self.row_blocks * o_split * b
        self.splits = resolve_splits(splits, ctas=ctas, num_tiles=self.n_tiles, sm_count=sm_count)
        self.chunk = ring["chunk"]
        self.n_chunks = ring["n_chunks"]
        self.n_v = ring["n_v"]
        self.n_nonv = ring["n_nonv"]
        self.slots = ring["slots"]
        self.qk_early = ring["qk_early"]
        self.d_cta = d // o_split
        self.q_tiler = (ROWS, KV_TILE, d)  # S = Q·Kᵀ, Q's whole head dim
        self.k_tiler = (ROWS, KV_TILE, self.chunk)  # the same MMA over one chunk of K
        self.pv_tiler = (ROWS, self.chunk, KV_TILE)  # O_sub = P·V_chunk (N = chunk)
        self.scale_log2 = math.log2(math.e) / math.sqrt(d)
        self._set_grid()

    def _set_grid(self) -> None:
        # stages/common/scheduler.py's mapping with one "head block" of 128 packed rows:
        # its `token` index is this kernel's row block of s_q·h_q rows.
        self.sched = DecodeGrid(1, self.row_blocks, self.b, self.splits, self.n_tiles)

    # ------------------------------------------------------------------ host side
    def prepare(self, Q, O, LSE, O_part, LSE_part):
        """Host set-up shared by the rungs: (views, operands, TMA atom of Q, its TMA tensor);
        the shared-storage struct is fixed here too."""
        v = self.host_views(Q, O, LSE, O_part, LSE_part)
        ops = self.operands()
        qk_mma, _, q_smem, k_smem, _, p_smem = ops
        tma_q, tma_Q = self.q_atom(qk_mma, v, q_smem)
        self.smem_struct = self._smem_struct(q_smem, k_smem, p_smem)
        return v, ops, tma_q, tma_Q

    def start(self, kernel, stream) -> None:
        """Launch the traced kernel call: grid (row blocks · o_split, splits, b), THREADS threads."""
        launch(kernel, self.launch_grid(), stream, self.THREADS)

    def block_last_token(self, rb):
        """The last query token with a row in 128-row block rb (rows are token·h_q + head)."""
        return cutlass.min((rb * ROWS + ROWS - 1) // self.h_q, self.s_q - 1)

    def kv_view(self, KV: cute.Tensor, n: int, n_alloc: int) -> cute.Tensor:
        """The TMA view (n, d, b) of a KV tensor [b, n_alloc, d]: only its first n keys."""
        return cute.make_tensor(KV.iterator, cute.make_layout((n, self.d, self.b), stride=(self.d, 1, n_alloc * self.d)))

    def host_views(self, Q, O, LSE, O_part, LSE_part):
        """The kernel's and the combine's views of Q, O, LSE and the partials."""
        p, d, rows = self.p, self.d, self.rows
        all_rows = p.b * rows
        v = _Views()
        # Row r of a sequence = token·h_q + head.  The TMA view of Q has s_q·h_q rows per
        # sequence (a 128-row box past them is zero-filled).
        v.mQ = cute.make_tensor(Q.iterator, cute.make_layout((rows, d, p.b), stride=(d, 1, rows * d)))
        # Flat row views (row = (batch·s_q + token)·h_q + head; partials split-major) and
        # LSE [b, h_q, s_q] indexed by that row (the combine's views, as in sm90.py).
        cap = O_part.shape[0]
        v.all_rows = all_rows
        v.mO = cute.make_tensor(O.iterator, cute.make_layout((all_rows, d), stride=(d, 1)))
        v.mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((p.h_q, p.s_q, p.b), stride=(p.s_q, 1, p.h_q * p.s_q)))
        v.mOp = cute.make_tensor(O_part.iterator, cute.make_layout((cap * all_rows, d), stride=(d, 1)))
        v.mLp = cute.make_tensor(LSE_part.iterator, cute.make_layout(cap * all_rows))
        # The epilogue's views: (128 rows, d_cta columns, half, row block, batch[, split]) with
        # static strides, so a CTA's slab keeps the tensors' 16-byte alignment (vector stores).
        slabs = (ROWS, self.d_cta, self.o_split, self.row_blocks, p.b)
        slab_strides = (d, 1, self.d_cta, ROWS * d, rows * d)
        v.eO = cute.make_tensor(O.iterator, cute.make_layout(slabs, stride=slab_strides))
        v.eOp = cute.make_tensor(O_part.iterator, cute.make_layout((*slabs, cap), stride=(*slab_strides, all_rows * d)))
        return v

    def q_atom(self, qk_mma, v, q_smem):
        """(TMA atom, TMA tensor) of Q (sets the byte count of its box)."""
        tma_q, tma_Q, self.q_bytes = sm100_tma_load("A", qk_mma, v.mQ, q_smem, self.q_tiler)
        return tma_q, tma_Q

    def kv_atom(self, qk_mma, k_smem, mK):
        """(TMA atom, TMA tensor) of one KV view (n, d, b): one chunk of one tile per box."""
        tma_k, tma_K, self.k_bytes = sm100_tma_load("B", qk_mma, mK, k_smem, self.k_tiler)
        return tma_k, tma_K

    def launch_grid(self):
        gx, gy, gz = self.sched.grid
        return (gx * self.o_split, gy, gz)

    def combine(self, v, stream) -> None:
        if cutlass.const_expr(self.splits > 1):
            SplitCombine(v.all_rows, self.splits, self.d).launch(v.mOp, v.mLp, v.mO, v.mLSE, stream)

    def operands(self):
        """(qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem): the tiled MMAs and the layouts of Q, the
                KV ring as K (K-major) and Vᵀ (MN-major), and P; proves the K and V views are the same
                bytes.  Call it while tracing."""
        cta = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.K, F32, cta, self.q_tiler[:2]
        )
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.MN, F32, cta, self.pv_tiler[:2],
            tcgen05.OperandSource.SMEM,
        )
        q_smem = sm100_utils.make_smem_layout_a(qk_mma, self.q_tiler, BF16, 1)
        k_smem = sm100_utils.make_smem_layout_b(qk_mma, self.k_tiler, BF16, self.slots)
        v_smem = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, BF16, self.slots)
        p_smem = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, BF16, 1)
        k_coords, v_coords = self.kv_coords(qk_mma, pv_mma)
        check_kv_same_bytes(k_smem, v_smem, k_coords, v_coords)  # V is K's ring viewed MN-major
        return qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem

    def kv_coords(self, qk_mma, pv_mma):
        """(key, col) coordinates partitioned like K's B operand and (col, key) like Vᵀ's."""
        k_coords = qk_mma.get_slice(0).partition_B(cute.make_identity_tensor((KV_TILE, self.chunk)))
        v_coords = pv_mma.get_slice(0).partition_B(cute.make_identity_tensor((self.chunk, KV_TILE)))
        return k_coords, v_coords

    def _check_tensors(self, Q, O, LSE, O_part, LSE_part, **kv) -> None:
        """Trace time: the tensors have the case's shapes (`kv`: name=(tensor, shape) of the KV inputs);
                the scratch holds this plan's splits ("auto" capped to it; a forced count must fit)."""
        p = self.p
        want = {
            "Q": (Q, (p.b, p.s_q, p.h_q, p.d)),
            **kv,
            "O": (O, (p.b, p.s_q, p.h_q, p.d)),
            "LSE": (LSE, (p.b, p.h_q, p.s_q)),
        }
        for name, (t, shape) in want.items():
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{self.NAME}: {name} has shape {tuple(t.shape)}, the case needs {tuple(shape)}")
        cap = O_part.shape[0]
        if tuple(O_part.shape[1:]) != (p.b, p.s_q, p.h_q, p.d) or tuple(LSE_part.shape) != (cap, p.b, p.s_q, p.h_q):
            raise ValueError(f"{self.NAME}: O_part {tuple(O_part.shape)} / LSE_part {tuple(LSE_part.shape)} "
                             f"do not match the case")
        self._cap_splits(cap)

    def _cap_splits(self, cap: int) -> None:
        """Trace time: "auto" splits capped to the scratch's `cap` partials; a forced count
        that does not fit is refused."""
        if self.splits > cap:
            if self.splits_axis != "auto":
                raise ValueError(f"{self.NAME}: {self.splits} splits need a scratch of ≥ {self.splits} partials, "
                                 f"it holds {cap}")
            self.splits = cap
            self._set_grid()

    def smem_fields(self) -> tuple[dict, dict]:
        """A rung's own shared-memory fields (mbarrier blocks, buffers: dicts of cute.struct
                annotations) after the house's barriers and before Q; their bytes are `smem_reserved`."""
        return {}, {}

    def _smem_struct(self, q_smem, k_smem, p_smem):
        barriers, buffers = self.smem_fields()
        fields = {
            "q_mbar": cute.struct.MemRange[cutlass.Int64, 2],
            "kv_mbar": cute.struct.MemRange[cutlass.Int64, 2 * self.slots],
            "s_mbar": cute.struct.MemRange[cutlass.Int64, 2 * self.s_stages],
            "p_mbar": cute.struct.MemRange[cutlass.Int64, 2],
            "o_mbar": cute.struct.MemRange[cutlass.Int64, 2],
            **barriers,
            "tmem_addr": cutlass.Int32,
            **buffers,
            "sQ": cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(q_smem.outer)], 1024],
            "sKV": cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(k_smem.outer)], 1024],
            "sP": cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(p_smem.outer)], 1024],
        }
        Smem = cute.struct(type("Smem", (), {"__annotations__": fields}))
        size = int(Smem.size_in_bytes())
        # What CuTeDSL infers as the launch's dynamic shared memory is this struct (the
        # kernel's only allocation; tests/test_blackwell_asserts.py reads it back from the
        # compiled launch): it must fit the sm_100 limit, and its margin is stated.
        self.smem_margin = SMEM_LIMIT - size
        if size > SMEM_LIMIT:
            raise ValueError(f"SMEM budget: the shared-storage struct takes {size} bytes > {SMEM_LIMIT} "
                             f"(the sm_100 limit), {-self.smem_margin} over")
        return Smem

    def _check_tmem_plan(self, plan: _TmemPlan) -> None:
        """Trace time: the fragment-derived columns equal tmem_budget() and fit in 512."""
        if plan.total > TMEM_COLUMNS:
            raise tmem_budget_error(self.d, self.kv_tile, self.o_split, self.s_stages, plan.s_cols, plan.o_cols)
        b = self.budget
        if (plan.s_cols, plan.o_cols, plan.alloc_cols) != (b["S"], b["O"], b["alloc"]):
            raise ValueError(
                f"TMEM plan: fragments give S {plan.s_cols}, O {plan.o_cols} (alloc {plan.alloc_cols}); "
                f"tmem_budget gives S {b['S']}, O {b['O']} (alloc {b['alloc']})"
            )

    # ------------------------------------------------------------------ device side
    def has_row_scale(self) -> bool:
        """Whether the epilogue multiplies a row's O by `row_scale` (D2: no)."""
        return False

    def score_scale_log2(self, keys):
        """c = scale · log2 e, taken once by each softmax thread before its KV loop: here 1/sqrt(d)
                folded at compile time; a runtime scale overrides it (stage E's `softmax_scale`)."""
        return F32(self.scale_log2)

    def row_scale(self, lse, row, batch, extra):
        """A per-row factor on the final O (when has_row_scale).  lse: the row's natural-log
        LSE before final_row_lse (−∞: no key); row: the row in its sequence (token·h_q + head)."""
        raise NotImplementedError

    @cute.jit
    def attend(self, keys, rb, split, batch, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
               q_smem, k_smem, v_smem, p_smem, extra):
        """The CTA of row block `rb`, KV split `split`, sequence `batch`, over `keys`: set-up
        shared by every warp, then each warp's role.  `extra`: the rung's own tensors for
        `row_scale` (None in D2)."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        half = bx % self.o_split  # which O column slab
        # Chunk at load position p is (p + shift) mod n_chunks: this CTA's V chunks last.
        shift = ((half + 1) * self.n_v) % self.n_chunks

        atoms = keys.atoms()  # (a keys method is never called inside a staged if / loop)
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, *atoms)

        storage = utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, 1, chunk/16, slots)
        sV = storage.sKV.get_tensor(v_smem.outer, swizzle=v_smem.inner)  # the same bytes, MN-major
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)

        # ---- pipelines (elected thread = 1, softmax side = 128 threads)
        q_prod, q_cons = tma_umma_pipeline(storage.q_mbar, 1, self.q_bytes, name="q")
        kv_pipe = self.kv_pipeline(storage)
        s_prod, s_cons = umma_to_threads_pipeline(storage.s_mbar, self.SOFTMAX_THREADS, self.s_stages, name="s")
        p_prod, p_cons = threads_to_umma_pipeline(storage.p_mbar, self.SOFTMAX_THREADS, name="p")
        o_prod, o_cons = umma_to_threads_pipeline(storage.o_mbar, self.SOFTMAX_THREADS, name="o")

        tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                                       num_threads=self.THREADS),
            allocator_warp_id=self.SOFTMAX_WARPS[0],
        )
        softmax_sync = pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_FREE), num_threads=self.SOFTMAX_THREADS)
        self.bind_keys(keys, storage)  # a rung's own pipelines and buffers (none here)

        # ---- MMA operands
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_mma.make_fragment_A(sQ)  # (MMA, 1, d/16, 1)
        tSrK = qk_mma.make_fragment_B(sK)  # (MMA, 1, chunk/16, slots)
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, 1, kv/16, slots)
        tOrP = pv_mma.make_fragment_A(sP)[None, None, None, 0]  # (MMA, 1, kv/16)

        # ---- TMA partitions
        gQ = cute.flat_divide(mQ, cute.select(self.q_tiler, mode=[0, 2]))  # (128, d, rb, 1, b)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, qk_thr.partition_A(gQ), 3)
        tQgQ = tQgQ[None, rb, 0, batch]
        keys.partition(sK, qk_thr, self.k_tiler, batch)
        lines = None  # a masked rung's (key, col, slot) line view of the ring (sm100_masks.py)
        if cutlass.const_expr(keys.masked):
            lines = self.ring_lines(storage, qk_mma, pv_mma, k_smem)

        # ---- TMEM plan from the fragments, checked against the budget
        s_mn = (ROWS, KV_TILE)
        o_mn = (ROWS, self.d_cta)
        plan = _TmemPlan(qk_mma, pv_mma, s_mn, o_mn, (ROWS, self.chunk), self.s_stages)
        self._check_tmem_plan(plan)
        tmem_ptr = tmem_allocate(tmem_alloc, plan.alloc_cols)
        tOtO = cute.make_tensor(tmem_ptr + plan.o_col, plan.o_layout)  # (MMA, 1, PV tiles)
        # One (MMA, 1, 1) accumulator per PV tile (N = chunk), for the MMA warp.
        o_tiles = [cute.make_tensor(tmem_ptr + plan.o_col + t * plan.o_sub_cols, plan.o_sub_layout)
                   for t in range(self.n_v)]

        # ---- S → registers → P in SMEM, and O load/store; trace-time agreement checks
        tS_src0 = cute.make_tensor(tmem_ptr, plan.s_layout)[(None, None), 0, 0]
        cS = qk_thr.partition_C(cute.make_identity_tensor(s_mn))[(None, None), 0, 0]
        cA = pv_thr.partition_A(cute.make_identity_tensor(s_mn))
        s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tS_src0)
        p_copy = cute.make_tiled_copy_D(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128), s_load
        )
        sP_mk = mk_view(sP[None, None, None, 0])
        check_smem_p(s_load, cS, p_copy, cA, ROWS, KV_TILE)
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        cO = pv_thr.partition_C(cute.make_identity_tensor(o_mn))
        check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale")
        # This CTA's (128, d_cta) slab of O (one split) or of the split's partial O,
        # partitioned like the O accumulator (built before any role mutates pv_mma).
        gO = None
        if cutlass.const_expr(self.splits == 1):
            gO = mO[None, None, half, rb, batch]
        else:
            gO = mOp[None, None, half, rb, batch, split]
        tOgO = pv_thr.partition_C(gO)  # rows past s_q·h_q are never stored (epilogue guard)

        # ======================= roles =======================
        if self.is_producer(warp_idx):
            self.load_role(q_prod, kv_pipe, tma_q, tQgQ, tQsQ, keys, shift)
        if warp_idx == self.MMA_WARP:
            self.mma_role(q_cons, kv_pipe, s_prod, p_cons, o_prod, qk_mma, pv_mma, tSrQ, tSrK, tOrV, tOrP,
                          tmem_ptr, plan.s_cols, plan.s_layout, o_tiles, keys, lines, shift)
        if warp_idx < self.MMA_WARP:
            self.softmax_role(s_cons, p_prod, o_cons, tOgO, s_load, p_copy, o_load, o_store, tmem_ptr, plan.s_cols,
                              plan.s_layout, tOtO, cS, cO, sP_mk, mLSE, mLSEp,
                              tidx, rb, half, split, batch, keys, extra)
            tcgen05_fence_before_sync()
            tmem_free(tmem_alloc, tmem_ptr, plan.alloc_cols, softmax_sync)

    # ---- the producer side, replaceable by a rung (stage E: gather + dequantisation warps)
    def kv_pipeline(self, storage):
        """The KV ring's pipeline: TMA bytes → the MMA warp (PipelineTmaUmma, one box a chunk)."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        return pipeline.PipelineTmaUmma.create(
            num_stages=self.slots, producer_group=one, consumer_group=one,
            tx_count=self.k_bytes, barrier_storage=storage.kv_mbar.data_ptr(), name=hang_guard.name("kv"),
        )

    def bind_keys(self, keys, storage) -> None:
        """Give the keys object what it needs of shared memory (before the roles; every
        thread).  The house's keys need nothing."""

    def is_producer(self, warp_idx):
        """Whether warp `warp_idx` runs load_role: the TMA warp (warp 5)."""
        return warp_idx == self.LOAD_WARP

    def ring_lines(self, storage, qk_mma, pv_mma, k_smem):
        """The (key, col, slot) line view of the KV ring for zeroing key rows, proven at
        trace time to put every element in its true 128-byte line (sm100_masks.py)."""
        k_coords, _ = self.kv_coords(qk_mma, pv_mma)
        check_lines(k_smem, k_coords, KV_TILE, self.chunk)
        slot_elems = cute.select(k_smem.outer, mode=[3])(1) if self.slots > 1 else KV_TILE * self.chunk
        if slot_elems != KV_TILE * self.chunk:
            raise ValueError(f"KV lines: ring slots are {slot_elems} elements apart, expected {KV_TILE * self.chunk}")
        ring = cute.make_tensor(storage.sKV.data_ptr(), cute.make_layout(1))
        return line_view(ring, KV_TILE, self.chunk, self.slots, slot_elems)

    def probs_for_pv(self, keys, j, p, rS, key_cols):
        """A rung's factor on tile j's P (fp32) after ℓ has summed it, before the bf16 cast (rS: free to
                reuse).  The house's: none (stage E simple: the keys' fp32 scales)."""
        return p

    # ---- ring states: chunk g of this CTA's sequence → (slot, phase)
    def _ring_state(self, g, producer: bool):
        """PipelineState of chunk number g: slot g mod R, phase ⌊g / R⌋ mod 2 (the
        producer's phase starts at 1: every slot starts empty)."""
        slot = g % self.slots
        phase = (g // self.slots) % 2
        if producer:
            phase = phase ^ 1
        return pipeline.PipelineState(self.slots, g, slot, phase)

    @cute.jit
    def load_role(self, q_prod, kv_pipe, tma_q, tQgQ, tQsQ, keys, shift):
        """Warp 5: Q once, then the chunks of every KV tile the CTA visits (this CTA's V
        chunks last), each into the next ring slot."""
        hang_guard.role("load")  # names this role's waits in a --debug-hangs build
        q_slot = q_prod.acquire_and_advance()
        cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_slot.barrier)
        n_local = keys.n_local
        for j in cutlass.range(n_local, unroll=1):
            for p in cutlass.range_constexpr(self.n_chunks):
                st = self._ring_state(j * self.n_chunks + p, True)
                kv_pipe.producer_acquire(st)
                self.load_chunk(keys, j, (p + shift) % self.n_chunks, st.index, kv_pipe.producer_get_barrier(st))
        # Wait for the MMA warp's last releases so no arrive lands after exit.
        g_end = n_local * self.n_chunks
        for i in cutlass.range_constexpr(self.slots):
            kv_pipe.producer_acquire(self._ring_state(g_end + i, True))
        q_prod.tail()

    @cute.jit
    def load_chunk(self, keys, j, cid, slot, bar):
        """TMA of chunk `cid` of visited tile j (keys.load, outside the caller's loop)."""
        keys.load(j, cid, slot, bar)

    @cute.jit
    def mask_scores(self, keys, j, rS, key_cols: cutlass.Constexpr, token):
        """The rung's score mask on tile j for a row of query token `token` (keys.mask)."""
        keys.mask(j, rS, key_cols, token)

    @cute.jit
    def qk_chunks(self, kv_pipe, qk_mma, tSrQ, tSrK, tStS, j, p_lo: cutlass.Constexpr, p_hi: cutlass.Constexpr,
                  shift, keys, lines):
        """Q·K_jᵀ over load positions [p_lo, p_hi) of tile j: a K-only chunk released by tcgen05.commit
                after its MMAs; a masked rung's V chunk first cleaned past the fill level (keys.clean_v)."""
        kb_per_chunk = cute.size(tSrK, mode=[2])
        for p in cutlass.range_constexpr(p_lo, p_hi):
            st = self._ring_state(j * self.n_chunks + p, False)
            kv_pipe.consumer_wait(st)
            if cutlass.const_expr(keys.masked and p >= self.n_nonv):
                keys.clean_v(j, lines, st.index)
            tcgen05_fence_after_sync()
            cid = (p + shift) % self.n_chunks
            for kb in cutlass.range_constexpr(kb_per_chunk):
                qk_mma.set(tcgen05.Field.ACCUMULATE, p * kb_per_chunk + kb != 0)
                cute.gemm(qk_mma, tStS, tSrQ[None, None, cid * kb_per_chunk + kb, 0],
                          tSrK[None, None, kb, st.index], tStS)
            if cutlass.const_expr(p < self.n_nonv):
                kv_pipe.consumer_release(st)

    @cute.jit
    def pv_tile(self, kv_pipe, pv_mma, o_tiles, tOrP, tOrV, j):
        """O += P_j · V_j (P from SMEM, already waited for): PV tile t reads V_chunkᵀ from
        the ring slot of this CTA's V chunk t of tile j; then those slots are released."""
        num_kb_pv = cute.size(tOrV, mode=[2])
        for t in cutlass.range_constexpr(self.n_v):
            v_slot = (j * self.n_chunks + self.n_nonv + t) % self.slots
            for kb in cutlass.range_constexpr(num_kb_pv):
                if cutlass.const_expr(kb == 0):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, j != 0)
                else:
                    pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(pv_mma, o_tiles[t], tOrP[None, None, kb], tOrV[None, None, kb, v_slot], o_tiles[t])

    def release_v(self, kv_pipe, j):
        """Release tile j's V chunks (tcgen05.commit: free once PV_j has read them)."""
        for t in range(self.n_v):
            kv_pipe.consumer_release(self._ring_state(j * self.n_chunks + self.n_nonv + t, False))

    @cute.jit
    def mma_role(self, q_cons, kv_pipe, s_prod, p_cons, o_prod, qk_mma, pv_mma, tSrQ, tSrK, tOrV, tOrP,
                 tmem_ptr, s_cols: cutlass.Constexpr, s_layout, o_tiles, keys, lines, shift):
        """Warp 4: QK_0; then per tile j with a successor: the early chunks of QK_{j+1},
        PV_j, the rest of QK_{j+1} (the S buffers alternate), so the next Q·Kᵀ overlaps
        the softmax of tile j; PV of the last tile."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        n_local = keys.n_local
        q_full = q_cons.wait_and_advance()
        # The tiled MMAs carry their ACCUMULATE field as traced state: each staged body
        # below sets it itself (a set made only inside a helper would not be threaded
        # out of the loop / branch by the tracer).
        qk_mma.set(tcgen05.Field.ACCUMULATE, False)
        pv_mma.set(tcgen05.Field.ACCUMULATE, False)
        if n_local > 0:
            qk_mma.set(tcgen05.Field.ACCUMULATE, False)
            s_slot = s_prod.acquire_and_advance()
            tStS = cute.make_tensor(tmem_ptr + s_slot.index * s_cols, s_layout)
            self.qk_chunks(kv_pipe, qk_mma, tSrQ, tSrK, tStS, 0, 0, self.n_chunks, shift, keys, lines)
            s_slot.commit()
        for j in cutlass.range(n_local - 1, unroll=1):  # tiles that have a successor
            qk_mma.set(tcgen05.Field.ACCUMULATE, False)
            pv_mma.set(tcgen05.Field.ACCUMULATE, False)
            s_next = s_prod.acquire_and_advance()
            tS_next = cute.make_tensor(tmem_ptr + s_next.index * s_cols, s_layout)
            self.qk_chunks(kv_pipe, qk_mma, tSrQ, tSrK, tS_next, j + 1, 0, self.qk_early, shift, keys, lines)
            p_full = p_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            self.pv_tile(kv_pipe, pv_mma, o_tiles, tOrP, tOrV, j)
            p_full.release()  # tcgen05.commit: P slot free ⇔ PV_j complete
            self.release_v(kv_pipe, j)
            self.qk_chunks(kv_pipe, qk_mma, tSrQ, tSrK, tS_next, j + 1, self.qk_early, self.n_chunks, shift, keys, lines)
            s_next.commit()
        if n_local > 0:
            pv_mma.set(tcgen05.Field.ACCUMULATE, False)
            p_last = p_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            self.pv_tile(kv_pipe, pv_mma, o_tiles, tOrP, tOrV, n_local - 1)
            p_last.release()
            self.release_v(kv_pipe, n_local - 1)
        o_slot = o_prod.acquire_and_advance()
        o_slot.commit()  # every MMA done: O final
        q_full.release()

    @cute.jit
    def softmax_role(self, s_cons, p_prod, o_cons, tOgO, s_load, p_copy, o_load, o_store, tmem_ptr,
                     s_cols: cutlass.Constexpr, s_layout, tOtO, cS, cO, sP_mk, mLSE, mLSEp,
                     tidx, rb, half, split, batch, keys, extra):
        """Warps 0-3: the online softmax (thread t owns row t: stages/common/sm100_softmax.py),
        the rung's score mask, P to SMEM, the O rescale, then the epilogue."""
        hang_guard.role("softmax")  # names this role's waits in a --debug-hangs build
        thr_s = s_load.get_slice(tidx)
        thr_o = o_load.get_slice(tidx)
        thr_o_st = o_store.get_slice(tidx)
        thr_pc = p_copy.get_slice(tidx)
        tTR_tO = thr_o.partition_S(tOtO)
        tRT_tO = thr_o_st.partition_D(tOtO)
        tTR_cO = thr_o.partition_D(cO)
        tTR_gO = thr_o.partition_D(tOgO)
        tRS_sP = thr_pc.partition_D(sP_mk)
        rS = cute.make_rmem_tensor(thr_s.partition_D(cS).shape, F32)
        key_cols = None  # a masked rung: register i of S ↔ key column key_cols[i] (trace-time constant)
        if cutlass.const_expr(keys.masked):
            key_cols = row_key_columns(s_load, cS)
        rP = cute.make_rmem_tensor(rS.shape, BF16)
        rP_smem = thr_pc.retile(rP)
        o_chunks = cute.size(tTR_cO, mode=[1])
        pv_tiles = cute.size(tTR_cO, mode=[3])
        rO = cute.make_rmem_tensor(tTR_cO[None, 0, None, 0].shape, F32)
        token = (rb * ROWS + tidx) // self.h_q  # this thread's query token (its row's)
        n_local = keys.n_local

        c = self.score_scale_log2(keys)
        row_max = F32(-math.inf)
        row_sum = F32(0.0)
        for j in cutlass.range(n_local, unroll=1):
            s_full = s_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            tS = cute.make_tensor(tmem_ptr + s_full.index * s_cols, s_layout)[(None, None), 0, 0]
            cute.copy(s_load, thr_s.partition_S(tS), rS)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
            tcgen05_fence_before_sync()
            s_full.release()  # S is in registers: the buffer may take QK_{j+2}
            if cutlass.const_expr(keys.masked):
                self.mask_scores(keys, j, rS, key_cols, token)

            p, new_max, alpha, row_sum = row_softmax_update(rS.load(), row_max, row_sum, c)
            if cutlass.const_expr(keys.masked):
                p = self.probs_for_pv(keys, j, p, rS, key_cols)  # ℓ has summed P: a rung's factor on P·V only
            rP.store(p.to(BF16))

            p_slot = p_prod.acquire_and_advance()  # PV_{j-1} complete: O final, P buffer free
            tcgen05_fence_after_sync()
            cute.copy(p_copy, rP_smem, tRS_sP)
            if j > 0:
                if cute.arch.vote_any_sync(new_max > row_max):
                    rescale_o(o_load, o_store, tTR_tO, tRT_tO, rO, alpha, pv_tiles, o_chunks)  # O ← α·O in TMEM
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st
            cute.arch.fence_view_async_shared()  # P visible to the tensor core (async proxy)
            tcgen05_fence_before_sync()
            p_slot.commit()
            row_max = new_max

        o_full = o_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        self.epilogue(o_load, tTR_tO, tTR_cO, tTR_gO, rO, row_max, row_sum, c, mLSE, mLSEp,
                      rb, half, split, batch, n_local, o_chunks, pv_tiles, extra)
        tcgen05_fence_before_sync()
        o_full.release()

    @cute.jit
    def epilogue(self, o_load, tTR_tO, tTR_cO, tTR_gO, rO, row_max, row_sum, c, mLSE, mLSEp,
                 rb, half, split, batch, n_local, o_chunks: cutlass.Constexpr, pv_tiles: cutlass.Constexpr, extra):
        """O / ℓ and LSE to global memory, 32 columns at a time: bf16 O and LSE (one split) or the fp32
                partials.  ℓ = 0 writes O = 0 and LSE = +∞ (one split) or −∞ (a partial); an empty split
                does so without reading TMEM."""
        row = rb * ROWS + tTR_cO[0][0]
        one_split = cutlass.const_expr(self.splits == 1)
        rOut = cute.make_rmem_tensor(rO.shape, BF16 if one_split else F32)
        inv_sum = row_inv_sum(row_sum)
        o_scale = inv_sum
        if cutlass.const_expr(self.has_row_scale()):
            o_scale = inv_sum * self.row_scale(row_lse(row_max, row_sum, c), row, batch, extra)
        for t in cutlass.range_constexpr(pv_tiles):
            for ch in cutlass.range_constexpr(o_chunks):
                if n_local > 0:
                    cute.copy(o_load, tTR_tO[None, ch, None, t], rO)
                    cute.arch.fence_view_async_tmem_load()
                    rOut.store((rO.load() * o_scale).to(rOut.element_type))
                else:
                    rOut.fill(0.0)
                if row < self.rows:
                    cute.autovec_copy(rOut, tTR_gO[None, ch, None, t])
        if row < self.rows:
            if half == 0:
                flat = batch * self.rows + row  # (batch·s_q + token)·h_q + head
                lse = row_lse(row_max, row_sum, c)
                if cutlass.const_expr(one_split):
                    mLSE[flat] = final_row_lse(lse)  # no key at all: +∞ (DSV4)
                else:
                    mLSEp[split * (self.b * self.rows) + flat] = lse  # −∞: skipped by the combine


class _Views:
    """The host-side tensor views of one launch (plain attributes)."""


class WindowSm100(DecodeSm100):
    """The house over one SWA branch with a per-batch fill level (D3) and, when `CAUSAL`, D4's rule:
        tensors (Q, KV, swa_lens, O, LSE, O_part, LSE_part); D3 / D4 set NAME / CAUSAL."""

    NAME = "sm100 window decode"
    CAUSAL = False

    def __init__(self, *, shape: str, splits, sm_count: int = B200_SMS, o_split: int | None = None,
                 s_stages: int = 2):
        p = DecodeShape.parse(shape)
        self.window = Branch("swa", p.n, p.n_alloc, causal=self.CAUSAL)
        self.setup_plan(p, splits, sm_count, o_split, s_stages)

    @cute.jit
    def __call__(self, Q: cute.Tensor, KV: cute.Tensor, swa_lens: cute.Tensor, O: cute.Tensor, LSE: cute.Tensor,
                 O_part: cute.Tensor, LSE_part: cute.Tensor, stream: cuda.CUstream):
        p = self.p
        self._check_tensors(Q, O, LSE, O_part, LSE_part, KV=(KV, (p.b, p.n_alloc, p.d)), swa_lens=(swa_lens, (p.b,)))
        v, ops, tma_q, tma_Q = self.prepare(Q, O, LSE, O_part, LSE_part)
        qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem = ops
        tma_k, tma_K = self.kv_atom(qk_mma, k_smem, self.kv_view(KV, p.n, p.n_alloc))
        self.start(self.kernel(qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, swa_lens, v.eO, v.mLSE, v.eOp, v.mLp,
                               q_smem, k_smem, v_smem, p_smem), stream)
        self.combine(v, stream)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, swa_lens: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mOp: cute.Tensor, mLSEp: cute.Tensor, q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout,
               v_smem: cute.ComposedLayout, p_smem: cute.ComposedLayout):
        bx, split, batch = cute.arch.block_idx()
        work = self.sched.work(bx // self.o_split, split, batch)
        keys = BranchKeys((self.window,), ((tma_k, mK),), (swa_lens[batch],), work.tile_begin, work.tile_end,
                          self.block_last_token(work.token), self.s_q, KV_TILE)
        self.attend(keys, work.token, split, batch, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                    q_smem, k_smem, v_smem, p_smem, None)
