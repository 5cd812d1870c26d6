"""The indexer's two problems (stages I1, I2), as a peer sees a stage's tensors.

  mqa_logits        q [s, h, d] e4m3, kv [s_kv, d] e4m3, kv_scale [s_kv] fp32, weights [s, h] fp32,
                    ks [s], ke [s] int32 -> logits [s, s_kv] fp32 or bf16 (logits_bf16 0 | 1):
                    Σ_h relu(q·k·kv_scale)·w over ks ≤ j < ke, −inf elsewhere; or (compressed 1,
                    W < s_kv) logits [s, W], column c of row i key ks[i] + c (−inf past ke[i]).
  paged_mqa_logits  q [b, next_n, h, d] e4m3, kv_cache [num_blocks, block_kv, 1, d + 4] uint8 (per
                    block: block_kv·d e4m3 values, then block_kv fp32 scales), context_lens [b],
                    block_table [b, max_blocks] int32, weights [b·next_n, h] fp32 ->
                    logits [b·next_n, max_blocks·block_kv] fp32 or bf16; token t of sequence i sees
                    positions ≤ context_lens[i] − next_n + t, −inf elsewhere; or, with
                    context_lens [b, next_n] (context_2d 1), the positions < context_lens[i, t]

`problem_dims` answers harness.peers.problems.problem_dims for these two problems."""

from __future__ import annotations

from typing import Any

from harness.peers.base import tensor_shape

INDEXER_PROBLEMS = ("mqa_logits", "paged_mqa_logits")


def problem_dims(problem: str, by: dict[str, Any]) -> dict[str, int] | str:
    """The problem's sizes from the stage's tensor specs (name -> TensorSpec), or one phrase
    saying why they are not the problem's layout."""

    def need(name: str, rank: int, dtype: str, role: str = "in") -> tuple[int, ...] | str:
        return tensor_shape(problem, by, name, rank, dtype, role)

    out_dtype = getattr(by.get("logits"), "dtype", None)
    bf16 = int(out_dtype == "bfloat16")  # the logits' dtype: fp32 (0) or bf16 (1)
    logits_dtype = "bfloat16" if bf16 else "float32"

    if problem == "mqa_logits":
        got = [need("q", 3, "float8_e4m3fn"), need("kv", 2, "float8_e4m3fn"), need("kv_scale", 1, "float32"),
               need("weights", 2, "float32"), need("ks", 1, "int32"), need("ke", 1, "int32"),
               need("logits", 2, logits_dtype, "out")]
        for g in got:
            if isinstance(g, str):
                return g
        q, kv, sc, w, ks, ke, out = got
        s, h, d = q
        s_kv = kv[0]
        if kv != (s_kv, d) or sc != (s_kv,) or w != (s, h) or ks != (s,) or ke != (s,) or out[0] != s \
                or not 0 < out[1] <= s_kv:
            return (f"shapes q {list(q)} kv {list(kv)} kv_scale {list(sc)} weights {list(w)} ks {list(ks)} "
                    f"ke {list(ke)} logits {list(out)} are not the mqa_logits layout")
        return {"s": s, "s_kv": s_kv, "h": h, "d": d, "logits_bf16": bf16, "compressed": int(out[1] < s_kv),
                "width": out[1]}
    if problem == "paged_mqa_logits":
        got = [need("q", 4, "float8_e4m3fn"), need("kv_cache", 4, "uint8"), need("context_lens", len(getattr(by.get("context_lens"), "shape", (0,))), "int32"),
               need("block_table", 2, "int32"), need("weights", 2, "float32"), need("logits", 2, logits_dtype, "out")]
        for g in got:
            if isinstance(g, str):
                return g
        q, cache, lens, table, w, out = got
        b, next_n, h, d = q
        nb, bk, one, d4 = cache
        if one != 1 or d4 != d + 4 or lens not in ((b,), (b, next_n)) or table[0] != b or w != (b * next_n, h) \
                or out != (b * next_n, table[1] * bk):
            return (f"shapes q {list(q)} kv_cache {list(cache)} context_lens {list(lens)} block_table {list(table)} "
                    f"weights {list(w)} logits {list(out)} are not the paged_mqa_logits layout")
        return {"b": b, "next_n": next_n, "h": h, "d": d, "num_blocks": nb, "block_kv": bk,
                "max_blocks": table[1], "max_len": table[1] * bk, "logits_bf16": bf16,
                "context_2d": int(len(lens) == 2)}
    return f"unknown problem {problem}"
