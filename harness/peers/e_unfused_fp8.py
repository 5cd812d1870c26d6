"""The unfused pair that stage E's fused FP8 output epilogue (`epilogue: fp8_rope`) replaces: our
sm90 kernel with bf16 output, then a separate inverse-RoPE + quantise pass (issue 33 item 3).

Supported: `sparse_decode` cases whose tensors carry the fp8_rope outputs (O_fp8, O_scale, with
cos_sin_cache and positions: harness/peers/torch_sparse.py sparse_dims says `epilogue`), on sm90.

make(): stage E's sm90 Kernel is built for the case's b, config and kv_format with splits
SPLITS ("auto": the bench block's only value; the tensors do not say it) and epilogue "bf16", and
compiled once per process (cute.compile traced on compact tensors of the real ones' shapes, as
harness/execution/compile.py traces the lab's kernels; launched as harness/execution/launch.py
launches them); each input set
gets its own bf16 O, LSE and split scratch.  run() launches that kernel, then the pass on its O:
the inverse rotation of the rope lanes (float32), the per-128 UE8M0 exponents and e4m3 values
(clamped to ±448) and the packed O_fp8 / O_scale words (pad words 0), all as oracles/fp8_epilogue.py's
module doc states them (its float64 rotate / quantise / pack are the reference the CPU tests hold
`rope_quantise` to).  The pass is `rope_quantise` under torch.compile (one
fused Triton kernel or a few; default mode, no CUDA graphs of its own: the bench captures the
pair in its graph), or eager PyTorch where torch.compile fails on the first call (PASS says
which ran; a line on stderr says so).  run() returns the kernel's own output form — O_fp8 and
O_scale as float32 words (fe.words_of), LSE — which the bench judges through stage E's decode,
as it judges our fused kernel (harness/execution/executor.py)."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from harness.peers.base import importable

PROBLEMS = ("sparse_decode",)
SPLITS = "auto"
PASS: dict[str, str] = {}  # "kind": "torch.compile" or "eager" — what the last make() runs

_KERNELS: dict[tuple, Any] = {}  # (b, config, kv_format, splits) -> the compiled bf16 kernel
_COMPILED_PASS: list = []


def installed() -> str | None:
    return importable("torch") or importable("cutlass")


def unsupported(problem: str, dims: dict[str, Any], cc: tuple[int, int] | None) -> str | None:
    if dims.get("epilogue") != "fp8_rope":
        return f"epilogue {dims.get('epilogue', 'bf16')}: times fp8_rope rows only"
    if cc is not None and cc[0] != 9:
        return f"compute capability {cc[0]}.{cc[1]}: the pair runs our sm90 kernel"
    if dims["h_q"] % 8:
        return f"h_q {dims['h_q']}: O_fp8's groups are 8 heads"
    return None


def config_of(dims: dict[str, Any]) -> str:
    """Stage E's config string of the problem's sizes (stages/common/sparse_config.py's form)."""
    text = f"s{dims['s_q']}h{dims['h_q']}_m{dims['topk']}bs{dims['block']}"
    return text + (f"_x{dims['extra_topk']}bs{dims['extra_block']}" if dims["extra_topk"] else "")


def rope_quantise(o, cos_sin_cache, positions):
    """(O_fp8 float8_e4m3fn [h_q/8, n, 8, 512], O_scale int32 [h_q/8, 8, align4(n)]) of bf16 O
    [b, s_q, h_q, 512] (n = b · s_q tokens, token r at positions[r]): the module doc's pass."""
    import torch

    b, s_q, h, d = o.shape
    n, g = b * s_q, h // 8
    x = o.reshape(n, h, d).float()
    cs = cos_sin_cache.index_select(0, positions.long())  # [n, 64]
    cos, sin = cs[:, None, :32], cs[:, None, 32:]
    x0, x1 = x[..., 448::2], x[..., 449::2]
    rope = torch.stack((x0 * cos + x1 * sin, x1 * cos - x0 * sin), dim=-1).reshape(n, h, 64)
    x = torch.cat((x[..., :448], rope), dim=-1).reshape(n, h, 4, 128)
    e = torch.ceil(torch.log2(torch.clamp_min(x.abs().amax(dim=-1), 1e-4) / 448.0))  # [n, h, 4]
    q = (x * torch.exp2(-e)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = q.reshape(n, g, 8, d).permute(1, 0, 2, 3).contiguous()
    ue = e.to(torch.int64) + 127
    words = ue[..., 0] | (ue[..., 1] << 8) | (ue[..., 2] << 16) | (ue[..., 3] << 24)  # [n, h]
    words = (words - ((words >> 31) << 32)).to(torch.int32).reshape(n, g, 8).permute(1, 2, 0)
    scales = torch.nn.functional.pad(words, (0, (-n) % 4))  # [g, 8, align4(n)], the pad words 0
    return out, scales.contiguous()


def _pass(o, cos_sin_cache, positions):
    """The pass as it runs: torch.compile'd where that works (tried on the first call, outside
    any timing), else eager; PASS["kind"] says which."""
    if not _COMPILED_PASS:
        try:
            import torch

            fn = torch.compile(rope_quantise, dynamic=False)
            got = fn(o, cos_sin_cache, positions)
            _COMPILED_PASS.append(fn)
            PASS["kind"] = "torch.compile"
            return got
        except Exception as exc:  # no Triton, no compiler: the eager pass (said once)
            _COMPILED_PASS.append(rope_quantise)
            PASS["kind"] = "eager"
            print(f"e_unfused_fp8: torch.compile failed ({type(exc).__name__}); the eager pass is timed",
                  file=sys.stderr)
    return _COMPILED_PASS[0](o, cos_sin_cache, positions)


def _bf16_case(dims: dict[str, Any]) -> dict[str, Any]:
    return dict(b=dims["b"], config=config_of(dims), kv_format=dims["kv_format"], scenario="sink",
                splits=SPLITS, epilogue="bf16")


def make(problem: str, dims: dict[str, Any], inputs: dict) -> Callable[[], dict]:
    import torch

    from oracles import fp8_epilogue as fe
    from oracles.sparse_decode import tensors

    case = _bf16_case(dims)
    specs = tensors(case)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "uint8": torch.uint8}
    dev = inputs["Q"].device
    bufs = {s.name: torch.empty(s.shape, dtype=dtypes[s.dtype], device=dev)
            for s in specs if s.role in ("out", "scratch")}
    bufs["cos_sin_cache"] = torch.zeros(specs[[s.name for s in specs].index("cos_sin_cache")].shape,
                                        dtype=torch.float32, device=dev)  # the bf16 kernel's unused [1, 64]
    args = [inputs[s.name] if s.name in inputs and s.name not in bufs else bufs[s.name] for s in specs]
    launch = _launcher(case, args)
    cos_sin, positions = inputs["cos_sin_cache"], inputs["positions"]

    def run() -> dict:
        launch()
        out, scales = _pass(bufs["O"], cos_sin, positions)
        o_words, s_words = fe.words_of(out.view(torch.uint8), scales)
        return {"O_fp8": o_words, "O_scale": s_words, "LSE": bufs["LSE"]}

    return run


def _launcher(case: dict[str, Any], args: list) -> Callable[[], None]:
    """A launch of stage E's sm90 kernel for `case` on `args` (torch tensors in tensors(case)'s
    order), compiled on the first call for these parameters in this process."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    from stages.E_sparse_decode.sm90 import Kernel

    cargs = [from_dlpack(t, assumed_align=16) for t in args]
    key = (case["b"], case["config"], case["kv_format"], case["splits"])
    if key not in _KERNELS:  # traced on compact row-major tensors of the real ones' shapes, as the lab compiles
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        kinds = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
                 torch.uint8: cutlass.Uint8}
        fakes = [make_fake_compact_tensor(kinds[t.dtype], tuple(t.shape), stride_order=tuple(range(t.dim() - 1, -1, -1)),
                                          assumed_align=16) for t in args]
        kernel = Kernel(b=case["b"], config=case["config"], kv_format=case["kv_format"], splits=case["splits"],
                        epilogue="bf16")
        _KERNELS[key] = cute.compile(kernel, *fakes, make_fake_stream())
    fn = _KERNELS[key]

    def launch() -> None:
        fn(*cargs, cuda.CUstream(torch.cuda.current_stream().cuda_stream))

    return launch
