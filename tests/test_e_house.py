"""Stage E's house: the SM count drives parts, merge, scratch, cache key; one barrier registry."""

import math
import re
from pathlib import Path

import pytest

from oracles import kvcache as kc
from oracles import sparse_decode as sd
from stages.common import device
from stages.E_sparse_decode import sm90

H128 = "s2h128_m128bs256_x1024bs64"
H64 = "s2h64_m128bs256_x1024bs64"


def _kernel(b, config, splits="auto", sm_count=None):
    return sm90.Kernel(b=b, config=config, kv_format="model1", splits=splits, sm_count=sm_count)


@pytest.mark.parametrize("sms", [132, 114, 78])
def test_parts_and_waves_are_computed_for_the_sm_count(sms):
    """One wave of the SMs given; in-kernel merge only when all CTAs fit at once."""
    for config in (H128, H64):
        for b in (32, 64, 74, 128, 256):
            k = _kernel(b, config, sm_count=sms)
            g = k.sched
            ctas = g.parts * g.head_blocks
            assert math.ceil(ctas / sms) == 1 and ctas <= sms, (config, b, sms, ctas)
            two = any(g.pieces(s) == 2 for s in range(g.sequences))
            assert k.merges == two, (config, b, sms)


def test_the_parts_differ_by_gpu():
    """b 64, h_q 128: 132 SMs run whole sequences; 114 and 78 cut them."""
    got = {sms: (_kernel(64, H128, sm_count=sms).sched.part_tiles, _kernel(64, H128, sm_count=sms).sched.parts,
                 _kernel(64, H128, sm_count=sms).merges) for sms in (132, 114, 78)}
    assert got == {132: (36, 64, False), 114: (42, 55, True), 78: (60, 39, True)}


def test_a_grid_larger_than_the_sms_is_not_merged_in_the_kernel():
    """b 3 splits 2: 132 SMs merge in-kernel; 8 SMs use PartCombine."""
    k = _kernel(3, H128, splits=2, sm_count=132)
    assert k.merges and not k.combines
    small = _kernel(3, H128, splits=2, sm_count=8)
    assert small.sched.parts * small.sched.head_blocks > 8
    assert not small.merges and small.combines and small.partials


def test_the_kernel_and_the_scratch_take_the_gpus_count(monkeypatch):
    """No sm_count: kernel and scratch take $DSV4_SM_COUNT."""
    monkeypatch.setenv(device.ENV, "78")
    k = _kernel(64, H128)
    assert k.sm_count == 78 and k.sched == _kernel(64, H128, sm_count=78).sched
    case = dict(b=64, config=H128, kv_format="model1", scenario="sink", splits="auto")
    assert k.splits == 2 <= sd.split_capacity(case)
    monkeypatch.delenv(device.ENV)
    if device.visible_sm_count() is None:  # compile-only here: the arch's stated default
        assert _kernel(64, H128).sm_count == device.DEFAULT_SM_COUNT["sm_90a"] == 132
        assert sd.split_capacity(case) == 1


def test_a_bad_sm_count_override_is_one_line(monkeypatch):
    monkeypatch.setenv(device.ENV, "lots")
    with pytest.raises(ValueError, match=r"DSV4_SM_COUNT='lots': must be a positive int"):
        _kernel(2, H128)


def test_the_compile_key_holds_the_sm_count(project_root, monkeypatch):
    """The compile cache keys kernels of different SM counts apart."""
    from harness.execution.compile import cache_key
    from harness.spec.spec import load_spec

    stage = load_spec(root=project_root).stages["E"]
    case = dict(b=64, config=H128, kv_format="model1", scenario="sink", splits="auto", epilogue="bf16")
    keys = set()
    for sms in ("114", "78"):
        monkeypatch.setenv(device.ENV, sms)
        keys.add(cache_key(project_root, stage, "sm_90a", case))
    assert len(keys) == 2


def test_the_cache_layout_is_named_once_and_agrees_with_the_oracle():
    from stages.common import fp8_cache as fc

    assert (fc.D, fc.D_NOPE, fc.D_ROPE) == (kc.D, kc.D_NOPE, kc.D_ROPE)
    assert (fc.MODEL1_ROW_BYTES, fc.MODEL1_SCALE_BYTES, fc.V41_ROW_BYTES) == (kc.MODEL1_DATA, kc.MODEL1_SCALES, kc.V41_TOKEN)
    assert (fc.NVFP4_NOPE_BYTES, fc.NVFP4_ROW_BYTES, fc.NVFP4_SCALE_BYTES) == (kc.NVFP4_NOPE, kc.NVFP4_DATA, kc.NVFP4_SCALE_BYTES)
    assert sm90.Kernel.PIECES == {"model1": 9, "v4.1": 8, "simple": 8, "nvfp4": 7}
    assert sm90.Kernel.DATA_PIECES == {"model1": 7, "v4.1": 8, "simple": 8, "nvfp4": 3}
    text = Path(sm90.__file__).read_text()
    code = "\n".join(line.split("#")[0] for line in text.split('"""')[-1].splitlines())  # past the docstrings' end
    for literal in ("448", "576", "480", "528", "584", "352", "224", "384"):
        assert not re.search(rf"\b{literal}\b", code), literal


def _stage_sources(project_root):
    return sorted((project_root / "stages").rglob("*.py"))


def test_barrier_ids_come_from_one_registry(project_root):
    """Every named barrier is a NamedBarrier member, never a bare int."""
    from stages.common import unaligned_barriers
    from stages.common.barriers import MAX_NAMED_BARRIERS, NamedBarrier

    ids = [int(b) for b in NamedBarrier]
    assert len(set(ids)) == len(ids) and max(ids) < MAX_NAMED_BARRIERS
    assert {"STAGED", "Q_FREE", "FLAG_SEEN"} <= set(NamedBarrier.__members__)
    assert not any(isinstance(v, int) for k, v in vars(unaligned_barriers).items() if k.isupper())
    bare = re.compile(r"(barrier_id=|named_sync\(|named_arrive\(|barrier_arrive\(barrier_id=)\s*\d")
    hits = [f"{p}:{i}" for p in _stage_sources(project_root) for i, line in enumerate(p.read_text().splitlines(), 1)
            if bare.search(line)]
    assert hits == []


def test_no_stage_imports_an_oracle(project_root):
    imports = re.compile(r"^\s*(from|import)\s+oracles\b", re.M)
    assert [str(p) for p in _stage_sources(project_root) if imports.search(p.read_text())] == []


def test_one_shared_memory_limit(project_root):
    """227 KiB is stated once (stages/common/device.py)."""
    hits = [str(p) for p in _stage_sources(project_root) if re.search(r"227\s*\*\s*1024", p.read_text())]
    assert hits == [str(project_root / "stages" / "common" / "device.py")]
