"""Stage D3 on Hopper (sm_90a): D2's decode attention over a sliding window filled to a per-batch
level — the SWA length mask (math and tensors: oracles/masked_decode.py).

New in this rung (the rest is the house, stages/common/sm90_decode.py): the key branch has a fill
level (`KeyBranch(fill=True)`): only the tiles below swa_lens[b] are visited, the boundary tile's
scores past it are masked and its KV rows zeroed (masks.py); a keyless CTA writes O = 0, LSE = +∞
(or the empty partial) directly."""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.scheduler import SM_COUNT, DecodeShape
from stages.common.sm90_decode import DecodeSm90, KeyBranch


class Kernel(DecodeSm90):
    """D2's decode kernel with the SWA fill-level mask."""

    STAGE = "stage D3 sm90"

    def __init__(self, *, shape: str, splits, sm_count: int = SM_COUNT):
        p = DecodeShape.parse(shape)
        self.p = p
        window = KeyBranch("n", p.n, p.n_alloc, fill=True)
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
