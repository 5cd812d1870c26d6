"""How each problem's sizes are read from a stage's tensors (`problem_dims`): what a peer needs to
know about the shapes it is given. harness.peers.PROBLEMS names the problems; DIMS reads each."""

from __future__ import annotations

from typing import Any, Callable

from harness.peers.base import shapes
from harness.peers.indexer_problems import problem_dims as _indexer_dims


def _attention(problem: str, by: dict[str, Any]) -> dict[str, int] | str:
    got = shapes(problem, by, ("Q", 2, "bfloat16"), ("K", 2, "bfloat16"), ("V", 2, "bfloat16"),
                 ("O", 2, "bfloat16", "out"))
    if isinstance(got, str):
        return got
    q, k, v, o = got
    m, d = q
    n = k[0]
    if k != (n, d) or v != (n, d) or o != (m, d):
        return f"shapes Q {list(q)} K {list(k)} V {list(v)} O {list(o)} are not Q [m, d], K/V [n, d], O [m, d]"
    lse = by.get("LSE")
    if lse is not None and tuple(lse.shape) != (m,):
        return f"LSE {list(lse.shape)} is not [m]"
    return {"m": m, "n": n, "d": d}


def _mla_decode(problem: str, by: dict[str, Any]) -> dict[str, int] | str:
    got = shapes(problem, by, ("Q", 4, "bfloat16"), ("KV", 3, "bfloat16"), ("O", 4, "bfloat16", "out"))
    if isinstance(got, str):
        return got
    q, kv, o = got
    b, s_q, h_q, d_qk = q
    if kv[0] != b or kv[2] != d_qk or o[:3] != (b, s_q, h_q) or o[3] > d_qk:
        return f"shapes Q {list(q)} KV {list(kv)} O {list(o)} are not Q [b, s_q, h_q, d], KV [b, n, d], O [b, s_q, h_q, d_v]"
    return {"b": b, "s_q": s_q, "h_q": h_q, "d_qk": d_qk, "d_v": o[3], "n": kv[1]}


def _sink_decode(problem: str, by: dict[str, Any]) -> dict[str, int] | str:
    got = shapes(problem, by, ("Q", 4, "bfloat16"), ("KV_main", 3, "bfloat16"), ("KV_swa", 3, "bfloat16"),
                 ("main_lens", 1, "int32"), ("swa_lens", 1, "int32"), ("sink", 1, "float32"),
                 ("O", 4, "bfloat16", "out"), ("LSE", 3, "float32", "out"))
    if isinstance(got, str):
        return got
    q, km, ks, ml, sl, sink, o, lse = got
    b, s_q, h_q, d = q
    if km[0] != b or ks[0] != b or km[2] != d or ks[2] != d or ml != (b,) or sl != (b,) or sink != (h_q,) \
            or o != q or lse != (b, h_q, s_q):
        return (f"shapes Q {list(q)} KV_main {list(km)} KV_swa {list(ks)} O {list(o)} LSE {list(lse)} are not "
                "the sink_decode layout")
    return {"b": b, "s_q": s_q, "h_q": h_q, "d": d, "n_main": km[1], "n_swa": ks[1]}


def _sparse_decode(problem: str, by: dict[str, Any]) -> dict[str, Any] | str:
    from harness.peers.torch_sparse import sparse_dims

    return sparse_dims(list(by.values()))


# problem -> how its sizes are read from a stage's tensors (harness.peers.PROBLEMS names them)
DIMS: dict[str, Callable[[str, dict[str, Any]], dict[str, int] | str]] = {
    "attention": _attention,
    "mla_decode": _mla_decode,
    "sink_decode": _sink_decode,
    "sparse_decode": _sparse_decode,
    "mqa_logits": _indexer_dims,
    "paged_mqa_logits": _indexer_dims,
}


def problem_dims(problem: str, specs: list[Any]) -> dict[str, int] | str:
    """The problem's sizes from `specs` (oracles.common.TensorSpec list), or one phrase saying
    why these tensors are not that problem's layout."""
    fn = DIMS.get(problem)
    if fn is None:
        return f"unknown problem {problem}"
    return fn(problem, {s.name: s for s in specs})


