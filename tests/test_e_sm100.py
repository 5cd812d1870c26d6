"""Stage E on sm_100a, compiled on the CPU: TMEM, ring view, LSE indexing, gather4, smem, no spills."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, traced


def _traced(script: str, tmp_path) -> subprocess.CompletedProcess:
    return traced(script, tmp_path, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))


_COMPILE = """
    import json, sys
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from harness.execution.compile import _fake_tensor
    from oracles.sparse_decode import tensors
    import stages.E_sparse_decode.sm100 as m
    case = {case!r}
    k = {kernel}(b=case["b"], config=case["config"], kv_format=case["kv_format"], splits=case["splits"])
    fakes = [_fake_tensor(s) for s in tensors(case)]
    try:
        c = cute.compile(k, *fakes, make_fake_stream())
    except Exception as exc:
        print("REFUSED", exc)
        sys.exit(0)
    ptx = c.__ptx__
    if ptx and "\\n" not in ptx:
        ptx = open(ptx).read()
    open("kernel.ptx", "w").write(ptx)
    print("COMPILED", json.dumps({{"splits": k.splits, "smem": int(k.smem_struct.size_in_bytes())}}))
"""


def _compile(case: dict, tmp_path, kernel: str = "m.Kernel", prelude: str = ""):
    script = textwrap.dedent(prelude) + textwrap.dedent(_COMPILE).format(case=case, kernel=kernel)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                       env={**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": str(ROOT),
                            "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=900)
    return r.stdout + r.stderr


# -- plain Python: the plan


def test_tmem_plan_fits_and_an_over_budget_plan_is_refused_by_the_constructor():
    from stages.E_sparse_decode.sm100 import Kernel

    k = Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=1)
    assert k.o_split == 2 and k.budget["total"] == 2 * 64 + 256 <= 512  # S 2×64 + O 256 per CTA
    assert k.n_tiles == 2 + 16 and k.b == 2 * 2 and k.rows == 128  # one token per CTA
    with pytest.raises(ValueError, match=r"TMEM budget: S 2×64 \+ O 512 = 640 columns > 512"):
        Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=1, o_split=1)
    with pytest.raises(ValueError, match="h_q ≤ 128"):
        Kernel(b=2, config="s1h256_m128bs256", kv_format="simple", splits=1)


def test_the_sink_is_applied_once_in_the_epilogue_or_in_the_combine():
    """One split: the epilogue applies the sink; split-KV: SplitCombine after the merge."""
    from stages.E_sparse_decode.sm100 import Kernel

    one = Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=1)
    many = Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits=4)
    assert one.splits == 1 and one.has_row_scale()
    assert many.splits == 4 and not many.has_row_scale()


def test_one_branch_config_has_only_main_tiles():
    from stages.E_sparse_decode.sm100 import Kernel

    k = Kernel(b=2, config="s1h64_m96bs64", kv_format="v4.1", splits="auto")
    assert (k.main_tiles, k.extra_tiles, k.n_tiles) == (2, 0, 2)


@pytest.mark.parametrize("fmt", ["model1", "v4.1"])
@pytest.mark.parametrize("block_size", [2, 64, 256])
def test_gather_rows_start_at_the_tokens_bytes(fmt, block_size):
    """gather_row(i) starts at token i's data (kvcache.token_offsets), across blocks."""
    import torch

    from oracles.kvcache import block_bytes, token_offsets
    from stages.E_sparse_decode.sm100 import GATHER_ROWS, gather_row

    row_bytes = GATHER_ROWS[fmt][0]
    bb = block_bytes(fmt, block_size)
    index = torch.arange(0, 5 * block_size, dtype=torch.int64)
    data, _ = token_offsets(fmt, block_size, index)
    rows = torch.tensor([gather_row(int(i), block_size, bb, row_bytes) for i in index])
    assert torch.equal(rows * row_bytes, data)


def test_the_simple_format_is_no_uniform_row_array_and_is_refused_a_tensor_map():
    """simple's blocks are no uniform rows: rows_view refuses them."""
    from oracles.kvcache import block_bytes
    from stages.common.sm100_gather import rows_view
    from stages.E_sparse_decode.sm100 import Kernel

    with pytest.raises(ValueError, match="not rows of 512 bytes"):
        rows_view(None, block_bytes("simple", 64), 512, 512)
    assert not Kernel(b=2, config="s1h64_m96bs64", kv_format="simple", splits=1).gather


def test_the_staging_ring_takes_its_bytes_from_the_chunk_ring():
    """Chunk slots never under n_v + 1 = 3; the plan stays under 227 KiB."""
    from stages.common.sm100_decode import SMEM_LIMIT
    from stages.E_sparse_decode.sm100 import Kernel

    slots = {f: Kernel(b=2, config="s2h64_m128bs256_x1024bs64", kv_format=f, splits=1) for f in ("model1", "v4.1", "simple", "nvfp4")}
    assert {f: k.slots for f, k in slots.items()} == {"model1": 3, "v4.1": 4, "simple": 5, "nvfp4": 5}
    assert all(k.ring["smem"] <= SMEM_LIMIT and k.slots >= k.n_v + 1 for k in slots.values())
    assert slots["model1"].raw_slot_bytes == 64 * 192 and slots["v4.1"].raw_slot_bytes == 64 * 128


# -- traced: refusals


_OVER_BUDGET = """
    import stages.common.sm100_decode as house
    real = house.tmem_budget
    house.tmem_budget = lambda d, kv, o_split, s_stages: real(d, kv, 2, s_stages)  # lie: "fits"
    import stages.E_sparse_decode.sm100 as m
    class Planted(m.Kernel):
        def __init__(self, **kw):
            super().__init__(o_split=1, **kw)
"""
_COLUMNS_FIRST_VIEW = """
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05
    import stages.E_sparse_decode.sm100 as m
    class Planted(m.Kernel):
        def key_col_layout(self, qk_mma, pv_mma, k_smem):
            atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, m.BF16)
            kw = cute.tile_to_shape(atom, (m.KV_TILE, self.chunk, self.slots), order=(1, 0, 2))
            k_coords, _ = self.kv_coords(qk_mma, pv_mma)
            m.check_key_col_view(kw, k_smem, k_coords)
            return kw
"""


@pytest.mark.parametrize("prelude, refusal", [
    (_OVER_BUDGET, "TMEM budget: S 2×64 + O 512 = 640 columns > 512"),
    (_COLUMNS_FIRST_VIEW, "REFUSED K write view"),
], ids=["tmem_plan_over_budget", "dequant_view_not_the_mma_bytes"])
def test_trace_time_checks_refuse_a_planted_kernel(tmp_path, prelude, refusal):
    """Plan forced to "fits": the trace re-checks S and O columns and refuses. A columns-first
    view of the dequantisers' writes misses the MMA's reads: tracing stops."""
    out = _compile({"b": 2, "config": "s1h128_m128bs256", "kv_format": "simple", "splits": 1}, tmp_path,
                   kernel="Planted", prelude=prelude)
    assert "COMPILED" not in out, out[-2000:]
    assert refusal in out, out[-2000:]


def test_lse_view_puts_one_token_rows_at_lse_b_h_t(tmp_path):
    """Flat row (b·s_q + t)·h_q + h lands at LSE[b, h, t]."""
    r = _traced("""
        import cutlass, cutlass.cute as cute
        b, s_q, h_q = 3, 2, 4

        @cute.jit
        def probe():
            ours = cute.make_layout((h_q, s_q, b), stride=(s_q, 1, h_q * s_q))
            house = cute.make_layout((h_q, 1, b * s_q), stride=(1, 1, h_q))
            bad_ours = bad_house = 0
            for bb in cutlass.range_constexpr(b):
                for t in cutlass.range_constexpr(s_q):
                    for h in cutlass.range_constexpr(h_q):
                        flat = (bb * s_q + t) * h_q + h
                        want = bb * h_q * s_q + h * s_q + t
                        bad_ours += ours(flat) != want
                        bad_house += house(flat) != want
            print("OURS", bad_ours, "HOUSE", bad_house)

        probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert "OURS 0 HOUSE" in out and "HOUSE 0" not in out, out[-2000:]


# -- traced: compiles


def _inventory(ptx: str) -> dict:
    from harness.notebook.inventory import ptx_inventory

    return ptx_inventory(ptx)


@pytest.mark.parametrize("case", [
    {"b": 2, "config": "s2h128_m128bs256_x1024bs64", "kv_format": "simple", "splits": 1},
    {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "splits": "auto"},
    {"b": 2, "config": "s1h128_m128bs256_x1024bs2", "kv_format": "v4.1", "splits": 1},
    {"b": 2, "config": "s1h64_m96bs64", "kv_format": "model1", "splits": 1},  # spilled with a lone `if wide` box
    {"b": 2, "config": "s2h128_m128bs256_x1024bs64", "kv_format": "nvfp4", "splits": 1},  # issue 33: global loads, no gather
])
def test_representative_cases_compile_for_sm100a_without_spills(case, tmp_path):
    """tcgen05 MMAs, async fences, no spills; gather4 of four distinct rows; no 0f3D8293EE."""
    import re

    from harness.execution.compile import ptxas_resources
    from harness.notebook.inventory import families

    out = _compile(case, tmp_path)
    assert "COMPILED" in out, out[-3000:]
    info = json.loads(out.split("COMPILED", 1)[1].strip().splitlines()[0])
    assert info["smem"] <= 227 * 1024
    ptx_path = tmp_path / "kernel.ptx"
    ptx = ptx_path.read_text()
    res = ptxas_resources(ptx_path, "sm_100a")
    assert res.get("spill", 0) == 0, res
    inv = _inventory(ptx)
    assert inv.get("tcgen05.mma.cta_group::1.kind::f16", 0) == 80, inv  # as the compile-only baselines
    fam = families(inv)
    for instr in ("tcgen05.ld", "tcgen05.st", "tcgen05.commit", "tcgen05.alloc", "fence.proxy.async.shared::cta"):
        assert fam.get(instr, 0) >= 1, (instr, inv)
    gathers = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\S*\s+"
                         r"\[[^]]+\], \[%rd\d+, \{([^}]+)\}\]", ptx)
    tiles = sum(n for k, n in inv.items() if k.startswith("cp.async.bulk.tensor.3d"))
    assert 0 < tiles <= 8, inv  # Q's boxes: KV never goes through a tiled TMA
    if case["kv_format"] == "nvfp4":  # e2m1 8 B, rope 32 B, scale 1 B: 4 keys × 2 lists
        assert not gathers and inv.get("ld.global.64b", 0) >= 8 and inv.get("ld.global.128b", 0) >= 16, inv
        assert ptx.count(f"mul.lo.u32 t, t, {0x1040:#x}") >= 8  # the e2m1 bit moves (stages/common/e2m1_bits.py)
    elif case["kv_format"] == "simple":
        assert not gathers and inv.get("ld.global.128b", 0) >= 8, inv  # 16-byte loads of 4 keys × 2 lists
    else:
        lists = 2 if "_x" in case["config"] else 1
        assert len(gathers) >= lists * 4 * 2 * 16, len(gathers)  # lists × 4 chunks × 2 boxes × 16 instructions
        for operands in gathers:
            col, *rows = [o.strip() for o in operands.split(",")]
            assert len(rows) == 4 and len(set(rows)) == 4, operands
        assert inv.get("ld.global.128b", 0) == 0, inv  # the rows come from the staging ring
        assert inv.get("ld.shared.128b", 0) >= 4 * 4 * 2, inv
    fam_wgmma = fam.get("wgmma", 0)
    assert fam_wgmma == 0
    # e8m0 bytes zero-extended
    assert "ld.global.s8" not in ptx
    if case["kv_format"] != "simple":
        assert "ld.global.b8" in ptx
    entries = ptx.count(".entry ")
    assert entries == (2 if info["splits"] > 1 else 1), entries  # the split kernel (+ SplitCombine)
    assert "0f3D8293EE" not in ptx
    loads = re.findall(r"ld\.global\.b32\s+(%r\d+),", ptx)
    assert any(re.search(rf"mul\.f32\s+%r\d+,\s*{r},\s*0f3FB8AA3B", ptx) for r in loads)
