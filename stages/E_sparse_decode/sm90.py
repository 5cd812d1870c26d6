"""Stage E on Hopper (sm_90a): DSV4 decode attention over an FP8 paged cache — sparse indices,
two branches under one softmax, attention sink, split-KV.

Math (oracles/sparse_decode.py): per query row (batch, token, head), over the valid keys of the
main list (idx, topk_length) and the extra/SWA list (idx_extra, extra_length) together,
    O = softmax(Q·Kᵀ · scale) · V · 1/(1 + exp(sink[h] − lse)),   LSE = ln Σ exp(Q·Kᵀ · scale),
K = V = the dequantised cache rows, scale = 1/sqrt(512); a row with no valid key: O = 0, LSE = +∞.

What is new in this rung (D2's house otherwise: heads fold into M, 64 heads of one token per
CTA, split-KV with an LSE combine, K and Vᵀ views of one shared-memory slot)
    The key list.  A CTA walks 32-key tiles of ONE list: the main list padded to whole tiles,
        then the extra list (`tile < main_tiles` picks the branch).  Key k of a tile is list
        position p = 32 · tile' + k; it is valid iff p < topk, p < length[b] and idx[b, t, p] ≠ −1.
        An invalid key is never loaded (garbage past the length may be INT_MAX): its shared-memory
        row is written as zeros and its score is set to −∞ (a per-slot mask in shared memory).
        Splits are chosen over 64-key units (the scratch the oracle declares), each split walking
        its share of 32-key tiles.
    Gather, asynchronous (Hopper's TMA cannot gather rows).  The producer warps (P = 8 alone, 4 in
        a pair: the WarpPlan; warp w owns keys w, w + P, … of every tile) stage the raw bytes
        RAW_STAGES tiles ahead:
        lane l cp.asyncs its 16 bytes of each key (model1's rope lanes 28 … 31: 32 bytes) and lane
        0 the key's scales into a ring of RAW_KEY_BYTES-byte rows, one commit group per tile.  An
        invalid key is copied too, as zeros (src-size 0, stages/common/sm90_gather.py): no branch
        per key, so ptxas interleaves a warp's keys.  The idx entries of a tile come by cp.async as
        well, in the group of the tile RAW_STAGES before it, into `s_ridx` (the first tiles' are
        loaded directly), so no global load waits in the loop; `key_index` judges an entry when it
        is used.
    Dequantise on the CUDA cores, into one of two 32-key bf16 slots while the MMA warpgroups work
        on the other: e4m3 → bf16 by bit moves and two exact bf16x2 multiplies by the power-of-two
        scale of the lane's group (stages/common/e4m3_bits.py; one multiply, the same bits, when a
        warp's vote finds every lane's scale ≤ 2^7), one 32-byte row piece into the
        swizzled K tile at an address precomputed per thread (piece_rows).  Scales: model1 — e8m0
        byte l // 4 of the token's 7 (the rope lanes copy bf16 as it is); v4.1 — e8m0 byte l // 2
        of 16.  simple — the e4m3 values go to bf16 unscaled (exact) and the token's fp32 scale to
        `s_kscale`: the MMA warpgroups apply it to S's column (S = Q·K_e4m3ᵀ · scale) and to P's
        (P·V = (P · scale)·V_e4m3) in fp32, after ℓ has summed P, so simple's LSE carries no bf16
        rounding of the scaled value.  The writes are made visible to the tensor cores
        (fence.proxy.async) before the slot's barrier is arrived on (a PipelineAsync: every producer
        thread arrives, 256 MMA threads release).
    Two CTAs share every tile (h_q a multiple of 128).  The two head blocks of one token walk the
        same keys, so they run as a (2, 1, 1) cluster and each dequantises half of every tile (a
        producer warp 4 of its 8 keys) and st.asyncs each piece into the peer's slot as well
        (stages/common/cluster_pair.py: the peer's bytes complete a transaction count on the
        slot's remote_full barrier; a slot is refilled once both CTAs' MMA warps released it).
    Sink.  One split: folded into the epilogue's 1/ℓ.  Several: stages/common/combine.py's
        SplitCombine applies it once, after the merge.

Warp roles (the WarpPlan: 512 threads alone, 384 in a pair)
    warpgroups 2, 3  producer: warp 8 loads Q once (TMA); every producer warp stages and
    (alone; 2 in     dequantises its keys of each KV tile (setmaxnreg 80; `register_plan`
    a pair)          checks the budget)
    warpgroup 0   S = Q·K_tileᵀ, mask, online softmax (stages/common/softmax.py), P → shared
                  memory, α per row; then its half of O += P·V   (setmaxnreg 176 alone, 208 paired)
    warpgroup 1   its half of O += P·V (O's 512 columns split over the two MMA warpgroups, in
                  m64n128 wgmmas alone — ptxas checks an instruction against the 128-register
                  launch cap of 512 threads — m64n256 in a pair)

Limits: d = 512; h_q a multiple of 64; static shapes; block sizes and formats of oracles/kvcache.py.
What bounds it (docs/STAGE_E.md): at h_q = 64 the producer — a warp's chain of loads, conversions and
stores runs at an IPC of ~0.2, hence 8 producer warps; at h_q = 128 the MMA warpgroups' chain per
32-key tile (S = Q·Kᵀ at n = 32 reads Q from shared memory every tile; softmax; P·V).  Not done yet:
64-key tiles (they need the raw staging ring gone: gather into registers), a persistent scheduler.
"""

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warp, warpgroup

from oracles.sparse_decode import SparseConfig
from stages.common.barriers import NamedBarrier
from stages.common.cluster_pair import TilePair
from stages.common.combine import SplitCombine, sink_factor
from stages.common.e4m3_bits import e4m3x16_to_bf16, one_multiply_fits
from stages.common.fp8_cache import D, cache_block_bytes, cp_async, lds16, lds_f32, lds_u8
from stages.common.inspection import expose
from stages.common.sm90_gather import cp_async_or_zero
from stages.common.scheduler import SM_COUNT, DecodeGrid, resolve_splits
from stages.common.sm90_idioms import acc_rows_cols, tma_pipeline, wgmma_sync
from stages.common.softmax import OnlineSoftmax, final_lse, scale_rows
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile

_SMEM_LIMIT = 227 * 1024


def register_plan(threads: int, plan: list[tuple[int, int]]) -> str | None:
    """None when the setmaxnreg plan [(thread count, registers per thread), …] — one entry per
    group of warps — fits the CTA's allocation at launch (threads × (65 536 / threads rounded
    down to a multiple of 8)); else why not.  A plan that does not fit hangs: setmaxnreg.inc
    waits for registers nobody frees."""
    at_launch = threads * (65536 // threads // 8 * 8)
    want = sum(n * r for n, r in plan)
    if sum(n for n, _ in plan) != threads or any(r % 8 or not 24 <= r <= 256 for _, r in plan):
        return f"setmaxnreg plan {plan} must cover the {threads} threads with multiples of 8 in 24 … 256"
    if want > at_launch:
        return f"setmaxnreg plan {plan} needs {want} registers, the CTA holds {at_launch} (a hang)"
    return None


def _kv_layouts(dtype, block_n: int, stages: int, slice_n: int):
    """K (block_n, D, stages) K-major and Vᵀ (D, block_n, stages) MN-major views of the same slot
    bytes (stage D2's construction: the swizzle atom of one warpgroup's O slice, keys first), and
    the byte stride of 8 keys (the swizzle atom's height) the dequantisers step by."""
    k_kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, slice_n)
    v_kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, dtype, slice_n)
    k_layout = cute.tile_to_shape(warpgroup.make_smem_layout_atom(k_kind, dtype), (block_n, D, stages), order=(0, 1, 2))
    vt_layout = cute.tile_to_shape(warpgroup.make_smem_layout_atom(v_kind, dtype), (D, block_n, stages), order=(1, 0, 2))
    if k_layout.inner.num_base < 4:  # the dequantisers store whole 16-byte pieces (slot_offset)
        raise ValueError(f"stage E sm90: the K swizzle {k_layout.inner} splits 16-byte pieces")
    for key in (0, 1, 7, 8, block_n - 1):
        for col in (0, 1, 15, 16, 63, 64, slice_n - 1, slice_n, D - 1):
            for slot in (0, stages - 1):
                if k_layout((key, col, slot)) != vt_layout((col, key, slot)):
                    raise ValueError(f"stage E sm90: the Vᵀ view is not K's bytes at key {key}, col {col}, slot {slot}")
    # The dequantisers address a piece as row_offset(key mod 8, col) + (key // 8)·key8 +
    # slot·block_n·D·2 (Kernel.piece_rows): the layout must be additive in those two strides.
    at = lambda key, col, slot: slot_offset(k_layout, key, col, slot)  # noqa: E731
    key8 = at(8, 0, 0) - at(0, 0, 0)
    for key in range(8):
        for col in (0, 8, 16, 120, 264, D - 8):
            for slot in range(stages):
                for k8 in range(block_n // 8):
                    if at(key + 8 * k8, col, slot) != at(key, col, 0) + k8 * key8 + slot * block_n * D * 2:
                        raise ValueError(f"stage E sm90: K slot offsets are not additive at key {key + 8 * k8}, col {col}")
    return k_layout, vt_layout, key8


@dataclass(frozen=True)
class WarpPlan:
    """The warps of a CTA: `producer_warps` gathering and dequantising after the two MMA
    warpgroups, the setmaxnreg registers of each side, and the O columns of one P·V wgmma
    (`pv_n`: ptxas checks each instruction against the launch cap, 65 536 / threads, and an
    m64n256 accumulator is 128 registers).  Key k of a tile belongs to producer warp
    k mod producer_warps."""

    producer_warps: int
    mma_regs: int
    producer_regs: int
    pv_n: int

    @property
    def producer_threads(self) -> int:
        return 32 * self.producer_warps

    @property
    def threads(self) -> int:
        return 128 * Kernel.NUM_MMA_WG + self.producer_threads


class Kernel:
    """FP8 paged sparse decode on Hopper: CUDA-core gather + dequantise into bf16 tiles, two
    wgmma warpgroups with the online softmax, sink, split-KV (see the module doc)."""

    BLOCK_M = 64
    BLOCK_N = 32  # keys per tile: two bf16 slots (the dequantisation of one overlaps the MMAs of the other)
    NUM_MMA_WG = 2
    MMA_THREADS = 128 * NUM_MMA_WG
    PRODUCER_WG = 2  # the first producer warpgroup (after the MMA warpgroups)
    # Warp plans, by whether the CTA is half of a cluster pair (measured on an H100 at b = 64,
    # docs/STAGE_E.md).  Alone (h_q = 64) the producer bounds the kernel: 8 producer warps (512
    # threads) are 12 % faster than 4.  In a pair (h_q = 128) each CTA dequantises half of every
    # tile and the MMA warpgroups bound it: 4 producer warps (384 threads) keep them at 208
    # registers and m64n256 P·V wgmmas (8 warps measured 19 % slower).
    PLANS = {False: WarpPlan(producer_warps=8, mma_regs=176, producer_regs=80, pv_n=128),
             True: WarpPlan(producer_warps=4, mma_regs=208, producer_regs=80, pv_n=256)}
    KV_STAGES = 2
    RAW_STAGES = 4  # raw tiles in flight (cp.async): 4 × 32 keys × 592 B, the latency hider
    INDEX_SLOTS = 2 * RAW_STAGES  # idx entries are staged RAW_STAGES tiles before their keys' bytes
    RAW_KEY_BYTES = 592  # one key in the ring: its data (model1 576, simple / v4.1 512) …
    RAW_SCALES = 576  # … then its scales (simple 4 bytes, model1 8, v4.1 16)
    LANE_COLS = 16  # columns of a key one lane dequantises (16 e4m3 = one 16-byte load)
    GROUP = 2  # keys whose staged bytes a lane reads before converting any

    def __init__(self, *, b: int, config: str, kv_format: str, splits, sm_count: int = SM_COUNT):
        c = SparseConfig.parse(config)
        if c.h_q % self.BLOCK_M:
            raise ValueError(f"stage E sm90: h_q must be a multiple of {self.BLOCK_M}, got {c.h_q}")
        self.fmt = kv_format
        self.block_bytes = cache_block_bytes(kv_format, c.block)
        self.extra_block_bytes = cache_block_bytes(kv_format, c.extra_block if c.has_extra else 1)
        self.b, self.c = b, c
        self.main_tiles = -(-c.topk // self.BLOCK_N)
        self.extra_tiles = -(-c.extra_topk // self.BLOCK_N) if c.has_extra else 0
        num_tiles = self.main_tiles + self.extra_tiles
        head_blocks = c.h_q // self.BLOCK_M
        ctas = head_blocks * c.s_q * b
        # Two head blocks of one token walk the same keys: a (2, 1, 1) cluster of them shares
        # every dequantised tile (stages/common/cluster_pair.py); each CTA dequantises half.
        self.pair = head_blocks % 2 == 0
        self.plan = self.PLANS[self.pair]
        pw = self.plan.producer_warps
        if 8 % pw or self.BLOCK_N % (2 * pw):
            raise ValueError(f"stage E sm90: {pw} producer warps must divide the 8 keys of a swizzle atom and half a tile")
        self.keys_per_warp = self.BLOCK_N // pw // (2 if self.pair else 1)  # keys a producer warp dequantises
        self.peer_bytes = self.keys_per_warp * pw * D * 2  # the bf16 bytes the peer writes into a slot
        if self.keys_per_warp % (8 // pw) or self.keys_per_warp % self.GROUP:
            raise ValueError(f"stage E sm90: {self.keys_per_warp} keys a producer warp must be whole groups of "
                             f"{8 // pw} (a swizzle row group) and of GROUP {self.GROUP}")
        # Splits are chosen over the case's 64-key tiles (the scratch the oracle declares holds one
        # split per 64 keys at most); each split then walks its share of 32-key tiles.
        self.splits = resolve_splits(splits, ctas=ctas, num_tiles=c.tiles(), sm_count=sm_count)
        self.sched = DecodeGrid(head_blocks, c.s_q, b, self.splits, num_tiles)
        self.rows = b * c.s_q * c.h_q
        self.scale_log2 = math.log2(math.e) / math.sqrt(D)
        why = register_plan(self.plan.threads, [(self.MMA_THREADS, self.plan.mma_regs), (self.plan.producer_threads, self.plan.producer_regs)])
        if why is not None:
            raise ValueError(f"stage E sm90: {why}")
        smem = (2 * (self.BLOCK_M * D + self.KV_STAGES * self.BLOCK_N * D + self.BLOCK_M * self.BLOCK_N)
                + self.RAW_STAGES * self.BLOCK_N * self.RAW_KEY_BYTES + 4096)
        if smem > _SMEM_LIMIT:
            raise ValueError(f"stage E sm90: {smem} bytes of shared memory needed, {_SMEM_LIMIT} available")

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        KV: cute.Tensor,
        idx: cute.Tensor,
        topk_length: cute.Tensor,
        KV_extra: cute.Tensor,
        idx_extra: cute.Tensor,
        extra_length: cute.Tensor,
        sink: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        O_part: cute.Tensor,
        LSE_part: cute.Tensor,
        stream: cuda.CUstream,
    ):
        c, bm, bn = self.c, self.BLOCK_M, self.BLOCK_N
        dtype = Q.element_type
        self._check_tensors(Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part)
        rows = self.rows

        mQ = cute.make_tensor(Q.iterator, cute.make_layout((rows, D), stride=(D, 1)))
        mO = cute.make_tensor(O.iterator, cute.make_layout((rows, D), stride=(D, 1)))
        mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((c.h_q, c.s_q, self.b), stride=(c.s_q, 1, c.h_q * c.s_q)))
        cap = O_part.shape[0]
        mOp = cute.make_tensor(O_part.iterator, cute.make_layout((cap * rows, D), stride=(D, 1)))
        mLp = cute.make_tensor(LSE_part.iterator, cute.make_layout(cap * rows))

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (1, 1, 1), tiler_mn=(bm, bn),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, cutlass.Float32,
            (1, self.NUM_MMA_WG, 1), tiler_mn=(bm, self.plan.pv_n),
        )
        q_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (bm, bn, D), dtype, 1)
        k_smem, vt_smem, self.key8_bytes = _kv_layouts(dtype, bn, self.KV_STAGES, D // self.NUM_MMA_WG)
        p_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (bm, D, bn), dtype, 1)
        expose(self, p_path="smem", qk_mma=(qk_mma, (bm, bn, D)), pv_mma=(pv_mma, (bm, D, bn)),
               smem={"Q": q_smem, "K (dequantised)": k_smem, "Vt (K's bytes)": vt_smem, "P": p_smem},
               p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=(bm, bn))
        tma_q, tma_Q, self.q_bytes = sm90_tma_load(mQ, q_smem, (bm, D))

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.KV_STAGES]
            remote_full: cute.struct.MemRange[cutlass.Int64, self.KV_STAGES]
            remote_empty: cute.struct.MemRange[cutlass.Int64, self.KV_STAGES]
            row_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]
            key_mask: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bn * self.KV_STAGES], 16]
            key_scale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bn * self.KV_STAGES], 16]
            raw_index: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, bn * self.INDEX_SLOTS], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(p_smem)], 1024]
            raw: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.RAW_STAGES * bn * self.RAW_KEY_BYTES // 4], 128]

        self.smem_struct = Smem
        cluster = {"cluster": (2, 1, 1)} if self.pair else {}
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, KV, idx, topk_length, KV_extra, idx_extra, extra_length, sink,
            mO, mLSE, mOp, mLp, q_smem, k_smem, vt_smem, p_smem,
        ).launch(grid=self.sched.grid, block=(self.plan.threads, 1, 1), smem=Smem.size_in_bytes(), stream=stream, **cluster)

        if cutlass.const_expr(self.splits > 1):
            SplitCombine(rows, self.splits, D, sink_heads=c.h_q).launch(mOp, mLp, mO, mLSE, stream, sink=sink)

    def _check_tensors(self, Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part) -> None:
        """Trace time: the tensors have the shapes this kernel's reading of the case implies
        (the cache block sizes in bytes included), and the scratch holds its splits."""
        c, b = self.c, self.b
        want = {
            "Q": (Q, (b, c.s_q, c.h_q, D)),
            "idx": (idx, (b, c.s_q, c.topk)),
            "O": (O, (b, c.s_q, c.h_q, D)),
            "LSE": (LSE, (b, c.h_q, c.s_q)),
        }
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"stage E sm90: {name} has shape {tuple(t.shape)}, the case needs {shape}")
        if KV.shape[1] != self.block_bytes or (c.has_extra and KV_extra.shape[1] != self.extra_block_bytes):
            raise ValueError(f"stage E sm90: {self.fmt} blocks of {c.block} / {c.extra_block} tokens are "
                             f"{self.block_bytes} / {self.extra_block_bytes} bytes; the caches have "
                             f"{KV.shape[1]} / {KV_extra.shape[1]}")
        if c.has_extra and tuple(idx_extra.shape) != (b, c.s_q, c.extra_topk):
            raise ValueError(f"stage E sm90: idx_extra has shape {tuple(idx_extra.shape)}, the case needs {(b, c.s_q, c.extra_topk)}")
        if self.splits > 1 and (self.splits > O_part.shape[0] or self.splits > LSE_part.shape[0]):
            raise ValueError(f"stage E sm90: {self.splits} splits need O_part/LSE_part capacity ≥ {self.splits}, "
                             f"got {O_part.shape[0]}")

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        KV: cute.Tensor,
        idx: cute.Tensor,
        topk_length: cute.Tensor,
        KV_extra: cute.Tensor,
        idx_extra: cute.Tensor,
        extra_length: cute.Tensor,
        sink: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        vt_smem: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
    ):
        bm, bn = self.BLOCK_M, self.BLOCK_N
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        work = self.sched.work(bx, by, bz)
        if warp_idx == 4 * self.PRODUCER_WG:
            prefetch_descriptors(tma_q)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bn, D, stages)
        sVt = storage.sKV.get_tensor(vt_smem.outer, swizzle=vt_smem.inner)  # (D, bn, stages): the same bytes
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)[None, None, 0]
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))
        s_mask = storage.key_mask.get_tensor(cute.make_layout((bn, self.KV_STAGES)))  # 0 or −∞ per key
        s_raw = storage.raw.get_tensor(cute.make_layout(self.RAW_STAGES * bn * self.RAW_KEY_BYTES // 4))
        s_kscale = storage.key_scale.get_tensor(cute.make_layout((bn, self.KV_STAGES)))  # simple: the token's scale
        s_ridx = storage.raw_index.get_tensor(cute.make_layout((bn, self.INDEX_SLOTS)))  # idx entries, staged
        k_base = storage.sKV.data_ptr().toint()  # the dequantisers address the slots through k_smem
        pair = self.tile_pair(storage)
        pair.init(self.KV_STAGES, tidx)

        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, 4)
        kv_pipe = pipeline.PipelineAsync.create(
            num_stages=self.KV_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.plan.producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.MMA_THREADS),
            barrier_storage=storage.kv_mbar.data_ptr(),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        pair.start()

        has_work = work.tile_begin < work.tile_end
        if warp_idx // 4 >= self.PRODUCER_WG:
            cute.arch.setmaxregister_decrease(self.plan.producer_regs)
            if has_work:
                self.produce(work, tidx - self.MMA_THREADS, q_pipe, kv_pipe, pair, tma_q, mQ, sQ, k_base, k_smem,
                             s_mask, s_kscale, s_raw, s_ridx,
                             KV, idx, topk_length, KV_extra, idx_extra, extra_length)
        else:
            cute.arch.setmaxregister_increase(self.plan.mma_regs)
            if has_work:
                self.attend(work, tidx, q_pipe, kv_pipe, pair, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row, s_mask,
                            s_kscale, sink, mO, mLSE, mOp, mLp)
            else:
                self.write_empty_split(work, tidx, mOp, mLp)
        pair.finish()

    def tile_pair(self, storage) -> TilePair:
        """The exchange of dequantised halves with the peer CTA (a no-op alone)."""
        return TilePair(self.pair, storage.remote_full.data_ptr(), storage.remote_empty.data_ptr(),
                        self.peer_bytes, self.MMA_THREADS // 32)

    # -----------------------------------------------------------------------------------------
    # Producer: Q by TMA, KV by gather + dequantise

    @cute.jit
    def produce(self, work, ptid, q_pipe, kv_pipe, pair, tma_q, mQ, sQ, k_base, k_smem, s_mask, s_kscale, s_raw,
                s_ridx, KV, idx, topk_length, KV_extra, idx_extra, extra_length):
        """The producer warpgroup (`ptid` 0 … 127): Q's row block once (warp 0, TMA), then every
        KV tile of the split: its raw bytes gathered RAW_STAGES tiles ahead (cp.async into the
        staging ring, one commit group per tile), dequantised into a bf16 slot as one frees up.
        Each warp stages and dequantises only its own keys (pwarp, pwarp + 4, …; in a pair, the
        half of them that is this CTA's), so a warp's own sync orders the ring; a key's index
        rides along in `s_ridx`."""
        bm = self.BLOCK_M
        pwarp = ptid // 32
        lane = ptid % 32
        rank = pair.rank()
        k_rows = self.piece_rows(k_base, k_smem, pwarp, lane)
        if pwarp == 0:
            gQ = cute.local_tile(mQ, (bm, D), (None, 0))
            tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[(None, self.sched.row_block(work))], tQsQ[(None, 0)],
                      tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

        lengths = (cutlass.min(topk_length[work.batch], self.c.topk), cutlass.Int32(0))
        if cutlass.const_expr(self.c.has_extra):
            lengths = (lengths[0], cutlass.min(extra_length[work.batch], self.c.extra_topk))
        lists = (KV, idx, KV_extra, idx_extra)
        # The first RAW_STAGES tiles' indices by plain loads (issued together, waited on once); every
        # later tile's idx entries come by cp.async with the bytes of the tile RAW_STAGES before it.
        first = [self.staged_indices(lists, lengths, work, work.tile_begin + r, None, pwarp, lane) for r in range(self.RAW_STAGES)]
        for r in cutlass.range_constexpr(self.RAW_STAGES):
            if lane < self.BLOCK_N // self.plan.producer_warps:  # their index slots, as staged_indices reads them
                s_ridx[pwarp + self.plan.producer_warps * lane, r] = first[r]
            self.stage_tile(lists, work, work.tile_begin + r, first[r], s_raw, s_ridx, r, rank, pwarp, lane)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.KV_STAGES)
        for tile in cutlass.range(work.tile_begin, work.tile_end, unroll=1):
            rslot = (tile - work.tile_begin) % self.RAW_STAGES
            cute.arch.cp_async_wait_group(self.RAW_STAGES - 1)  # this thread's copies of `tile`'s group landed
            cute.arch.sync_warp()  # … and every lane's (scales and idx entries are read across lanes)
            mine = self.staged_indices(lists, lengths, work, tile, s_ridx, pwarp, lane)
            kv_pipe.producer_acquire(kv_state)
            pair.producer_acquire(kv_state, ptid)
            self.dequant_tile(mine, s_raw, rslot, k_rows, s_mask, s_kscale, kv_state, pair, rank, pwarp, lane)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic smem writes → wgmma reads
            kv_pipe.producer_commit(kv_state)
            kv_state.advance()
            ahead = self.staged_indices(lists, lengths, work, tile + self.RAW_STAGES, s_ridx, pwarp, lane)
            cute.arch.sync_warp()  # the warp is done reading the staging slots before they refill
            self.stage_tile(lists, work, tile + self.RAW_STAGES, ahead, s_raw, s_ridx, rslot, rank, pwarp, lane)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def stage_tile(self, lists, work, tile, mine, s_raw, s_ridx, rslot, rank, pwarp, lane):
        """One commit group: `tile`'s keys (indices `mine`) into staging slot `rslot`, and the idx
        entries of tile + RAW_STAGES into their index slot (an empty group past the split's end,
        so the group of every tile is the RAW_STAGES-th one back)."""
        self.issue_tile(lists, tile, mine, s_raw, rslot, rank, pwarp, lane)
        self.copy_index_entries(lists, work, tile + self.RAW_STAGES, s_ridx, pwarp, lane)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def list_position(self, tile, pwarp, lane):
        """(branch, position in its list) of this warp's key `lane` of `tile`: key pwarp + producer_warps·lane."""
        pos = tile * self.BLOCK_N + pwarp + self.plan.producer_warps * lane
        branch = cutlass.Int32(0)
        if tile >= self.main_tiles:
            branch = cutlass.Int32(1)
            pos = pos - self.main_tiles * self.BLOCK_N
        return branch, pos

    @cute.jit
    def copy_index_entries(self, lists, work, tile, s_ridx, pwarp, lane):
        """Lane j < BLOCK_N / producer_warps: cp.async the idx entry of this warp's key j of `tile` (its list
        position clamped into the list) into the tile's index slot; nothing past the split."""
        if lane < self.BLOCK_N // self.plan.producer_warps and tile < work.tile_end:
            branch, pos = self.list_position(tile, pwarp, lane)
            dst = s_ridx.iterator.toint() + ((tile - work.tile_begin) % self.INDEX_SLOTS * self.BLOCK_N + pwarp + self.plan.producer_warps * lane) * 4
            if branch == 0:
                cp_async(dst, lists[1].iterator.toint() + _idx_offset(lists[1], work, cutlass.min(pos, self.c.topk - 1)), 4)
            else:
                if cutlass.const_expr(self.c.has_extra):
                    cp_async(dst, lists[3].iterator.toint() + _idx_offset(lists[3], work, cutlass.min(pos, self.c.extra_topk - 1)), 4)

    @cute.jit
    def staged_indices(self, lists, lengths, work, tile, s_ridx, pwarp, lane) -> cutlass.Int32:
        """Lane j < BLOCK_N / producer_warps: the cache index of this warp's key j of `tile`, judged by key_index
        from its idx entry — staged in `s_ridx`, or (s_ridx None: the first tiles) read from global
        memory, its position clamped into the list; −1 for an invalid key or a tile past the split."""
        mine = cutlass.Int32(-1)
        if lane < self.BLOCK_N // self.plan.producer_warps and tile < work.tile_end:
            branch, pos = self.list_position(tile, pwarp, lane)
            if branch == 0:
                got = self.idx_entry(lists[1], work, tile, pos, self.c.topk, s_ridx, pwarp, lane)
                mine = self.key_index(lists[0], got, pos, lengths[0], self.c.topk, self.c.block)
            else:
                if cutlass.const_expr(self.c.has_extra):
                    got = self.idx_entry(lists[3], work, tile, pos, self.c.extra_topk, s_ridx, pwarp, lane)
                    mine = self.key_index(lists[2], got, pos, lengths[1], self.c.extra_topk, self.c.extra_block)
        return mine

    @cute.jit
    def idx_entry(self, idx, work, tile, pos, topk: cutlass.Constexpr[int], s_ridx, pwarp, lane) -> cutlass.Int32:
        """This lane's idx entry of `tile`: from its staged slot, or from global memory when
        `s_ridx` is None (the position clamped into the list)."""
        if cutlass.const_expr(s_ridx is None):
            return idx[work.batch, work.token, cutlass.min(pos, topk - 1)]
        return s_ridx[pwarp + self.plan.producer_warps * lane, (tile - work.tile_begin) % self.INDEX_SLOTS]

    @cute.jit
    def issue_tile(self, lists, tile, mine, s_raw, rslot, rank, pwarp, lane):
        """cp.async this warp's valid keys of `tile` into staging slot `rslot` (nothing for a tile
        past the end: its indices are all −1)."""
        if tile < self.main_tiles:
            self.issue_keys(lists[0], self.c.block, self.block_bytes, mine, s_raw, rslot, rank, pwarp, lane)
        else:
            if cutlass.const_expr(self.c.has_extra):
                self.issue_keys(lists[2], self.c.extra_block, self.extra_block_bytes, mine, s_raw, rslot, rank, pwarp,
                                lane)

    @cute.jit
    def issue_keys(self, cache, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int],
                   mine, s_raw, rslot, rank, pwarp, lane):
        """Key j of this warp (index by shuffle from lane j), for the keys this CTA dequantises:
        lane l copies its 16 bytes of the token (model1's rope lanes 28 … 31: 32 bytes), lane 0
        the token's scales — an invalid key's as zeros, without a branch (stages/common/
        sm90_gather.py: its address clamped to token 0, nothing read).  simple: lane j copies key
        j's fp32 scale, for every key of the warp (a pair's MMA warpgroups apply the scales of
        both halves)."""
        base = cache.iterator.toint()
        for jj in cutlass.range_constexpr(self.keys_per_warp):
            j = rank * self.keys_per_warp + jj
            index = cute.arch.shuffle_sync(mine, j)
            dst = self.raw_key(s_raw, rslot, pwarp + self.plan.producer_warps * j)
            self.issue_piece(base, cutlass.max(index, 0), index != -1, block_size, block_bytes, lane, dst)
        if cutlass.const_expr(self.fmt == "simple"):
            if lane < self.BLOCK_N // self.plan.producer_warps and mine != -1:
                block, off = _token_block(base, mine, block_size, block_bytes)
                cp_async(self.raw_key(s_raw, rslot, pwarp + self.plan.producer_warps * lane) + self.RAW_SCALES, block + block_size * D + off * 4, 4)

    @cute.jit
    def raw_key(self, s_raw, rslot, key):
        """The byte address of `key`'s bytes in staging slot `rslot` (RAW_KEY_BYTES each)."""
        return s_raw.iterator.toint() + (rslot * self.BLOCK_N + key) * self.RAW_KEY_BYTES

    @cute.jit
    def issue_piece(self, base, index, valid, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int],
                    lane, dst):
        """cp.async token `index`'s bytes this lane stages: data columns 16·lane … 16·lane + 15 as
        16 e4m3 (model1's lanes 28 … 31: 16 bf16 rope values, 32 bytes) at their own offset, and
        (lane 0) the token's scales at RAW_SCALES: model1 8 bytes, v4.1 16 (simple's 4: issue_keys);
        zeros when not `valid`."""
        block, off = _token_block(base, index, block_size, block_bytes)
        if cutlass.const_expr(self.fmt == "simple"):
            cp_async_or_zero(dst + lane * 16, block + off * D + lane * 16, 16, valid)  # its scale: issue_keys
        elif cutlass.const_expr(self.fmt == "model1"):
            token = block + off * 576
            if lane < 28:
                cp_async_or_zero(dst + lane * 16, token + lane * 16, 16, valid)
            else:
                cp_async_or_zero(dst + 448 + (lane - 28) * 32, token + 448 + (lane - 28) * 32, 16, valid)
                cp_async_or_zero(dst + 464 + (lane - 28) * 32, token + 464 + (lane - 28) * 32, 16, valid)
            if lane == 0:
                cp_async_or_zero(dst + self.RAW_SCALES, block + block_size * 576 + off * 8, 8, valid)
        else:
            token = block + off * 528
            cp_async_or_zero(dst + lane * 16, token + lane * 16, 16, valid)
            if lane == 0:
                cp_async_or_zero(dst + self.RAW_SCALES, token + D, 16, valid)

    @cute.jit
    def piece_rows(self, k_base, k_smem, pwarp, lane):
        """The byte addresses, in slot 0, of this lane's two 16-byte pieces of the warp's keys in
        the first 8-key row group of the swizzle atom: keys pwarp + P·par (P = the plan's producer_warps,
        par < 8 / P), entry 2·par + piece.  Key pwarp + P·j is entry j mod (8 / P) plus
        (j // (8 / P))·key8_bytes, slot s adds s·BLOCK_N·D·2 (_kv_layouts checks the layout is
        additive that way), so a piece's address is one add a tile."""
        rows = cute.make_rmem_tensor(2 * (8 // self.plan.producer_warps), cutlass.Int32)
        for par in cutlass.range_constexpr(8 // self.plan.producer_warps):
            for h in cutlass.range_constexpr(self.LANE_COLS // 8):
                rows[2 * par + h] = k_base + slot_offset(k_smem, pwarp + self.plan.producer_warps * par, self.LANE_COLS * lane + 8 * h, 0)
        return rows

    @cute.jit
    def dequant_tile(self, mine, s_raw, rslot, k_rows, s_mask, s_kscale, state, pair, rank, pwarp, lane):
        """This CTA's keys of the warp in the staged tile → bf16 rows of slot state.index, GROUP keys
        at a time (an invalid key: its staged bytes are zeros, so its row is), each 16-byte piece stored by
        `pair` (here, and in a pair into the peer's slot too); then the mask entries (0 or −∞) of
        all the warp's keys, lane j for key j.  simple: the rows are the e4m3 values themselves
        (exact in bf16) and the token's scale goes to `s_kscale` — the MMA warpgroups apply it to
        S's and P's columns in fp32."""
        lc, group, kpw = self.LANE_COLS, self.GROUP, self.keys_per_warp
        per8 = 8 // self.plan.producer_warps  # keys of a warp in one 8-key row group of the swizzle atom
        for kg in cutlass.range_constexpr(kpw // group):
            raw = cute.make_rmem_tensor((8, group), cutlass.Int32)  # per key: 16 B of e4m3 (or 32 B of rope)
            expo = cute.make_rmem_tensor(group, cutlass.Int32)  # the e8m0 byte of each key's piece
            for g in cutlass.range_constexpr(group):  # an invalid key's staged bytes are zeros: no branch
                j = rank * kpw + kg * group + g
                expo[g] = self.read_piece(self.raw_key(s_raw, rslot, pwarp + self.plan.producer_warps * j), lane, raw[None, g])
            fits = one_multiply_fits(expo[0])
            for g in cutlass.range_constexpr(1, group):
                fits = fits & one_multiply_fits(expo[g])
            one_multiply = cute.arch.vote_all_sync(fits)  # every lane, before any lane-dependent branch
            for g in cutlass.range_constexpr(group):
                jj = kg * group + g
                vals = cute.make_rmem_tensor(lc, cutlass.BFloat16)
                self.convert_piece(raw[None, g], expo[g], lane, vals, one_multiply)
                words = cute.recast_tensor(vals, cutlass.Int32)
                # key pwarp + producer_warps·j, j = rank·kpw + jj: row group j // per8, entry j mod per8
                # of piece_rows — kpw is a multiple of per8 (__init__), so the entry is static
                rows_at = (rank * (kpw // per8) + jj // per8) * self.key8_bytes + state.index * (self.BLOCK_N * D * 2)
                for h in cutlass.range_constexpr(lc // 8):  # 8 bf16 = one 16-byte piece of a swizzled row
                    at = k_rows[2 * (jj % per8) + h] + rows_at
                    pair.store16(at, cute.make_tensor(words.iterator + 4 * h, cute.make_layout(4)), state)
        if lane < self.BLOCK_N // self.plan.producer_warps:
            key = pwarp + self.plan.producer_warps * lane
            s_mask[key, state.index] = cutlass.Float32(0.0) if mine != -1 else -cutlass.Float32.inf
            if cutlass.const_expr(self.fmt == "simple"):
                kscale = cutlass.Float32(0.0)
                if mine != -1:
                    kscale = lds_f32(self.raw_key(s_raw, rslot, key) + self.RAW_SCALES)
                s_kscale[key, state.index] = kscale

    @cute.jit
    def key_index(self, cache, got, pos, length, topk: cutlass.Constexpr[int], block_size: cutlass.Constexpr[int]):
        """The cache index of list position `pos` (its idx entry `got`, read clamped into the list,
        so a padded tail position never reads past it), or −1 when the key is invalid: pos ≥ the
        list's length (min(topk, topk_length[b])) or the entry is −1."""
        out = cutlass.Int32(-1)
        if pos < length:
            out = got
        return out

    @cute.jit
    def read_piece(self, src, lane, raw) -> cutlass.Int32:
        """raw (8 Int32) ← this lane's staged bytes of one key (16, or model1's rope lanes 32);
        returns their scale's e8m0 byte (127, a scale of 1, for the rope and for simple)."""
        e = cutlass.Int32(127)
        if cutlass.const_expr(self.fmt == "model1"):
            if lane < 28:
                lds16(src + lane * 16, raw, 0)
                e = self.staged_scale(src, lane)
            else:
                lds16(src + 448 + (lane - 28) * 32, raw, 0)
                lds16(src + 464 + (lane - 28) * 32, raw, 4)
        else:
            lds16(src + lane * 16, raw, 0)
            e = self.staged_scale(src, lane)
        return e

    @cute.jit
    def staged_scale(self, src, lane) -> cutlass.Int32:
        """The e8m0 scale byte of this lane's 16 columns, from the key's staged scale bytes:
        model1 — byte lane // 4 (one per 64 columns); v4.1 — byte lane // 2 (one per 32); simple
        — 127, a scale of 1 (its fp32 scale is the MMA warpgroups' column factor, see
        dequant_tile).  Masked: a Uint8 loads sign-extended."""
        at = src + self.RAW_SCALES
        e = cutlass.Int32(127)
        if cutlass.const_expr(self.fmt == "model1"):
            e = lds_u8(at + lane // 4) & 0xFF
        elif cutlass.const_expr(self.fmt == "v4.1"):
            e = lds_u8(at + lane // 2) & 0xFF
        return e

    @cute.jit
    def convert_piece(self, raw, e, lane, vals, one_multiply):
        """vals (16 bf16) ← raw: 16 e4m3 × 2^(e − 127) by bit moves and two exact bf16x2
        multiplies (stages/common/e4m3_bits.py; one when the warp's vote `one_multiply` says every
        lane's scale allows it), or model1's rope as it is; simple's e4m3 unscaled (e = 127; its
        scale is a column factor of S and P, see dequant_tile)."""
        if cutlass.const_expr(self.fmt == "model1"):
            if lane < 28:
                e4m3x16_to_bf16(raw, e, vals, one_multiply)
            else:
                vals.store(cute.recast_tensor(raw, cutlass.BFloat16).load())
        elif cutlass.const_expr(self.fmt == "simple"):
            e4m3x16_to_bf16(raw, e, vals, True)  # e = 127
        else:
            e4m3x16_to_bf16(raw, e, vals, one_multiply)

    # -----------------------------------------------------------------------------------------
    # MMA warpgroups (stage D2's, plus the key mask and the sink)

    @cute.jit
    def attend(self, work, tidx, q_pipe, kv_pipe, pair, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row, s_mask, s_kscale,
               sink, mO, mLSE, mOp, mLp):
        bm, bn = self.BLOCK_M, self.BLOCK_N
        wg = tidx // 128
        tid_wg = tidx % 128
        mma_threads = self.MMA_THREADS

        thr_qk = qk_mma.get_slice(tid_wg)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))
        s_shape = thr_qk.partition_shape_C((bm, bn))
        tScS_rc = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((bm, bn))))
        p_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), sP.element_type), qk_mma
        )
        thr_p_store = p_store.get_slice(tid_wg)
        tPsP = thr_p_store.partition_D(sP)
        expose(self, p_store=(p_store, qk_mma, (bm, bn), (bm, bn)))

        thr_pv = pv_mma.get_slice(tidx)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(sP))
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sVt))
        o_shape = thr_pv.partition_shape_C((bm, D))
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, D))))
        tOgO = self.o_destination(work, thr_pv, mO, mOp)
        acc_o = cute.make_rmem_tensor(o_shape, cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_rc = acc_rows_cols(acc_o)

        num_rows = cute.size(tScS_rc, mode=[0])
        num_cols = cute.size(tScS_rc, mode=[1])
        softmax = OnlineSoftmax.create(num_rows, self.scale_log2)

        kv_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.KV_STAGES)
        if wg == 0:
            q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        for i in cutlass.range(work.tile_end - work.tile_begin, unroll=1):
            kv_pipe.consumer_wait(kv_cons)
            pair.consumer_wait(kv_cons)
            if wg == 0:
                acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=kv_cons.index, zero_init=True)
                s_rc = acc_rows_cols(acc_s)
                for r in cutlass.range_constexpr(num_rows):
                    for j in cutlass.range_constexpr(num_cols):
                        key = tScS_rc[r, j][1]
                        if cutlass.const_expr(self.fmt == "simple"):  # S = (Q·K_e4m3ᵀ) · the key's scale
                            s_rc[r, j] = s_rc[r, j] * s_kscale[key, kv_cons.index]
                        s_rc[r, j] = s_rc[r, j] + s_mask[key, kv_cons.index]  # −∞ for an invalid key
                alpha = softmax.update(s_rc)
                if cutlass.const_expr(self.fmt == "simple"):  # P·V = (P · the key's scale)·V_e4m3; ℓ keeps P
                    for r in cutlass.range_constexpr(num_rows):
                        for j in cutlass.range_constexpr(num_cols):
                            s_rc[r, j] = s_rc[r, j] * s_kscale[tScS_rc[r, j][1], kv_cons.index]
                r_p = cute.make_rmem_tensor(s_shape, sP.element_type)
                r_p.store(acc_s.load().to(sP.element_type))
                if i > 0:
                    cute.arch.barrier(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)
                cute.copy(p_store, thr_p_store.retile(r_p), tPsP)
                for r in cutlass.range_constexpr(num_rows):
                    if tScS_rc[r, 0][1] == 0:
                        s_row[tScS_rc[r, 0][0]] = alpha[r]
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=int(NamedBarrier.P_FULL), number_of_threads=mma_threads)
            for r in cutlass.range_constexpr(num_rows):
                scale_rows(acc_o_rc, r, s_row[tOcO_rc[r, 0][0]])
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=kv_cons.index)
            kv_pipe.consumer_release(kv_cons)
            pair.consumer_release(kv_cons, tidx % 32)
            kv_cons.advance()
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)

        if wg == 0:
            cute.arch.barrier(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)
            inv_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            lse = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            softmax.finalize(inv_sum, lse)
            for r in cutlass.range_constexpr(num_rows):
                row = tScS_rc[r, 0][0]
                if tScS_rc[r, 0][1] == 0:
                    factor = inv_sum[r]
                    if cutlass.const_expr(self.splits == 1):  # one split: the sink here
                        factor = factor * sink_factor(sink[work.head_block * bm + row], lse[r])
                    s_row[row] = factor
                    self.store_lse(work, row, lse[r], mLSE, mLp)
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=mma_threads)
        for r in cutlass.range_constexpr(num_rows):
            scale_rows(acc_o_rc, r, s_row[tOcO_rc[r, 0][0]])
        self.store_o(acc_o, tOgO)

    @cute.jit
    def store_lse(self, work, row, lse, mLSE, mLp):
        if cutlass.const_expr(self.splits == 1):
            mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(lse)
        else:
            mLp[self.sched.partial_row_block(work) * self.BLOCK_M + row] = lse

    @cute.jit
    def o_destination(self, work, thr_pv, mO, mOp):
        bm = self.BLOCK_M
        if cutlass.const_expr(self.splits == 1):
            return thr_pv.partition_C(cute.local_tile(mO, (bm, D), (self.sched.row_block(work), 0)))
        return thr_pv.partition_C(cute.local_tile(mOp, (bm, D), (self.sched.partial_row_block(work), 0)))

    @cute.jit
    def store_o(self, acc_o, tOgO):
        out = cute.make_rmem_tensor(tOgO.shape, tOgO.element_type)
        out.store(acc_o.load().to(tOgO.element_type))
        cute.autovec_copy(out, tOgO)

    @cute.jit
    def write_empty_split(self, work, tidx, mOp, mLp):
        """A split with no KV tile: partial O = 0 and LSE = −∞ (the combine ignores it)."""
        if cutlass.const_expr(self.splits > 1):
            bm = self.BLOCK_M
            block = cute.local_tile(mOp, (bm, D), (self.sched.partial_row_block(work), 0))
            for k in cutlass.range_constexpr(bm * D // self.MMA_THREADS):
                e = k * self.MMA_THREADS + tidx
                block[e // D, e % D] = cutlass.Float32(0.0)
            if tidx < bm:
                mLp[self.sched.partial_row_block(work) * bm + tidx] = -cutlass.Float32.inf


def swizzle_bytes(off, bits: int, base: int, shift: int):
    """A shared-memory swizzle S<bits, base, shift> applied to a BYTE offset (as the swizzle of
    a swizzled pointer acts): the `bits` bits above base + shift are XORed into the ones above
    base.  SW128 is S<3,4,3>: the 16-byte piece (bits 4 … 6) of a 128-byte row is permuted by
    the row's index mod 8 (bits 7 … 9).  Plain ints or traced Int32s."""
    return off ^ ((off & (((1 << bits) - 1) << (base + shift))) >> shift)


def slot_offset(k_smem, key, col, slot):
    """The byte offset of K[key, col] of `slot` from the slots' base: the K-major layout's
    offset in bf16 elements, × 2, swizzled (ints at trace time, traced Int32s in the kernel).  A ComposedLayout evaluated as a function would apply
    its swizzle to the ELEMENT offset — wrong for a swizzle that lives in the pointer (bytes)."""
    sw = k_smem.inner
    return swizzle_bytes(k_smem.outer((key, col, slot)) * 2, sw.num_bits, sw.num_base, sw.num_shift)


def _token_block(base, index, block_size: int, block_bytes: int):
    """(byte address of token `index`'s page block, its offset in the block) — 64-bit."""
    return base + cutlass.Int64(index // block_size) * block_bytes, cutlass.Int64(index % block_size)


@cute.jit
def _idx_offset(idx, work, pos):
    """The byte offset of idx[batch, token, pos] (int32 entries, the tensor's own strides)."""
    return (work.batch * idx.stride[0] + work.token * idx.stride[1] + pos * idx.stride[2]) * 4
