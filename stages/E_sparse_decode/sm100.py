"""Stage E on Blackwell (sm_100a): DSV4 decode attention over an FP8 paged cache — sparse
indices, the main and the extra (SWA) key lists under one softmax, attention sink, split-KV.
tcgen05 MMAs with S and O in tensor memory, P through shared memory.

Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math and contract: oracles/sparse_decode.py (tensors, constructor keywords and __call__ as
stages/E_sparse_decode/sm90.py).  Per query row (batch, token, head):
    O = softmax(Q·Kᵀ · scale) · V · 1/(1 + exp(sink[h] − LSE)),  LSE = ln Σ exp(Q·Kᵀ · scale)
over the valid keys of both lists (position < the list's length, index ≠ −1), K = V = the
dequantised cache rows, scale = softmax_scale[0] (runtime fp32; `score_scale_log2` folds log2 e
in once); a row with no valid key: O = 0, LSE = +∞.

Everything but the producer is the sm100 decode house (stages/common/sm100_decode.py).  New
here, through the house's hooks (kv_pipeline, smem_fields, bind_keys, is_producer, load_role):

    One token per CTA.  A sequence's tokens attend DIFFERENT key lists, so the house runs over
        b·s_q "sequences" of one token (DecodeShape(b·s_q, 1, h_q, …), the same bytes of Q and
        O), h_q ≤ 128 rows a CTA (h_q = 64: rows 64 … 127 TMA zero padding, never stored); the
        LSE view is re-indexed so flat row (b·s_q + t)·h_q + h lands at LSE[b, h, t].
    The key list replaces the TMA of KV.  The tile space is the main list's 64-key tiles, then
        the extra list's; a CTA visits its split's tiles below the list's length
        (scheduler.visit_tiles).
    The index warp (warp 5: Q's TMA first).  Per visited tile, lane l reads list positions l
        and l + 32 (clamped into the list) and makes them cache indices or −1; publishes the 64
        mask flags (0 or −∞) in a 2-slot mask ring (PipelineAsync, 32 → 128 threads, added to
        the scores before the row max); then per 128-column chunk, in the house's chunk order,
        takes a slot of the 2-slot raw staging ring (PipelineTmaAsync → the dequantisers),
        writes the 64 indices and row ids into its sidecar and issues the TMA gather4 of the
        chunk's bytes of the 64 rows (sm100_gather.py).  The cache as a uniform row array (a
        tensor map per list): v4.1 — 528-byte rows, row = index, 512 bytes gathered; model1 —
        576-byte rows, row = block · (block_bytes / 576) + offset, all gathered (the rope chunk
        192 bytes, three boxes).  An invalid key's row id is 0 (never read).  `simple` and `nvfp4` are no
        uniform row array: no gather, the dequantisers load the rows from global memory.
    The dequantisation warps (6 … 9, 128 threads).  Per chunk: wait for the raw slot, read the
        4 indices of their keys (thread p: keys p // 8 + 16 r, r = 0 … 3; columns 16 (p mod 8)
        … + 15), issue the valid ones' scale loads (simple / nvfp4: the raw bytes too), take a
        slot of the house's bf16 chunk ring (PipelineAsyncUmma → the MMA warp), then key by key
        (8 registers, not 32) convert (e4m3 × scale → bf16; the rope as stored; nvfp4 by
        e2m1_bits.py; an invalid key → zeros, so P·V never meets a NaN) and write the K-major
        128-byte-swizzled tile through a (key, column, slot) view proven to address the MMA's
        operand bytes (`check_key_col_view`); release the raw slot (one arrive a warp),
        fence.proxy.async, arrive.  Scales: model1 — e8m0 byte col // 64 of the token's 7;
        v4.1 — byte col // 32 of its 16 (powers of two: exact); simple — unscaled (exact).
    simple's fp32 key scale (KEY_SCALE "scores", as sm90.py): the index warp publishes each
        valid key's scale in a `key_scale` ring beside the mask (−1 for an invalid key, so the
        scale is the mask); each softmax thread takes S ← S·scale (−∞ at −1) before the row max
        and, after ℓ has summed P, P ← P·scale in fp32 before the bf16 cast (probs_for_pv).  So
        O = Σ bf16(P·scale)·e4m3 / ℓ and LSE carries no bf16 rounding of a scaled key.
    Shared memory: the staging ring takes 2 × 8 KiB (v4.1) or 2 × 12 KiB (model1) from the
        house's bf16 ring (smem_reserved): 4 or 3 chunk slots instead of 5.
    Sink: the house's row_scale hook with one split; SplitCombine applies it after the merge.


Not here yet: FlashMLA's 2-CTA cluster sharing the dequantisation (csrc/sm100/decode/sparse_fp8).

Warp roles (320 threads)
    warps 0-3   softmax: house (S from TMEM, key mask, P → SMEM, O rescale, epilogue)
    warp 4      MMA: house (Q·Kᵀ chunk by chunk, P·V of this CTA's half)
    warp 5      index warp: Q by TMA, key indices + mask, row ids, TMA gather4 into the raw ring
    warps 6-9   dequantisation: raw ring (+ scales) → bf16 chunk ring"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05

from stages.common import hang_guard
from stages.common.combine import SplitCombine, sink_factor
from stages.common.e2m1_bits import TWO_126, e2m1x8_to_bf16, scale_factors, scale_select
from stages.common.fp8_cache import (D, D_NOPE, NVFP4_ROW_BYTES, NVFP4_SCALE_BYTES, cache_block_bytes, convert16,
                                     e8m0_to_f32, ldg8, ldg16, ldg_f32, ldg_u8, lds16)
from stages.common.fp8_epilogue import (ROPE_START, Fp8Out, absmax, cvt_e4m3x2, inverse_scale, rotate_pair, st_b8,
                                        st_b16, st_b32, st_v4, ue8m0_byte)
from stages.common.sparse_config import MAX_TOPK, SparseConfig
from stages.common.scheduler import DecodeShape, valid_tiles, visit_tiles
from stages.common.sm100_decode import B200_SMS, KV_TILE, ROWS, DecodeSm100
from stages.common.sm100_softmax import final_row_lse, row_inv_sum, row_lse
from stages.common.sm100_gather import gather4_atom, gather4_partition, gather4_tile, rows_view
from stages.common.sm100_idioms import fragment_coords
from stages.common.sm90_idioms import tma_pipeline
from stages.common.softmax import runtime_scale_log2

BF16 = cutlass.BFloat16
F32 = cutlass.Float32
PIECE = 16  # columns one thread dequantises per key (16 e4m3 = one 16-byte load)
MASK_SLOTS = 2
RAW_SLOTS = 2
BOX = 64  # bytes of a row per gather4 box column
GATHER_ROWS = {"model1": (576, 576), "v4.1": (528, 512)}  # (row bytes, bytes gathered) of a gathered format
RAW_WIDTH = {"model1": 192, "v4.1": 128}  # staging bytes a key: the widest chunk (model1: 64 e4m3 + 128 rope)
# Where a format's per-key scale is applied (the same plan as sm90.py):
#   "keys"   — in the dequantisation, bf16(e4m3 × scale): exact for model1 / v4.1, whose scales are
#              powers of two (e8m0);
#   "scores" — after the MMA, in fp32: the ring holds the exact e4m3 values (bf16, unscaled), the
#              index warp publishes each key's fp32 scale beside the mask ring, the softmax threads
#              take S·scale before the row max and P·scale before the bf16 cast (ℓ sums the
#              unscaled P).  simple's scale is any fp32: bf16(e4m3 × scale) would round every key
#              (LSE rel L2 2–4e-4 against the stage's 1e-5; tests/test_sm100_rounding.py).
#   nvfp4 (issue 33) — "keys": bf16(e2m1 × e4m3 scale) is exact (6 significant bits at most).
KEY_SCALE = {"simple": "scores", "model1": "keys", "v4.1": "keys", "nvfp4": "keys"}


def gather_row(index, block_size: int, block_bytes: int, row_bytes: int):
    """The gather row of cache index `index` (= block · block_size + offset) in the uniform row view
        (sm100_gather.rows_view): block · (block_bytes / row_bytes) + offset; ints or traced Int32."""
    return index // block_size * (block_bytes // row_bytes) + index % block_size


def check_key_col_view(kw_smem, k_smem, k_coords) -> int:
    """Trace-time proof that the dequantisers' (key, col, slot) view `kw_smem` of the ring and the
        MMA's K operand layout `k_smem` (k_coords partitioned like the B operand) give every element
        of a slot the same offset before the swizzle, and the same slot stride.  Returns the
        elements compared; ValueError names the first mismatch."""
    if str(kw_smem.inner) != str(k_smem.inner):
        raise ValueError(f"K write view: swizzles differ ({kw_smem.inner} vs {k_smem.inner})")
    k_one = cute.select(k_smem.outer, mode=[0, 1, 2])
    slots = cute.size(kw_smem.outer, mode=[2])
    if slots > 1 and kw_smem.outer((0, 0, 1)) != cute.select(k_smem.outer, mode=[3])(1):
        raise ValueError("K write view: the ring slots are a different stride apart")
    coords = fragment_coords(k_coords)
    for i in range(cute.size(k_coords)):
        key, col = coords[i]
        if kw_smem.outer((key, col, 0)) != k_one(i):
            raise ValueError(f"K write view: key {key}, column {col} is at {kw_smem.outer((key, col, 0))}, "
                             f"the MMA reads it at {k_one(i)}")
    return cute.size(k_coords)


class SparseKeys:
    """The tiles one CTA visits and where their keys come from (traced values, read by the kernel's
        methods outside staged loops and `if`s): plan = (n_local, n_first, first_begin,
        second_begin) — n_first main-list tiles from first_begin, then extra-list tiles from
        second_begin; lists = (KV, idx, main_len, KV_extra, idx_extra, extra_len); gathers = (atom,
        coordinates) of each list, or Nones.  `bind` adds the shared-memory pieces."""

    masked = True

    def __init__(self, plan, lists, seq, gathers, kw_smem):
        self.n_local, self.n_first, self.first_begin, self.second_begin = plan
        self.plan, self.lists, self.seq, self.gathers, self.kw_smem = plan, lists, seq, gathers, kw_smem

    def atoms(self):
        return tuple(g[0] for g in self.gathers if g is not None)

    def partition(self, sK, qk_thr, k_tiler, batch) -> None:
        """No KV TMA: the ring is written by the dequantisation warps."""

    def clean_v(self, j, lines, slot):
        """Nothing to clean: an invalid key's row is written as zeros by the dequantisers."""

    @cute.jit
    def mask(self, j, rS, key_cols: cutlass.Constexpr, token):
        """Softmax thread: wait for tile j's flags, add them to its row's scores (register i holds key
                column key_cols[i]), release the mask slot.  scores_scaled (simple): the key-scale ring
                is the mask, S ← S · scale or −∞ where the index warp published −1 (one shared load a
                score: reading the flags too spilled); released by scale_probs."""
        st = pipeline.PipelineState(MASK_SLOTS, j, j % MASK_SLOTS, (j // MASK_SLOTS) % 2)
        self.mask_pipe.consumer_wait(st)
        if cutlass.const_expr(self.scores_scaled):
            for i in cutlass.range_constexpr(cute.size(rS)):
                ks = self.s_kscale[key_cols[i], st.index]
                rS[i] = F32(-F32.inf) if ks < F32(0.0) else rS[i] * ks
        else:
            for i in cutlass.range_constexpr(cute.size(rS)):
                rS[i] = rS[i] + self.s_mask[key_cols[i], st.index]
            self.mask_pipe.consumer_release(st)

    @cute.jit
    def scale_probs(self, j, p, rS, key_cols: cutlass.Constexpr):
        """Softmax thread, scores_scaled only: P · key scale in fp32 (rS holds it: S is dead)
        for the P·V MMA over the unscaled e4m3 values; then tile j's mask slot is released."""
        st = pipeline.PipelineState(MASK_SLOTS, j, j % MASK_SLOTS, (j // MASK_SLOTS) % 2)
        rS.store(p)
        # A fence the compiler cannot move the scale loads above: hoisted over the exp2s they
        # kept 64 more registers live and spilled at the 168-register ceiling (s2h128 simple).
        cute.arch.fence_acq_rel_cta()
        for i in cutlass.range_constexpr(cute.size(rS)):
            rS[i] = rS[i] * self.s_kscale[key_cols[i], st.index]
        self.mask_pipe.consumer_release(st)
        return rS.load()


class Kernel(DecodeSm100):
    """FP8 paged sparse decode on Blackwell (module doc).  Options beyond the stage's axes: o_split,
        s_stages, sm_count (DecodeSm100); an impossible TMEM plan raises ValueError("TMEM budget:
        …").  Each list at most MAX_TOPK entries; "auto" splits at most AUTO_SPLITS."""

    NAME = "stage E sm100"
    DEQUANT_WARPS = (6, 7, 8, 9)
    DEQUANT_THREADS = 32 * 4
    THREADS = 32 * 10

    def __init__(self, *, b: int, config: str, kv_format: str, splits, epilogue: str = "bf16",
                 sm_count: int = B200_SMS, o_split: int | None = None, s_stages: int = 2):
        c = SparseConfig.parse(config)
        # epilogue: bf16 (O) or fp8_rope — O's rope lanes inverse-rotated, e4m3 with a UE8M0
        # exponent a 128 values (stages/common/fp8_epilogue.py): the one-split epilogue
        # (`epilogue`, two passes over TMEM) or SplitCombine's
        if epilogue not in ("bf16", "fp8_rope"):
            raise ValueError(f"{self.NAME}: epilogue must be bf16 or fp8_rope, got {epilogue!r}")
        self.fp8 = epilogue == "fp8_rope"
        if self.fp8 and c.h_q % 8:
            raise ValueError(f"{self.NAME}: epilogue fp8_rope needs h_q a multiple of 8, got {c.h_q}")
        if c.h_q > ROWS:
            raise ValueError(f"{self.NAME}: h_q ≤ {ROWS} (one token's heads per CTA), got {c.h_q}")
        if max(c.topk, c.extra_topk) > MAX_TOPK:
            raise ValueError(f"{self.NAME}: topk {c.topk} / extra_topk {c.extra_topk}: at most {MAX_TOPK} a list "
                             f"(FlashMLA's largest)")
        self.c, self.fmt, self.b_real = c, kv_format, b
        self.block_bytes = cache_block_bytes(kv_format, c.block)
        self.extra_block_bytes = cache_block_bytes(kv_format, c.extra_block if c.has_extra else 1)
        self.gather = kv_format in GATHER_ROWS
        self.scores_scaled = KEY_SCALE[kv_format] == "scores"
        self.raw_slot_bytes = KV_TILE * RAW_WIDTH[kv_format] if self.gather else 0
        self.main_tiles = -(-c.topk // KV_TILE)
        self.extra_tiles = -(-c.extra_topk // KV_TILE) if c.has_extra else 0
        tiles = self.main_tiles + self.extra_tiles
        n = tiles * KV_TILE
        reserved = RAW_SLOTS * self.raw_slot_bytes + 1024  # the staging ring; mask ring + sidecars
        self.setup_plan(DecodeShape(b * c.s_q, 1, c.h_q, n, D, n), splits, sm_count, o_split, s_stages,
                        n_tiles=tiles, smem_reserved=reserved)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, Q: cute.Tensor, KV: cute.Tensor, idx: cute.Tensor, topk_length: cute.Tensor,
                 KV_extra: cute.Tensor, idx_extra: cute.Tensor, extra_length: cute.Tensor, sink: cute.Tensor,
                 softmax_scale: cute.Tensor, cos_sin_cache: cute.Tensor, positions: cute.Tensor, O: cute.Tensor,
                 LSE: cute.Tensor, O_fp8: cute.Tensor, O_scale: cute.Tensor, O_part: cute.Tensor,
                 LSE_part: cute.Tensor, stream: cuda.CUstream):
        self._check_sparse_tensors(Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part, softmax_scale)
        self._check_fp8_tensors(cos_sin_cache, positions, O_fp8, O_scale)
        v, ops, tma_q, tma_Q = self.prepare(Q, O, LSE, O_part, LSE_part)
        qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem = ops
        kw_smem = self.key_col_layout(qk_mma, pv_mma, k_smem)
        tma_m, g_m = self.gather_atom(KV, self.block_bytes, self.gather)
        tma_x, g_x = self.gather_atom(KV_extra, self.extra_block_bytes, self.gather and self.c.has_extra)
        self.start(self.kernel(qk_mma, pv_mma, tma_q, tma_Q, KV, idx, topk_length, KV_extra, idx_extra,
                               extra_length, sink, softmax_scale, v.eO, v.mLSE, v.eOp, v.mLp, q_smem, k_smem,
                               v_smem, p_smem, kw_smem, tma_m, g_m, tma_x, g_x,
                               *((O_fp8, O_scale, cos_sin_cache, positions) if self.fp8 else (None,) * 4)), stream)
        if cutlass.const_expr(self.splits > 1):
            SplitCombine(v.all_rows, self.splits, D, sink_heads=self.c.h_q, fp8=self.fp8).launch(
                v.mOp, v.mLp, v.mO, v.mLSE, stream, sink=sink,
                fp8_args=(O_fp8, O_scale, cos_sin_cache, positions, self.rope_sin_sign()) if self.fp8 else None)

    def _check_fp8_tensors(self, cos_sin_cache, positions, O_fp8, O_scale) -> None:
        """Trace time, epilogue fp8_rope: the shapes of oracles/fp8_epilogue.py."""
        if not self.fp8:
            return
        n = self.b_real * self.c.s_q
        want = {"O_fp8": (O_fp8, (self.c.h_q // 8, n, 8, D // 4)), "O_scale": (O_scale, (self.c.h_q // 8, 8, -(-n // 4) * 4)),
                "positions": (positions, (n,))}
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"{self.NAME}: {name} has shape {tuple(t.shape)}, the case needs {shape}")
        if cos_sin_cache.shape[1] != 64:
            raise ValueError(f"{self.NAME}: cos_sin_cache must be [max_position, 64], got {tuple(cos_sin_cache.shape)}")

    def chunk_columns(self, tTR_cO, o_chunks: int, pv_tiles: int) -> dict:
        """Trace time: {(pv tile, chunk): its first column in this CTA's slab}, each TMEM chunk
        a thread loads being 32 consecutive columns of its row (else ValueError)."""
        cols = {}
        for t in range(pv_tiles):
            for ch in range(o_chunks):
                cc = tTR_cO[None, ch, None, t]
                first = cc[0][1]
                if not isinstance(first, int) or any(cc[j][1] != first + j for j in range(cute.size(cc))):
                    raise ValueError(f"{self.NAME}: the FP8 epilogue takes a TMEM chunk as consecutive columns; "
                                     f"chunk ({t}, {ch}) is not")
                cols[(t, ch)] = first
        return cols

    def rope_sin_sign(self) -> float:
        """The sign on every sin of the epilogue's inverse rotation (1: the conjugate rotation,
        oracles/fp8_epilogue.py) — a hook, so a test fixture can plant a bug here."""
        return 1.0

    def gather_atom(self, cache, block_bytes: int, wanted: bool):
        """(gather4 atom, coordinate tensor) over `cache` seen as uniform rows, or (None, None)."""
        if not wanted:
            return None, None
        row_bytes, cols = GATHER_ROWS[self.fmt]
        return gather4_atom(rows_view(cache, block_bytes, row_bytes, cols), KV_TILE, BOX, RAW_SLOTS)

    def host_views(self, Q, O, LSE, O_part, LSE_part):
        """The house's views over b·s_q one-token sequences; LSE [b, h_q, s_q] re-indexed so
        flat row (b·s_q + t)·h_q + h is LSE[b, h, t] (shape (h_q, s_q, b), colexicographic)."""
        v = super().host_views(Q, O, LSE, O_part, LSE_part)
        c, b = self.c, self.b_real
        v.mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((c.h_q, c.s_q, b), stride=(c.s_q, 1, c.h_q * c.s_q)))
        return v

    def key_col_layout(self, qk_mma, pv_mma, k_smem):
        """The dequantisers' (key, col, slot) view of the ring: the K-major 128-byte-swizzle
        atom tiled keys first — proven to be the MMA's bytes (check_key_col_view)."""
        atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, BF16)
        kw = cute.tile_to_shape(atom, (KV_TILE, self.chunk, self.slots), order=(0, 1, 2))
        k_coords, _ = self.kv_coords(qk_mma, pv_mma)
        check_key_col_view(kw, k_smem, k_coords)
        return kw

    def _check_sparse_tensors(self, Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part, softmax_scale) -> None:
        """Trace time: the case's shapes (cache block sizes in bytes included); "auto" splits
        capped to the scratch's capacity, a forced count must fit."""
        c, b = self.c, self.b_real
        want = {"Q": (Q, (b, c.s_q, c.h_q, D)), "idx": (idx, (b, c.s_q, c.topk)),
                "O": (O, (b, c.s_q, c.h_q, D) if not self.fp8 else tuple(O.shape)), "LSE": (LSE, (b, c.h_q, c.s_q)),
                "O_part": (O_part, (O_part.shape[0], b, c.s_q, c.h_q, D)),
                "LSE_part": (LSE_part, (O_part.shape[0], b, c.s_q, c.h_q)),
                "softmax_scale": (softmax_scale, (1,))}
        if c.has_extra:
            want["idx_extra"] = (idx_extra, (b, c.s_q, c.extra_topk))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{self.NAME}: {name} has shape {tuple(t.shape)}, the case needs {tuple(shape)}")
        if KV.shape[1] != self.block_bytes or (c.has_extra and KV_extra.shape[1] != self.extra_block_bytes):
            raise ValueError(f"{self.NAME}: {self.fmt} blocks of {c.block} / {c.extra_block} tokens are "
                             f"{self.block_bytes} / {self.extra_block_bytes} bytes; the caches have "
                             f"{KV.shape[1]} / {KV_extra.shape[1]}")
        self._cap_splits(O_part.shape[0])

    # ---- the house's hooks: shared memory, the ring's producer side
    def smem_fields(self):
        """Barriers of the mask and raw rings; the mask ring (64 fp32 flags a slot), the raw ring's
                sidecars (64 indices, and 64 row ids for a gathered format) and bytes; simple: the keys'
                fp32 scales in the row ids' bytes."""
        barriers = {"mask_mbar": cute.struct.MemRange[cutlass.Int64, 2 * MASK_SLOTS],
                    "raw_mbar": cute.struct.MemRange[cutlass.Int64, 2 * RAW_SLOTS]}
        buffers = {"key_mask": cute.struct.Align[cute.struct.MemRange[F32, KV_TILE * MASK_SLOTS], 16],
                   "raw_idx": cute.struct.Align[cute.struct.MemRange[cutlass.Int32, KV_TILE * RAW_SLOTS], 16]}
        if self.scores_scaled:
            buffers["key_scale"] = cute.struct.Align[cute.struct.MemRange[F32, KV_TILE * MASK_SLOTS], 16]
        if self.gather:
            buffers["raw_rows"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int32, KV_TILE * RAW_SLOTS], 16]
            buffers["raw"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, RAW_SLOTS * self.raw_slot_bytes], 1024]
        return barriers, buffers

    def kv_pipeline(self, storage):
        """The chunk ring is written by 128 dequantisation threads (release: tcgen05.commit)."""
        return pipeline.PipelineAsyncUmma.create(
            num_stages=self.slots,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.DEQUANT_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            barrier_storage=storage.kv_mbar.data_ptr(), name=hang_guard.name("kv"),
        )

    def bind_keys(self, keys, storage) -> None:
        """The mask ring (index warp → softmax), the raw ring (gather4 → dequantisers) with sidecars and
                staging bytes, the gather partitions and the (key, col, slot) view of the chunk ring."""
        keys.mask_pipe = pipeline.PipelineAsync.create(
            num_stages=MASK_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.SOFTMAX_THREADS),
            barrier_storage=storage.mask_mbar.data_ptr(), name=hang_guard.name("mask"),
        )
        keys.raw_pipe = tma_pipeline(storage.raw_mbar, RAW_SLOTS, self.raw_slot_bytes, len(self.DEQUANT_WARPS),
                                     defer_sync=False, name="raw")  # one arrive a dequantisation warp
        keys.s_mask = storage.key_mask.get_tensor(cute.make_layout((KV_TILE, MASK_SLOTS)))
        keys.s_idx = storage.raw_idx.get_tensor(cute.make_layout((KV_TILE, RAW_SLOTS)))
        keys.scores_scaled = self.scores_scaled
        keys.s_kscale = None
        if self.scores_scaled:
            keys.s_kscale = storage.key_scale.get_tensor(cute.make_layout((KV_TILE, MASK_SLOTS)))
        keys.s_rows = None
        keys.s_raw = None
        keys.parts = (None, None)
        if self.gather:
            s_rows = storage.raw_rows.get_tensor(cute.make_layout(KV_TILE * RAW_SLOTS))
            keys.s_rows = cute.make_tensor(s_rows.iterator, cute.make_layout((KV_TILE, RAW_SLOTS)))
            regions = RAW_WIDTH[self.fmt] // BOX
            keys.s_raw = storage.raw.get_tensor(cute.make_layout(
                (KV_TILE, BOX, regions, RAW_SLOTS), stride=(BOX, 1, KV_TILE * BOX, self.raw_slot_bytes)))
            keys.parts = tuple(None if g is None else gather4_partition(g[0], g[1], keys.s_raw, s_rows, KV_TILE, BOX)
                               for g in keys.gathers)
            self.gather_tx = self.gather_bytes(next(p for p in keys.parts if p is not None)[0])
        keys.sKw = storage.sKV.get_tensor(keys.kw_smem.outer, swizzle=keys.kw_smem.inner)  # the ring's bytes

    def probs_for_pv(self, keys, j, p, rS, key_cols):
        """The house's hook on P before its bf16 cast: simple's P · key scale (KEY_SCALE)."""
        if self.scores_scaled:
            return keys.scale_probs(j, p, rS, key_cols)
        return p

    def gather_bytes(self, tAsA) -> tuple[int, int]:
        """(bytes a 128-byte chunk deposits, bytes model1's wide rope chunk deposits) on the raw slot's
                mbarrier, from the copy atom's partition (a chunk is 2 gather4 tiles, 3 wide).  Trace
                time: a tile is KV_TILE rows × BOX bytes, the wide chunk fits its slot, and the chunks
                add up to the bytes gathered a row; else ValueError."""
        tile = int(cute.size_in_bytes(cutlass.Uint8, tAsA[None, 0, 0].layout))
        narrow = 2 * tile
        wide = 3 * tile if self.fmt == "model1" else narrow
        per_row = GATHER_ROWS[self.fmt][1]
        total = (self.n_chunks - 1) * narrow + wide
        if tile != KV_TILE * BOX or wide > self.raw_slot_bytes or total != KV_TILE * per_row:
            raise ValueError(f"{self.NAME}: a gather4 tile deposits {tile} bytes (want {KV_TILE} rows × {BOX}); "
                             f"chunks of {narrow} / {wide} bytes (slot {self.raw_slot_bytes}) add up to {total}, "
                             f"a tile's {KV_TILE} rows hold {KV_TILE * per_row} gathered bytes")
        return narrow, wide

    def is_producer(self, warp_idx):
        """The index warp and the dequantisation warps (5 … 9)."""
        return warp_idx >= self.LOAD_WARP

    def has_row_scale(self) -> bool:
        """The sink in the epilogue with one split; with split-KV the combine applies it."""
        return self.splits == 1

    def score_scale_log2(self, keys):
        """The house's hook: c = softmax_scale[0] · log2 e from the runtime input (one load a
        softmax thread, before its KV loop: stages/common/softmax.py runtime_scale_log2)."""
        return runtime_scale_log2(keys.softmax_scale)

    def row_scale(self, lse, row, batch, extra):
        """The sink's factor on a final row.  Row = head: one token per CTA.  `extra`: the sink,
        or (sink, Fp8Out) with the FP8 epilogue."""
        sink = extra[0] if self.fp8 else extra
        return sink_factor(sink[row % self.c.h_q], lse)

    @cute.jit
    def epilogue(self, o_load, tTR_tO, tTR_cO, tTR_gO, rO, row_max, row_sum, c, mLSE, mLSEp,
                 rb, half, split, batch, n_local, o_chunks: cutlass.Constexpr, pv_tiles: cutlass.Constexpr, extra):
        """The house's epilogue, or with the FP8 epilogue and one split this thread's row through
                stages/common/fp8_epilogue.py: per 128-column block of d_cta, two passes over its 32-column
                TMEM chunks — amax, then the values (1/ℓ × the sink's factor, the inverse rope rotation,
                x · 2^−e to e4m3, two 16-byte stores a chunk) — and this CTA's bytes of the scale word."""
        if cutlass.const_expr(not self.fp8 or self.splits > 1):
            DecodeSm100.epilogue(self, o_load, tTR_tO, tTR_cO, tTR_gO, rO, row_max, row_sum, c, mLSE, mLSEp,
                                 rb, half, split, batch, n_local, o_chunks, pv_tiles, extra)
        else:
            self.fp8_epilogue(o_load, tTR_tO, tTR_cO, rO, row_max, row_sum, c, mLSE, rb, half, batch, n_local,
                              o_chunks, pv_tiles, extra)

    @cute.jit
    def fp8_epilogue(self, o_load, tTR_tO, tTR_cO, rO, row_max, row_sum, c, mLSE, rb, half, batch, n_local,
                     o_chunks: cutlass.Constexpr, pv_tiles: cutlass.Constexpr, extra):
        sink, out = extra
        row = rb * ROWS + tTR_cO[0][0]
        lse = row_lse(row_max, row_sum, c)
        o_scale = row_inv_sum(row_sum) * sink_factor(sink[row % self.c.h_q], lse)
        token = batch  # one token a sequence here: batch = b_i · s_q + t
        inside = row < self.rows
        o8, sc, pos = out.row_addresses(cutlass.min(row, self.rows - 1) + token * self.c.h_q)
        o8 = o8 + half * self.d_cta
        cols = self.chunk_columns(tTR_cO, o_chunks, pv_tiles)
        chunks = list(cols)
        blocks = self.d_cta // 128
        word = cutlass.Int32(0)
        for blk in cutlass.range_constexpr(blocks):
            mine = [tc for tc in chunks if cols[tc] // 128 == blk]
            amax = F32(0.0)
            for p in cutlass.range_constexpr(2):
                byte = cutlass.Int32(0)
                inv = F32(0.0)
                if cutlass.const_expr(p == 1):
                    byte = ue8m0_byte(amax)
                    inv = inverse_scale(byte)
                    word = word | (byte << (8 * blk))
                for i in cutlass.range_constexpr(len(mine)):
                    t, ch = mine[i]
                    if n_local > 0:
                        cute.copy(o_load, tTR_tO[None, ch, None, t], rO)
                        cute.arch.fence_view_async_tmem_load()
                    else:
                        rO.fill(0.0)
                    self.fp8_rows(rO, o_scale, cols[(t, ch)], half, out.cos_sin, pos, out.sin_sign)
                    if cutlass.const_expr(p == 0):
                        for j in cutlass.range_constexpr(cute.size(rO)):
                            amax = absmax(amax, rO[j])
                    else:
                        w = cute.make_rmem_tensor(8, cutlass.Int32)
                        for k in cutlass.range_constexpr(8):
                            w[k] = (cvt_e4m3x2(rO[4 * k] * inv, rO[4 * k + 1] * inv)
                                    | (cvt_e4m3x2(rO[4 * k + 2] * inv, rO[4 * k + 3] * inv) << 16))
                        at = o8 + cols[(t, ch)]
                        if inside:
                            st_v4(at, w[0], w[1], w[2], w[3])
                            st_v4(at + 16, w[4], w[5], w[6], w[7])
        if inside:
            at = sc + half * blocks
            if cutlass.const_expr(blocks == 4):
                st_b32(at, word)
            elif cutlass.const_expr(blocks == 2):
                st_b16(at, word)
            else:
                st_b8(at, word)
            if half == 0:
                mLSE[batch * self.rows + row] = final_row_lse(lse)

    @cute.jit
    def fp8_rows(self, rO, o_scale, first: cutlass.Constexpr[int], half, cos_sin, pos, sin_sign: cutlass.Constexpr[float]):
        """A chunk's 32 values of this thread's row (columns first … first + 31 of the CTA's
        slab, `half` · d_cta + those of the row) times o_scale, the rope pairs inverse-rotated."""
        for j in cutlass.range_constexpr(cute.size(rO)):
            rO[j] = rO[j] * o_scale
        lowest = ROPE_START - (self.o_split - 1) * self.d_cta  # a slab column that may be a rope lane
        if cutlass.const_expr(first + cute.size(rO) > lowest):
            for j in cutlass.range_constexpr(0, cute.size(rO), 2):
                col = half * self.d_cta + (first + j)
                rope = col >= ROPE_START
                i = cutlass.max(col - ROPE_START, 0) // 2
                cos = cutlass.select_(rope, cos_sin[pos * 64 + i], F32(1.0))
                sin = cutlass.select_(rope, sin_sign * cos_sin[pos * 64 + 32 + i], F32(0.0))
                rO[j], rO[j + 1] = rotate_pair(rO[j], rO[j + 1], cos, sin)


    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               KV: cute.Tensor, idx: cute.Tensor, topk_length: cute.Tensor, KV_extra: cute.Tensor,
               idx_extra: cute.Tensor, extra_length: cute.Tensor, sink: cute.Tensor, softmax_scale: cute.Tensor,
               mO: cute.Tensor,
               mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor, q_smem: cute.ComposedLayout,
               k_smem: cute.ComposedLayout, v_smem: cute.ComposedLayout, p_smem: cute.ComposedLayout,
               kw_smem: cute.ComposedLayout, tma_m, g_m, tma_x, g_x, O_fp8: cute.Tensor | None,
               O_scale: cute.Tensor | None, cos_sin_cache: cute.Tensor | None, positions: cute.Tensor | None):
        c = self.c
        bx, split, seq = cute.arch.block_idx()
        work = self.sched.work(bx // self.o_split, split, seq)
        batch = seq // c.s_q
        main_len = cutlass.max(cutlass.min(topk_length[batch], c.topk), 0)
        extra_len = cutlass.Int32(0)
        if cutlass.const_expr(c.has_extra):
            extra_len = cutlass.max(cutlass.min(extra_length[batch], c.extra_topk), 0)
        plan = visit_tiles(work.tile_begin, work.tile_end, self.main_tiles, valid_tiles(main_len, KV_TILE),
                           valid_tiles(extra_len, KV_TILE))
        gathers = (None if tma_m is None else (tma_m, g_m), None if tma_x is None else (tma_x, g_x))
        keys = SparseKeys(plan, (KV, idx, main_len, KV_extra, idx_extra, extra_len), seq, gathers, kw_smem)
        keys.softmax_scale = softmax_scale
        extra = sink
        if cutlass.const_expr(self.fp8):  # the FP8 epilogue's outputs and inputs ride with the sink
            cs = cute.make_tensor(cos_sin_cache.iterator, cute.make_layout(cute.size(cos_sin_cache)))
            extra = (sink, Fp8Out(O_fp8, O_scale, cs, positions, c.h_q, self.b_real * c.s_q, self.rope_sin_sign()))
        self.attend(keys, work.token, split, seq, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                    q_smem, k_smem, v_smem, p_smem, extra)

    @cute.jit
    def load_role(self, q_prod, kv_pipe, tma_q, tQgQ, tQsQ, keys, shift):
        """Warps 5 … 9: the index warp (5) or a dequantisation warp (6 … 9)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            self.index_role(q_prod, tma_q, tQgQ, tQsQ, keys.plan, keys.lists, keys.seq, keys.mask_pipe, keys.s_mask,
                            keys.s_kscale, keys.raw_pipe, keys.s_idx, keys.s_rows, keys.gathers, keys.parts, shift,
                            tidx % 32)
        else:
            self.dequant_role(kv_pipe, keys.raw_pipe, keys.s_idx, keys.s_raw, keys.sKw, keys.plan, keys.lists, shift,
                              tidx - 32 * self.DEQUANT_WARPS[0])

    def _raw_state(self, g, producer: bool):
        """PipelineState of chunk number g in the raw ring (the producer's phase starts at 1)."""
        phase = (g // RAW_SLOTS) % 2
        if producer:
            phase = phase ^ 1
        return pipeline.PipelineState(RAW_SLOTS, g, g % RAW_SLOTS, phase)

    # ---- the index warp
    @cute.jit
    def index_role(self, q_prod, tma_q, tQgQ, tQsQ, plan, lists, seq, mask_pipe, s_mask, s_kscale, raw_pipe, s_idx,
                   s_rows, gathers, parts, shift, lane):
        """Warp 5: Q once (TMA); per visited tile the 64 keys' indices (lane l: positions l, l + 32),
                the mask flags (simple: the fp32 key scales, −1 invalid), then per chunk a raw slot:
                sidecar, arrive with the gather's bytes, TMA gather4 of the 64 rows."""
        hang_guard.role("index")  # names this role's waits in a --debug-hangs build
        c = self.c
        q_slot = q_prod.acquire_and_advance()
        cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_slot.barrier)
        n_local, n_first, first_begin, second_begin = plan
        KV, idx, main_len, KV_extra, idx_extra, extra_len = lists
        batch = seq // c.s_q
        token = seq % c.s_q
        for j in cutlass.range(n_local, unroll=1):
            second = j >= n_first
            tile = cutlass.Int32(cutlass.select_(second, second_begin + j - n_first, first_begin + j))
            index = cute.make_rmem_tensor(2, cutlass.Int32)
            rows = cute.make_rmem_tensor(2, cutlass.Int32)
            if second:
                if cutlass.const_expr(c.has_extra):
                    self.key_indices(idx_extra, batch, token, tile, extra_len, c.extra_topk, lane, 32, index)
                    self.row_ids(index, c.extra_block, self.extra_block_bytes, rows)
            else:
                self.key_indices(idx, batch, token, tile, main_len, c.topk, lane, 32, index)
                self.row_ids(index, c.block, self.block_bytes, rows)
            kscale = cute.make_rmem_tensor(2, F32)
            kscale.fill(0.0)
            if cutlass.const_expr(self.scores_scaled):  # the loads before the slot wait
                if second:
                    if cutlass.const_expr(c.has_extra):
                        self.key_scales(KV_extra, c.extra_block, self.extra_block_bytes, index, kscale)
                else:
                    self.key_scales(KV, c.block, self.block_bytes, index, kscale)
            m_state = pipeline.PipelineState(MASK_SLOTS, j, j % MASK_SLOTS, ((j // MASK_SLOTS) % 2) ^ 1)
            mask_pipe.producer_acquire(m_state)
            for r in cutlass.range_constexpr(2):
                s_mask[lane + 32 * r, m_state.index] = F32(0.0) if index[r] != -1 else -F32.inf
                if cutlass.const_expr(self.scores_scaled):
                    s_kscale[lane + 32 * r, m_state.index] = kscale[r] if index[r] != -1 else F32(-1.0)
            mask_pipe.producer_commit(m_state)
            for p in cutlass.range_constexpr(self.n_chunks):
                st = self._raw_state(j * self.n_chunks + p, True)
                raw_pipe.sync_object_empty.wait(st.index, st.phase)
                for r in cutlass.range_constexpr(2):
                    s_idx[lane + 32 * r, st.index] = index[r]
                    if cutlass.const_expr(self.gather):
                        s_rows[lane + 32 * r, st.index] = rows[r]
                cute.arch.sync_warp()  # the sidecar before the arrive that publishes it
                cid = (p + shift) % self.n_chunks
                if cutlass.const_expr(self.gather):
                    wide = cid == self.n_chunks - 1  # model1's rope chunk: 192 bytes a row
                    narrow_tx, wide_tx = self.gather_tx  # from the copy atom (gather_bytes)
                    nbytes = narrow_tx
                    if cutlass.const_expr(self.fmt == "model1"):
                        nbytes = cutlass.Int32(cutlass.select_(wide, wide_tx, narrow_tx))
                    raw_pipe.sync_object_full.arrive_and_expect_tx(st.index, nbytes)
                    bar = raw_pipe.producer_get_barrier(st)
                    if second:
                        if cutlass.const_expr(c.has_extra):
                            self.gather_chunk(gathers[1][0], parts[1], st.index, cid, wide, bar)
                    else:
                        self.gather_chunk(gathers[0][0], parts[0], st.index, cid, wide, bar)
                else:
                    raw_pipe.sync_object_full.arrive_and_expect_tx(st.index, 0)  # the sidecar only
        g_end = n_local * self.n_chunks  # wait for the dequantisers' last releases before exit
        for i in cutlass.range_constexpr(RAW_SLOTS):
            st = self._raw_state(g_end + i, True)
            raw_pipe.sync_object_empty.wait(st.index, st.phase)
        q_prod.tail()

    @cute.jit
    def gather_chunk(self, atom, parts, slot, cid, wide, bar):
        """Bytes 128·cid … of the slot's 64 rows: box columns 2·cid, 2·cid + 1 (and 2·cid + 2 on
                model1's `wide` rope chunk) into regions 0, 1 (2) of the staging slot.  An if / else of
                whole chunks: a lone `if wide` made ptxas spill at 168 registers."""
        if cutlass.const_expr(self.fmt == "model1"):
            if wide:
                for r in cutlass.range_constexpr(3):
                    gather4_tile(atom, parts, slot, 2 * cid + r, r, bar)
            else:
                for r in cutlass.range_constexpr(2):
                    gather4_tile(atom, parts, slot, 2 * cid + r, r, bar)
        else:
            for r in cutlass.range_constexpr(2):
                gather4_tile(atom, parts, slot, 2 * cid + r, r, bar)

    @cute.jit
    def key_indices(self, idx, batch, token, tile, length, topk: cutlass.Constexpr[int], first, step: cutlass.Constexpr[int],
                    index):
        """index[r] ← the cache index at list position 64·tile + first + step·r, or −1 (position ≥
                length, or −1 in the list).  The read is clamped into the list."""
        for r in cutlass.range_constexpr(cute.size(index)):
            pos = tile * KV_TILE + first + step * r
            got = idx[batch, token, cutlass.min(pos, topk - 1)]
            index[r] = cutlass.Int32(-1)
            if pos < length:
                index[r] = got

    @cute.jit
    def key_scales(self, cache, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], index,
                   kscale):
        """kscale[r] ← simple's fp32 scale of cache index index[r] (its block's scale plane);
        an invalid key (−1) is not read: 0."""
        base = cache.iterator.toint()
        for r in cutlass.range_constexpr(cute.size(index)):
            if index[r] != -1:
                blk = cutlass.Int64(index[r] // block_size)
                off = cutlass.Int64(index[r] % block_size)
                kscale[r] = ldg_f32(base + blk * block_bytes + block_size * D + off * 4)

    @cute.jit
    def row_ids(self, index, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], rows):
        """rows[r] ← the gather row of cache index index[r]: block · (block_bytes / row bytes)
        + offset; 0 (a row in range, never read) for an invalid key."""
        if cutlass.const_expr(self.gather):
            for r in cutlass.range_constexpr(cute.size(index)):
                rows[r] = cutlass.Int32(0)
                if index[r] != -1:
                    rows[r] = gather_row(index[r], block_size, block_bytes, GATHER_ROWS[self.fmt][0])

    # ---- the dequantisation warps
    @cute.jit
    def dequant_role(self, kv_pipe, raw_pipe, s_idx, s_raw, sKw, plan, lists, shift, ptid):
        """Warps 6-9, per chunk in the house's load order: the raw slot's indices and bytes (+ scales)
                into registers, the raw slot released, the converted piece into the chunk-ring slot."""
        hang_guard.role("dequant")  # names this role's waits in a --debug-hangs build
        c = self.c
        n_local, n_first, first_begin, second_begin = plan
        KV, idx, main_len, KV_extra, idx_extra, extra_len = lists
        row = ptid // 8  # keys row, row + 16, row + 32, row + 48 of each tile
        piece = ptid % 8  # columns 16·piece … + 15 of each chunk
        for j in cutlass.range(n_local, unroll=1):
            second = j >= n_first
            for p in cutlass.range_constexpr(self.n_chunks):
                g = j * self.n_chunks + p
                rst = self._raw_state(g, False)
                raw_pipe.consumer_wait(rst)
                cid = (p + shift) % self.n_chunks
                col0 = cid * self.chunk + PIECE * piece
                index = cute.make_rmem_tensor(4, cutlass.Int32)
                for r in cutlass.range_constexpr(4):
                    index[r] = s_idx[row + 16 * r, rst.index]
                raw = cute.make_rmem_tensor((8, 4), cutlass.Int32)
                raw.fill(0)
                scale = cute.make_rmem_tensor(4, F32)
                scale.fill(0.0)
                if second:
                    if cutlass.const_expr(c.has_extra):
                        self.load_keys(KV_extra, c.extra_block, self.extra_block_bytes, s_raw, rst.index, index, row,
                                       col0, cid, raw, scale)
                else:
                    self.load_keys(KV, c.block, self.block_bytes, s_raw, rst.index, index, row, col0, cid, raw, scale)
                if cutlass.const_expr(not self.gather):
                    cute.arch.sync_warp()  # every lane's reads of the slot done before the warp's release
                    raw_pipe.consumer_release(rst)
                st = self._ring_state(g, True)
                kv_pipe.producer_acquire(st)
                dst = sKw[None, None, st.index]
                for r in cutlass.range_constexpr(4):
                    if cutlass.const_expr(self.gather):  # staged bytes a key at a time: 8 registers, not 32
                        raw[None, r].fill(0)
                        if index[r] != -1:
                            self.load_staged_piece(s_raw, rst.index, row + 16 * r, col0, cid, raw[None, r])
                    vals = cute.make_rmem_tensor(PIECE, BF16)
                    self.convert_piece(raw[None, r], scale[r], col0, vals)
                    cute.autovec_copy(vals, cute.local_tile(dst, (1, PIECE), (row + 16 * r, piece))[0, None])
                if cutlass.const_expr(self.gather):
                    cute.arch.sync_warp()  # every lane's reads of the slot done before the warp's release
                    raw_pipe.consumer_release(rst)
                cute.arch.fence_view_async_shared()  # generic smem writes → the MMA's async proxy
                kv_pipe.producer_commit(st)
        g_end = n_local * self.n_chunks  # wait for the MMA warp's last releases before exit
        for i in cutlass.range_constexpr(self.slots):
            kv_pipe.producer_acquire(self._ring_state(g_end + i, True))

    @cute.jit
    def load_keys(self, cache, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], s_raw, slot,
                  index, row, col0, cid, raw, scale):
        """The scales of columns col0 … col0 + 15 of this thread's 4 keys into scale[r] and, for
                `simple` and `nvfp4` (no uniform row array to gather), their raw bytes into raw[:, r] —
                every load issued before any is used; an invalid key is not read: zeros, scale 0.
                (A gathered format's bytes come from the staging slot: load_staged_piece.)"""
        base = cache.iterator.toint()
        for r in cutlass.range_constexpr(4):
            if index[r] != -1:
                scale[r] = self.load_piece(base, index[r], block_size, block_bytes, col0, raw[None, r])

    @cute.jit
    def load_piece(self, base, index, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], col0,
                   raw) -> cutlass.Float32:
        """The scale of token `index`, columns col0 … col0 + 15; `simple` also its 16 e4m3 bytes into
                raw[0:4], scale 1 (its fp32 scale is applied to S and P)."""
        blk = cutlass.Int64(index // block_size)
        off = cutlass.Int64(index % block_size)
        block = base + blk * block_bytes
        scale = F32(1.0)
        if cutlass.const_expr(self.fmt == "simple"):
            if cutlass.const_expr(not self.scores_scaled):  # KEY_SCALE "keys": bf16(e4m3 × scale)
                scale = ldg_f32(block + block_size * D + off * 4)
            ldg16(block + off * D + col0, raw, 0)
        elif cutlass.const_expr(self.fmt == "model1"):
            if col0 < 448:  # the rope (columns 448 …) is bf16 as stored: scale 1
                scale = e8m0_to_f32(ldg_u8(block + block_size * 576 + off * 8 + col0 // 64))
        elif cutlass.const_expr(self.fmt == "nvfp4"):
            token = block + off * NVFP4_ROW_BYTES
            if col0 < D_NOPE:  # 16 e2m1 (8 bytes) and their group's e4m3 scale (group col0 // 16)
                ldg8(token + col0 // 2, raw, 0)
                byte = ldg_u8(block + block_size * NVFP4_ROW_BYTES + off * NVFP4_SCALE_BYTES + col0 // 16) & 0xFF
                _, sb = scale_factors(byte, scale_select(0))  # masked: a zero-extending load, as e8m0's
                bits = cute.make_rmem_tensor(1, cutlass.Int32)
                bits[0] = sb << 16  # the bf16 scale (exact: e4m3 ⊂ bf16) as an fp32
                scale = cute.recast_tensor(bits, F32)[0]
            else:  # the rope, 16 bf16 as stored (32 bytes at 224 + 2·(col0 − 448))
                at = token + D_NOPE // 2 + (col0 - D_NOPE) * 2
                ldg16(at, raw, 0)
                ldg16(at + 16, raw, 4)
        else:
            scale = e8m0_to_f32(ldg_u8(block + off * 528 + D + col0 // 32))
        return scale

    @cute.jit
    def load_staged_piece(self, s_raw, slot, key, col0, cid, raw):
        """Columns col0 … col0 + 15 of key `key` from staging slot `slot` into raw (8 Int32):
        16 e4m3 bytes (raw[0:4]), or model1's rope, 16 bf16 (raw[0:8])."""
        if cutlass.const_expr(self.fmt == "model1"):
            if col0 < 448:
                self.load_staged(s_raw, slot, key, col0 - cid * self.chunk, raw, 0)
            else:  # the rope: 2 bytes a column
                at = 448 + (col0 - 448) * 2 - cid * self.chunk
                self.load_staged(s_raw, slot, key, at, raw, 0)
                self.load_staged(s_raw, slot, key, at + 16, raw, 4)
        else:
            self.load_staged(s_raw, slot, key, col0 - cid * self.chunk, raw, 0)

    @cute.jit
    def load_staged(self, s_raw, slot, key, at, raw, word: cutlass.Constexpr[int]):
        """raw[word : word + 4] ← the 16 staged bytes at row byte `at` (of its chunk) of key
        `key`: region at // 64 of the slot, offset at mod 64 (one 16-byte shared load)."""
        lds16(s_raw.iterator.toint() + s_raw.layout((key, at % BOX, at // BOX, slot)), raw, word)

    @cute.jit
    def convert_piece(self, raw, scale, col0, vals):
        """vals (16 bf16) ← raw: e4m3 × scale (fp32), a rope as it is, nvfp4's e2m1 (raw[0:2]) by bit
                moves × 2^126 × the bf16 scale (e2m1_bits.py: exact)."""
        if cutlass.const_expr(self.fmt == "nvfp4"):
            if col0 < D_NOPE:
                bits = cute.make_rmem_tensor(1, F32)
                bits[0] = scale
                hi = (cute.recast_tensor(bits, cutlass.Int32)[0] >> 16) & 0xFFFF
                sb = hi | (hi << 16)  # bf16x2: the scale in both halves
                out = cute.recast_tensor(vals, cutlass.Int32)
                for w in cutlass.range_constexpr(2):
                    e2m1x8_to_bf16(raw[w], cutlass.Int32(TWO_126), sb, cute.make_tensor(out.iterator + 4 * w, cute.make_layout(4)))
            else:
                vals.store(cute.recast_tensor(raw, BF16).load())
        elif cutlass.const_expr(self.fmt == "model1"):
            if col0 < 448:
                convert16(raw, scale, vals)
            else:
                vals.store(cute.recast_tensor(raw, BF16).load())
        else:
            convert16(raw, scale, vals)
