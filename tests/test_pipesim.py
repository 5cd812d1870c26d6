"""Pipeline protocols simulated by stages/common/pipesim.py: no deadlock, lapped ring or stray arrival;
counts and bytes equal the PTX's; planted drifts caught.
"""

import json
import os
import subprocess
import sys
import textwrap
from functools import lru_cache

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from stages.common import protocols as P
from stages.common.pipesim import (Arrive, Barrier, Bytes, Protocol, Wait, consumer_wait, cross_check, ptx_facts,
                                   producer_wait, simulate)
from tests.conftest import ROOT

DECODE = ("D2", "D3", "D4", "D5")


@lru_cache(maxsize=None)
def _spec():
    return load_spec(root=ROOT)


def _kernel(stage_id: str, case: dict, arch: str = "sm_100a"):
    import importlib

    st = _spec().stages[stage_id]
    ref = st.kernels[arch]
    cls = getattr(importlib.import_module(ref.module), ref.entry)
    return cls(**{k: case[k] for k in st.kernel_params})


def _kernel_cases(stage_id: str) -> list[dict]:
    """One case per distinct kernel of the stage's sm100 matrix."""
    st = _spec().stages[stage_id]
    seen, out = set(), []
    for c in expand(st):
        key = tuple((k, str(c.dict[k])) for k in st.kernel_params)
        if key not in seen:
            seen.add(key)
            out.append(c.dict)
    return out


def _max_tiles(k) -> int:
    """The most KV tiles a CTA visits: its longest split."""
    g = k.sched
    return max(g.work(0, s, 0).tile_end - g.work(0, s, 0).tile_begin for s in range(g.splits))


def _protocols(stage_id: str, case: dict, arch: str = "sm_100a"):
    """(tiles, ring laps, protocol) for every CTA the kernel can have."""
    k = _kernel(stage_id, case, arch)
    if arch == "sm_90a" and stage_id == "E":  # every part of the grid
        for part in range(k.sched.parts):
            proto = P.sparse_sm90(k, part)
            n = sum(w.tile_end - w.tile_begin for w, _ in (k.sched.segment(0, part, s)
                                                            for s in range(k.sched.segments(part))))
            yield n, n / k.KV_STAGES, proto
        return
    if arch == "sm_90a" and stage_id in DECODE and k.PERSISTENT:  # every CTA's walk over its items
        g = k.sched
        for c in range(k.grid_ctas):
            tiles = [max(g.item(i).tile_end - g.item(i).tile_begin, 0) for i in range(c, g.items, k.grid_ctas)]
            yield sum(tiles), sum(tiles) / k.stages, P.decode_sm90_persistent(k, tiles)
        # with empty items between, before and after
        for tiles in ([0, 2, 0, 3], [3, 0, 1], [1, 1, 1, 1, 1]):
            yield sum(tiles), sum(tiles) / k.stages, P.decode_sm90_persistent(k, tiles)
        return
    if arch == "sm_90a" and stage_id in ("I1", "I2"):  # every CTA's pairs
        from oracles.indexer import context_lens_of, paged_geometry, ranges_of
        from stages.common.indexer import block_tiles, share_segments

        if stage_id == "I1":
            blocks = block_tiles(*ranges_of(case), k.BLOCK_Q, k.s_kv, k.BLOCK_K)
        else:
            max_len = paged_geometry(case)["max_len"]
            blocks = [-(-min(max(n, 0), max_len) // k.BLOCK_KV) for n in context_lens_of(case)]
        every = stage_id == "I1"
        for c in range(k.ctas):
            segs = [n for _, _, n in share_segments(blocks, c, k.ctas)]
            yield sum(segs), sum(segs) / k.STAGES, P.indexer_sm90_persistent(k, segs, every)
        # empty segments, more segments than Q slots
        for segs in ([2], [0, 2, 0, 3], [3 * k.STAGES + 1, 0, 1], [1] * 7, [k.STAGES - 1, k.STAGES + 1]):
            yield sum(segs), sum(segs) / k.STAGES, P.indexer_sm90_persistent(k, segs, every)
        return
    if arch == "sm_90a":
        for n in range(_max_tiles(k) + 1):
            yield n, n / k.stages, P.decode_sm90(k, n)
        return
    if stage_id in DECODE or stage_id == "E":
        build = P.decode_sm100 if stage_id in DECODE else P.sparse_sm100
        for n in range(_max_tiles(k) + 1):
            for half in range(k.o_split):
                yield n, n * k.n_chunks / k.slots, build(k, n, half)
    else:
        most = k.s_kv // k.BLOCK_K if stage_id == "I1" else k.CHUNK_TILES
        for n in range(most + 1):
            yield n, n / k.STAGES, P.indexer_sm100(k, n, boxes=1 if stage_id == "I1" else 2)


COVERED = [("sm_100a", s) for s in DECODE + ("E", "I1", "I2")] + [("sm_90a", s) for s in DECODE + ("E", "I1", "I2")]


@pytest.mark.parametrize("arch,stage_id", COVERED)
def test_every_case_of_the_matrix_completes(arch, stage_id):
    counts, laps, runs = set(), 0.0, 0
    for case in _kernel_cases(stage_id):
        for n, lapped, proto in _protocols(stage_id, case, arch):
            got = simulate(proto)
            assert got is None, (case, got)
            counts.add(n)
            laps = max(laps, lapped)
            runs += 1
    # empty split, one tile, two tiles
    assert ({1, 2} if (arch, stage_id) == ("sm_90a", "E") else {0, 1, 2}) <= counts
    assert laps >= 2  # and many: the ring wraps twice
    print(arch, stage_id, runs, "CTA protocols, tiles", sorted(counts)[-1], "laps", laps)


def test_model1_wide_chunk_and_both_load_orders_are_in_the_protocol():
    k = _kernel("E", {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "splits": 1, "epilogue": "bf16"})
    raw = [[op.tx for op in P.sparse_sm100(k, 1, half).roles["index"]() if isinstance(op, Arrive) and op.bar == "raw.full"]
           for half in (0, 1)]
    assert sorted(raw[0]) == sorted(raw[1]) == [8192, 8192, 8192, 12288]
    assert raw[0] != raw[1]  # the wide chunk moves


# -- planted protocol bugs


def _planted(proto: Protocol, role: str, bar: str, delta: int) -> Protocol:
    """`proto` with `role` arriving `delta` more times on its first arrival at `bar`."""
    make = proto.roles[role]

    def wrong():
        first = True
        for op in make():
            if first and isinstance(op, Arrive) and op.bar == bar:
                first = False
                op = op._replace(n=op.n + delta)
            yield op

    return Protocol(proto.name, proto.barriers, {**proto.roles, role: wrong}, proto.tx)


def test_an_arrive_count_off_by_one_deadlocks_and_names_the_barrier():
    k = _kernel("D2", {"shape": "b4s2h128n256d64", "splits": 1})
    good = P.decode_sm100(k, 3)
    assert simulate(good) is None
    short = simulate(_planted(good, "softmax", "p.full", -1))  # 127 of the 128 softmax threads arrive
    assert short and "deadlock" in short and "role mma waits on p.full[0]" in short and "127 of 128" in short, short
    e = _kernel("E", {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "splits": 1, "epilogue": "bf16"})
    missing = simulate(_planted(P.sparse_sm100(e, 2), "dequant", "raw.empty", -1))  # one dequant warp never releases
    assert missing and "deadlock" in missing and "raw.empty[0]" in missing, missing
    extra = simulate(_planted(good, "mma", "kv.empty", +1))
    assert extra and "kv.empty" in extra and ("arrivals in phase" in extra or "lapped" in extra), extra


def test_d2_persistent_walk_completes_and_a_q_never_freed_deadlocks_at_the_next_item():
    """D2 sm90: without warpgroup 0 freeing Q the load warp waits at item 2."""
    k = _kernel("D2", {"shape": "b64s2h128n1152d512", "splits": "auto"}, "sm_90a")
    good = P.decode_sm90_persistent(k, [18, 18])
    assert simulate(good) is None
    stuck = simulate(_planted(good, "mma", "q.empty", -4))  # warpgroup 0's 4 warps never arrive
    assert stuck and "deadlock" in stuck and "role load waits on q.empty[0]" in stuck, stuck


def test_the_simulator_reports_a_lapped_ring_and_a_stray_arrival():
    bars = {"x.full": Barrier(1, 1), "x.empty": Barrier(1, 1)}

    def producer():  # fills the slot twice
        for g in range(2):
            yield Arrive("x.full", 0)

    def consumer():
        for g in range(2):
            yield consumer_wait("x.full", g, 1)
            yield Arrive("x.empty", 0)

    got = simulate(Protocol("lap", bars, {"p": producer, "c": consumer}))
    assert got and "lapped" in got, got

    def lone():
        yield producer_wait("x.empty", 0, 1)
        yield Arrive("x.full", 0, 1, 64)
        yield Bytes("x.full", 0, 32)  # half the announced bytes land

    got = simulate(Protocol("bytes", bars, {"p": lone}))
    assert got and "x.full[0] left mid-phase" in got and "32 bytes" in got, got
    assert simulate(Protocol("w", bars, {"w": lambda: iter([Wait("x.full", 0, 0, 1)])})).endswith(
        "role w waits on x.full[0] phase 0 (parity 0; 0 of 1 arrivals, 0 bytes outstanding)")


# -- the PTX cross-check

PTX_CASES = {  # sm_100a: one case per family (E: three formats)
    "D2": {"shape": "b4s2h128n256d64", "splits": 1},
    "D5": {"shape": "b4s2h128m128n256d512", "splits": "many", "sink": 0},
    "E/model1": {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "splits": 1, "epilogue": "bf16"},
    "E/simple": {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "simple", "splits": 1, "epilogue": "bf16"},
    "E/v4.1": {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "v4.1", "splits": 1, "epilogue": "bf16"},
    "I1": {"s": 128, "s_kv": 1024},
    "I2": {"b": 8, "next_n": 2, "block_kv": 64},
}
PTX_CASES_SM90 = {  # sm_90a: decode house, E, indexers
    "D2": {"shape": "b4s2h128n256d64", "splits": 1},
    "E/pair": {"b": 2, "config": "s2h128_m128bs256_x1024bs64", "kv_format": "model1", "splits": 1, "epilogue": "bf16"},
    "E/alone": {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "simple", "splits": "auto", "epilogue": "bf16"},
    "D5": {"shape": "b4s2h128m128n256d512", "splits": "many", "sink": 0},
    "I1": {"s": 128, "s_kv": 1024},
    "I2": {"b": 8, "next_n": 2, "block_kv": 64},
}

_COMPILE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from harness.execution.compile import compile_case
from harness.spec.matrix import expand
from harness.spec.spec import load_spec
root = Path({root!r})
spec = load_spec(root=root)
out = {{}}
for label, want in {cases!r}.items():
    st = spec.stages[label.split("/")[0]]
    case = next(c.dict for c in expand(st) if all(str(c.dict[k]) == str(v) for k, v in want.items()))
    r = compile_case(root, st, {arch!r}, case)
    out[label] = {{"ok": r.ok, "error": r.error, "ptx": r.ptx_path, "case": case}}
print("RESULT" + json.dumps(out))
"""


def _compiled(tmp, arch: str, cases: dict) -> dict:
    """The PTX of `cases` for `arch` through the lab's compile cache."""
    script = tmp / f"compile_{arch}.py"
    script.write_text(textwrap.dedent(_COMPILE.format(root=str(ROOT), cases=cases, arch=arch)))
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(tmp),
           "PYTHONPATH": str(ROOT)}
    env.pop("DSV4_DEBUG_HANGS", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line[len("RESULT"):])
    for label, r in out.items():
        assert r["ok"], (label, r["error"])
        with open(r["ptx"]) as f:
            r["facts"] = ptx_facts(f.read())
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return _compiled(tmp_path_factory.mktemp("pipesim"), "sm_100a", PTX_CASES)


@pytest.fixture(scope="module")
def compiled_sm90(tmp_path_factory) -> dict:
    return _compiled(tmp_path_factory.mktemp("pipesim90"), "sm_90a", PTX_CASES_SM90)


def _protocol_for(label: str, case: dict) -> Protocol:
    stage_id = label.split("/")[0]
    k = _kernel(stage_id, case)
    if stage_id in DECODE:
        return P.decode_sm100(k, 2)
    if stage_id == "E":
        return P.sparse_sm100(k, 2)
    return P.indexer_sm100(k, 2, boxes=1 if stage_id == "I1" else 2)


@pytest.mark.parametrize("label", list(PTX_CASES))
def test_protocol_counts_and_bytes_are_the_compiled_kernels(compiled, label):
    r = compiled[label]
    assert cross_check(_protocol_for(label, r["case"]), r["facts"]) == []


@pytest.mark.parametrize("label", list(PTX_CASES_SM90))
def test_sm90_protocol_counts_and_bytes_are_the_compiled_kernels(compiled_sm90, label):
    r = compiled_sm90[label]
    k = _kernel(label.split("/")[0], r["case"], "sm_90a")
    if label.startswith("E/"):
        proto = P.one_cta(P.sparse_sm90(k, 0))
    else:
        proto = P.decode_sm90(k, 2) if label in DECODE else P.indexer_sm90_persistent(k, [2, 1], label == "I1")
        if label in DECODE and k.PERSISTENT:
            proto = P.decode_sm90_persistent(k, [2, 1])
    assert cross_check(proto, r["facts"]) == []


def test_a_drifted_count_or_byte_total_fails_the_cross_check(compiled):
    r = compiled["D5"]
    proto = _protocol_for("D5", r["case"])
    assert cross_check(proto, r["facts"]) == []
    drift = Protocol(proto.name, {**proto.barriers, "s.empty": Barrier(proto.barriers["s.empty"].slots, 127)},
                     proto.roles, proto.tx)
    (why,) = cross_check(drift, r["facts"])
    assert "barrier init counts" in why and "127" in why
    tx = Protocol(proto.name, proto.barriers, proto.roles, {**proto.tx, "kv": {16384 + 1}})
    (why,) = cross_check(tx, r["facts"])
    assert "expect_tx bytes" in why and "16385" in why
    e = compiled["E/model1"]
    narrow = _protocol_for("E/model1", e["case"])
    narrow = Protocol(narrow.name, narrow.barriers, narrow.roles, {**narrow.tx, "raw": {8192}})  # no wide chunk
    assert any("expect_tx" in w for w in cross_check(narrow, e["facts"]))


def test_an_eager_qk_order_that_outruns_the_ring_deadlocks():
    """qk_early = R − n_v chunks; one more and the MMA warp waits on a slot only P·V_j frees."""
    import copy

    k = _kernel("D2", {"shape": "b1s2h128n1152d512", "splits": 1})
    assert (k.slots, k.n_chunks, k.n_v, k.qk_early) == (5, 4, 2, 3)
    assert simulate(P.decode_sm100(k, 3)) is None
    eager = copy.copy(k)
    eager.qk_early = k.qk_early + 1
    got = simulate(P.decode_sm100(eager, 3))
    assert got and "deadlock" in got and "role mma waits on kv.full" in got and "role load waits on kv.empty" in got, got


def test_a_pair_whose_consumers_never_release_the_peer_deadlocks_naming_remote_empty():
    """E sm90 h_q 128: without the release on remote_empty the peer's producer waits forever."""
    k = _kernel("E", {"b": 2, "config": "s2h128_m128bs256_x1024bs64", "kv_format": "model1", "splits": 1, "epilogue": "bf16"}, "sm_90a")
    good = P.sparse_sm90(k, 0)
    assert simulate(good) is None
    make = good.roles["attend@0"]

    def no_remote_release():
        for op in make():
            if not (isinstance(op, Arrive) and op.bar == "remote_empty@1"):
                yield op

    got = simulate(Protocol(good.name, good.barriers, {**good.roles, "attend@0": no_remote_release}, good.tx))
    assert got and "deadlock" in got and "role producer@1 waits on remote_empty@1" in got, got
