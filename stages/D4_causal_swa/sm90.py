"""Stage D4 on Hopper (sm_90a): D3's sliding-window decode, causal: token t of batch b sits at key
position swa_lens[b] − s_q + t and attends keys j ≤ that (and j < swa_lens[b]); a token with no
key: O = 0, LSE = +∞ (oracles/masked_decode.py).

New in this rung (the house: stages/common/sm90_decode.py): the branch is causal
(`KeyBranch(causal=True)`).  A CTA's 64 rows are ONE token's heads, so the causal mask is one
more key limit per CTA, max(swa_lens[b] − s_q + t + 1, 0) (scheduler.key_limit); D3's machinery
does the rest with no per-element causal test."""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.scheduler import SM_COUNT, DecodeShape
from stages.common.sm90_decode import DecodeSm90, KeyBranch


class Kernel(DecodeSm90):
    """D3's decode kernel with the causal SWA limit."""

    STAGE = "stage D4 sm90"

    def __init__(self, *, shape: str, splits, sm_count: int = SM_COUNT):
        p = DecodeShape.parse(shape)
        self.p = p
        window = KeyBranch("n", p.n, p.n_alloc, fill=True, causal=True)
        self.setup(b=p.b, s_q=p.s_q, h_q=p.h_q, d=p.d, branches=(window,), splits=splits, sm_count=sm_count)

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        KV: cute.Tensor,
        swa_lens: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        O_part: cute.Tensor,
        LSE_part: cute.Tensor,
        stream: cuda.CUstream,
    ):
        p = self.p
        self.check_shapes({
            "Q": (Q, (p.b, p.s_q, p.h_q, p.d)),
            "KV": (KV, (p.b, p.n_alloc, p.d)),
            "swa_lens": (swa_lens, (p.b,)),
            "O": (O, (p.b, p.s_q, p.h_q, p.d)),
            "LSE": (LSE, (p.b, p.h_q, p.s_q)),
        }, O_part, LSE_part)
        self.launch(Q, (KV,), (swa_lens,), None, O, LSE, O_part, LSE_part, stream)
