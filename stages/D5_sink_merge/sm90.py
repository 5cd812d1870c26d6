"""Stage D5 on Hopper (sm_90a): DSV4's two key branches under ONE softmax in one launch, and the
attention sink (math and tensors: oracles/masked_decode.py).

New in this rung (the rest is the house, stages/common/sm90_decode.py): the tile space is the
main branch's tiles then the SWA branch's (visit_tiles over both fill levels); the load warp
takes each tile from its branch's TMA tensor into the same slots, and ONE online softmax runs
over all of them (each branch's boundary tile masked on its own limit).  The sink: one split
multiplies 1/ℓ by combine.sink_factor; split-KV leaves it to the combine.  LSE never includes it."""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.scheduler import SM_COUNT, BranchShape
from stages.common.sm90_decode import DecodeSm90, KeyBranch

SINK_WORDS = ("none", "-inf", "inf")  # or a number


class Kernel(DecodeSm90):
    """The decode kernel over a main and a causal SWA branch under one softmax, with the sink."""

    STAGE = "stage D5 sm90"

    def __init__(self, *, shape: str, splits, sink, sm_count: int = SM_COUNT):
        p = BranchShape.parse(shape)
        self.p = p
        if sink not in SINK_WORDS and (isinstance(sink, bool) or not isinstance(sink, (int, float))):
            raise ValueError(f"{self.STAGE}: sink must be none, -inf, inf or a number, got {sink!r}")
        branches = (
            KeyBranch("n_main", p.n_main, p.n_main, fill=True),
            KeyBranch("n_swa", p.n_swa, p.n_swa, fill=True, causal=True),
        )
        self.setup(b=p.b, s_q=p.s_q, h_q=p.h_q, d=p.d, branches=branches, splits=splits,
                   sm_count=sm_count, sink=sink != "none")

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        KV_main: cute.Tensor,
        KV_swa: cute.Tensor,
        main_lens: cute.Tensor,
        swa_lens: cute.Tensor,
        sink: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        O_part: cute.Tensor,
        LSE_part: cute.Tensor,
        stream: cuda.CUstream,
    ):
        b, s_q, h_q, d = self.b, self.s_q, self.h_q, self.d
        self.check_shapes({
            "Q": (Q, (b, s_q, h_q, d)),
            "KV_main": (KV_main, (b, self.p.n_main, d)),
            "KV_swa": (KV_swa, (b, self.p.n_swa, d)),
            "main_lens": (main_lens, (b,)),
            "swa_lens": (swa_lens, (b,)),
            "sink": (sink, (h_q,)),
            "O": (O, (b, s_q, h_q, d)),
            "LSE": (LSE, (b, h_q, s_q)),
        }, O_part, LSE_part)
        self.launch(Q, (KV_main, KV_swa), (main_lens, swa_lens), sink, O, LSE, O_part, LSE_part, stream)
