"""What a peer needs to know about a stage's tensors: the problem's sizes, read from the
stage's tensor specs (harness.peers names the problems and their layouts)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def tensor_shape(problem: str, by: dict[str, Any], name: str, rank: int, dtype: str,
                 role: str = "in") -> tuple[int, ...] | str:
    """The shape of tensor `name` in `by` (name -> TensorSpec) when it has this rank, dtype and
    role; else one phrase saying how it differs from what `problem` wants."""
    s = by.get(name)
    if s is None:
        return f"no tensor {name}"
    if len(s.shape) != rank or s.dtype != dtype or s.role != role:
        return f"{name} is {list(s.shape)} {s.dtype} ({s.role}); {problem} wants rank {rank} {dtype} ({role})"
    return tuple(s.shape)


def shapes(problem: str, by: dict[str, Any], *wanted: tuple) -> list[tuple[int, ...]] | str:
    """tensor_shape for each (name, rank, dtype[, role]) in turn: the shapes, or the first phrase."""
    got = []
    for w in wanted:
        g = tensor_shape(problem, by, *w)
        if isinstance(g, str):
            return g
        got.append(g)
    return got


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


def _indexer(problem: str, by: dict[str, Any]) -> dict[str, int] | str:
    from harness.peers.indexer_problems import problem_dims as indexer_dims

    return indexer_dims(problem, by)


# problem -> how its sizes are read from a stage's tensors (harness.peers.PROBLEMS names them)
DIMS: dict[str, Callable[[str, dict[str, Any]], dict[str, int] | str]] = {
    "attention": _attention,
    "mla_decode": _mla_decode,
    "sink_decode": _sink_decode,
    "mqa_logits": _indexer,
    "paged_mqa_logits": _indexer,
}


def problem_dims(problem: str, specs: list[Any]) -> dict[str, int] | str:
    """The problem's sizes from `specs` (oracles.common.TensorSpec list), or one phrase saying
    why these tensors are not that problem's layout."""
    fn = DIMS.get(problem)
    if fn is None:
        return f"unknown problem {problem}"
    return fn(problem, {s.name: s for s in specs})


def importable(module: str) -> str | None:
    """None when `module` imports; "missing" when it is not there; else why it does not load."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        return "missing" if exc.name and exc.name.split(".")[0] == top else f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a package that is there but will not load (ABI, CUDA libraries)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return None
