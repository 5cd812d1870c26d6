"""Stage E's sm90 kernel on the CPU (no compile): its own statement of the cache layouts agrees
with oracles/kvcache.py, its split count fits the scratch the oracle declares on every matrix
and bench case, and it refuses what it cannot do."""

import pytest

from harness.matrix import expand
from harness.spec import load_spec
from oracles import kvcache as kc
from oracles import sparse_decode as sd
from stages.E_sparse_decode import sm90


@pytest.mark.parametrize("fmt", kc.FORMATS)
def test_kernel_block_bytes_agree_with_the_oracle(fmt):
    for bs in (1, 2, 3, 61, 64, 72, 73, 256):
        assert sm90.cache_block_bytes(fmt, bs) == kc.block_bytes(fmt, bs)


def test_splits_fit_the_declared_scratch(project_root):
    stage = load_spec(root=project_root).stages["E"]
    cases = [c.dict for c in expand(stage)]
    cases += [dict(b=b, config=cfg, kv_format="model1", scenario="sink", splits="auto")
              for b in (2, 64, 74, 128, 148, 256) for cfg in ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64")]
    seen = set()
    for case in cases:
        key = (case["b"], case["config"], case["splits"])
        if key in seen:
            continue
        seen.add(key)
        k = sm90.Kernel(b=case["b"], config=case["config"], kv_format=case["kv_format"], splits=case["splits"])
        assert 1 <= k.splits <= sd.split_capacity(case), case
        if case["splits"] == 1:
            assert k.splits == 1


def test_refusals():
    with pytest.raises(ValueError, match="h_q"):
        sm90.Kernel(b=2, config="s1h32_m64bs64", kv_format="model1", splits=1)
    with pytest.raises(ValueError, match="kv_format"):
        sm90.Kernel(b=2, config="s1h64_m64bs64", kv_format="fp4", splits=1)


def test_register_plan_fits_the_launch_allocation():
    """setmaxnreg only moves registers inside the CTA's launch allocation (384 × 168 = 64 512):
    the first rung asked 2·128·216 + 128·80 = 65 536 and hung on the GPU (batch 2)."""
    assert sm90.register_plan(384, [(256, 216), (128, 80)]) is not None  # the plan that hung
    assert sm90.register_plan(384, [(256, 240), (128, 24)]) is None  # D2's: exactly 64 512
    k = sm90.Kernel
    for plan in k.PLANS.values():
        assert sm90.register_plan(plan.threads, [(k.MMA_THREADS, plan.mma_regs), (plan.producer_threads, plan.producer_regs)]) is None
    assert sm90.register_plan(512, [(256, 184), (256, 80)]) is not None  # 512 threads hold 128 each


def test_e8m0_bytes_are_loaded_unsigned(project_root, tmp_path, monkeypatch):
    """Compiled for sm_90a (no GPU, no records): the e8m0 scale bytes are loaded zero-extended.
    CuTeDSL loaded a Uint8 with ld.global.s8, and `byte << 23` then negated every scale ≥ 2."""
    from pathlib import Path

    from harness.compile import Compiler

    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path))
    spec = load_spec(root=project_root)
    compiler = Compiler(spec.root)
    case = dict(b=2, config="s1h64_m96bs64", kv_format="model1", scenario="plain", splits=1)
    res = compiler.submit(spec.stages["E"], "sm_90a", case).result()
    compiler.close()
    assert res.ok, res.error
    ptx = Path(res.ptx_path).read_text()
    # The scale bytes are staged by cp.async and read from shared memory, never sign-extended.
    assert "ld.global.s8" not in ptx and "ld.shared.s8" not in ptx
    assert "ld.shared.b8" in ptx or "ld.shared.u8" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx  # the gather is asynchronous


def test_two_head_blocks_share_their_tiles_in_a_cluster():
    """h_q = 128: the two head blocks of a token form a (2, 1, 1) cluster and each dequantises
    half of every tile (4 producer warps: 4 keys of a warp's 8); the peer's half is 16 KiB of bf16
    a slot.  h_q = 64 (one head block) runs alone with 8 producer warps, 4 keys each."""
    k = sm90.Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=1)
    assert k.pair and k.plan.producer_warps == 4 and k.keys_per_warp == 4 and k.peer_bytes == 16 * 1024
    assert k.sched.grid[0] % 2 == 0  # the cluster pairs CTAs (2j, 2j + 1): head blocks 0 and 1 of one token
    assert all(k.sched.work(2 * j, 0, 0).token == k.sched.work(2 * j + 1, 0, 0).token for j in range(2))
    alone = sm90.Kernel(b=2, config="s2h64_m128bs256_x1024bs64", kv_format="model1", splits=1)
    assert not alone.pair and alone.plan.producer_warps == 8 and alone.keys_per_warp == 4


def test_the_pair_exchanges_tiles_by_st_async(project_root, tmp_path, monkeypatch):
    """Compiled for sm_90a: at h_q = 128 the dequantised pieces go to the peer by st.async (one
    per local 16-byte store), behind a cluster barrier at start and end; h_q = 64 has none of it."""
    from pathlib import Path

    from harness.compile import Compiler

    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path))
    spec = load_spec(root=project_root)
    compiler = Compiler(spec.root)
    ptx = {}
    for cfg in ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64"):
        case = dict(b=2, config=cfg, kv_format="v4.1", scenario="plain", splits=1)
        res = compiler.submit(spec.stages["E"], "sm_90a", case).result()
        assert res.ok, res.error
        assert res.resources.get("spill", 0) == 0, res.resources
        ptx[cfg] = Path(res.ptx_path).read_text()
    compiler.close()
    pair, alone = ptx["s2h128_m128bs256_x1024bs64"], ptx["s2h64_m128bs256_x1024bs64"]
    k = sm90.Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="v4.1", splits=1)
    pieces = k.keys_per_warp * k.LANE_COLS // 8  # the 16-byte pieces a lane stores a tile
    assert pair.count("st.async") == pieces and "mbarrier::complete_tx::bytes" in pair
    assert "barrier.cluster.arrive.relaxed" in pair and "barrier.cluster.wait" in pair
    assert "mapa" in pair
    for word in ("st.async", "barrier.cluster", "mapa"):
        assert word not in alone
    # the warp plans: alone 8 producer warps (512 threads), m64n128 P·V; paired 4 (384), m64n256
    assert ".reqntid 512" in alone and "m64n128k16" in alone and "m64n256k16" not in alone
    assert ".reqntid 384" in pair and "m64n256k16" in pair
    # the one-multiply conversion is chosen by a warp vote (v4.1's scales vary per lane)
    assert "vote.sync.all" in alone and "vote.sync.all" in pair


def test_slot_offsets_swizzle_bytes_not_elements():
    """The dequantisers address K's slots by hand (slot_offset): SW128 permutes the eight 16-byte
    pieces of a 128-byte row by the row's index mod 8, on BYTE offsets.  Applied to bf16 element
    offsets (a ComposedLayout called as a function) it moves 32-byte groups by a 256-byte period —
    the first pair run failed 96/96 that way (cosine 0.39–0.63)."""
    for row in range(16):
        for piece in range(8):
            for byte in (0, 5, 15):
                off = row * 128 + piece * 16 + byte
                assert sm90.swizzle_bytes(off, 3, 4, 3) == row * 128 + (piece ^ (row % 8)) * 16 + byte
