"""Stage D5 on Blackwell (sm_100a): two key branches (the main keys and the SWA window) under one
softmax with the attention sink, one launch, Q read once.  Compiled and inspected (PTX
inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math: oracles/masked_decode.py.  Tensors: Q, KV_main [b, n_main, d], KV_swa [b, n_swa, d],
main_lens, swa_lens [b] int32, sink [h_q] fp32 (unread without one), O, LSE, O_part, LSE_part;
shape word b{b}s{s_q}h{h_q}m{n_main}n{n_swa}d{d}.

New in this rung (the rest: the sm100 house and D3/D4's masks): one tile space, the main tiles
then the SWA tiles, visited where they hold a valid key (a two-branch BranchKeys); ONE online
softmax across both, the branch picking per tile the TMA descriptor and the limit.  The sink:
one split multiplies 1/ℓ by combine.sink_factor; split-KV partials carry none and SplitCombine
applies it once (sink_heads = h_q)."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from stages.common.combine import SplitCombine, sink_factor
from stages.common.scheduler import BranchShape, DecodeShape
from stages.common.sm100_decode import B200_SMS, KV_TILE, DecodeSm100
from stages.common.sm100_keys import Branch, BranchKeys


class Kernel(DecodeSm100):
    """Two masked key branches under one softmax, with an optional sink.  `sink`: the case's
    sink axis — "none" applies no sink (the tensor is never read), any other value applies
    the sink tensor's logits."""

    NAME = "stage D5 sm100"

    def __init__(self, *, shape: str, splits, sink, sm_count: int = B200_SMS, o_split: int | None = None,
                 s_stages: int = 2):
        bp = BranchShape.parse(shape)
        for name, n in (("n_main", bp.n_main), ("n_swa", bp.n_swa)):
            if n % KV_TILE:
                raise ValueError(f"{self.NAME}: {name} must be a multiple of {KV_TILE}, got {n}")
        self.bp = bp
        self.has_sink = str(sink) != "none"
        self.main = Branch("main", bp.n_main, bp.n_main)
        self.swa = Branch("swa", bp.n_swa, bp.n_swa, causal=True)
        n = bp.n_main + bp.n_swa  # the tile space of both branches
        self.setup_plan(DecodeShape(bp.b, bp.s_q, bp.h_q, n, bp.d, n), splits, sm_count, o_split, s_stages)

    @cute.jit
    def __call__(self, Q: cute.Tensor, KV_main: cute.Tensor, KV_swa: cute.Tensor, main_lens: cute.Tensor,
                 swa_lens: cute.Tensor, sink: cute.Tensor, O: cute.Tensor, LSE: cute.Tensor, O_part: cute.Tensor,
                 LSE_part: cute.Tensor, stream: cuda.CUstream):
        bp = self.bp
        self._check_tensors(Q, O, LSE, O_part, LSE_part,
                            KV_main=(KV_main, (bp.b, bp.n_main, bp.d)), KV_swa=(KV_swa, (bp.b, bp.n_swa, bp.d)),
                            main_lens=(main_lens, (bp.b,)), swa_lens=(swa_lens, (bp.b,)), sink=(sink, (bp.h_q,)))
        v, ops, tma_q, tma_Q = self.prepare(Q, O, LSE, O_part, LSE_part)
        qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem = ops
        tma_m, tma_M = self.kv_atom(qk_mma, k_smem, self.kv_view(KV_main, bp.n_main, bp.n_main))
        tma_s, tma_S = self.kv_atom(qk_mma, k_smem, self.kv_view(KV_swa, bp.n_swa, bp.n_swa))
        self.start(self.kernel(qk_mma, pv_mma, tma_q, tma_Q, tma_m, tma_M, tma_s, tma_S, main_lens, swa_lens, sink,
                               v.eO, v.mLSE, v.eOp, v.mLp, q_smem, k_smem, v_smem, p_smem), stream)
        if cutlass.const_expr(self.splits > 1):
            heads = self.h_q if self.has_sink else 0
            SplitCombine(v.all_rows, self.splits, self.d, sink_heads=heads).launch(
                v.mOp, v.mLp, v.mO, v.mLSE, stream, sink=sink if self.has_sink else None)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               tma_m: cute.CopyAtom, mM: cute.Tensor, tma_s: cute.CopyAtom, mS: cute.Tensor,
               main_lens: cute.Tensor, swa_lens: cute.Tensor, sink: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mOp: cute.Tensor, mLSEp: cute.Tensor, q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout,
               v_smem: cute.ComposedLayout, p_smem: cute.ComposedLayout):
        bx, split, batch = cute.arch.block_idx()
        work = self.sched.work(bx // self.o_split, split, batch)
        keys = BranchKeys((self.main, self.swa), ((tma_m, mM), (tma_s, mS)), (main_lens[batch], swa_lens[batch]),
                          work.tile_begin, work.tile_end, self.block_last_token(work.token), self.s_q, KV_TILE)
        self.attend(keys, work.token, split, batch, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                    q_smem, k_smem, v_smem, p_smem, sink)

    def has_row_scale(self) -> bool:
        """The sink is applied here with one split; with split-KV the combine applies it
        once, after the merge."""
        return self.has_sink and self.splits == 1

    def row_scale(self, lse, row, batch, sink):
        """The sink's factor on a final row: 1 / (1 + exp(sink[h] − LSE)), 0 for a row with no key."""
        return sink_factor(sink[row % self.h_q], lse)
