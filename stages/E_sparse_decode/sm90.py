"""Stage E on Hopper (sm_90a): DSV4 decode attention over an FP8 paged cache — sparse indices,
two branches under one softmax, attention sink, persistent parts.

Math (oracles/sparse_decode.py): per query row (batch, token, head), over the valid keys of the
main list (idx, topk_length) and the extra/SWA list (idx_extra, extra_length) together,
    O = softmax(Q·Kᵀ · scale) · V · 1/(1 + exp(sink[h] − lse)),   LSE = ln Σ exp(Q·Kᵀ · scale),
K = V = the dequantised cache rows, scale = softmax_scale[0] (a runtime fp32 input; the MMA
warpgroups fold log2 e into it once, `softmax_scale_log2`); a row with no valid key: O = 0,
LSE = +∞.

Shared with D2–D5 (stages/common): heads fold into M, 64 heads of one token per CTA; K and Vᵀ
views of one shared-memory slot (sm90_kv_slots.kv_layouts, no-swizzle atoms); P to warpgroup 1
through shared memory (sm90_smem_p.SmemP, unaligned_barriers); setmaxnreg plans
(sm90_registers); the sink and LSE combine (combine, part_combine); barrier ids from
barriers.NamedBarrier.  docs/STAGE_E.md: formats, ablations, timelines, what was tried.

New in this rung
    Persistent parts (part_scheduler.py).  A CTA (a cluster pair at h_q 128) runs its part's
        segments without ending (the KV ring goes on; warpgroup 0 loads the next segment's Q
        during the last tile's P·V).  A whole sequence writes O and LSE; one cut in two is merged
        here (part_merge.py), one of more pieces by part_combine.py.
    The key list.  A CTA walks 64-key tiles of ONE list: the main list padded to whole tiles,
        then the extra list (`tile < main_tiles` picks the branch).  Key k of a tile is list
        position p = 64 · tile' + k; valid iff p < topk, p < length[b] and idx[b, t, p] ≠ −1.
        An invalid key is never loaded (its idx may be INT_MAX): its row is written as zeros
        and its score set to −∞ (a per-slot mask in shared memory).  A segment's idx entries
        are staged in shared memory at its start (stage_entries); a segment longer than 32
        tiles (topk up to 32768) streams them through two windows of 16 tiles, window w + 1
        copied in by cp.async while w is judged (idx_windows.py).
    Gather into registers (Hopper's TMA cannot gather rows).  A key belongs to 4 producer
        threads of one warp (lane mod 8 the key, q = lane // 8 the piece): thread q loads
        bytes 64·p + 16·q of each 16-byte data piece p and the scale words, by predicated
        read-only loads (sm90_gather.py: an invalid key's loads yield zeros, no branch).  The
        next unit's loads (a tile in a pair, half a tile alone) are in flight while this one is
        dequantised (two register buffers alone, one in a pair: 152 registers).
    Dequantise on the CUDA cores into one of two 64-key bf16 slots while the MMA warpgroups use
        the other: e4m3 → bf16 by bit moves and an exact multiply by the piece's power-of-two
        scale (e4m3_bits.py; one multiply when a warp's vote finds every scale ≤ 2^7), two
        16-byte stores a piece at addresses precomputed per thread (piece_addresses; no-swizzle
        8 × 8 atoms, so one store instruction's 8 keys fill 128 contiguous bytes).  Scales:
        model1 — e8m0 byte p of 7 (the rope copied as it is); v4.1 — e8m0 byte 2·p + q // 2 of
        16; simple — unscaled e4m3, the token's fp32 scale to `s_kscale`, applied by the MMA
        warpgroups to S's column and P's (after ℓ has summed P); nvfp4 — dequant_nvfp4.  The
        writes are fenced (fence.proxy.async) before the slot's PipelineAsync arrive (every
        producer thread arrives, one lane of each MMA warp releases).
    Two CTAs share every tile (h_q a multiple of 128): a (2, 1, 1) cluster of the token's two
        head blocks, each dequantising half of every tile into both CTAs' slots
        (cluster_pair.py) and writing both halves' mask entries.
    Sink.  A whole sequence: folded into the epilogue's 1/ℓ; a cut one: applied once by the
        merge (piece 0 or PartCombine).

Warp roles (384 threads; the WarpPlan's registers, checked by `register_plan`)
    warpgroup 2   producer: gathers and dequantises its keys of each KV tile   (setmaxnreg.dec 152)
    warpgroup 0   S = Q·K_tileᵀ (m64n64), mask, online softmax with the conditional rescale
                  (lazy_softmax.py: a row keeps its max until it has grown by 2^8, so most
                  tiles' α is 1 and the O rescale is skipped), P → shared memory, α per row;
                  its half of O += P·V with P from registers (an RS wgmma,
                  check_accumulator_is_a_operand); its warp 0 loads each segment's Q (TMA)
                                                                                (setmaxnreg.inc 192)
    warpgroup 1   its half of O += P·V, P from shared memory (O's 512 columns split over the
                  two MMA warpgroups, m64n256 wgmmas)                           (setmaxnreg.dec 160)
    Each MMA warpgroup traces its own copy of `attend` (ptxas allocates each its own count).
    The epilogue stores O by 16-byte stores, each thread's bf16 words transposed across its
    quad (quad_store.py).

Limits: d = 512; h_q a multiple of 64; static shapes; block sizes and formats of
oracles/kvcache.py; topk and extra_topk ≤ 32768 each (MAX_TOPK: 8 KiB of idx entries in shared
memory at most); the in-kernel merge assumes the grid is resident at once when it has at most
`sm_count` CTAs (device.py); a larger grid is merged by PartCombine.  What bounds it and the
small-batch options of __init__: docs/STAGE_E.md."""

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from stages.common import hang_guard
from stages.common.barriers import NamedBarrier
from stages.common.cluster_pair import TilePair
from stages.common.combine import sink_factor
from stages.common.e2m1_bits import e2m1x8_to_bf16, e2m1x8_to_bf16_table, scale_factors, scale_select, scales_fit
from stages.common.e4m3_bits import e4m3x16_to_bf16, one_multiply_fits
from stages.common.fp8_epilogue import Fp8Out, store_accumulator_fp8
from stages.common.fp8_cache import (D, D_NOPE, D_ROPE, MODEL1_ROW_BYTES, MODEL1_SCALE_BYTES, NVFP4_NOPE_BYTES,
                                     NVFP4_ROW_BYTES, NVFP4_SCALE_BYTES, V41_ROW_BYTES, cache_block_bytes)
from stages.common.idx_windows import (WINDOW_TILES, boundary, commit_copies, copy4_async_if, entry, staged_bytes,
                                       staged_tiles, streams, wait_copies, window_slot, window_tile)
from stages.common.inspection import expose
from stages.common.part_combine import GROUP as COMBINE_GROUP, PartCombine
from stages.common.part_merge import (ZeroFlags, add_staged_rows, flag_address, load_l2, merge_factors,
                                      merges_in_kernel, raise_flag, stage_partial, wait_flag)
from stages.common.part_scheduler import PartGrid, resolve_part_tiles
from stages.common.quad_store import check_accumulator_layout, store_accumulator_pairs, store_accumulator_wide
from stages.common.sparse_config import MAX_TOPK, SparseConfig
from stages.common.stamps import RECORD_BYTES, stamp
from stages.common.sm90_gather import ldg_or
from stages.common.sm90_smem_p import SmemP
from stages.common.sm90_kv_slots import kv_layouts, piece_strides, ring_state, slot_offset
from stages.common.sm90_registers import register_plan, set_registers
from stages.common.sm90_idioms import (acc_rows_cols, accumulator_to_a_operand, check_accumulator_is_a_operand, check_rows_shared,
                                       wgmma_sync)
from stages.common.unaligned_barriers import named_arrive, named_sync
from stages.common.lazy_softmax import LazyOnlineSoftmax, needs_rescale
from stages.common.softmax import final_lse, runtime_scale_log2, scale_rows
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile
from stages.common.device import SMEM_LIMIT, sm_count as device_sm_count

_GRID_Y = 65535  # a launch grid's y extent at most (the parts run along it)


class AttendSmem(NamedTuple):
    """The shared-memory views the MMA warpgroups read and write."""

    sQ: cute.Tensor  # (64, D, 1) Q of the segment
    sK: cute.Tensor  # (BLOCK_N, D, slots) the dequantised keys
    sVt: cute.Tensor  # (D, BLOCK_N, slots): K's bytes as Vᵀ
    sP: cute.Tensor  # (64, BLOCK_N) P for warpgroup 1
    s_row: cute.Tensor  # α of a tile (SmemP's row factors)
    s_fin: cute.Tensor  # a segment's 1/ℓ (· the sink's factor), or piece 0's factor on its own O
    s_mrg: cute.Tensor  # a merge's factor on the partial it reads
    s_mask: cute.Tensor  # (BLOCK_N, slots) 0 or −∞ per key
    s_kscale: cute.Tensor  # (BLOCK_N, slots) simple: the token's scale


class AttendIO(NamedTuple):
    """What an MMA warpgroup's `attend` works with: Q's barrier, TMA atom and view; the KV ring's
        pipeline and the pair's barriers; the slots' base address (a merge stages piece 1's partial
        there); the shared-memory views; the sink and the outputs."""

    q_bar: object
    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    kv_pipe: object
    pair: TilePair
    k_base: object
    smem: AttendSmem
    sink: cute.Tensor
    mO: cute.Tensor
    mLSE: cute.Tensor
    mOp: cute.Tensor
    mLp: cute.Tensor
    softmax_scale: cute.Tensor  # [1] fp32: the scale on Q·Kᵀ
    marks: object = None  # a diagnostic build's stamp record (Kernel.mark); None otherwise
    fp8: object = None  # epilogue fp8_rope: where O leaves (stages/common/fp8_epilogue.py Fp8Out); None for bf16


class MmaTiles(NamedTuple):
    """An MMA warpgroup's tiled MMAs and its partitions of the operands (Kernel.mma_tiles)."""

    qk_mma: cute.TiledMma
    pv_mma: cute.TiledMma
    thr_pv: object  # the P·V MMA's slice of this thread
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    s_shape: object
    tScS_rc: cute.Tensor  # (row, key) of S's accumulator, as (rows, columns)
    tOrP: object  # warpgroup 1: the shared P as the A operand; None for warpgroup 0
    tOrV: cute.Tensor
    o_shape: object
    tOcO_rc: cute.Tensor  # (row, col) of O's accumulator, as (rows, columns)


@dataclass(frozen=True)
class WarpPlan:
    """The warps of a CTA: `producer_warps` after the two MMA warpgroups, the setmaxnreg registers
        of warpgroup 0, warpgroup 1 and the producer, and `pv_n`, the O columns of one P·V wgmma
        (ptxas checks each against the launch cap 65 536 / threads; m64n256 is 128 registers)."""

    producer_warps: int
    mma_regs: tuple[int, int]
    producer_regs: int
    pv_n: int

    @property
    def producer_threads(self) -> int:
        return 32 * self.producer_warps

    @property
    def threads(self) -> int:
        return 128 * Kernel.NUM_MMA_WG + self.producer_threads

    @property
    def registers(self) -> list[tuple[int, int]]:
        """The setmaxnreg plan, as register_plan reads it."""
        return [(128, self.mma_regs[0]), (128, self.mma_regs[1]), (self.producer_threads, self.producer_regs)]


class Kernel:
    """FP8 paged sparse decode on Hopper: CUDA-core gather + dequantise into bf16 tiles, two
    wgmma warpgroups with the online softmax, sink, split-KV (see the module doc)."""

    BLOCK_M = 64
    BLOCK_N = 64  # keys per tile: two bf16 slots (the dequantisation of one overlaps the MMAs of the other)
    NUM_MMA_WG = 2
    MMA_THREADS = 128 * NUM_MMA_WG
    PRODUCER_WG = 2  # the first producer warpgroup (after the MMA warpgroups)
    # The warp plan (docs/STAGE_E.md), alone or in a cluster pair: a producer thread loads
    # PIECES 16-byte pieces a key into registers; a pair's CTA dequantises 32 keys a tile (one
    # round of 4 warps), a CTA alone 64 (two rounds).
    PLAN = WarpPlan(producer_warps=4, mma_regs=(192, 160), producer_regs=152, pv_n=256)
    KV_STAGES = 2
    # 16-byte pieces of a key a producer thread (one of 4 a key) loads: the e4m3 data pieces, 64
    # columns each, and model1's bf16 rope (128 bytes: 2 a thread) after them
    # nvfp4 (dequant_nvfp4): 3 16-byte pieces of e2m1 (32 columns a thread each), then
    # NVFP4_TAIL: 8 bytes (the last 64 columns, 16 a thread; words 0, 1 of its piece), the 2
    # rope pieces, and one piece of the 4 scale words the thread's groups are in (of the 8)
    NVFP4_TAIL = NVFP4_NOPE_BYTES // 64  # 3: the tail piece (e2m1 bytes 3·64 … 3·64 + 31)
    DATA_PIECES = {"model1": D_NOPE // 64, "v4.1": D // 64, "simple": D // 64, "nvfp4": NVFP4_NOPE_BYTES // 64}
    ROPE_PIECES = {"model1": 2 * D_ROPE // 64, "v4.1": 0, "simple": 0, "nvfp4": 2 * D_ROPE // 64}
    PIECES = {"model1": D_NOPE // 64 + 2 * D_ROPE // 64, "v4.1": D // 64, "simple": D // 64,
              "nvfp4": NVFP4_NOPE_BYTES // 64 + 1 + 2 * D_ROPE // 64 + 1}  # 9, 8, 8, 7
    ROW_BYTES = {"model1": MODEL1_ROW_BYTES, "v4.1": V41_ROW_BYTES, "simple": D,
                 "nvfp4": NVFP4_ROW_BYTES}  # a token's row in its block (model1's, nvfp4's scales apart)

    def __init__(self, *, b: int, config: str, kv_format: str, splits, epilogue: str = "bf16",
                 sm_count: int | None = None, combine_group: int = COMBINE_GROUP, stamps: bool = False,
                 pair_stores: bool = True, fast_combine: bool = True, sink_first: bool = True,
                 e2m1_table: bool | None = None):
        # epilogue: bf16 (O) or fp8_rope — O's rope lanes inverse-rotated and O written as e4m3
        # with a UE8M0 exponent a 128 values (stages/common/fp8_epilogue.py), wherever a whole
        # sequence's O leaves: this kernel's epilogue, its in-kernel merge, PartCombine
        # Small-batch options (docs/STAGE_E.md "The timeline at b = 2"), switched by
        # scripts/e_small_timeline.py; the defaults are the build the lab runs:
        #   fast_combine   PartCombine's CTAs only for cut sequences, its loads in groups
        #   sink_first     the sinks loaded before the first S, not in the epilogue
        #   pair_stores    a partial's fp32 by 8-byte stores, no quad transpose
        #   combine_group  PartCombine's slots a load group (with fast_combine)
        #   stamps         a diagnostic build (stages/common/stamps.py): each CTA writes the times
        #                  its roles pass named points (`mark`) over O; PartCombine not launched
        # Timed slower and dropped: docs/STAGE_E.md.
        self.combine_group, self.stamps, self.pair_stores = combine_group, stamps, pair_stores
        self.fast_combine, self.sink_first = fast_combine, sink_first
        if epilogue not in ("bf16", "fp8_rope"):
            raise ValueError(f"stage E sm90: epilogue must be bf16 or fp8_rope, got {epilogue!r}")
        self.epilogue = epilogue
        self.fp8 = epilogue == "fp8_rope"
        if self.fp8 and stamps:
            raise ValueError("stage E sm90: a stamps build writes its records over O: bf16 epilogue only")
        # the SMs the parts fill and the merge's residency is judged against: the GPU's here
        # (stages/common/device.py; compile-only on a CPU: sm_90a's 132); a kernel built for one
        # count is keyed by it in the compile cache
        self.sm_count = device_sm_count("sm_90a") if sm_count is None else sm_count
        if self.sm_count < 1:
            raise ValueError(f"stage E sm90: sm_count must be positive, got {self.sm_count}")
        sm_count = self.sm_count
        c = SparseConfig.parse(config)
        if c.h_q % self.BLOCK_M:
            raise ValueError(f"stage E sm90: h_q must be a multiple of {self.BLOCK_M}, got {c.h_q}")
        if max(c.topk, c.extra_topk) > MAX_TOPK:
            raise ValueError(f"stage E sm90: topk {c.topk} / extra_topk {c.extra_topk}: at most {MAX_TOPK} a list "
                             f"(FlashMLA's largest)")
        self.fmt = kv_format
        self.block_bytes = cache_block_bytes(kv_format, c.block)
        self.extra_block_bytes = cache_block_bytes(kv_format, c.extra_block if c.has_extra else 1)
        self.b, self.c = b, c
        self.main_tiles = -(-c.topk // self.BLOCK_N)
        self.extra_tiles = -(-c.extra_topk // self.BLOCK_N) if c.has_extra else 0
        num_tiles = self.main_tiles + self.extra_tiles
        head_blocks = c.h_q // self.BLOCK_M
        # Two head blocks of one token walk the same keys: a (2, 1, 1) cluster of them shares
        # every dequantised tile (stages/common/cluster_pair.py); each CTA dequantises half.
        self.pair = head_blocks % 2 == 0
        # nvfp4's e2m1 → bf16 (stages/common/e2m1_bits.py): the 16-entry table where a CTA is alone
        # (faster there: docs/STAGE_E.md), the bit moves in the pair (the table's words spill there)
        # the bit moves in the 2-CTA pair (the table's 4 words spill 96 bytes there; not yet timed)
        self.e2m1_table = (not self.pair) if e2m1_table is None else e2m1_table
        self.plan = self.PLAN
        self.own_keys = self.BLOCK_N // 2 if self.pair else self.BLOCK_N  # keys a CTA dequantises a tile
        self.sides = 2 if self.pair else 1  # whose keys' masks a CTA writes: its own, the peer's
        self.keys_per_round = self.plan.producer_threads // 4  # 4 threads a key, 8 keys a warp
        if self.own_keys % self.keys_per_round:
            raise ValueError(f"stage E sm90: {self.plan.producer_warps} producer warps take {self.keys_per_round} "
                             f"keys a round, which must divide the {self.own_keys} a CTA dequantises")
        self.rounds = self.own_keys // self.keys_per_round
        self.peer_bytes = self.own_keys * D * 2  # the bf16 bytes the peer writes into a slot
        # persistent parts (stages/common/part_scheduler.py): a CTA walks L tiles of the
        # flattened (sequence, tile) work; a sequence a part boundary cuts leaves partials
        part_tiles = resolve_part_tiles(splits, head_blocks=head_blocks, tokens=c.s_q, batches=b,
                                        num_tiles=num_tiles, sm_count=sm_count)
        self.sched = PartGrid(head_blocks, c.s_q, b, num_tiles, part_tiles)
        if self.sched.parts > _GRID_Y:
            raise ValueError(f"stage E sm90: {self.sched.parts} parts of {part_tiles} tiles exceed the launch grid's "
                             f"{_GRID_Y} rows (grid.y); use fewer splits (auto, or an int)")
        self.splits = self.sched.capacity  # partial slots a sequence may fill (1: nothing is combined)
        self.partials = self.splits > 1
        # a sequence cut in two is merged by its piece 0 (stages/common/part_merge.py); PartCombine
        # is launched only for sequences of more pieces
        self.merges = merges_in_kernel(self.sched, sm_count)
        self.combines = self.partials and (self.splits > 2 or not self.merges)
        if self.merges and 2 * self.KV_STAGES * self.BLOCK_N * D < self.BLOCK_M * D * 4:
            raise ValueError("stage E sm90: a merge stages piece 1's fp32 partial block in the KV slots, which are smaller")
        self.rows = b * c.s_q * c.h_q
        why = register_plan(self.plan.threads, self.plan.registers)
        if why is not None:
            raise ValueError(f"stage E sm90: {why}")
        # a segment's idx entries: staged whole where it is at most 2 windows long, else streamed
        # through two windows of WINDOW_TILES tiles (stages/common/idx_windows.py)
        self.streams = streams(self.sched.chunk)
        self.staged_tiles = staged_tiles(self.sched.chunk)
        smem = self.smem_bytes
        if smem > SMEM_LIMIT:
            raise ValueError(f"stage E sm90: {smem} bytes of shared memory needed, {SMEM_LIMIT} available")

    @property
    def smem_bytes(self) -> int:
        """Upper bound of the Smem struct: Q, KV slots, P (bf16), the staged idx entries (a segment's
                or two windows), the row factors, and 4 KiB for barriers, masks, scales, alignment."""
        return (2 * (self.BLOCK_M * D + self.KV_STAGES * self.BLOCK_N * D + self.BLOCK_M * self.BLOCK_N)
                + staged_bytes(self.sched.chunk, self.BLOCK_N) + 4 * self.BLOCK_M + 4096)

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
        softmax_scale: cute.Tensor,
        cos_sin_cache: cute.Tensor,
        positions: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        O_fp8: cute.Tensor,
        O_scale: cute.Tensor,
        O_part: cute.Tensor,
        LSE_part: cute.Tensor,
        stream: cuda.CUstream,
    ):
        c, bm, bn = self.c, self.BLOCK_M, self.BLOCK_N
        dtype = Q.element_type
        self._check_tensors(Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part, softmax_scale)
        self._check_fp8_tensors(cos_sin_cache, positions, O_fp8, O_scale)
        rows = self.rows

        mQ = cute.make_tensor(Q.iterator, cute.make_layout((rows, D), stride=(D, 1)))
        mO = cute.make_tensor(O.iterator, cute.make_layout((rows, D), stride=(D, 1)))
        mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((c.h_q, c.s_q, self.b), stride=(c.s_q, 1, c.h_q * c.s_q)))
        cap = O_part.shape[0]
        mOp = cute.make_tensor(O_part.iterator, cute.make_layout((cap * rows, D), stride=(D, 1)))
        mLp = cute.make_tensor(LSE_part.iterator, cute.make_layout(cap * rows))

        qk_mma, pv_mma = self.tiled_mmas(dtype)
        # O's wide stores (store_block) rely on the accumulator's layout: one warp of each
        # warpgroup and a lane of every other warp
        check_accumulator_layout(pv_mma, (bm, D), list(range(32)) + [45, 77, 109] + list(range(128, 160)) + [205, 237],
                                 D // self.NUM_MMA_WG)
        # warpgroup 0's P is S's registers converted (an RS wgmma) and α scales O's rows in registers
        reg_p_mmas = self.tiled_mmas(dtype, p_in_registers=True)
        check_accumulator_is_a_operand(*reg_p_mmas, (bm, bn))
        check_rows_shared(*reg_p_mmas, (bm, bn), D)
        q_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, bn, D), dtype, 1)
        # no-swizzle slots: one store instruction of 8 keys fills 128 contiguous bytes, here and in
        # the peer (with a 128-byte swizzle the peer's pieces scatter over 8 rows, slower); the
        # dequantisers step by 8 keys and 64 columns (piece_strides)
        k_smem, vt_smem = kv_layouts(dtype, D, bn, self.KV_STAGES, D // self.NUM_MMA_WG, swizzled=False)
        self.key8_bytes, self.col64_bytes = piece_strides(k_smem, bn, D, self.KV_STAGES)
        if self.fmt == "nvfp4":  # dequant_nvfp4 steps 8 columns by col64 / 8 inside its 128-column pieces
            _check_even_columns(k_smem, self.col64_bytes)
        p_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, D, bn), dtype, 1)
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
            final_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]
            merge_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]
            key_mask: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bn * self.KV_STAGES], 16]
            key_scale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bn * self.KV_STAGES], 16]
            idx_stage: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.staged_tiles * bn], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(p_smem)], 1024]

        self.smem_struct = Smem
        cluster = {"cluster": (2, 1, 1)} if self.pair else {}
        if cutlass.const_expr(self.merges):
            ZeroFlags(self.sched, bm).launch(mLp, stream)  # the attention kernel waits for it at its flags
        self.kernel(
            tma_q, tma_Q, KV, idx, topk_length, KV_extra, idx_extra, extra_length, sink, softmax_scale,
            mO, mLSE, mOp, mLp, q_smem, k_smem, vt_smem, p_smem,
            *((O_fp8, O_scale, cos_sin_cache, positions) if self.fp8 else (None,) * 4),  # bf16: no parameters
        ).launch(grid=self.sched.grid, block=(self.plan.threads, 1, 1), smem=Smem.size_in_bytes(), stream=stream,
                 use_pdl=self.merges, **cluster)

        if cutlass.const_expr(self.combines and not self.stamps):
            PartCombine(self.sched, c.h_q, D, skip_two=self.merges, fast=self.fast_combine,
                        group=self.combine_group, fp8=self.fp8).launch(
                mOp, mLp, mO, mLSE, sink, stream, fp8_args=(O_fp8, O_scale, cos_sin_cache, positions, self.rope_sin_sign()))

    def tiled_mmas(self, dtype, p_in_registers: bool = False):
        """S = Q·Kᵀ (m64 × BLOCK_N, one warpgroup) and O += P·V (O's columns over the two MMA
                warpgroups, pv_n a wgmma; P from warpgroup 0's registers or shared memory).  Made
                afresh in each warpgroup's trace of `attend`: a tiled MMA caches its first trace."""
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (1, 1, 1), tiler_mn=(self.BLOCK_M, self.BLOCK_N),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, cutlass.Float32,
            (1, self.NUM_MMA_WG, 1), tiler_mn=(self.BLOCK_M, self.plan.pv_n),
            a_source=warpgroup.OperandSource.RMEM if p_in_registers else warpgroup.OperandSource.SMEM,
        )
        return qk_mma, pv_mma

    def rope_sin_sign(self) -> float:
        """The sign on every sin of the epilogue's inverse rotation (1: the conjugate rotation,
        oracles/fp8_epilogue.py) — a hook, so a test fixture can plant a bug here."""
        return 1.0

    def _check_fp8_tensors(self, cos_sin_cache, positions, O_fp8, O_scale) -> None:
        """Trace time, epilogue fp8_rope: O_fp8 e4m3 [h_q/8, b·s_q, 8, 512] and O_scale int32
                [h_q/8, 8, align4(b·s_q)] (float32 words), cos_sin_cache [max_position, 64], positions
                [b·s_q] (oracles/fp8_epilogue.py)."""
        c, n = self.c, self.b * self.c.s_q
        if tuple(positions.shape) != (n,):
            raise ValueError(f"stage E sm90: positions has shape {tuple(positions.shape)}, the case needs {(n,)}")
        if not self.fp8:
            return
        want = {"O_fp8": (O_fp8, (c.h_q // 8, n, 8, D // 4)), "O_scale": (O_scale, (c.h_q // 8, 8, -(-n // 4) * 4))}
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape or t.element_type.width != 32:
                raise ValueError(f"stage E sm90: {name} has shape {tuple(t.shape)}, the case needs {shape} of 4-byte words")
        if c.h_q % 8 or cos_sin_cache.shape[1] != 64:
            raise ValueError(f"stage E sm90: fp8_rope needs h_q a multiple of 8 and cos_sin_cache [max_position, 64], "
                             f"got h_q {c.h_q}, {tuple(cos_sin_cache.shape)}")

    def _check_tensors(self, Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part, softmax_scale) -> None:
        """Trace time: the tensors have the shapes this kernel's reading of the case implies
        (the cache block sizes in bytes included), and the scratch holds its partial slots."""
        c, b = self.c, self.b
        want = {
            "Q": (Q, (b, c.s_q, c.h_q, D)),
            "idx": (idx, (b, c.s_q, c.topk)),
            "LSE": (LSE, (b, c.h_q, c.s_q)),
            "softmax_scale": (softmax_scale, (1,)),
        }
        if not self.fp8:  # fp8_rope: O is an unused scratch
            want["O"] = (O, (b, c.s_q, c.h_q, D))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"stage E sm90: {name} has shape {tuple(t.shape)}, the case needs {shape}")
        if KV.shape[1] != self.block_bytes or (c.has_extra and KV_extra.shape[1] != self.extra_block_bytes):
            raise ValueError(f"stage E sm90: {self.fmt} blocks of {c.block} / {c.extra_block} tokens are "
                             f"{self.block_bytes} / {self.extra_block_bytes} bytes; the caches have "
                             f"{KV.shape[1]} / {KV_extra.shape[1]}")
        if c.has_extra and tuple(idx_extra.shape) != (b, c.s_q, c.extra_topk):
            raise ValueError(f"stage E sm90: idx_extra has shape {tuple(idx_extra.shape)}, the case needs {(b, c.s_q, c.extra_topk)}")
        if self.partials and (self.splits > O_part.shape[0] or self.splits > LSE_part.shape[0]):
            raise ValueError(f"stage E sm90: parts of {self.sched.part_tiles} tiles need O_part/LSE_part capacity ≥ {self.splits}, "
                             f"got {O_part.shape[0]}")

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        KV: cute.Tensor,
        idx: cute.Tensor,
        topk_length: cute.Tensor,
        KV_extra: cute.Tensor,
        idx_extra: cute.Tensor,
        extra_length: cute.Tensor,
        sink: cute.Tensor,
        softmax_scale: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        vt_smem: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
        O_fp8: cute.Tensor | None,
        O_scale: cute.Tensor | None,
        cos_sin_cache: cute.Tensor | None,
        positions: cute.Tensor | None,
    ):
        bm, bn = self.BLOCK_M, self.BLOCK_N
        tidx, _, _ = cute.arch.thread_idx()
        head_block, part, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        marks = None
        if cutlass.const_expr(self.stamps):  # this CTA's record of stamps, over O (a diagnostic build)
            marks = mO.iterator.toint() + cutlass.Int64(part * self.sched.head_blocks + head_block) * RECORD_BYTES
        self.mark(marks, 0, tidx == 0)
        if warp_idx == 0:  # warpgroup 0 loads Q
            prefetch_descriptors(tma_q)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bn, D, stages)
        sVt = storage.sKV.get_tensor(vt_smem.outer, swizzle=vt_smem.inner)  # (D, bn, stages): the same bytes
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)[None, None, 0]
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))  # α of a tile
        s_fin = storage.final_factor.get_tensor(cute.make_layout(bm))  # a segment's 1/ℓ (· the sink's factor)
        s_mrg = storage.merge_factor.get_tensor(cute.make_layout(bm))  # a merge's factor on the partial it reads
        s_mask = storage.key_mask.get_tensor(cute.make_layout((bn, self.KV_STAGES)))  # 0 or −∞ per key
        s_kscale = storage.key_scale.get_tensor(cute.make_layout((bn, self.KV_STAGES)))  # simple: the token's scale
        s_idx = storage.idx_stage.get_tensor(cute.make_layout(self.staged_tiles * bn))  # a segment's idx entries
        q_bar = storage.q_mbar.data_ptr()
        k_base = storage.sKV.data_ptr().toint()  # the dequantisers address the slots through k_smem
        pair = self.tile_pair(storage)
        pair.init(self.KV_STAGES, tidx)

        if tidx == 0:
            cute.arch.mbarrier_init(q_bar, 1)  # Q's TMA, one arrival and its bytes a segment
        kv_pipe = pipeline.PipelineAsync.create(
            num_stages=self.KV_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.plan.producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.MMA_THREADS // 32),  # a lane a warp
            barrier_storage=storage.kv_mbar.data_ptr(), name=hang_guard.name("kv"),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        pair.start()
        self.mark(marks, 1, tidx == 0)

        # every part holds at least one tile: no CTA is idle
        if warp_idx // 4 >= self.PRODUCER_WG:
            set_registers(self.plan.producer_regs, self.plan.threads)
            self.produce(part, head_block, tidx - self.MMA_THREADS, kv_pipe, pair, k_base, k_smem,
                         s_mask, s_kscale, s_idx, KV, idx, topk_length, KV_extra, idx_extra, extra_length, marks)
        else:
            # each MMA warpgroup its own copy of attend, compiled for its own register count
            smem = AttendSmem(sQ=sQ, sK=sK, sVt=sVt, sP=sP, s_row=s_row, s_fin=s_fin, s_mrg=s_mrg, s_mask=s_mask,
                              s_kscale=s_kscale)
            fp8 = None
            if cutlass.const_expr(self.fp8):
                cs = cute.make_tensor(cos_sin_cache.iterator, cute.make_layout(cute.size(cos_sin_cache)))
                fp8 = Fp8Out(O_fp8, O_scale, cs, positions, self.c.h_q, self.b * self.c.s_q, self.rope_sin_sign())
            io = AttendIO(q_bar=q_bar, tma_q=tma_q, mQ=mQ, kv_pipe=kv_pipe, pair=pair, k_base=k_base, smem=smem,
                          sink=sink, mO=mO, mLSE=mLSE, mOp=mOp, mLp=mLp, softmax_scale=softmax_scale, marks=marks,
                          fp8=fp8)
            if warp_idx // 4 == 0:
                set_registers(self.plan.mma_regs[0], self.plan.threads)
                self.attend(0, part, head_block, tidx, io)
            else:
                set_registers(self.plan.mma_regs[1], self.plan.threads)
                self.attend(1, part, head_block, tidx, io)
        pair.finish()
        self.mark(marks, 9, tidx == 0)

    def mark(self, marks, slot: int, here):
        """Diagnostic build (`stamps`): the thread where `here` writes the time into stamp `slot`
                of its CTA's record (stages/common/stamps.py); else nothing is traced.  Slots: 0 entry,
                1 barriers set up, 2 idx staged, 3 Q arrived, 4 / 11 tile 0 / 1 ready, 5 tile 0's
                softmax done, 6 tiles done, 12 warpgroup 1's last P·V, 13 O rescaled, 7 / 8 warpgroup
                0 / 1 past the epilogue, 9 exit, 10 producer done (2–8, 11–13: the last segment)."""
        if self.stamps:
            _stamp_if(marks + slot * 16, here)

    def tile_pair(self, storage) -> TilePair:
        """The exchange of dequantised halves with the peer CTA (a no-op alone)."""
        return TilePair(self.pair, storage.remote_full.data_ptr(), storage.remote_empty.data_ptr(),
                        self.peer_bytes, self.MMA_THREADS // 32)

    # -----------------------------------------------------------------------------------------
    # Producer: KV by a gather into registers and the dequantisation

    @cute.jit
    def produce(self, part, head_block, ptid, kv_pipe, pair, k_base, k_smem, s_mask, s_kscale, s_idx,
                KV, idx, topk_length, KV_extra, idx_extra, extra_length, marks=None):
        """The producer threads (`ptid` 0 … producer_threads − 1), segment after segment: the idx
                entries into shared memory, then each KV tile a unit (a round of keys) at a time — bytes
                loaded a unit ahead, slot taken, mask entries written, pieces dequantised into the slot
                (and the peer's), slot committed.  The ring state is rebuilt from the part's earlier tiles."""
        hang_guard.role("producer")  # names this role's waits in a --debug-hangs build
        pwarp = ptid // 32
        lane = ptid % 32
        rank = pair.rank()
        lists = (KV, idx, KV_extra, idx_extra)
        pieces = self.piece_addresses(k_base, k_smem, self.key_of(rank, 0, 0, pwarp, lane), lane)
        for k in cutlass.range(self.sched.segments(part), unroll=1):
            work, before = self.sched.segment(head_block, part, k)
            self.produce_segment(work, before, ptid, pwarp, lane, rank, kv_pipe, pair, pieces, s_mask, s_kscale,
                                 s_idx, lists, topk_length, extra_length, marks)
        self.mark(marks, 10, ptid == 0)

    @cute.jit
    def produce_segment(self, work, before, ptid, pwarp, lane, rank, kv_pipe, pair, pieces, s_mask, s_kscale, s_idx,
                        lists, topk_length, extra_length, marks=None):
        """One segment's tiles (see produce)."""
        lengths = (cutlass.min(topk_length[work.batch], self.c.topk), cutlass.Int32(0))
        if cutlass.const_expr(self.c.has_extra):
            lengths = (lengths[0], cutlass.min(extra_length[work.batch], self.c.extra_topk))
        # Two register buffers of one unit (a round of a tile) each: the loads of the next unit
        # are in flight while this one is dequantised.  An iteration takes two units — two
        # tiles of one round in a pair, the two rounds of one tile alone — so the buffers and
        # the two tiles' key indices (even, odd tile of the iteration) are static.
        R = self.rounds
        per = 2 // R  # tiles an iteration
        raws = (cute.make_rmem_tensor((4, self.PIECES[self.fmt]), cutlass.Int32),
                cute.make_rmem_tensor((4, self.PIECES[self.fmt]), cutlass.Int32))
        scs = (cute.make_rmem_tensor((4, self.sides), cutlass.Int32), cute.make_rmem_tensor((4, self.sides), cutlass.Int32))
        keys = (cute.make_rmem_tensor((R, self.sides), cutlass.Int32), cute.make_rmem_tensor((R, self.sides), cutlass.Int32))
        if cutlass.const_expr(self.streams):
            self.stage_windows(lists, work, s_idx, ptid)
        else:
            self.stage_entries(lists, work, s_idx, ptid)
        self.mark(marks, 2, ptid == 0)
        self.key_indices(lists, lengths, work, work.tile_begin, s_idx, rank, pwarp, lane, keys[0])
        self.gather(lists, work.tile_begin, keys[0], 0, lane, raws[0], scs[0])
        # alone (two rounds a tile) the next unit's loads are issued before this unit is
        # dequantised; in a pair (one round) after, which keeps one buffer's registers
        early = R > 1
        kv_state = ring_state(self.KV_STAGES, before, producer=True)
        for it in cutlass.range(work.tile_begin, work.tile_end, per, unroll=1):
            for u in cutlass.range_constexpr(2):
                j, r = divmod(u, R)  # this unit: tile it + j, round r
                nj, nr = divmod(u + 1, R)  # the next unit
                if cutlass.const_expr(early):
                    self.next_unit(lists, lengths, work, it + nj, nr, s_idx, rank, pwarp, lane, keys[nj % 2],
                                   raws[(u + 1) % 2], scs[(u + 1) % 2])
                if cutlass.const_expr(j == 0):
                    self.produce_unit(kv_pipe, kv_state, pair, ptid, keys[0], r, raws[u], scs[u], rank, pwarp, lane,
                                      pieces, s_mask, s_kscale)
                else:
                    if it + j < work.tile_end:
                        self.produce_unit(kv_pipe, kv_state, pair, ptid, keys[1], r, raws[u], scs[u], rank, pwarp,
                                          lane, pieces, s_mask, s_kscale)
                if cutlass.const_expr(not early):
                    self.next_unit(lists, lengths, work, it + nj, nr, s_idx, rank, pwarp, lane, keys[nj % 2],
                                   raws[(u + 1) % 2], scs[(u + 1) % 2])
                if cutlass.const_expr(r == R - 1):
                    kv_state.advance()
            if cutlass.const_expr(per == 1):
                keys[0].store(keys[1].load())

    @cute.jit
    def next_unit(self, lists, lengths, work, tile, r: cutlass.Constexpr[int], s_idx, rank, pwarp, lane, keys, raw, sc):
        """Issue the loads of round r of `tile` (its keys judged first when r is 0)."""
        if cutlass.const_expr(r == 0):
            self.key_indices(lists, lengths, work, tile, s_idx, rank, pwarp, lane, keys)
        self.gather(lists, tile, keys, r, lane, raw, sc)

    @cute.jit
    def stage_entries(self, lists, work, s_idx, ptid):
        """A segment of at most 2 windows: s_idx[(tile − tile_begin)·BLOCK_N + key] ← each key's idx
                entry (−1 past a list), loaded by all producer threads, who meet (STAGED) before the
                stores (all done with the last segment's) and after them."""
        n = self.sched.chunk * self.BLOCK_N
        per_thread = -(-n // self.plan.producer_threads)
        got = cute.make_rmem_tensor(per_thread, cutlass.Int32)
        for e in cutlass.range_constexpr(per_thread):
            i = e * self.plan.producer_threads + ptid
            tile = work.tile_begin + i // self.BLOCK_N
            branch, pos = self.list_position(tile, i % self.BLOCK_N)
            here = (i < n) & (tile < work.tile_end)
            got[e] = self.idx_entry(lists[1], work, pos, self.c.topk, here & (branch == 0))
            if cutlass.const_expr(self.c.has_extra):
                got[e] = cutlass.select_(branch == 0, got[e], self.idx_entry(lists[3], work, pos, self.c.extra_topk,
                                                                            here & (branch == 1)))
        cute.arch.barrier(barrier_id=int(NamedBarrier.STAGED), number_of_threads=self.plan.producer_threads)
        for e in cutlass.range_constexpr(per_thread):
            i = e * self.plan.producer_threads + ptid
            if i < n:
                s_idx[i] = got[e]
        cute.arch.barrier(barrier_id=int(NamedBarrier.STAGED), number_of_threads=self.plan.producer_threads)

    @cute.jit
    def stage_windows(self, lists, work, s_idx, ptid):
        """A streamed segment's start (idx_windows.py): meet (STAGED), issue windows 0 and 1 into
                buffers 0 and 1 (a cp.async group each), wait for window 0, meet again."""
        cute.arch.barrier(barrier_id=int(NamedBarrier.STAGED), number_of_threads=self.plan.producer_threads)
        w0, w1 = cutlass.Int32(0), cutlass.Int32(1)
        self.issue_window(lists, work, w0, w0, s_idx, ptid)
        self.issue_window(lists, work, w1, w1, s_idx, ptid)
        wait_copies(1)
        cute.arch.barrier(barrier_id=int(NamedBarrier.STAGED), number_of_threads=self.plan.producer_threads)

    @cute.jit
    def next_window(self, lists, work, i, s_idx, ptid):
        """At tile i = w·W (w ≥ 1): wait for this thread's copies of window w, meet (WINDOW: all
                landed, all past window w − 1), issue window w + 1 into window w − 1's buffer."""
        wait_copies(0)
        cute.arch.barrier(barrier_id=int(NamedBarrier.WINDOW), number_of_threads=self.plan.producer_threads)
        w = i // WINDOW_TILES + 1
        self.issue_window(lists, work, w, self.refill_source(w), s_idx, ptid)

    @cute.jit
    def refill_source(self, w):
        """The window whose entries next_window copies into window w's buffer: w itself
        (a hook so a test fixture can plant a bug here)."""
        return w

    @cute.jit
    def issue_window(self, lists, work, w, entries, s_idx, ptid):
        """cp.async the idx entries of window w into buffer w mod 2 (consecutive threads consecutive
                keys; none past the segment's tiles or its list), then close the group.  Each entry's
                tile picks its list (list_position): a window may cross into the extra list."""
        n = WINDOW_TILES * self.BLOCK_N
        base = s_idx.iterator.toint()
        # a loop, not unrolled: its per-entry values are made in turn, none kept across the tiles
        # (unrolled, ptxas held eight of them through the producer's loop and spilled in a pair)
        for e in cutlass.range(-(-n // self.plan.producer_threads), unroll=1):
            j = e * self.plan.producer_threads + ptid
            t_off, key = window_tile(entries, j, self.BLOCK_N)
            tile = work.tile_begin + t_off
            branch, pos = self.list_position(tile, key)
            here = (j < n) & (tile < work.tile_end)
            src = lists[1].iterator.toint() + _idx_offset(lists[1], work, pos)
            ok = here & (branch == 0) & (pos < self.c.topk)
            if cutlass.const_expr(self.c.has_extra):
                src = cutlass.select_(branch == 0, src, lists[3].iterator.toint() + _idx_offset(lists[3], work, pos))
                ok = ok | (here & (branch == 1) & (pos < self.c.extra_topk))
            copy4_async_if(base + window_slot(w, j, self.BLOCK_N) * 4, src, ok)
        commit_copies()

    @property
    def entries_per_thread(self) -> int:
        """The idx entries of a segment (chunk · BLOCK_N) a producer thread stages."""
        return -(-self.sched.chunk * self.BLOCK_N // self.plan.producer_threads)

    @cute.jit
    def produce_unit(self, kv_pipe, kv_state, pair, ptid, keys, r: cutlass.Constexpr[int], raw, sc, rank, pwarp, lane,
                     pieces, s_mask, s_kscale):
        """Round r of a tile into slot kv_state.index: take the slot (round 0), write the
        round's mask entries, dequantise its pieces, commit the slot (the last round)."""
        if cutlass.const_expr(r == 0):
            kv_pipe.producer_acquire(kv_state)
            pair.producer_acquire(kv_state, ptid)
        self.write_masks(keys, sc, r, rank, pwarp, lane, s_mask, s_kscale, kv_state)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            self.dequant_nvfp4(raw, r, lane, pieces, kv_state, pair)
        else:
            self.dequant_unit(raw, sc, r, lane, pieces, kv_state, pair)
        if cutlass.const_expr(r == self.rounds - 1):
            cute.arch.fence_proxy("async.shared", space="cta")  # generic smem writes → wgmma reads
            kv_pipe.producer_commit(kv_state)

    def key_of(self, rank, side: int, rnd: int, pwarp, lane):
        """The key of a tile this thread loads in round `rnd`: side 0 its own CTA's half (the whole
                tile alone), side 1 the peer's half (whose mask it writes).  8 keys a warp a round,
                lane mod 8 the key, lane // 8 the piece.  Plain ints (CPU test) or traced Int32s."""
        return (rank ^ side) * self.own_keys + rnd * self.keys_per_round + 8 * pwarp + lane % 8

    @cute.jit
    def list_position(self, tile, key):
        """(branch, position in its list) of key `key` of `tile`: the main list's tiles first."""
        branch = cutlass.Int32(0)
        pos = tile * self.BLOCK_N + key
        if tile >= self.main_tiles:
            branch = cutlass.Int32(1)
            pos = pos - self.main_tiles * self.BLOCK_N
        return branch, pos

    @cute.jit
    def idx_entry(self, idx, work, pos, topk: cutlass.Constexpr[int], here) -> cutlass.Int32:
        """idx[batch, token, pos] when `here` (the key is in this list), or −1 (nothing read)
        for a position past the list."""
        return ldg_or(idx.iterator.toint() + _idx_offset(idx, work, pos), here & (pos < topk), 1, -1)[0]

    @cute.jit
    def key_indices(self, lists, lengths, work, tile, s_idx, rank, pwarp, lane, out):
        """out[round, side] ← the cache index of this thread's keys of `tile` (key_index on the entry
                from s_idx, or streamed from idx_windows.entry); −1 past the split."""
        if cutlass.const_expr(self.streams):  # a window's first tile: its entries waited for, the next issued
            if (tile < work.tile_end) & boundary(tile - work.tile_begin):
                self.next_window(lists, work, tile - work.tile_begin, s_idx, pwarp * 32 + lane)
        for r in cutlass.range_constexpr(self.rounds):
            for s in cutlass.range_constexpr(self.sides):
                key = self.key_of(rank, s, r, pwarp, lane)
                branch, pos = self.list_position(tile, key)
                out[r, s] = cutlass.Int32(-1)
                if tile < work.tile_end:
                    if cutlass.const_expr(self.streams):
                        got = s_idx[entry(tile - work.tile_begin, key, self.BLOCK_N)]
                    else:
                        got = s_idx[(tile - work.tile_begin) * self.BLOCK_N + key]
                    if branch == 0:
                        out[r, s] = self.key_index(lists[0], got, pos, lengths[0], self.c.topk, self.c.block)
                    else:
                        if cutlass.const_expr(self.c.has_extra):
                            out[r, s] = self.key_index(lists[2], got, pos, lengths[1], self.c.extra_topk,
                                                       self.c.extra_block)

    @cute.jit
    def key_index(self, cache, got, pos, length, topk: cutlass.Constexpr[int], block_size: cutlass.Constexpr[int]):
        """The cache index at list position `pos` (entry `got`), or −1 when pos ≥ min(topk,
                topk_length[b]) or the entry is −1."""
        out = cutlass.Int32(-1)
        if pos < length:
            out = got
        return out

    @cute.jit
    def gather(self, lists, tile, keys, r: cutlass.Constexpr[int], lane, raw, sc):
        """raw, sc ← the bytes of this thread's round-r key of `tile` from the tile's cache."""
        if tile < self.main_tiles:
            self.gather_key(lists[0], self.c.block, self.block_bytes, keys, r, lane, raw, sc)
        else:
            if cutlass.const_expr(self.c.has_extra):
                self.gather_key(lists[2], self.c.extra_block, self.extra_block_bytes, keys, r, lane, raw, sc)

    @cute.jit
    def gather_key(self, cache, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], keys,
                   r: cutlass.Constexpr[int], lane, raw, sc):
        """Round r's own key (index keys[r, 0]; an invalid key's loads are not made: zeros), q =
                lane // 8:  raw[:, p] ← 16-byte piece p: e4m3 columns 64·p + 16·q … + 15, model1's rope
                bytes 448 + 16·q + 64·h as pieces 7 + h; sc[:, 0] ← the scale bytes (model1 8, v4.1 16).
                nvfp4: pieces 0 … 2 e2m1 bytes 64·p + 16·q (columns 128·p + 32·q … + 31), piece 3 words
                0, 1 bytes 192 + 8·q (columns 384 + 16·q … + 15), pieces 4, 5 rope bytes 224 + 16·q +
                64·h, pieces 6, 7 the scale words 2·p + q // 2 (p = 0 … 2), then 6.  simple:
                sc[0, side] ← each side's fp32 scale (the MMA warpgroups apply it)."""
        base = cache.iterator.toint()
        q = lane // 8
        index = keys[r, 0]
        valid = index != -1
        block, off = _token_block(base, index, block_size, block_bytes)
        token = block + off * self.ROW_BYTES[self.fmt]
        for p in cutlass.range_constexpr(self.DATA_PIECES[self.fmt]):
            self.load16(raw, p, token + 64 * p + 16 * q, valid)
        if cutlass.const_expr(self.fmt == "model1"):
            for h in cutlass.range_constexpr(self.ROPE_PIECES[self.fmt]):
                self.load16(raw, self.DATA_PIECES[self.fmt] + h, token + D_NOPE + 16 * q + 64 * h, valid)
            w = ldg_or(block + block_size * MODEL1_ROW_BYTES + off * MODEL1_SCALE_BYTES, valid, 2, prefetch=False)
            sc[0, 0], sc[1, 0] = w[0], w[1]
        elif cutlass.const_expr(self.fmt == "nvfp4"):
            t = self.NVFP4_TAIL
            w = ldg_or(token + 64 * t + 8 * q, valid, 2)  # e2m1 bytes 3·64 + 8·q: columns 6·64 + 16·q … + 15
            raw[0, t], raw[1, t] = w[0], w[1]
            for h in cutlass.range_constexpr(self.ROPE_PIECES[self.fmt]):
                self.load16(raw, t + 1 + h, token + NVFP4_NOPE_BYTES + 16 * q + 64 * h, valid)
            # the scale words of this thread's groups: 2·p + q // 2 (p = 0 … 2) and 6 (the tail's)
            scales = block + block_size * NVFP4_ROW_BYTES + off * NVFP4_SCALE_BYTES
            lo = ldg_or(scales, valid, 4, prefetch=False)
            hi = ldg_or(scales + 16, valid, 4, prefetch=False)
            words = lo + hi
            odd = q // 2 == 1
            for p in cutlass.range_constexpr(t):
                raw[p, t + 3] = cutlass.select_(odd, words[2 * p + 1], words[2 * p])
            raw[t, t + 3] = words[2 * t]
        elif cutlass.const_expr(self.fmt == "v4.1"):
            w = ldg_or(token + D, valid, 4)
            for i in cutlass.range_constexpr(4):
                sc[i, 0] = w[i]
        else:
            for s in cutlass.range_constexpr(self.sides):
                b_s, o_s = block, off
                if cutlass.const_expr(s > 0):
                    b_s, o_s = _token_block(base, keys[r, s], block_size, block_bytes)
                sc[0, s] = ldg_or(b_s + block_size * D + o_s * 4, keys[r, s] != -1, 1, prefetch=False)[0]

    @cute.jit
    def load16(self, raw, p, addr, valid):
        w = ldg_or(addr, valid, 4)
        for i in cutlass.range_constexpr(4):
            raw[i, p] = w[i]

    @cute.jit
    def piece_addresses(self, k_base, k_smem, key, lane):
        """Shared-memory byte addresses, in slot 0, of this thread's pieces of round 0's own key:
                data columns 16·q and 16·q + 8 (q = lane // 8; piece p adds p·col64_bytes), model1's
                rope columns 448 + 8·q and 480 + 8·q.  Round r adds r·(keys_per_round / 8)·key8_bytes,
                slot s s·BLOCK_N·D·2 (piece_strides checks the layout is additive in all three)."""
        q = lane // 8
        cols = (16 * q, 16 * q + 8, D_NOPE + 8 * q, D_NOPE + D_ROPE // 2 + 8 * q)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            cols = cols + (32 * q,)  # nvfp4's 16-byte loads: columns 128·p + 32·q + 8·i (dequant_nvfp4)
        at = cute.make_rmem_tensor(len(cols), cutlass.Int32)
        for i, col in enumerate(cols):
            at[i] = k_base + slot_offset(k_smem, key, col, 0)
        return at

    @cute.jit
    def dequant_unit(self, raw, sc, r: cutlass.Constexpr[int], lane, pieces, state, pair):
        """This thread's pieces of its round-r key → bf16 in slot state.index, 16-byte stores by
                `pair` (also into the peer's slot in a pair): e4m3 × the piece's power-of-two scale
                (e4m3_bits.py; one multiply when the warp's vote finds every scale ≤ 2^7), model1's rope
                as it is, an invalid key's zeros.  simple: unscaled (its scale is applied in attend)."""
        q = lane // 8
        dims = self.DATA_PIECES[self.fmt]
        expo = cute.make_rmem_tensor(dims, cutlass.Int32)
        fits = cutlass.Boolean(True)
        for p in cutlass.range_constexpr(dims):
            expo[p] = self.scale_byte(sc, p, q)
            fits = fits & one_multiply_fits(expo[p])
        one_multiply = cute.arch.vote_all_sync(fits)  # every lane, before any lane-dependent branch
        if cutlass.const_expr(self.fmt == "simple"):
            one_multiply = True
        rows = r * (self.keys_per_round // 8) * self.key8_bytes + state.index * (self.BLOCK_N * D * 2)
        for p in cutlass.range_constexpr(dims):
            vals = cute.make_rmem_tensor(16, cutlass.BFloat16)
            e4m3x16_to_bf16(raw[None, p], expo[p], vals, one_multiply)
            words = cute.recast_tensor(vals, cutlass.Int32)
            for h in cutlass.range_constexpr(2):
                pair.store16(pieces[h] + p * self.col64_bytes + rows,
                             cute.make_tensor(words.iterator + 4 * h, cute.make_layout(4)), state)
        if cutlass.const_expr(self.fmt == "model1"):
            for h in cutlass.range_constexpr(2):
                pair.store16(pieces[2 + h] + rows, raw[None, dims + h], state)

    @cute.jit
    def dequant_nvfp4(self, raw, r: cutlass.Constexpr[int], lane, pieces, state, pair):
        """nvfp4: this thread's pieces of its round-r key → bf16 in slot state.index, model1's tile
                (e2m1_bits.py: exact).  Thread q's columns, from gather_key's pieces:
                    piece p ≤ 2, word i   columns 128·p + 32·q + 8·i … + 7, group 8·p + 2·q + i // 2:
                                          scale byte 2·(q mod 2) + i // 2 of scale word 2·p + q // 2
                                          (piece 6's word p)
                    piece 3, word i       columns 384 + 16·q + 8·i … + 7, group 24 + q: byte q of scale
                                          word 6 (piece 6's word 3)
                stored at pieces[4] (column 32·q) + p·2·col64 + i·col8, and as model1's piece 6; the rope
                as model1's.  `one_multiply`: the warp's vote that every scale is below 4."""
        q = lane // 8
        t = self.NVFP4_TAIL
        rows = r * (self.keys_per_round // 8) * self.key8_bytes + state.index * (self.BLOCK_N * D * 2)
        col8 = self.col64_bytes // 8
        one_multiply = True  # the table path: one multiply always (its values are the e2m1 values)
        if cutlass.const_expr(not self.e2m1_table):
            fits = cutlass.Int32(0)
            for i in cutlass.range_constexpr(4):  # the 4 threads of a key hold all 28 scales between them
                fits = fits | scales_fit(raw[i, t + 3])
            one_multiply = cute.arch.vote_all_sync(fits == 0)  # every lane, before any lane-dependent branch
        for p in cutlass.range_constexpr(t):
            word = raw[p, t + 3]
            for h in cutlass.range_constexpr(2):
                f, sb = scale_factors(word, scale_select(self.e2m1_group_byte(2 * (q % 2) + h)))
                for i in cutlass.range_constexpr(2 * h, 2 * h + 2):
                    out = cute.make_rmem_tensor(4, cutlass.Int32)
                    self.e2m1_words(raw[i, p], f, sb, out, one_multiply)
                    pair.store16(pieces[4] + 2 * p * self.col64_bytes + i * col8 + rows, out, state)
        f, sb = scale_factors(raw[t, t + 3], scale_select(self.e2m1_group_byte(q)))
        for i in cutlass.range_constexpr(2):
            out = cute.make_rmem_tensor(4, cutlass.Int32)
            self.e2m1_words(raw[i, t], f, sb, out, one_multiply)
            pair.store16(pieces[i] + (D_NOPE // 64 - 1) * self.col64_bytes + rows, out, state)
        for h in cutlass.range_constexpr(2):
            pair.store16(pieces[2 + h] + rows, raw[None, t + 1 + h], state)

    @cute.jit
    def e2m1_words(self, word, f, sb, out, one_multiply):
        """out[0:4] ← 8 codes × the group's scale: bit moves, or the table (e2m1_table)."""
        if cutlass.const_expr(self.e2m1_table):
            e2m1x8_to_bf16_table(word, sb, out)
        else:
            e2m1x8_to_bf16(word, f, sb, out, one_multiply)

    @cute.jit
    def e2m1_group_byte(self, byte):
        """The byte of a scale word that holds a group's e4m3 scale: `byte` itself (a hook so a
        test fixture can plant a bug here)."""
        return byte

    @cute.jit
    def scale_byte(self, sc, p, q) -> cutlass.Int32:
        """The e8m0 byte of data piece p (columns 64·p + 16·q …): model1 byte p, v4.1 byte 2·p + q // 2,
                simple 127 (a scale of 1).  Masked: the words shift arithmetically."""
        e = cutlass.Int32(127)
        if cutlass.const_expr(self.fmt == "model1"):
            e = (sc[p // 4, 0] >> (8 * (p % 4))) & 0xFF
        elif cutlass.const_expr(self.fmt == "v4.1"):
            e = (sc[p // 2, 0] >> (8 * (2 * p % 4) + 8 * (q // 2))) & 0xFF
        return e

    @cute.jit
    def write_masks(self, keys, sc, r: cutlass.Constexpr[int], rank, pwarp, lane, s_mask, s_kscale, state):
        """Round r's mask entries (0 or −∞) in slot state.index: piece q = side's threads write their
                side's (the peer's half too in a pair); simple: also the fp32 scale."""
        for s in cutlass.range_constexpr(self.sides):
            if lane // 8 == s:
                key = self.key_of(rank, s, r, pwarp, lane)
                s_mask[key, state.index] = cutlass.Float32(0.0) if keys[r, s] != -1 else -cutlass.Float32.inf
                if cutlass.const_expr(self.fmt == "simple"):
                    s_kscale[key, state.index] = cute.recast_tensor(sc[None, s], cutlass.Float32)[0]

    # -----------------------------------------------------------------------------------------
    # MMA warpgroups (stage D2's, plus the key mask and the sink)

    @cute.jit
    def attend(self, wg: cutlass.Constexpr[int], part, head_block, tidx, io):
        """An MMA warpgroup, segment after segment: O and the softmax state start afresh, the tiles
                run as D2's (`tile_s_p`: warpgroup 0's S, softmax, P; `tile_pv`: both halves of P·V),
                `finish_segment` writes O and LSE or a partial.  Warpgroup 0 arrives at P_FULL without
                waiting; its first warp loads the next segment's Q once warpgroup 0 is past this one's
                last S (Q_FREE), overlapping the last P·V and the epilogue.  The consumer state is
                rebuilt from the part's earlier tiles.  `io`: the kernel's AttendIO."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        tid_wg = tidx % 128
        mma = self.mma_tiles(wg, tidx, io.smem)
        # P and the row factors (α, a tile's) → warpgroup 1; the two warpgroups meet unaligned
        smem_p = SmemP.create(self, mma.qk_mma, io.smem.sP, io.smem.s_row, tid_wg, self.MMA_THREADS,
                              sync=named_sync, arrive=named_arrive)
        acc_o = cute.make_rmem_tensor(mma.o_shape, cutlass.Float32)
        kv_pipe, pair = io.kv_pipe, io.pair

        segments = self.sched.segments(part)
        scale_log2 = self.softmax_scale_log2(io.softmax_scale)  # c = scale · log2 e, once
        sink_rows = None
        if cutlass.const_expr(wg == 0):
            self.load_q(self.sched.segment(head_block, part, 0)[0], tid_wg, io)
            if cutlass.const_expr(self.sink_first):
                sink_rows = self.load_sink_rows(head_block, mma.tScS_rc, io.sink)
        for k in cutlass.range(segments, unroll=1):
            work, before = self.sched.segment(head_block, part, k)
            # a whole sequence? (taken here, before the tiles, as before the split into named pieces:
            # taken in finish_segment, ptxas spilled 28–48 bytes more in simple and parted model1)
            complete = self.sched.complete(work)
            acc_o.fill(0.0)
            softmax = LazyOnlineSoftmax.create(cute.size(mma.tScS_rc, mode=[0]), scale_log2)
            kv_cons = ring_state(self.KV_STAGES, before, producer=False)
            if cutlass.const_expr(wg == 0):
                hang_guard.mbarrier_wait(io.q_bar, k % 2, "q")
                self.mark(io.marks, 3, tidx == 0)
            for i in cutlass.range(work.tile_end - work.tile_begin, unroll=1):
                kv_pipe.consumer_wait(kv_cons)
                pair.consumer_wait(kv_cons)
                if cutlass.const_expr(wg == 0):
                    self.mark(io.marks, 4, (tidx == 0) & (i == 0))
                    self.mark(io.marks, 11, (tidx == 0) & (i == 1))
                    r_p, alpha = self.tile_s_p(mma, smem_p, softmax, kv_cons.index, i, io.smem)
                    self.mark(io.marks, 5, (tidx == 0) & (i == 0))
                    if (i == work.tile_end - work.tile_begin - 1) & (k + 1 < segments):
                        named_sync(NamedBarrier.Q_FREE, 128)  # every warp of warpgroup 0 is past its last S
                        self.load_q(self.sched.segment(head_block, part, k + 1)[0], tid_wg, io)
                    self.tile_pv(mma, acc_o, alpha, r_p, kv_cons.index)
                else:
                    smem_p.wait_full()
                    self.tile_pv(mma, acc_o, smem_p.row_factors(mma.tOcO_rc), mma.tOrP, kv_cons.index)
                cute.arch.sync_warp()  # every lane's wgmma reads of the slot are done
                if tidx % 32 == 0:  # the slot's empty barriers count warps
                    kv_pipe.consumer_release(kv_cons)
                    pair.consumer_release(kv_cons)
                kv_cons.advance()
                if cutlass.const_expr(wg == 1):
                    smem_p.release()
            self.mark(io.marks, 6, tidx == 0)
            self.finish_segment(wg, tidx, work, complete, mma, smem_p, softmax, acc_o, io, sink_rows)
            self.mark(io.marks, 7 + wg, tidx % 128 == 0)

    def softmax_scale_log2(self, softmax_scale: cute.Tensor) -> cutlass.Float32:
        """c = softmax_scale[0] · log2 e (stages/common/softmax.py runtime_scale_log2): the
        softmax's base-2 factor on raw scores, read from the runtime input once a warpgroup."""
        return runtime_scale_log2(softmax_scale)

    def mma_tiles(self, wg: int, tidx, smem) -> "MmaTiles":
        """Warpgroup wg's MMAs (warpgroup 0's P·V takes P from registers) and its partitions of
        the shared operands (trace time: no code but the fragments' descriptors)."""
        bm, bn = self.BLOCK_M, self.BLOCK_N
        qk_mma, pv_mma = self.tiled_mmas(smem.sQ.element_type, p_in_registers=wg == 0)
        thr_qk = qk_mma.get_slice(tidx % 128)
        thr_pv = pv_mma.get_slice(tidx)
        return MmaTiles(
            qk_mma=qk_mma, pv_mma=pv_mma, thr_pv=thr_pv,
            tSrQ=qk_mma.make_fragment_A(thr_qk.partition_A(smem.sQ)),
            tSrK=qk_mma.make_fragment_B(thr_qk.partition_B(smem.sK)),
            s_shape=thr_qk.partition_shape_C((bm, bn)),
            tScS_rc=acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((bm, bn)))),
            tOrP=pv_mma.make_fragment_A(thr_pv.partition_A(smem.sP)) if wg == 1 else None,
            tOrV=pv_mma.make_fragment_B(thr_pv.partition_B(smem.sVt)),
            o_shape=thr_pv.partition_shape_C((bm, D)),
            tOcO_rc=acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, D)))),
        )

    @cute.jit
    def tile_s_p(self, mma, smem_p, softmax, slot, i, smem):
        """Warpgroup 0, one tile in `slot`: S = Q·Kᵀ, the mask (simple: × the key scale), the online
                softmax, P = bf16(S) (its own P·V's A operand) published with α to warpgroup 1 (SmemP;
                P_EMPTY waited from the second tile).  Returns (P, α)."""
        acc_s = cute.make_rmem_tensor(mma.s_shape, cutlass.Float32)
        wgmma_sync(mma.qk_mma, acc_s, mma.tSrQ, mma.tSrK, a_slot=0, b_slot=slot, zero_init=True)
        s_rc = acc_rows_cols(acc_s)
        tScS_rc = mma.tScS_rc
        for r in cutlass.range_constexpr(cute.size(tScS_rc, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(tScS_rc, mode=[1])):
                key = tScS_rc[r, j][1]
                if cutlass.const_expr(self.fmt == "simple"):  # S = (Q·K_e4m3ᵀ) · the key's scale
                    s_rc[r, j] = s_rc[r, j] * smem.s_kscale[key, slot]
                s_rc[r, j] = s_rc[r, j] + smem.s_mask[key, slot]  # −∞ for an invalid key
        alpha = softmax.update(s_rc)
        if cutlass.const_expr(self.fmt == "simple"):  # P·V = (P · the key's scale)·V_e4m3; ℓ keeps P
            for r in cutlass.range_constexpr(cute.size(tScS_rc, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(tScS_rc, mode=[1])):
                    s_rc[r, j] = s_rc[r, j] * smem.s_kscale[tScS_rc[r, j][1], slot]
        # P: S's registers as bf16 — warpgroup 0's A operand and, stored (indexed like S), warpgroup 1's
        r_p = accumulator_to_a_operand(acc_s, mma.thr_pv, (self.BLOCK_M, self.BLOCK_N), smem.sP.element_type)
        smem_p.publish_p(cute.make_tensor(r_p.iterator, acc_s.layout), alpha, i > 0)
        smem_p.arrive_full()
        return r_p, alpha

    @cute.jit
    def tile_pv(self, mma, acc_o, alpha, p, slot):
        """O *= α where the warp's max moved, then O += P·V over this warpgroup's half (P from
                warpgroup 0's registers, or shared memory for warpgroup 1)."""
        self.rescale_o(acc_o, alpha, mma.tOcO_rc)
        wgmma_sync(mma.pv_mma, acc_o, p, mma.tOrV, b_slot=slot)

    @cute.jit
    def rescale_o(self, acc_o, alpha, tOcO_rc):
        """O[row, :] *= α[row] for this thread's rows — skipped by the whole warp when every α
        is 1 (`rescales`, a warp vote)."""
        num_rows = cute.size(tOcO_rc, mode=[0])
        if self.rescales(alpha, num_rows):  # most tiles keep every row's max: α = 1
            acc_o_rc = acc_rows_cols(acc_o)
            for r in cutlass.range_constexpr(num_rows):
                scale_rows(acc_o_rc, r, alpha[r])

    @cute.jit
    def finish_segment(self, wg: cutlass.Constexpr[int], tidx, work, complete, mma, smem_p, softmax, acc_o, io,
                       sink_rows=None):
        """A segment's epilogue: warpgroup 0 (after warpgroup 1's last P·V) finalises the rows — the
                factor on O (1/ℓ, times the sink's for a whole sequence) and LSE, or piece 0's merge
                factors (part_merge.py; its first thread waits for piece 1's flag); both warpgroups
                scale O, piece 0 adds piece 1's partial (staged in the KV slots), O or the partial is
                stored, piece 1 raises its flag."""
        # a two-piece sequence's pieces; Python False without merges, so none of the branches
        # below is traced then
        merge, hand_over = self.merge_roles(work)
        if cutlass.const_expr(wg == 0):
            smem_p.wait_empty()  # warpgroup 1's last P·V is done
            self.mark(io.marks, 12, tidx == 0)
            self.finish_rows(work, complete, merge, softmax, mma.tScS_rc, tidx % 128, io, sink_rows)
        smem_p.wait_epilogue()
        smem_p.rescale(acc_rows_cols(acc_o), mma.tOcO_rc, io.smem.s_fin)
        self.mark(io.marks, 13, tidx == 0)
        tOcO_rc = mma.tOcO_rc
        if merge:
            self.add_piece_1(acc_o, tidx, wg, work, io.k_base, io.smem.s_mrg[tOcO_rc[0, 0][0]],
                             io.smem.s_mrg[tOcO_rc[1, 0][0]], io.mOp)
        self.store_o(acc_o, tidx, wg, work, complete | merge, io)
        if hand_over:
            self.raise_piece_1(work, tidx, io.mLp)

    @cute.jit
    def finish_rows(self, work, complete, merge, softmax, tScS_rc, tid_wg, io, sink_rows):
        """Warpgroup 0: 1/ℓ and LSE of its rows; each row's quad leader writes the final factor
                (finish_row) or piece 0's merge factors (merge_row); `sink_rows`: from load_sink_rows,
                or None: loaded here."""
        num_rows = cute.size(tScS_rc, mode=[0])
        inv_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        lse = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        softmax.finalize(inv_sum, lse)
        if merge:
            self.await_piece_1(work, tid_wg, io.mLp)
        for r in cutlass.range_constexpr(num_rows):
            row = tScS_rc[r, 0][0]
            if tScS_rc[r, 0][1] == 0:
                if cutlass.const_expr(sink_rows is None):
                    h = io.sink[work.head_block * self.BLOCK_M + row]
                else:
                    h = sink_rows[r]
                if merge:
                    self.merge_row(work, row, inv_sum[r], lse[r], h, io.smem.s_fin, io.smem.s_mrg, io.mLSE, io.mLp)
                else:
                    self.finish_row(work, complete, row, inv_sum[r], lse[r], h, io.smem.s_fin, io.mLSE, io.mLp)

    @cute.jit
    def load_sink_rows(self, head_block, tScS_rc, sink):
        """Warpgroup 0, once a CTA: the sinks of its rows, loaded at the start so that no epilogue
                waits for them (docs/STAGE_E.md, the stamps at b 2)."""
        num_rows = cute.size(tScS_rc, mode=[0])
        out = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(num_rows):
            out[r] = sink[head_block * self.BLOCK_M + tScS_rc[r, 0][0]]
        return out

    @cute.jit
    def rescales(self, alpha, num_rows: cutlass.Constexpr[int]):
        """Whether this warp rescales O this tile (stages/common/lazy_softmax.py: some row's α ≠ 1;
        a warp vote, the same in every lane)."""
        return needs_rescale(alpha, num_rows)

    def merge_roles(self, work):
        """(piece 0: merges; piece 1: hands its partial over) — traced Booleans, or Python False for
                both without in-kernel merges (their branches are then not traced)."""
        if not self.merges:
            return False, False
        two = self.sched.pieces(work.batch * self.c.s_q + work.token) == 2
        return two & (work.split == 0), two & (work.split == 1)

    @cute.jit
    def await_piece_1(self, work, tid_wg, mLp):
        """Warpgroup 0, piece 0: its first thread waits for piece 1's flag (after ZeroFlags, the
        launch before, has lowered it); then every thread of warpgroup 0 may read piece 1's LSEs."""
        if tid_wg == 0:
            cute.arch.griddepcontrol_wait()
            wait_flag(flag_address(mLp.iterator.toint(), self.sched.row_block(work), self.BLOCK_M))
        named_sync(NamedBarrier.FLAG_SEEN, 128)

    @cute.jit
    def add_piece_1(self, acc_o, tidx, wg: cutlass.Constexpr[int], work, k_base, f_lo, f_hi, mOp):
        """Both MMA warpgroups, piece 0: O += piece 1's partial · its factor (f_lo, f_hi: the
        factors of this thread's two rows), staged in the idle KV slots."""
        piece1 = self.sched.partial_row_block(work._replace(split=1))
        src = mOp.iterator.toint() + cutlass.Int64(piece1) * (self.BLOCK_M * D * 4)
        stage_partial(tidx, self.MMA_THREADS, src, k_base, self.BLOCK_M, D * 4)
        named_sync(NamedBarrier.EPILOGUE, self.MMA_THREADS)  # every thread's copies have landed
        add_staged_rows(acc_o, tidx, k_base, D * 4, wg * (D // self.NUM_MMA_WG), f_lo, f_hi)

    @cute.jit
    def raise_piece_1(self, work, tidx, mLp):
        """Both MMA warpgroups, piece 1: once every MMA thread has issued its partial's stores,
        one thread raises the flag (after ZeroFlags has lowered it)."""
        named_sync(NamedBarrier.EPILOGUE, self.MMA_THREADS)
        if tidx == 0:
            cute.arch.griddepcontrol_wait()
            raise_flag(flag_address(mLp.iterator.toint(), self.sched.row_block(work), self.BLOCK_M))

    @cute.jit
    def finish_row(self, work, complete, row, inv_sum, lse, sink_h, s_fin, mLSE, mLp):
        """Warpgroup 0, a row's quad leader: the row's final factor (a whole sequence takes the
        sink here; a partial's is the combine's) and its LSE."""
        s_fin[row] = cutlass.select_(complete, inv_sum * sink_factor(sink_h, lse), inv_sum)
        self.store_lse(work, complete, row, lse, mLSE, mLp)

    @cute.jit
    def merge_row(self, work, row, inv_sum, lse, sink_h, s_fin, s_mrg, mLSE, mLp):
        """Warpgroup 0, a row's quad leader, piece 0 of a two-piece sequence: the factors on its
        own O and on piece 1's partial, and the merged row's LSE (stages/common/part_merge.py)."""
        piece1 = self.sched.partial_row_block(work._replace(split=1))
        lse1 = load_l2(mLp.iterator.toint() + cutlass.Int64(piece1 * self.BLOCK_M + row) * 4)
        f0, f1, merged = merge_factors(inv_sum, lse, lse1, sink_h)
        s_fin[row] = f0
        s_mrg[row] = f1
        mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(merged)

    @cute.jit
    def load_q(self, work, tid_wg, io):
        """Warp 0 (tid_wg < 32): Q's row block of segment `work` by TMA, its bytes counted on
        io.q_bar (armed by one thread)."""
        if tid_wg < 32:
            gQ = cute.local_tile(io.mQ, (self.BLOCK_M, D), (None, 0))
            tQsQ, tQgQ = tma_partition_tile(io.tma_q, io.smem.sQ, gQ, 2)
            if tid_wg == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(io.q_bar, self.q_bytes)
            cute.copy(io.tma_q, tQgQ[(None, self.sched.row_block(work))], tQsQ[(None, 0)], tma_bar_ptr=io.q_bar)

    @cute.jit
    def store_lse(self, work, complete, row, lse, mLSE, mLp):
        """A whole sequence's LSE (+∞ for a row with no key) or a partial's (−∞ then)."""
        if cutlass.const_expr(self.partials):
            if complete:
                mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(lse)
            else:
                mLp[self.sched.partial_row_block(work) * self.BLOCK_M + row] = lse
        else:  # every segment is a whole sequence
            mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(lse)

    @cute.jit
    def store_o(self, acc_o, tidx, wg: cutlass.Constexpr[int], work, complete, io):
        """A whole sequence's O (bf16, or fp8_rope's e4m3 and exponents) or a partial's (fp32),
        from the scaled accumulator."""
        if cutlass.const_expr(self.partials):
            if complete:
                self.store_final(acc_o, tidx, wg, self.sched.row_block(work), io)
            else:
                self.store_block(acc_o, tidx, io.mOp, self.sched.partial_row_block(work))
        else:  # every segment is a whole sequence
            self.store_final(acc_o, tidx, wg, self.sched.row_block(work), io)

    @cute.jit
    def store_final(self, acc_o, tidx, wg: cutlass.Constexpr[int], row_block, io):
        """A whole (or merged) sequence's O: bf16 rows, or the fused FP8 epilogue
        (stages/common/fp8_epilogue.py: inverse RoPE, a UE8M0 exponent a 128 values, e4m3)."""
        if cutlass.const_expr(self.fp8):
            store_accumulator_fp8(acc_o, tidx, wg, row_block, io.fp8, D // self.NUM_MMA_WG)
        else:
            self.store_block(acc_o, tidx, io.mO, row_block)

    @cute.jit
    def store_block(self, acc_o, tidx, mOut, row_block):
        """acc_o as mOut's type (O bf16, partials fp32) into 64-row block `row_block` by 16-byte
                stores, each thread's words transposed across its quad (quad_store.py)."""
        size = mOut.element_type.width // 8
        base = mOut.iterator.toint() + cutlass.Int64(row_block) * (self.BLOCK_M * D * size)
        col0 = (tidx // 128) * (D // self.NUM_MMA_WG)
        if cutlass.const_expr(self.pair_stores and size == 4):
            store_accumulator_pairs(acc_o, tidx, base, D * size, col0)
        else:
            store_accumulator_wide(acc_o, tidx, base, D * size, col0, mOut.element_type)


@cute.jit
def _stamp_if(addr, here):
    if here:
        stamp(addr)


def _check_even_columns(k_smem, col64: int) -> None:
    """Raise unless every 8-column piece of K's slots lies col64 / 8 bytes after the one before
    (no-swizzle atoms: true), as dequant_nvfp4's stores assume."""
    for c8 in range(D // 8):
        if slot_offset(k_smem, 0, 8 * c8, 0) - slot_offset(k_smem, 0, 0, 0) != c8 * (col64 // 8):
            raise ValueError(f"stage E sm90: nvfp4's stores need K's 8-column pieces evenly spaced (column {8 * c8})")


def _token_block(base, index, block_size: int, block_bytes: int):
    """(64-bit byte address of token `index`'s page block, its offset there); a negative index (−1,
        never loaded) as token 0, so no address lies below the cache."""
    index = cutlass.max(index, 0)
    return base + cutlass.Int64(index // block_size) * block_bytes, cutlass.Int64(index % block_size)


@cute.jit
def _idx_offset(idx, work, pos):
    """The byte offset of idx[batch, token, pos] (int32 entries, the tensor's own strides)."""
    return (work.batch * idx.stride[0] + work.token * idx.stride[1] + pos * idx.stride[2]) * 4
