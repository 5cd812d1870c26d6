"""Smoke test of a DeepGEMM build through the lab's peer adapter (harness/peers/deepgemm.py), on
the GPU machine, from the repository root: `python3 scripts/deepgemm_smoke.py MODE`.

  flat      fp8_mqa_logits at I1's s 128, s_kv 1024, cp ranges against the float64 oracle
  paged N   fp8_paged_mqa_logits at I2's b 8, next_n N, ctx 3000 (NaN past every context)
  meta      the schedule-metadata kernels of the bench's batch sizes (b 64, 128; next_n 1, 2)
  AXIS=VALUE words after flat / paged N set the stage's options, e.g.
            `flat logits_dtype=bf16 compressed=true heads=32 head_dim=64`

These calls use the bench's template parameters, so DeepGEMM's JIT cache (DG_JIT_CACHE_DIR) holds
them for a later bench.  One line per mode; exit 1 (one line) on an error or a result off the
oracle."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())


def main(argv: list[str]) -> int:
    import torch

    import deep_gemm
    from harness.execution.metrics import compare
    from harness.peers import deepgemm
    from harness.peers.indexer_problems import problem_dims
    from oracles import indexer as ix

    device = os.environ.get("DG_SMOKE_DEVICE", "cuda")  # "cpu": a dry run against a stand-in deep_gemm

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    options = {}
    for word in [w for w in argv if "=" in w]:
        key, value = word.split("=", 1)
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    argv = [w for w in argv if "=" not in w]
    mode = argv[0] if argv else "flat"
    if mode == "meta":
        t0 = time.perf_counter()
        for b in (64, 128):
            for next_n in (1, 2):
                lens = torch.full((b, next_n), 8192, dtype=torch.int32, device=device)
                deep_gemm.get_paged_mqa_logits_metadata(lens, 64, deep_gemm.get_num_sms())
        sync()
        print(f"deepgemm smoke meta: metadata kernels for b 64, 128 ready ({time.perf_counter() - t0:.1f} s)")
        return 0
    if mode == "flat":
        problem, case = "mqa_logits", {"s": 128, "s_kv": 1024, "ranges": "cp", **options}
        specs, make_inputs, reference = ix.tensors(case), ix.make_inputs, ix.reference
    elif mode == "paged":
        next_n = int(argv[1]) if len(argv) > 1 else 2
        problem, case = "paged_mqa_logits", {"b": 8, "next_n": next_n, "ctx": 3000, "block_kv": 64, **options}
        specs, make_inputs, reference = ix.paged_tensors(case), ix.paged_make_inputs, ix.paged_reference
    else:
        print(f"deepgemm smoke: unknown mode {mode!r} (flat, paged N, meta)")
        return 2
    dims = problem_dims(problem, {s.name: s for s in specs})
    ins = make_inputs(case, 0, device)
    t0 = time.perf_counter()
    run = deepgemm.make(problem, dims, ins)
    got = run()["logits"]
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    run()
    sync()
    again = time.perf_counter() - t0
    m = compare(got, reference(ins, case)["logits"])
    where = " ".join(f"{k} {v}" for k, v in case.items())
    line = (f"deepgemm smoke {mode} ({where}): cosine {m.cosine}, rel_l2 {m.rel_l2}, "
            f"non-finite mismatches {m.nonfinite}, unwritten {m.unwritten}; "
            f"first call {first:.1f} s (JIT compile + load), next {again * 1e3:.2f} ms")
    ok = m.nonfinite == 0 and m.unwritten == 0 and m.cosine is not None and m.cosine > 0.99999
    print(("" if ok else "FAILED: ") + line)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:  # one line, not a traceback
        text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
        print(f"FAILED: deepgemm smoke {' '.join(sys.argv[1:])}: {text[:1500]}")
        sys.exit(1)
