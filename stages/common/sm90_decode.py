"""The Hopper (sm_90a) decode-attention house of stages D2–D5: one kernel class whose rungs
differ only in the keys they attend and what they do at the end.

Math (per query row): O = softmax(Q·Kᵀ · scale) · V and LSE = ln Σ exp(Q·Kᵀ · scale) over the
row's VALID keys, scale = 1/sqrt(d); Q [b, s_q, h_q, d], one latent KV head per key branch
(K = V), O [b, s_q, h_q, d] bf16, LSE [b, h_q, s_q] fp32.  The online softmax: softmax.py.

What the rungs set (`setup`)
    D2  one branch KV [b, n_alloc, d], keys 0 … n−1 all valid.
    D3  a fill level (swa_lens [b]): key j valid iff j < swa_lens[b].
    D4  and causal: token t sees keys j ≤ swa_lens[b] − s_q + t.
    D5  two branches (main, then SWA) under ONE softmax, Q read once, and an optional sink.
    Every mask is a key LIMIT per (batch, token, branch) (masks.py, scheduler.key_limit): tiles
    past it are never loaded, the boundary tile's scores are masked and its rows past the limit
    zeroed in shared memory, and a CTA with no valid key writes O = 0, LSE = +∞ (one split) or
    the empty partial (LSE = −∞) without touching the tensor cores.

Head packing: the 64 heads of one (batch, token) are a CTA's 64 rows (M); Q and O are viewed as
    [b · s_q · h_q, d], one TMA box a row block.
Grid and split-KV (scheduler.py): grid (h_q/64 · s_q, splits, b), a CTA one row block × one KV
    split of the tile space (main branch first); several splits write fp32 partials merged by
    combine.py's launch, which also applies the sink once.
K = V, read once: one TMA load per KV tile into one slot, read as K (K-major B) and as Vᵀ
    (MN-major B) — `kv_layouts` (sm90_kv_slots.py) proves the two address the same bytes.
NaN beyond the keys: a branch's TMA tensor has extent n, so a row ≥ n is never loaded; rows past
    the fill level inside the boundary tile are loaded and zeroed before P·V.

Warp roles (384 threads)
    warpgroup 2       load (its first warp): Q once, then the split's KV tiles into a 2-slot
                      TMA pipeline; setmaxnreg 24 here, 240 each for the MMA warpgroups
    warpgroup 0       S = Q·K_tileᵀ (m64 n{block_n}), the boundary mask, online softmax,
                      P → shared memory (SmemP), α per row; then its half of O += P·V
    warpgroup 1       waits for P (P_FULL), its half of O += P·V (d/2 columns: 128 registers
                      at d = 512), frees P (P_EMPTY)
    epilogue          both: O / ℓ (× the sink factor) → bf16 O or fp32 O_part, and LSE.
    A KV slot is released when both warpgroups' P·V on it completed (8 consumer warps).

Class flags (D2 sets all four, D3–D5 none)
    WIDE_STORE    O / the partial by 16-byte stores transposed across the quad (quad_store.py)
    LAZY_RESCALE  a row keeps its max until it grew by 2^8 (lazy_softmax.py): most tiles' α is
                  1 and a warp skips the O rescale by a vote
    PERSISTENT    min(items, SMs) CTAs, CTA c walking items c, c + grid, … (`DecodeGrid.item`);
                  the ring's and Q slot's states placed by the earlier items (`ring_state`);
                  warpgroup 0 frees Q after the item's last S, so the next item's loads overlap
                  this one's last P·V and epilogue; the MMA warpgroups meet at EPILOGUE after
                  reading 1/ℓ, before the next item's α overwrites the row buffer
    REGISTER_P    warpgroup 0's P·V is an RS wgmma on P = bf16(S) in its registers
                  (`register_p_tile`, `pv_rs_mma`; proven to be S's accumulator, S's rows O's),
                  issued before P is stored for warpgroup 1; warpgroup 0 scales its O by α in
                  registers and arrives at P_FULL without waiting (unaligned barriers)
    Tried and lost: issuing S_{i+1} before P·V_i (docs/MASKED_DECODE.md).

Tiles and shared memory
      d     block_n   slots   Q + 2 KV slots + P                         ≈ dynamic smem
      64      128       2     8 + 2·16 + 16 KiB                            57 KiB
      128     128       2     16 + 2·32 + 16 KiB                           97 KiB
      256     128       2     32 + 2·64 + 16 KiB                          177 KiB
      512      64       2     64 + 2·64 +  8 KiB                          201 KiB

Limits: h_q a multiple of 64; d ∈ {64, 128, 256, 512}; every branch's n a multiple of block_n;
splits ≤ the scratch capacity (oracles/decode.py); static shapes, row-major, 16-byte aligned."""



from dataclasses import dataclass

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from stages.common import hang_guard
from stages.common.combine import SplitCombine, sink_factor
from stages.common.inspection import expose
from stages.common.scheduler import SM_COUNT, DecodeGrid, VisitPlan, key_limit, resolve_splits, valid_tiles, visit_tiles
from stages.common.sm90_idioms import (acc_rows_cols, accumulator_to_a_operand, check_accumulator_is_a_operand,
                                       check_rows_shared, wgmma_sync)
from stages.common.sm90_setup import TmaPipe, load_once, smem_struct, smem_tensors, tma_pipelines, tma_tiles, wait_once
from stages.common.sm90_kv_slots import check_same_bytes, kv_layouts, ring_state  # noqa: F401 (check_same_bytes: D2's tests)
from stages.common.sm90_smem_p import SmemP, smem_p_mmas
from stages.common.softmax import OnlineSoftmax, final_lse, scale_rows
from stages.common.lazy_softmax import LazyOnlineSoftmax, needs_rescale
from stages.common.quad_store import check_accumulator_layout, store_accumulator_wide
from stages.common.masks import mask_scores, zero_kv_rows
from stages.common.tma import prefetch_descriptors, sm90_tma_load
from stages.common.device import SMEM_LIMIT  # the largest dynamic shared memory of a CTA
from stages.common.unaligned_barriers import named_arrive, named_sync



@cute.jit
def wgmma_issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, a_slot=None, b_slot=None,
                zero_init: cutlass.Constexpr[bool] = False):
    """acc = A · B (zero_init) or acc += A · B as one wgmma group (fence, K steps, commit_group), NOT
        waited for: the caller's warpgroup.wait_group(k) does."""
    warpgroup.fence()
    tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        a_k = a[None, None, k] if cutlass.const_expr(a_slot is None) else a[None, None, k, a_slot]
        b_k = b[None, None, k] if cutlass.const_expr(b_slot is None) else b[None, None, k, b_slot]
        cute.gemm(tiled_mma, acc, a_k, b_k, acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@dataclass(frozen=True)
class KeyBranch:
    """One set of keys a decode kernel attends: `name`, its KV rows `n_alloc`, the attended keys `n`
        (≤ n_alloc, a multiple of block_n), and its mask: `fill` (key j valid iff j < lens[b]),
        `causal` (D4: token t sees j ≤ lens[b] − s_q + t)."""

    name: str
    n: int
    n_alloc: int
    fill: bool = False
    causal: bool = False


class DecodeSm90:
    """DSV4 decode attention on Hopper tensor cores: 64 query heads of one token per CTA,
    KV read once per tile (K and V views of one slot), split-KV with an LSE combine; the
    key branches, masks and sink of a rung (see the module doc)."""

    STAGE = "sm90 decode"  # the rung's name in its messages
    BLOCK_M = 64  # query heads per CTA (one m64 wgmma row block)
    NUM_MMA_WG = 2  # warpgroups that own d/2 columns of O each
    LOAD_WG = NUM_MMA_WG  # the warpgroup after the MMA warpgroups; its first warp loads
    LOAD_WARP = 4 * LOAD_WG
    MMA_THREADS = 128 * NUM_MMA_WG
    THREADS = MMA_THREADS + 128
    # setmaxnreg: 2 · 128 · 240 + 128 · 24 = 64 512 ≤ 65 536 registers.  A CTA of 288 threads
    # (one load warp) gets the same 168-register cap at entry as 384, so a whole warpgroup
    # costs nothing more, and it is what lets the MMA warpgroups grow to 240.
    MMA_REGS = 240
    LOAD_REGS = 24
    HEAD_DIMS = (64, 128, 256, 512)
    KV_STAGES = 2
    # What a rung opts into: the module docstring's class flags (D2 sets all four; D3–D5 keep the
    # plain house until re-proven with them).
    LAZY_RESCALE = False
    WIDE_STORE = False
    PERSISTENT = False
    REGISTER_P = False

    def setup(self, *, b: int, s_q: int, h_q: int, d: int, branches, splits, sm_count: int = SM_COUNT,
              sink: bool = False) -> None:
        """The launch of one case: its sizes, key branches (1 or 2 `KeyBranch`es), splits
        (an int, "auto" or "many") and whether a sink is applied."""
        if d not in self.HEAD_DIMS:
            raise ValueError(f"{self.STAGE}: d must be one of {self.HEAD_DIMS}, got {d}")
        if h_q % self.BLOCK_M:
            raise ValueError(f"{self.STAGE}: h_q must be a multiple of {self.BLOCK_M}, got {h_q}")
        if len(branches) not in (1, 2):
            raise ValueError(f"{self.STAGE}: one or two key branches, got {len(branches)}")
        self.block_n = 64 if d == 512 else 128
        for br in branches:
            if br.n < self.block_n or br.n % self.block_n:
                raise ValueError(f"{self.STAGE}: {br.name} must be a positive multiple of {self.block_n} at d = {d}, got {br.n}")
        self.b, self.s_q, self.h_q, self.d = b, s_q, h_q, d
        self.branches = tuple(branches)
        self.tiles = tuple(br.n // self.block_n for br in branches)
        self.masked = any(br.fill for br in branches)
        self.has_sink = bool(sink)
        num_tiles = sum(self.tiles)
        head_blocks = h_q // self.BLOCK_M
        ctas = head_blocks * s_q * b
        self.splits = resolve_splits(splits, ctas=ctas, num_tiles=num_tiles, sm_count=sm_count)
        self.sched = DecodeGrid(head_blocks, s_q, b, self.splits, num_tiles)
        # PERSISTENT: one CTA a SM at most (the shared memory holds one), each walking items
        self.grid_ctas = min(self.sched.items, sm_count)
        self.rows = b * s_q * h_q
        self.scale_log2 = math.log2(math.e) / math.sqrt(d)
        self.stages = self.KV_STAGES
        smem = 2 * (self.BLOCK_M * d + self.stages * self.block_n * d + self.BLOCK_M * self.block_n) + 4096
        if smem > SMEM_LIMIT:
            raise ValueError(f"{self.STAGE}: {smem} bytes of shared memory needed, {SMEM_LIMIT} available")

    def pv_rs_mma(self, dtype):
        """REGISTER_P: O += P·V as `smem_p_mmas`' pv_mma but A = P from registers (an RS wgmma).
        Made where it is used (a tiled MMA caches values of a trace)."""
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, cutlass.Float32,
            (1, self.NUM_MMA_WG, 1), tiler_mn=(self.BLOCK_M, self.d // self.NUM_MMA_WG),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def launch_grid(self) -> tuple[int, int, int]:
        """The attention launch's grid: one CTA an item (`sched.grid`), or PERSISTENT's
        min(items, SMs) CTAs along x."""
        return (self.grid_ctas, 1, 1) if self.PERSISTENT else self.sched.grid

    def check_shapes(self, want: dict, O_part, LSE_part) -> None:
        """Trace time: each tensor of `want` ({name: (tensor, shape)}) has the shape the case
        names, and the scratch holds this kernel's splits."""
        for name, (t, shape) in want.items():
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{self.STAGE}: {name} has shape {tuple(t.shape)}, the case needs {tuple(shape)}")
        if self.splits > 1:
            b, s_q, h_q, d = self.b, self.s_q, self.h_q, self.d
            cap = O_part.shape[0]
            if self.splits > cap or tuple(O_part.shape[1:]) != (b, s_q, h_q, d) or tuple(LSE_part.shape) != (cap, b, s_q, h_q):
                raise ValueError(
                    f"{self.STAGE}: {self.splits} splits need O_part ≥ ({self.splits}, {b}, {s_q}, {h_q}, {d}) "
                    f"and LSE_part to match, got {tuple(O_part.shape)} and {tuple(LSE_part.shape)}"
                )

    @cute.jit
    def launch(self, Q: cute.Tensor, kvs: tuple, lens: tuple, sink, O: cute.Tensor, LSE: cute.Tensor,
               O_part: cute.Tensor, LSE_part: cute.Tensor, stream: cuda.CUstream):
        """Build the views, MMAs, layouts and TMA atoms and launch (then the combine when split).  `kvs`:
                a KV tensor per branch; `lens`: its fill-level tensor or None; `sink`: [h_q] or None."""
        bm, bn, d = self.BLOCK_M, self.block_n, self.d
        dtype = Q.element_type
        rows, splits = self.rows, self.splits

        # Views: rows = (batch, token, head) row-major; each KV with extent n along the keys.
        mQ = cute.make_tensor(Q.iterator, cute.make_layout((rows, d), stride=(d, 1)))
        mO = cute.make_tensor(O.iterator, cute.make_layout((rows, d), stride=(d, 1)))
        mKVs = [
            cute.make_tensor(kv.iterator, cute.make_layout((br.n, d, self.b), stride=(d, 1, br.n_alloc * d)))
            for kv, br in zip(kvs, self.branches)
        ]
        # LSE [b, h_q, s_q] indexed by row r = (batch·s_q + token)·h_q + head (CuTe's linear index).
        mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((self.h_q, self.s_q, self.b), stride=(self.s_q, 1, self.h_q * self.s_q)))
        cap = O_part.shape[0]
        mOp = cute.make_tensor(O_part.iterator, cute.make_layout((cap * rows, d), stride=(d, 1)))
        mLp = cute.make_tensor(LSE_part.iterator, cute.make_layout(cap * rows))

        # S = Q·Kᵀ on warpgroup 0 (m64 n{bn}); O = P·V with O's d columns over the MMA warpgroups.
        qk_mma, pv_mma = smem_p_mmas(dtype, bm, bn, d, self.NUM_MMA_WG)
        if cutlass.const_expr(self.REGISTER_P):  # S's accumulator is P's A fragment; S's rows are O's
            check_accumulator_is_a_operand(qk_mma, self.pv_rs_mma(dtype), (bm, bn))
            check_rows_shared(qk_mma, self.pv_rs_mma(dtype), (bm, bn), d)
        if cutlass.const_expr(self.WIDE_STORE):  # the wide stores rely on the accumulator's layout
            check_accumulator_layout(pv_mma, (bm, d), list(range(32)) + [45, 77, 109] + list(range(128, 160)) + [205, 237],
                                     d // self.NUM_MMA_WG)

        q_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, bn, d), dtype, 1)
        k_smem, vt_smem = kv_layouts(dtype, d, bn, self.stages, d // self.NUM_MMA_WG)
        p_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, d, bn), dtype, 1)

        expose(self, p_path="smem", qk_mma=(qk_mma, (bm, bn, d)), pv_mma=(pv_mma, (bm, d, bn)),  # dsv4-lab inspect
               smem={"Q": q_smem, "K": k_smem, "Vt (K's bytes)": vt_smem, "P": p_smem},
               p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=(bm, bn))

        tma_q, tma_Q, self.q_bytes = sm90_tma_load(mQ, q_smem, (bm, d))
        tma_kv, tma_KV, self.kv_bytes = sm90_tma_load(mKVs[0], k_smem, (bn, d))
        tma_kv2, tma_KV2 = None, None
        if cutlass.const_expr(len(self.branches) == 2):
            tma_kv2, tma_KV2, _ = sm90_tma_load(mKVs[1], k_smem, (bn, d))

        # Q: consumed by warpgroup 0 (4 warps); a KV slot: by both MMA warpgroups (8 warps).
        self.pipes = (TmaPipe("q", 1, self.q_bytes, 4), TmaPipe("kv", self.stages, self.kv_bytes, self.MMA_THREADS // 32))
        self.smem_struct = smem_struct(self.pipes, {"sQ": (dtype, q_smem), "sKV": (dtype, k_smem), "sP": (dtype, p_smem)},
                                       row_factor_rows=bm)  # row_factor: α, then 1/ℓ

        len2 = lens[1] if len(lens) == 2 else None
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, tma_kv, tma_KV, tma_kv2, tma_KV2, lens[0], len2, sink,
            mO, mLSE, mOp, mLp, q_smem, k_smem, vt_smem, p_smem,
        ).launch(grid=self.launch_grid(), block=(self.THREADS, 1, 1), smem=self.smem_struct.size_in_bytes(), stream=stream)

        if cutlass.const_expr(splits > 1):
            if cutlass.const_expr(self.has_sink):
                SplitCombine(rows, splits, d, sink_heads=self.h_q).launch(mOp, mLp, mO, mLSE, stream, sink=sink)
            else:
                SplitCombine(rows, splits, d).launch(mOp, mLp, mO, mLSE, stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_kv: cute.CopyAtom,
        mKV: cute.Tensor,
        tma_kv2,
        mKV2,
        mLen: cute.Tensor,
        mLen2,
        mSink,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        vt_smem: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
    ):
        bm, bn, d = self.BLOCK_M, self.block_n, self.d
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(not self.PERSISTENT):  # one item, the CTA's own
            work = self.sched.work(bx, by, bz)
            limits = self.key_limits(work, mLen, mLen2)
            plan = self.visit_plan(work, limits)
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_kv)
            if cutlass.const_expr(len(self.branches) == 2):
                prefetch_descriptors(tma_kv2)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ, sK, sP = smem_tensors(storage, sQ=q_smem, sKV=k_smem, sP=p_smem)  # (64, d, 1), (bn, d, stages), (64, bn, 1)
        (sVt,) = smem_tensors(storage, sKV=vt_smem)  # (d, bn, stages): the same bytes as sK
        sP = sP[None, None, 0]
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))
        q_pipe, kv_pipe = tma_pipelines(storage, self.pipes)

        if cutlass.const_expr(self.PERSISTENT):
            # items bx, bx + grid, …; before each, the KV tiles and Q loads of this CTA's earlier
            # items (tiles, qs) place the pipelines' states (every role computes the same plans)
            tiles = cutlass.Int32(0)
            qs = cutlass.Int32(0)
            if warp_idx // 4 == self.LOAD_WG:
                cute.arch.setmaxregister_decrease(self.LOAD_REGS)
                if warp_idx == self.LOAD_WARP:
                    for item in cutlass.range(bx, self.sched.items, self.grid_ctas, unroll=1):
                        item_work = self.sched.item(item)
                        item_plan = self.visit_plan(item_work, self.key_limits(item_work, mLen, mLen2))
                        if item_plan.count > 0:
                            self.load(item_work, item_plan, q_pipe, kv_pipe, tma_q, mQ, sQ, tma_kv, mKV, tma_kv2, mKV2, sK, tiles, qs)
                            tiles += item_plan.count
                            qs += 1
            else:
                cute.arch.setmaxregister_increase(self.MMA_REGS)
                for item in cutlass.range(bx, self.sched.items, self.grid_ctas, unroll=1):
                    item_work = self.sched.item(item)
                    item_limits = self.key_limits(item_work, mLen, mLen2)
                    item_plan = self.visit_plan(item_work, item_limits)
                    if item_plan.count > 0:
                        self.attend(item_work, item_plan, item_limits, tidx, q_pipe, kv_pipe, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row,
                                    mSink, mO, mLSE, mOp, mLp, tiles, qs)
                        tiles += item_plan.count
                        qs += 1
                    else:
                        self.write_empty(item_work, tidx, mO, mLSE, mOp, mLp)
        else:
            has_work = plan.count > 0
            if warp_idx // 4 == self.LOAD_WG:
                cute.arch.setmaxregister_decrease(self.LOAD_REGS)
                if warp_idx == self.LOAD_WARP:
                    if has_work:
                        self.load(work, plan, q_pipe, kv_pipe, tma_q, mQ, sQ, tma_kv, mKV, tma_kv2, mKV2, sK, 0, 0)
            else:
                cute.arch.setmaxregister_increase(self.MMA_REGS)
                if has_work:
                    self.attend(work, plan, limits, tidx, q_pipe, kv_pipe, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row,
                                mSink, mO, mLSE, mOp, mLp, 0, 0)
                else:
                    self.write_empty(work, tidx, mO, mLSE, mOp, mLp)

    # -- which keys ---------------------------------------------------------------------------

    def key_limits(self, work, mLen, mLen2):
        """Per branch, how many leading keys this CTA's token may attend (scheduler.key_limit):
        the static n, or the batch's fill level (after the causal limit)."""
        lens = (mLen, mLen2)
        out = []
        for i, br in enumerate(self.branches):
            if cutlass.const_expr(br.fill):
                out.append(key_limit(br.n, lens[i][work.batch], br.causal, self.s_q, work.token))
            else:
                out.append(br.n)
        return tuple(out)

    def visit_plan(self, work, limits) -> VisitPlan:
        """The tiles of this CTA's split that hold a valid key (scheduler.visit_tiles)."""
        valid = [valid_tiles(lim, self.block_n) if br.fill else t for lim, br, t in zip(limits, self.branches, self.tiles)]
        second = valid[1] if len(valid) == 2 else None
        return visit_tiles(work.tile_begin, work.tile_end, self.tiles[0], valid[0], second)

    # -- roles --------------------------------------------------------------------------------

    @cute.jit
    def load(self, work, plan, q_pipe, kv_pipe, tma_q, mQ, sQ, tma_kv, mKV, tma_kv2, mKV2, sK, tiles_before, qs_before):
        """Load role (one warp): Q's row block once, then the visited KV tiles into the slots as they
                free up.  `tiles_before` / `qs_before`: this CTA's earlier items' loads (PERSISTENT)."""
        hang_guard.role("load")  # names this role's waits in a --debug-hangs build
        bm, bn, d = self.BLOCK_M, self.block_n, self.d
        q_load = tma_tiles(tma_q, sQ, mQ, (bm, d), (None, 0))
        if cutlass.const_expr(self.PERSISTENT):  # the slot is free once warpgroup 0's last S of the item before is done
            q_state = ring_state(1, qs_before, producer=True)
            q_pipe.producer_acquire(q_state)
            cute.copy(q_load.atom, q_load.gmem[(None, self.sched.row_block(work))], q_load.smem[(None, 0)],
                      tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        else:
            load_once(q_pipe, q_load, self.sched.row_block(work))
        _, tKgK, tKsK = tma_tiles(tma_kv, sK, mKV, (bn, d), (None, 0, None))  # tiles (bn, d) of (keys, d, b)
        tKgK2 = tKgK
        if cutlass.const_expr(len(self.branches) == 2):
            _, tKgK2, _ = tma_tiles(tma_kv2, sK, mKV2, (bn, d), (None, 0, None))

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if cutlass.const_expr(self.PERSISTENT):
            kv_state = ring_state(self.stages, tiles_before, producer=True)
        for i in cutlass.range(plan.count, unroll=1):
            kv_pipe.producer_acquire(kv_state)
            if cutlass.const_expr(len(self.branches) == 1):
                cute.copy(
                    tma_kv, tKgK[(None, plan.first_begin + i, work.batch)], tKsK[(None, kv_state.index)],
                    tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                )
            else:
                second, tile = plan.tile(i)
                if second:
                    cute.copy(tma_kv2, tKgK2[(None, tile, work.batch)], tKsK[(None, kv_state.index)],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
                else:
                    cute.copy(tma_kv, tKgK[(None, tile, work.batch)], tKsK[(None, kv_state.index)],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
            kv_state.advance()

    @cute.jit
    def attend(self, work, plan, limits, tidx, q_pipe, kv_pipe, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row,
               mSink, mO, mLSE, mOp, mLp, tiles_before, qs_before):
        """The two MMA warpgroups (module doc).  `tiles_before` / `qs_before` as in `load`.  PERSISTENT:
                warpgroup 0 frees Q after its last S; both meet after reading 1/ℓ, before the next
                item's P overwrites the row factors."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        bm, bn, d = self.BLOCK_M, self.block_n, self.d
        wg = tidx // 128
        tid_wg = tidx % 128
        mma_threads = self.MMA_THREADS

        # S side (warpgroup 0's; built by every thread so all names exist before the branches).
        thr_qk = qk_mma.get_slice(tid_wg)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, d/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, d/16, stages)
        s_shape = thr_qk.partition_shape_C((bm, bn))
        if cutlass.const_expr(self.REGISTER_P):  # warpgroup 0 arrives at P_FULL, 1 waits: met unaligned
            smem_p = SmemP.create(self, qk_mma, sP, s_row, tid_wg, mma_threads, sync=named_sync, arrive=named_arrive)
        else:
            smem_p = SmemP.create(self, qk_mma, sP, s_row, tid_wg, mma_threads)  # P and the row factors → the P·V warpgroups
        tScS_rc = smem_p.tScS_rc  # (row, key)

        # O side: this thread's part of its warpgroup's d/2 columns.
        thr_pv = pv_mma.get_slice(tidx)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(sP))  # (MMA, 1, bn/16)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sVt))  # (MMA, 1, bn/16, stages)
        tOrV_rs = None
        if cutlass.const_expr(self.REGISTER_P):  # warpgroup 0's P·V: the same Vᵀ as an RS wgmma's B
            pv_rs = self.pv_rs_mma(sVt.element_type)
            tOrV_rs = pv_rs.make_fragment_B(pv_rs.get_slice(tidx).partition_B(sVt))
        o_shape = thr_pv.partition_shape_C((bm, d))
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, d))))  # (row, col)
        tOgO = None
        if cutlass.const_expr(not self.WIDE_STORE):
            tOgO = self.o_destination(work, thr_pv, mO, mOp)  # before the loop: wgmma_sync re-sets pv_mma inside it
        acc_o = cute.make_rmem_tensor(o_shape, cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_rc = acc_rows_cols(acc_o)

        num_rows = cute.size(tScS_rc, mode=[0])
        if cutlass.const_expr(self.LAZY_RESCALE):
            softmax = LazyOnlineSoftmax.create(num_rows, self.scale_log2)
        else:
            softmax = OnlineSoftmax.create(num_rows, self.scale_log2)

        kv_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        q_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        if cutlass.const_expr(self.PERSISTENT):
            kv_cons = ring_state(self.stages, tiles_before, producer=False)
            q_cons = ring_state(1, qs_before, producer=False)
        if wg == 0:
            if cutlass.const_expr(self.PERSISTENT):
                q_pipe.consumer_wait(q_cons)
            else:
                wait_once(q_pipe)

        for i in cutlass.range(plan.count, unroll=1):
            kv_pipe.consumer_wait(kv_cons)
            if wg == 0:
                acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=kv_cons.index, zero_init=True)
                if cutlass.const_expr(self.PERSISTENT):
                    if i == plan.count - 1:  # the item's last S has read Q: the next item's may load
                        q_pipe.consumer_release(q_cons)
                if cutlass.const_expr(self.masked):
                    self.mask_boundary(plan, limits, i, acc_rows_cols(acc_s), tScS_rc, sK[None, None, kv_cons.index], tid_wg)
                alpha = softmax.update(acc_rows_cols(acc_s))
                if cutlass.const_expr(self.REGISTER_P):
                    self.register_p_tile(acc_s, alpha, i, smem_p, acc_o, acc_o_rc, num_rows, tOrV_rs, kv_cons.index, tid_wg)
                else:
                    # P and α out (after warpgroup 1 is done with the previous ones); its async-proxy
                    # fence also covers the KV rows mask_boundary zeroed.
                    smem_p.publish(acc_s, alpha, i > 0)
            if cutlass.const_expr(self.REGISTER_P):
                if wg == 1:
                    smem_p.wait_full()
                    self.rescale_o(smem_p, acc_o_rc, tOcO_rc)
                    wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=kv_cons.index)
            else:
                smem_p.wait_full()
                self.rescale_o(smem_p, acc_o_rc, tOcO_rc)
                wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=kv_cons.index)
            kv_pipe.consumer_release(kv_cons)
            kv_cons.advance()
            if wg == 1:
                smem_p.release()

        # Finalize (warpgroup 0 holds the row state): 1/ℓ (× the sink factor) through the row
        # buffer, LSE out.
        if wg == 0:
            smem_p.wait_empty()
            inv_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            lse = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            softmax.finalize(inv_sum, lse)
            for r in cutlass.range_constexpr(num_rows):
                row = tScS_rc[r, 0][0]
                if tScS_rc[r, 0][1] == 0:
                    s_row[row] = self.row_out_factor(work, row, inv_sum[r], lse[r], mSink)
                    self.store_lse(work, row, lse[r], mLSE, mLp, mSink)
        smem_p.wait_epilogue()
        smem_p.rescale(acc_o_rc, tOcO_rc)
        if cutlass.const_expr(self.PERSISTENT):
            smem_p.wait_epilogue()  # both have read 1/ℓ: the next item's first α may overwrite it
        if cutlass.const_expr(self.WIDE_STORE):
            self.store_o_wide(work, tidx, acc_o, mO, mOp)
        else:
            self.store_o(acc_o, tOgO)

    # -- pieces -------------------------------------------------------------------------------

    @cute.jit
    def mask_boundary(self, plan, limits, i, s_rc, cols_rc, s_kv, tid_wg):
        """Visit i's boundary tile (rem = limit − first key < block_n): scores past rem → −∞, their KV
                rows in the slot → 0 (masks.py)."""
        bn = self.block_n
        if cutlass.const_expr(len(self.branches) == 1):
            rem = limits[0] - (plan.first_begin + i) * bn
        else:
            second, tile = plan.tile(i)
            lim = cutlass.Int32(cutlass.select_(second, limits[1], limits[0]))
            rem = lim - tile * bn
        if rem < bn:
            mask_scores(s_rc, cols_rc, rem)
            zero_kv_rows(s_kv, rem, tid_wg, 128)

    @cute.jit
    def row_out_factor(self, work, row, inv_sum, lse, mSink):
        """The factor on a finished row's O: 1/ℓ, and with one split and a sink also the sink's
        1 / (1 + e^(sink − lse)) (split-KV applies the sink in the combine, once)."""
        f = inv_sum
        if cutlass.const_expr(self.has_sink and self.splits == 1):
            f = inv_sum * sink_factor(mSink[work.head_block * self.BLOCK_M + row], lse)
        return f

    @cute.jit
    def store_lse(self, work, row, lse, mLSE, mLp, mSink):
        """LSE of `row`: final (one split; +∞ for a keyless row) or the split's partial (−∞ for a
                keyless row).  Never the sink's (`mSink` is here for the planted-bug fixture)."""
        if cutlass.const_expr(self.splits == 1):
            mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(lse)
        else:
            mLp[self.sched.partial_row_block(work) * self.BLOCK_M + row] = lse

    @cute.jit
    def o_destination(self, work, thr_pv, mO, mOp):
        """This thread's part of the CTA's output block: bf16 O (one split) or this split's
        fp32 partial."""
        bm, d = self.BLOCK_M, self.d
        if cutlass.const_expr(self.splits == 1):
            return thr_pv.partition_C(cute.local_tile(mO, (bm, d), (self.sched.row_block(work), 0)))
        return thr_pv.partition_C(cute.local_tile(mOp, (bm, d), (self.sched.partial_row_block(work), 0)))

    @cute.jit
    def register_p_tile(self, acc_s, alpha, i, smem_p, acc_o, acc_o_rc, num_rows: cutlass.Constexpr[int], tOrV_rs,
                        slot, tid_wg):
        """REGISTER_P, warpgroup 0 after tile i's softmax: O *= α where the warp's max moved, issue
                O += P·V with P = bf16(S) in registers (RS wgmma), and while it runs publish P and α for
                warpgroup 1 (P_EMPTY waited from the second tile) and arrive at P_FULL; wait."""
        dtype = smem_p.tPsP.element_type
        pv_rs = self.pv_rs_mma(dtype)
        r_p = accumulator_to_a_operand(acc_s, pv_rs.get_slice(tid_wg), (self.BLOCK_M, self.block_n), dtype)
        if cutlass.const_expr(self.LAZY_RESCALE):
            if needs_rescale(alpha, num_rows):
                for r in cutlass.range_constexpr(num_rows):
                    scale_rows(acc_o_rc, r, alpha[r])
        else:
            for r in cutlass.range_constexpr(num_rows):
                scale_rows(acc_o_rc, r, alpha[r])
        wgmma_issue(pv_rs, acc_o, r_p, tOrV_rs, b_slot=slot)
        smem_p.publish(acc_s, alpha, i > 0)
        smem_p.arrive_full()
        warpgroup.wait_group(0)

    @cute.jit
    def rescale_o(self, smem_p, acc_o_rc, tOcO_rc):
        """O[row, :] *= α[row] (the row factor SmemP carries) for this thread's rows; with
        LAZY_RESCALE skipped by the whole warp when every α of its rows is 1 (a warp vote)."""
        if cutlass.const_expr(self.LAZY_RESCALE):
            alpha = smem_p.row_factors(tOcO_rc)
            num_rows = cute.size(tOcO_rc, mode=[0])
            if needs_rescale(alpha, num_rows):  # most tiles keep every row's max: α = 1
                for r in cutlass.range_constexpr(num_rows):
                    scale_rows(acc_o_rc, r, alpha[r])
        else:
            smem_p.rescale(acc_o_rc, tOcO_rc)

    @cute.jit
    def store_o_wide(self, work, tidx, acc_o, mO, mOp):
        """WIDE_STORE: the accumulator into the CTA's output block — bf16 O (one split) or this
        split's fp32 partial — by 16-byte stores (stages/common/quad_store.py)."""
        bm, d = self.BLOCK_M, self.d
        col0 = (tidx // 128) * (d // self.NUM_MMA_WG)
        if cutlass.const_expr(self.splits == 1):
            size = mO.element_type.width // 8
            base = mO.iterator.toint() + cutlass.Int64(self.sched.row_block(work)) * (bm * d * size)
            store_accumulator_wide(acc_o, tidx, base, d * size, col0, mO.element_type)
        else:
            size = mOp.element_type.width // 8
            base = mOp.iterator.toint() + cutlass.Int64(self.sched.partial_row_block(work)) * (bm * d * size)
            store_accumulator_wide(acc_o, tidx, base, d * size, col0, mOp.element_type)

    @cute.jit
    def store_o(self, acc_o, tOgO):
        """The accumulator into `tOgO` (from `o_destination`), converted to its type."""
        out = cute.make_rmem_tensor(tOgO.shape, tOgO.element_type)
        out.store(acc_o.load().to(tOgO.element_type))
        cute.autovec_copy(out, tOgO)

    @cute.jit
    def write_empty(self, work, tidx, mO, mLSE, mOp, mLp):
        """A CTA with no key to visit (plain stores, no tiled MMA touched): split-KV writes partial O = 0,
                LSE = −∞ for its 64 rows; one split writes the lonely row's O = 0, LSE = +∞."""
        bm, d = self.BLOCK_M, self.d
        if cutlass.const_expr(self.splits > 1):
            block = cute.local_tile(mOp, (bm, d), (self.sched.partial_row_block(work), 0))
            for k in cutlass.range_constexpr(bm * d // self.MMA_THREADS):
                e = k * self.MMA_THREADS + tidx  # consecutive threads, consecutive columns
                block[e // d, e % d] = cutlass.Float32(0.0)
            if tidx < bm:
                mLp[self.sched.partial_row_block(work) * bm + tidx] = -cutlass.Float32.inf
        elif cutlass.const_expr(self.masked):
            block = cute.local_tile(mO, (bm, d), (self.sched.row_block(work), 0))
            for k in cutlass.range_constexpr(bm * d // self.MMA_THREADS):
                e = k * self.MMA_THREADS + tidx
                block[e // d, e % d] = mO.element_type(0.0)
            if tidx < bm:
                mLSE[self.sched.row_block(work) * bm + tidx] = cutlass.Float32.inf
