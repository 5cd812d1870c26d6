"""The kernels a stage's kernel is timed against (`dsv4-lab bench --peers`): one adapter module
per peer, named here so stages.yaml can be validated without importing any of them (or torch).

A peer computes a *problem* (the stage's bench block's `problem:`), not a stage: its adapter
maps the stage's tensors to its call and says which shapes it supports.  A missing package is
"not installed (pip install …)", never a failure.  An adapter whose work differs (FlashMLA's
Q·Kᵀ at 576 columns) says so with `flops(problem, dims)`.

Problems (tensor names and shapes the adapters rely on; the stage's tensors() must match):
  attention    dense softmax attention of one head: Q [m, d], K [n, d], V [n, d] (bf16) ->
               O [m, d] (bf16), LSE [m] (fp32, natural log); scale 1/sqrt(d)
  mla_decode   DSV4/MLA dense decode, MQA over one latent head: Q [b, s_q, h_q, d_qk],
               KV [b, n, d_qk] (bf16; V is KV's first d_v columns) -> O [b, s_q, h_q, d_v],
               LSE [b, h_q, s_q]; scale 1/sqrt(d_qk)
  sink_decode  D5: Q [b, s_q, h_q, d], KV_main [b, n_main, d], KV_swa [b, n_swa, d] (bf16),
               main_lens, swa_lens [b] int32, sink [h_q] fp32 (NaN: none) -> O, LSE
               (torch_plain.py)
  sparse_decode
               stage E: Q, the FP8 paged byte caches with int32 indices and lengths, sink -> O,
               LSE (torch_sparse.py; FlashMLA's V4 kernel: flashmla_sparse.py); with the fused FP8
               epilogue -> O_fp8, O_scale, LSE (e_unfused_fp8.py: the unfused pair)
  mqa_logits, paged_mqa_logits
               the indexer's FP8 MQA logits, flat and paged (indexer_problems.py)"""

from __future__ import annotations

# name -> (adapter module, what to install)
PEERS: dict[str, tuple[str, str]] = {
    "torch_sdpa": ("harness.peers.torch_sdpa", "pip install torch"),
    "torch_plain": ("harness.peers.torch_plain", "pip install torch"),
    "fa4": ("harness.peers.fa4", "pip install flash-attn-4"),
    "flashmla": ("harness.peers.flashmla", "pip install --no-deps sgl-flash-mla"),
    "flashmla_sparse": ("harness.peers.flashmla_sparse", "pip install --no-deps sgl-flash-mla"),
    "flashmla_sparse_percall": ("harness.peers.flashmla_sparse_percall", "pip install --no-deps sgl-flash-mla"),
    "torch_sparse": ("harness.peers.torch_sparse", "pip install torch"),
    "e_unfused_fp8": ("harness.peers.e_unfused_fp8", "pip install torch nvidia-cutlass-dsl"),
    "torch_indexer": ("harness.peers.torch_indexer", "pip install torch"),
    "deepgemm": ("harness.peers.deepgemm", "build DeepGEMM from source: git clone --recursive "
                 "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh"),
}
PEER_NAMES = tuple(PEERS)
PROBLEMS = ("attention", "mla_decode", "sink_decode", "sparse_decode", "mqa_logits", "paged_mqa_logits")  # harness.peers.problems.DIMS reads each


def adapter(name: str):
    """The adapter module of peer `name` (importing it imports no peer package)."""
    import importlib

    if name not in PEERS:
        raise KeyError(f"unknown peer '{name}' (known: {', '.join(PEER_NAMES)})")
    return importlib.import_module(PEERS[name][0])


def why_not(name: str, problem: str | None, dims: dict[str, int] | str, cc: tuple[int, int] | None,
            probe: bool = True) -> str | None:
    """None when peer `name` can run this shape here; else one phrase: the unsupported shape, or "not
        installed (pip install …)".  `dims`: problems.problem_dims's answer (a string: why the tensors
        do not fit).  `probe=False` skips the import check."""
    mod = adapter(name)
    if problem is None:
        return "the stage's bench block names no problem"
    if problem not in mod.PROBLEMS:
        return f"unsupported: computes {', '.join(mod.PROBLEMS)}, not {problem}"
    if isinstance(dims, str):
        return f"unsupported: {dims}"
    why = mod.unsupported(problem, dims, cc)
    if why:
        return f"unsupported: {why}"
    if probe:
        missing = mod.installed()
        if missing:
            return f"not installed ({PEERS[name][1]})" + (f": {missing}" if missing != "missing" else "")
    return None
