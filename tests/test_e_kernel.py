"""Stage E's sm90 kernel on the CPU (no compile): cache layouts, partial scratch, refusals."""

import inspect
import re

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
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
    from harness.execution.bench import plan_cases

    cases += plan_cases(stage, [])  # every bench shape
    seen = set()
    for case in cases:
        key = (case["b"], case["config"], case["splits"])
        if key in seen:
            continue
        seen.add(key)
        k = sm90.Kernel(b=case["b"], config=case["config"], kv_format=case["kv_format"], splits=case["splits"])
        assert 1 <= k.splits <= sd.split_capacity(case), case  # k.splits: the partial slots a sequence fills
        assert k.partials == (k.sched.cut > 0)
        if case["splits"] == 1:
            assert k.splits == 1 and not k.partials
    # parts cutting sequences fit too
    case = dict(b=3, config="s2h128_m128bs256_x1024bs64", kv_format="model1", scenario="sink", splits=4)
    k = sm90.Kernel(b=3, config=case["config"], kv_format="model1", splits=4)
    assert k.sched.part_tiles == 5 and k.splits == 5 <= sd.split_capacity(case)


def test_refusals():
    with pytest.raises(ValueError, match="h_q"):
        sm90.Kernel(b=2, config="s1h32_m64bs64", kv_format="model1", splits=1)
    with pytest.raises(ValueError, match="kv_format"):
        sm90.Kernel(b=2, config="s1h64_m64bs64", kv_format="fp4", splits=1)


def test_register_plan_fits_the_launch_allocation():
    """setmaxnreg stays inside the launch allocation (384 × 168); 65 536 once hung on the GPU."""
    assert sm90.register_plan(384, [(256, 216), (128, 80)]) is not None  # the plan that hung
    assert sm90.register_plan(384, [(256, 240), (128, 24)]) is None  # D2's: exactly 64 512
    plan = sm90.Kernel.PLAN
    assert sm90.register_plan(plan.threads, plan.registers) is None
    assert sm90.register_plan(512, [(256, 184), (256, 80)]) is not None  # 512 threads hold 128 each
    assert sm90.register_plan(384, [(128, 216), (128, 176), (128, 120)]) is not None  # 65 536 > 64 512
    from stages.common.sm90_registers import launch_registers

    assert launch_registers(384) == 168 and launch_registers(512) == 128


def _ptx(project_root, tmp_path, monkeypatch, cfgs, fmt):
    """The PTX of E's sm90 kernel per config (sm_90a, no records)."""
    from pathlib import Path

    from tests.conftest import compile_cases

    cases = [dict(b=2, config=cfg, kv_format=fmt, scenario="plain", splits=1, epilogue="bf16") for cfg in cfgs]
    got = compile_cases(monkeypatch, tmp_path, load_spec(root=project_root).stages["E"], "sm_90a", cases)
    return {cfg: (Path(r.ptx_path).read_text(), r) for cfg, r in zip(cfgs, got)}


def test_the_gather_loads_into_registers(project_root, tmp_path, monkeypatch):
    """Keys by predicated 128-bit ld.global.nc; scales as whole words; no cp.async."""
    ptx, _ = _ptx(project_root, tmp_path, monkeypatch, ["s1h64_m96bs64"], "model1")["s1h64_m96bs64"]
    assert "@p ld.global.nc.L2::256B.v4.b32" in ptx and "@p ld.global.nc.v2.b32" in ptx
    assert "ld.global.nc.L2::256B.v2.b32" not in ptx
    assert "ld.global.s8" not in ptx and "ld.shared.s8" not in ptx
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx and "cp.async.wait" not in ptx


def test_more_parts_than_the_grid_holds_are_refused():
    """Parts on grid.y (≤ 65 535): past it the kernel refuses at construction."""
    T = 18  # 2 + 16 tiles a sequence
    fits = 65535 // (2 * T)
    sm90.Kernel(b=fits, config="s2h64_m128bs256_x1024bs64", kv_format="model1", splits="many")
    with pytest.raises(ValueError, match="65535 rows"):
        sm90.Kernel(b=fits + 1, config="s2h64_m128bs256_x1024bs64", kv_format="model1", splits="many")


def test_two_head_blocks_share_their_tiles_in_a_cluster():
    """h_q 128: a (2, 1, 1) cluster, each CTA dequantises 32 keys a tile; h_q 64: two rounds."""
    k = sm90.Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=1)
    assert k.pair and k.plan.producer_warps == 4 and k.own_keys == 32 and k.rounds == 1 and k.sides == 2
    assert k.peer_bytes == 32 * 1024
    assert k.sched.grid[0] == 2  # pairs (0, p), (1, p)
    for p in range(k.sched.parts):  # … which walk the same segments
        for s in range(k.sched.segments(p)):
            w0, w1 = k.sched.segment(0, p, s)[0], k.sched.segment(1, p, s)[0]
            assert w0._replace(head_block=1) == w1 and w0.head_block == 0
    alone = sm90.Kernel(b=2, config="s2h64_m128bs256_x1024bs64", kv_format="model1", splits=1)
    assert not alone.pair and alone.own_keys == 64 and alone.rounds == 2 and alone.sides == 1
    # each key dequantised once; its 4 threads agree; both CTAs mask all
    for kk in (k, alone):
        ranks = (0, 1) if kk.pair else (0,)
        threads = [(w, lane) for w in range(kk.plan.producer_warps) for lane in range(32)]
        for r in range(kk.rounds):
            for w in range(kk.plan.producer_warps):
                for lane in range(8):
                    assert len({kk.key_of(0, 0, r, w, lane + 8 * q) for q in range(4)}) == 1
        own = sorted(kk.key_of(rank, 0, r, w, lane) for rank in ranks for r in range(kk.rounds)
                     for w, lane in threads if lane < 8)
        assert own == list(range(kk.BLOCK_N)), own
        for rank in ranks:
            masked = sorted(kk.key_of(rank, s, r, w, lane) for s in range(kk.sides) for r in range(kk.rounds)
                            for w, lane in threads if lane // 8 == s)
            assert masked == list(range(kk.BLOCK_N)), masked


def test_the_pair_exchanges_tiles_by_st_async(project_root, tmp_path, monkeypatch):
    """h_q 128: one st.async per 16-byte store, cluster barriers (none at h_q 64); setmaxnreg .inc/.dec."""
    got = _ptx(project_root, tmp_path, monkeypatch, ["s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64"], "v4.1")
    (pair, pres), (alone, ares) = got["s2h128_m128bs256_x1024bs64"], got["s2h64_m128bs256_x1024bs64"]
    assert pres.resources.get("spill", 0) == 0 and ares.resources.get("spill", 0) == 0, (pres.resources, ares.resources)
    # v4.1: two 16-byte stores a piece
    assert pair.count("st.async") == 2 * 8 * 2 and "mbarrier::complete_tx::bytes" in pair
    assert "barrier.cluster.arrive.relaxed" in pair and "barrier.cluster.wait" in pair
    assert "mapa" in pair
    for word in ("st.async", "barrier.cluster", "mapa"):
        assert word not in alone
    plan = sm90.Kernel.PLAN
    for ptx in (pair, alone):
        assert ".reqntid 384" in ptx and "m64n256k16" in ptx and "m64n64k16" in ptx
        moves = sorted(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
        assert moves == sorted([("inc", str(plan.mma_regs[0])), ("dec", str(plan.mma_regs[1])),
                                ("dec", str(plan.producer_regs))]), moves
        # conversion chosen by a warp vote
        assert "vote.sync.all" in ptx
        # unaligned named barriers
        for bar in ("barrier.cta.sync 1, 256", "barrier.cta.sync 2, 256", "barrier.cta.arrive 2, 256",
                    "barrier.cta.sync 3, 256"):
            assert bar in ptx, bar
        assert not re.search(r"\bbar\.(sync|arrive)\s+[123],", ptx)


def test_a_producer_store_fills_128_contiguous_bytes(monkeypatch):
    """No-swizzle 8 × 8 atoms: one store's 8 keys fill 128 contiguous bytes."""
    import cutlass
    import cutlass.cute as cute

    from stages.common.sm90_kv_slots import kv_layouts, piece_strides

    got = {}

    @cute.jit
    def trace():
        k, _ = kv_layouts(cutlass.BFloat16, 512, 64, 2, 256, swizzled=False)
        key8, _ = piece_strides(k, 64, 512, 2)
        got["key8"] = key8
        got["at"] = {(key, col): sm90.slot_offset(k, key, col, 0)
                     for key in range(16) for col in (0, 7, 8, 16, 64, 448)}

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    trace()
    at = got["at"]
    for col in (0, 8, 16, 64, 448):
        for key in range(16):
            assert at[(key, col)] == at[(key - key % 8, col)] + 16 * (key % 8), (key, col)
            assert at[(key, col)] % 16 == 0, (key, col)
    assert all(at[(key, 7)] == at[(key, 0)] + 14 for key in range(16))  # a key's 8 columns: one piece
    assert got["key8"] == 128


def test_slot_offsets_swizzle_bytes_not_elements():
    """slot_offset swizzles BYTE offsets (SW128, 16-byte pieces by row mod 8)."""
    from stages.common.sm90_kv_slots import swizzle_bytes

    for row in range(16):
        for piece in range(8):
            for byte in (0, 5, 15):
                off = row * 128 + piece * 16 + byte
                assert swizzle_bytes(off, 3, 4, 3) == row * 128 + (piece ^ (row % 8)) * 16 + byte


_KNOB_PROBE = r'''
import os, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from harness.execution.compile import fake_tensor
from oracles.sparse_decode import tensors
from stages.E_sparse_decode.sm90 import Kernel

case = dict(b=2, config="s2h64_m128bs256_x1024bs64", kv_format="model1", scenario="plain", splits="auto")
for name, knobs in (("default", {}), ("plain", dict(sink_first=False, pair_stores=False, fast_combine=False)),
                    ("stamps", dict(stamps=True))):
    k = Kernel(b=2, config=case["config"], kv_format="model1", splits="auto", **knobs)
    c = cute.compile(k, *[fake_tensor(s) for s in tensors(case)], make_fake_stream())
    raw = c.__ptx__ or ""
    ptx = open(raw).read() if raw and "\n" not in raw and os.path.isfile(raw) else raw
    open(os.path.join(sys.argv[1], name + ".ptx"), "w").write(ptx)
'''


def _main_body(ptx: str) -> str:
    entries = {m.group(1): m.start() for m in re.finditer(r"\.entry\s+(\S+)\(", ptx)}
    main = next(at for name, at in entries.items() if "E_sparse_decode" in name)
    return ptx[main:min([at for at in entries.values() if at > main] + [len(ptx)])]


@pytest.fixture(scope="module")
def knob_ptx(tmp_path_factory):
    """E's PTX with each small-batch option and without (`_KNOB_PROBE`), compiled once."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path_factory.mktemp("knobs")
    probe, dump = out / "probe.py", out / "dump"
    probe.write_text(_KNOB_PROBE)
    dump.mkdir()
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(dump),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(probe), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    return out


def test_small_batch_defaults_load_the_sink_first_and_never_launch_dependents(knob_ptx):
    """b 2 s_q 2 h_q 64: sinks load before the first S (`plain`: after); no launch_dependents, no prefetch."""
    tmp_path = knob_ptx
    default = _main_body((tmp_path / "default.ptx").read_text())
    plain = _main_body((tmp_path / "plain.ptx").read_text())
    for body in (default, plain):
        assert "griddepcontrol.launch_dependents" not in body
        assert "cp.async.bulk.prefetch" not in body and "prefetch.global.L2" not in body
    # the sink is warpgroup 0's first load after the scale
    wg0 = default[default.index("setmaxnreg.inc.sync.aligned.u32"):]
    assert _first_load_but_the_scale(wg0) < wg0.index("wgmma.mma_async"), "the sink is loaded after the first S"
    wg0 = plain[plain.index("setmaxnreg.inc.sync.aligned.u32"):]
    assert _first_load_but_the_scale(wg0) > wg0.index("wgmma.mma_async")


def _first_load_but_the_scale(body: str) -> int:
    """Where `body`'s first ld.global.b32 is, past the softmax_scale load."""
    for m in re.finditer(r"ld\.global\.b32\s+(%r\d+),", body):
        if not re.search(rf"mul\.f32\s+%r\d+,\s*{m.group(1)},\s*0f3FB8AA3B", body[m.end():m.end() + 2000]):
            return m.start()
    raise AssertionError("no global load but the softmax scale's")


def test_the_stamps_build_and_pair_stores(knob_ptx):
    """`stamps` writes timers at 12 points, default none; partial stores by 8 bytes, `plain` by 16."""
    tmp_path = knob_ptx
    stamps = _main_body((tmp_path / "stamps.ptx").read_text())
    default = _main_body((tmp_path / "default.ptx").read_text())
    plain = _main_body((tmp_path / "plain.ptx").read_text())
    sites = stamps.count("mov.u64 c, %clock64;")
    assert sites == stamps.count("st.global.v2.b64") and sites >= 12, sites  # every named point traced
    assert "%globaltimer" not in default and "st.global.v2.b64" not in default
    assert default.count("st.global.v2.b32") == 2 * 64 and "st.global.v2" not in plain


# -- the softmax scale (issue 35 item 1)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_softmax_scale_is_a_kernel_input_in_the_oracle_order(arch):
    """Both kernels take `softmax_scale` where the oracle lists it (the harness's order)."""
    import importlib

    kernel = importlib.import_module(f"stages.E_sparse_decode.{arch}").Kernel
    names = [s.name for s in sd.tensors(dict(b=2, config="s1h64_m96bs64", kv_format="model1", scenario="plain",
                                             splits=1))]
    assert names.index("softmax_scale") == names.index("sink") + 1
    assert list(inspect.signature(kernel.__call__).parameters) == ["self", *names, "stream"]


def test_the_matrix_covers_the_softmax_scale_in_48_cases_of_the_same_kernels(project_root):
    """`softmax_scale` adds 48 cases, compiled as the default-scale ones."""
    from harness.execution.compile import cache_key

    spec = load_spec(root=project_root)
    stage = spec.stages["E"]
    cases = [c.dict for c in expand(stage)]
    fp8 = [c for c in cases if c["epilogue"] == "fp8_rope"]  # issue 33 item 2's cases of `more:`
    cases = [c for c in cases if c["epilogue"] == "bf16"]
    scaled = [c for c in cases if c["scenario"] == "softmax_scale"]
    assert len(cases) == 9 * 48 + 25 and len(scaled) == 48  # + the topk-up-to-32768 cases of `more:`
    assert len(fp8) == 9 * 8 + 2
    assert "scenario" not in stage.kernel_params
    assert len({(c["config"], c["kv_format"], c["splits"]) for c in scaled}) == 48
    for case in scaled[:3]:
        assert cache_key(spec.root, stage, "sm_90a", case) == cache_key(spec.root, stage, "sm_90a", {**case, "scenario": "sink"})


def test_the_sm90_kernel_reads_its_softmax_scale_at_run_time(project_root, tmp_path, monkeypatch):
    """The base-2 factor is the loaded scale × log2 e; the old constant is gone."""
    ptx, _ = _ptx(project_root, tmp_path, monkeypatch, ["s1h64_m96bs64"], "model1")["s1h64_m96bs64"]
    body = _main_body(ptx)
    assert "0f3D8293EE" not in body
    loads = re.findall(r"ld\.global\.b32\s+(%r\d+),", body)
    assert any(re.search(rf"mul\.f32\s+%r\d+,\s*{r},\s*0f3FB8AA3B", body) for r in loads)


def test_resident_combine_is_gone():
    """`resident_combine` (NaN on the GPU) is removed."""
    import importlib.util

    from stages.common.barriers import NamedBarrier

    params = set(inspect.signature(sm90.Kernel.__init__).parameters)
    assert not params & {"resident_combine", "rc_group", "rc_early"}, params
    with pytest.raises(TypeError, match="resident_combine"):
        sm90.Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits="auto", resident_combine=True)
    assert importlib.util.find_spec("stages.common.resident_combine") is None
    assert "ARRIVED" not in NamedBarrier.__members__


def _entries(ptx: str) -> list[str]:
    return re.findall(r"\.entry\s+(\S+)\(", ptx)


def test_the_default_small_batch_build_combines_by_part_combine(knob_ptx):
    """b 2 s2 h64 model1: PartCombine launched; the attention kernel waits on no CTA."""
    default = (knob_ptx / "default.ptx").read_text()
    assert any("PartCombine" in n for n in _entries(default))
    body = _main_body(default)
    for instr in ("red.release", "red.relaxed", "ld.acquire", "griddepcontrol.wait"):
        assert instr not in body, instr
