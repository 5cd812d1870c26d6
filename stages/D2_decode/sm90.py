"""Stage D2 on Hopper (sm_90a): DSV4 decode attention — batches, tokens, MQA head packing,
split-KV with an LSE combine (tensors: oracles/decode.py).

The kernel is the decode house, stages/common/sm90_decode.py (its module doc), which D3–D5 extend
with masks, a second branch and the sink; D2 turns on its four flags WIDE_STORE, LAZY_RESCALE,
PERSISTENT and REGISTER_P (docs/MASKED_DECODE.md).

Limits: h_q a multiple of 64; d ∈ {64, 128, 256, 512}; n a multiple of block_n (64 at d = 512,
else 128); splits ≤ the scratch capacity (oracles/decode.py)."""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.device import sm_count as device_sm_count
from stages.common.scheduler import DecodeShape
from stages.common.sm90_decode import DecodeSm90, KeyBranch
from stages.common.sm90_kv_slots import check_same_bytes, kv_layouts  # noqa: F401 (tests)


class Kernel(DecodeSm90):
    """DSV4 decode attention on Hopper tensor cores: 64 query heads of one token per CTA,
    KV read once per tile (K and V views of one slot), split-KV with an LSE combine."""

    STAGE = "stage D2 sm90"
    LAZY_RESCALE = True  # most tiles skip the O rescale (the house's doc)
    WIDE_STORE = True  # O leaves by 16-byte stores
    PERSISTENT = True  # min(CTAs, SMs) CTAs walk the row blocks: the next one's loads overlap this one's end
    REGISTER_P = True  # warpgroup 0: P·V from its registers, issued before P is published for warpgroup 1

    def __init__(self, *, shape: str, splits, sm_count: int | None = None):
        # the SMs the splits and the persistent grid fill: the GPU's here (stages/common/device.py;
        # compile-only on a CPU: sm_90a's 132), keyed in the compile cache
        sm_count = device_sm_count("sm_90a") if sm_count is None else sm_count
        p = DecodeShape.parse(shape)
        self.p = p
        self.setup(b=p.b, s_q=p.s_q, h_q=p.h_q, d=p.d, branches=(KeyBranch("n", p.n, p.n_alloc),),
                   splits=splits, sm_count=sm_count)

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        KV: cute.Tensor,
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
            "O": (O, (p.b, p.s_q, p.h_q, p.d)),
            "LSE": (LSE, (p.b, p.h_q, p.s_q)),
        }, O_part, LSE_part)
        self.launch(Q, (KV,), (None,), None, O, LSE, O_part, LSE_part, stream)
