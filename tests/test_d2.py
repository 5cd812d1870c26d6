"""Stage D2 on the CPU: oracle, inputs, splits, grid, combine, barriers, K/V views, refusals, scratch."""

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from oracles import decode
from oracles.common import case_seed
from stages.common import scheduler as sch
from stages.common.barriers import MAX_NAMED_BARRIERS, NamedBarrier
from stages.common.combine import combine_reference
from tests.test_d3_d5 import loops, matrix

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape", ["b2s2h3n5d8p2", "b1s1h4n70d16", "b2s3h2n1001d4p7"])
def test_oracle_matches_plain_float64_loops(shape):
    case = {"shape": shape, "splits": 1}
    p = decode.parse_shape(shape)
    inputs = decode.make_inputs(case, seed=case_seed("D2", case))
    ref = decode.reference(inputs, case)
    # float64 loops, keys below n valid
    o, lse = loops(inputs["Q"].double().tolist(), [(inputs["KV"].double().tolist(), lambda b, t, j: j < p["n"])])
    assert torch.allclose(ref["O"], o, rtol=0, atol=1e-10)
    assert torch.allclose(ref["LSE"], lse, rtol=0, atol=1e-10)
    assert [tuple(ref[k].shape) for k in ("O", "LSE")] == [
        s.shape for s in decode.tensors(case) if s.role == "out"
    ]


def test_inputs_seeded_never_degenerate_and_nan_beyond_n():
    case = {"shape": "b2s2h64n256d64p100", "splits": "many"}
    a, b = decode.make_inputs(case, 7), decode.make_inputs(case, 7)
    c = decode.make_inputs(case, 8)
    assert torch.equal(a["Q"], b["Q"]) and not torch.equal(a["Q"], c["Q"])
    kv = a["KV"]
    assert kv.shape == (2, 356, 64)
    assert torch.isnan(kv[:, 256:]).all(), "rows beyond n must be NaN (they must not leak)"
    live = kv[:, :256].float()
    assert torch.isfinite(live).all() and (live != 0).float().mean() > 0.99 and live.std() > 0.5
    assert (a["Q"] != 0).float().mean() > 0.99 and a["Q"].float().std() > 1.0
    ref = decode.reference(a, case)
    assert all(torch.isfinite(t).all() for t in ref.values()), "the NaN rows leaked into the oracle"


@pytest.mark.parametrize("shape", ["b1s2h64n1152d512", "b1s1h64n4096d512"])
def test_inputs_make_every_tile_matter_and_move_the_max_late(shape):
    """Late maxima, no dominant key: dropping any 64-key tile breaks the O tolerance."""
    case = {"shape": shape, "splits": 1}
    p = decode.parse_shape(shape)
    inputs = decode.make_inputs(case, case_seed("D2", case))
    q, kv = inputs["Q"].double(), inputs["KV"].double()
    s = torch.einsum("bthd,bnd->bthn", q, kv) / math.sqrt(p["d"])
    prob = torch.softmax(s, dim=-1)
    assert (s.argmax(dim=-1) >= p["n"] - 1000).float().mean() > 0.05
    assert prob.amax(dim=-1).median() < 0.2
    full = prob @ kv[0]
    worst = math.inf
    for t in range(p["n"] // 64):
        keep = torch.ones(p["n"], dtype=torch.bool)
        keep[t * 64:(t + 1) * 64] = False
        o = torch.softmax(s[..., keep], dim=-1) @ kv[0][keep]
        worst = min(worst, float((o - full).norm() / full.norm()))
    assert worst > 1e-2, f"dropping one KV tile changes O by only {worst:.2e}"


def test_tensors_and_capacity_over_the_matrix():
    from stages.D2_decode.sm90 import Kernel

    cases = matrix("D2")
    assert 20 <= len(cases) <= 30
    for case in cases:
        specs = {s.name: s for s in decode.tensors(case)}
        assert [s.role for s in specs.values()] == ["in", "in", "out", "out", "scratch", "scratch"]
        k = Kernel(shape=case["shape"], splits=case["splits"])
        cap = specs["O_part"].shape[0]
        assert k.splits <= cap or k.splits == 1, case
        if case["splits"] == "many":
            assert k.splits > k.sched.num_tiles, case  # some splits empty
        if case["splits"] == "auto":
            assert sch.nonempty_splits(k.sched.num_tiles, k.splits) == k.splits


def test_matrix_covers_the_issue():
    ps = [decode.parse_shape(c["shape"]) for c in matrix("D2")]
    d512 = [p for p in ps if p["d"] == 512]
    assert {p["b"] for p in d512} == {1, 4} and {p["h_q"] for p in d512} == {64, 128}
    assert {1, 2} <= {p["s_q"] for p in d512} and {256, 1152, 4096} <= {p["n"] for p in d512}
    assert {64, 128, 256, 512} == {p["d"] for p in ps}
    assert any(p["n_alloc"] > p["n"] for p in ps), "no case with NaN rows beyond n"
    assert any((p["b"], p["s_q"], p["h_q"]) == (4, 64, 128) for p in ps), "the user's case is missing"
    assert {c["splits"] for c in matrix("D2")} == {1, "auto", "many"}


# -- kernel refusals


@pytest.mark.parametrize(
    "shape, splits, words",
    [
        ("b1s1h96n256d512", 1, "h_q"),
        ("b1s1h64n200d512", 1, "multiple of 64"),
        ("b1s1h64n192d256", 1, "multiple of 128"),
        ("b1s1h64n256d96", 1, "d must be"),
        ("b1s1h64n256d512", "lots", "splits"),
        ("b1s1h64n256d512", 0, "splits"),
        ("b1s1x64n256d512", 1, "shape"),
    ],
)
def test_kernel_refuses_what_it_cannot_do(shape, splits, words):
    from stages.D2_decode.sm90 import Kernel

    with pytest.raises(ValueError, match=words):
        Kernel(shape=shape, splits=splits)


# -- split chooser


def test_choose_splits_known_values():
    assert sch.choose_splits(1, 4) == 4  # one CTA: one split per tile
    assert sch.choose_splits(8, 64) == 16  # 128 CTAs: one full wave
    assert sch.choose_splits(4, 18) == 18
    assert sch.choose_splits(132, 64) == 1 and sch.choose_splits(512, 18) == 1  # the GPU is full
    assert sch.choose_splits(1, 1) == 1
    assert sch.choose_splits(16, 18) == 6  # 6 × 3 tiles in one wave


@pytest.mark.parametrize("ctas, tiles, sms", [(c, t, s) for c in (1, 2, 3, 7, 8, 33, 66, 131, 132, 500)
                                              for t in (1, 2, 4, 9, 18, 64, 200) for s in (132, 148)])
def test_choose_splits_is_the_cheapest_split_with_no_empty_one(ctas, tiles, sms):
    s = sch.choose_splits(ctas, tiles, sms)
    assert 1 <= s <= min(tiles, sch.MAX_SPLITS)
    assert sch.nonempty_splits(tiles, s) == s
    if ctas >= sms:  # GPU already full: no split
        assert s == 1
        return
    best = min(sch.split_cost(ctas, tiles, k, sms) for k in range(1, min(tiles, sch.MAX_SPLITS) + 1)
               if sch.nonempty_splits(tiles, k) == k)
    assert sch.split_cost(ctas, tiles, s, sms) == best


def test_resolve_splits():
    assert sch.resolve_splits("many", ctas=1, num_tiles=4) == 4 + sch.MANY_EXTRA
    assert sch.resolve_splits("auto", ctas=1, num_tiles=4) == 4
    assert sch.resolve_splits(5, ctas=1, num_tiles=4) == 5
    for bad in (0, -1, True, 2.0, "lots", None):
        with pytest.raises(ValueError):
            sch.resolve_splits(bad, ctas=1, num_tiles=4)
    with pytest.raises(ValueError):
        sch.choose_splits(0, 4)


# -- scheduler mapping


@pytest.mark.parametrize("grid", [
    sch.DecodeGrid(1, 1, 1, 1, 4), sch.DecodeGrid(2, 2, 4, 7, 4), sch.DecodeGrid(2, 1, 4, 16, 64),
    sch.DecodeGrid(1, 2, 1, 7, 18), sch.DecodeGrid(2, 64, 4, 1, 18), sch.DecodeGrid(2, 3, 2, 21, 18),
])
def test_scheduler_covers_every_row_block_and_tile_once(grid):
    gx, gy, gz = grid.grid
    assert (gx, gy, gz) == (grid.head_blocks * grid.tokens, grid.splits, grid.batches)
    seen_tiles: dict[tuple, list[int]] = {}
    row_blocks, partial_blocks = set(), set()
    for bx, by, bz in itertools.product(range(gx), range(gy), range(gz)):
        w = grid.work(bx, by, bz)
        assert 0 <= w.head_block < grid.head_blocks and 0 <= w.token < grid.tokens and 0 <= w.batch < grid.batches
        assert w.split == by and 0 <= w.tile_begin and w.tile_end <= grid.num_tiles
        key = (w.head_block, w.token, w.batch)
        seen_tiles.setdefault(key, []).extend(range(w.tile_begin, w.tile_end))
        empty = w.tile_begin >= w.tile_end
        assert empty == (w.split >= sch.nonempty_splits(grid.num_tiles, grid.splits))
        rb = grid.row_block(w)
        # Q and O as [b · s_q · h_q, d], 64 heads a block
        assert rb * 64 == (w.batch * grid.tokens + w.token) * grid.head_blocks * 64 + w.head_block * 64
        row_blocks.add((w.split, rb))
        partial_blocks.add(grid.partial_row_block(w))
    assert len(seen_tiles) == grid.row_blocks
    assert all(sorted(t) == list(range(grid.num_tiles)) for t in seen_tiles.values())
    assert {rb for _, rb in row_blocks} == set(range(grid.row_blocks))
    assert partial_blocks == set(range(grid.splits * grid.row_blocks))


@pytest.mark.parametrize("grid", [sch.DecodeGrid(2, 2, 64, 1, 18), sch.DecodeGrid(1, 2, 1, 7, 18), sch.DecodeGrid(2, 3, 2, 21, 18)])
@pytest.mark.parametrize("ctas", [1, 7, 132])
def test_persistent_ctas_walk_every_item_once_in_the_grids_order(grid, ctas):
    """Persistent CTA c walks items c, c + ctas, …: all work once, neighbours together."""
    gx, gy, gz = grid.grid
    assert grid.items == gx * gy * gz
    assert [grid.item(i) for i in range(grid.items)] == [
        grid.work(bx, by, bz) for bz, by, bx in itertools.product(range(gz), range(gy), range(gx))]
    walked = [i for c in range(min(ctas, grid.items)) for i in range(c, grid.items, min(ctas, grid.items))]
    assert sorted(walked) == list(range(grid.items))


def test_d2_runs_persistent_ctas_and_the_masked_rungs_do_not():
    """D2 launches min(items, SMs) CTAs; D3 one CTA an item."""
    from stages.D2_decode.sm90 import Kernel
    from stages.D3_swa.sm90 import Kernel as D3Kernel

    k = Kernel(shape="b64s2h128n1152d512", splits="auto", sm_count=132)
    assert k.PERSISTENT and k.sched.items == 256 and k.launch_grid() == (132, 1, 1)
    assert Kernel(shape="b1s2h64n4096d512", splits=1, sm_count=132).launch_grid() == (2, 1, 1)
    assert Kernel(shape="b64s2h128n1152d512", splits="auto", sm_count=114).launch_grid() == (114, 1, 1)
    d3 = D3Kernel(shape="b4s2h128n1152d512", splits=1)
    assert not d3.PERSISTENT and d3.launch_grid() == d3.sched.grid


def test_empty_splits_also_below_the_tile_count():
    g = sch.DecodeGrid(1, 1, 1, 7, 18)  # chunk 3: split 6 empty
    assert g.chunk == 3 and sch.nonempty_splits(18, 7) == 6
    w = g.work(0, 6, 0)
    assert w.tile_begin >= w.tile_end


def test_decode_shape_words():
    s = sch.DecodeShape.parse("b4s2h64n1152d512p100")
    assert (s.b, s.s_q, s.h_q, s.n, s.d, s.n_alloc) == (4, 2, 64, 1152, 512, 1252)
    for bad in ("b4s2h64n1152", "b0s1h64n64d64", "b4s2h64n1152d512p", " b1s1h64n64d64"):
        with pytest.raises(ValueError):
            sch.DecodeShape.parse(bad)


# -- combine


def _attention(q, kv):
    s = q @ kv.T
    return torch.softmax(s, dim=-1) @ kv, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("num_tiles, splits", [(4, 1), (4, 3), (4, 7), (18, 7), (9, 9), (3, 12)])
def test_combine_of_split_partials_is_full_attention(num_tiles, splits):
    g = torch.Generator().manual_seed(num_tiles * 100 + splits)
    tile, rows, d = 4, 6, 8
    q = torch.randn(rows, d, generator=g, dtype=torch.float64) * 2
    kv = torch.randn(num_tiles * tile, d, generator=g, dtype=torch.float64)
    grid = sch.DecodeGrid(1, 1, 1, splits, num_tiles)
    o_parts, lse_parts = [], []
    for s in range(splits):
        w = grid.work(0, s, 0)
        if w.tile_begin >= w.tile_end:  # empty: LSE −∞, O ignored
            o_parts.append(torch.full((rows, d), math.nan, dtype=torch.float64))
            lse_parts.append(torch.full((rows,), -math.inf, dtype=torch.float64))
        else:
            o, lse = _attention(q, kv[w.tile_begin * tile: w.tile_end * tile])
            o_parts.append(o)
            lse_parts.append(lse)
    o, lse = combine_reference(torch.stack(o_parts), torch.stack(lse_parts))
    want_o, want_lse = _attention(q, kv)
    assert torch.allclose(o, want_o, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)


def test_combine_rows_with_no_key_are_zero_and_plus_inf():
    o_parts = torch.full((3, 2, 4), math.nan, dtype=torch.float64)
    lse_parts = torch.full((3, 2), -math.inf, dtype=torch.float64)
    o_parts[1, 1] = 1.5
    lse_parts[1, 1] = 0.25
    o, lse = combine_reference(o_parts, lse_parts)
    assert torch.equal(o[0], torch.zeros(4, dtype=torch.float64)) and lse[0] == math.inf
    assert torch.equal(o[1], torch.full((4,), 1.5, dtype=torch.float64)) and lse[1] == 0.25


# -- barriers


def test_named_barriers_are_distinct_hardware_ids():
    ids = [int(b) for b in NamedBarrier]
    assert len(set(ids)) == len(ids) and NamedBarrier.SYNC_THREADS == 0
    assert all(1 <= i < MAX_NAMED_BARRIERS for i in ids if i)


# -- K and Vᵀ views of one smem slot


def test_kv_views_address_the_same_bytes_and_a_mismatch_is_caught(monkeypatch):
    import cutlass
    import cutlass.cute as cute
    from cutlass.tensor_utils import LayoutEnum
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup

    from stages.D2_decode.sm90 import check_same_bytes, kv_layouts

    outcome = {}

    @cute.jit
    def trace():
        for d, bn in ((64, 128), (128, 128), (256, 128), (512, 64)):
            kv_layouts(cutlass.BFloat16, d, bn, 2, d // 2)  # raises if the views disagree
        # Vᵀ tiled hd-first is not K's bytes: refused.
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, 256)
        vkind = sm90_utils.get_smem_layout_atom(LayoutEnum.COL_MAJOR, cutlass.BFloat16, 256)
        k = cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, cutlass.BFloat16), (64, 512, 2), order=(0, 1, 2))
        v = cute.tile_to_shape(warpgroup.make_smem_layout_atom(vkind, cutlass.BFloat16), (512, 64, 2), order=(0, 1, 2))
        try:
            check_same_bytes(k, v, 64, 512, 256, 2)
        except ValueError as e:
            outcome["refused"] = str(e)

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    trace()
    assert "not K's bytes" in outcome.get("refused", "")


# -- the real kernel, compiled (no GPU): ~30 s


@pytest.fixture(scope="module")
def d2_builds(tmp_path_factory):
    import os

    from harness.execution.compile import Compiler
    from harness.spec.spec import load_spec

    os.environ["DSV4_LAB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    spec = load_spec(root=ROOT)
    compiler = Compiler(spec.root)
    cases = [{"shape": "b4s2h128n256d64", "splits": 1}, {"shape": "b1s1h64n256d512", "splits": "many"}]
    futs = [(c, compiler.submit(spec.stages["D2"], "sm_90a", c)) for c in cases]
    results = [(c, f.result()) for c, f in futs]
    compiler.close()
    yield results
    del os.environ["DSV4_LAB_CACHE"]


def test_kernel_builds_reads_kv_once_rebalances_registers_and_combines_only_when_split(d2_builds):
    import shutil

    from harness.notebook.inventory import families

    for case, res in d2_builds:
        assert res.ok, f"{case}: {res.error}"
        fam = families(res.inventory)
        d = decode.parse_shape(case["shape"])["d"]
        # One TMA per swizzle-atom box.
        assert fam.get("cp.async.bulk.tensor") == d // 64 + d // min(64, d // 2), (case, fam)
        assert fam.get("wgmma", 0) > 0 and fam.get("stmatrix", 0) > 0
        ptx = Path(res.ptx_path).read_text()
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
        entries = ptx.count(".entry ")
        assert entries == (1 if case["splits"] == 1 else 2), (case, entries)  # + the combine kernel
        if shutil.which("ptxas"):
            assert res.resources["spill"] == 0, (case, res.resources)


def test_kernel_stores_o_by_16_bytes_and_votes_on_the_o_rescale(d2_builds):
    """D2's WIDE_STORE and LAZY_RESCALE."""
    for case, res in d2_builds:
        assert res.ok, f"{case}: {res.error}"
        ptx = Path(res.ptx_path).read_text()
        attention = next(e for e in ptx.split(".entry ")[1:] if "wgmma" in e)
        d = decode.parse_shape(case["shape"])["d"]
        per_thread = 2 * (d // 2) // 32 * (1 if case["splits"] == 1 else 2)
        assert len(re.findall(r"st\.global\.v4\.", attention)) == per_thread, case
        assert re.search(r"vote\.sync\.any\.pred", attention), case


def test_warpgroup_0_takes_p_from_registers_and_only_arrives_at_p_full(d2_builds):
    """REGISTER_P: wg 0's P·V reads P from registers, wg 1 from smem; only wg 0 arrives at P_FULL."""
    for case, res in d2_builds:
        assert res.ok, f"{case}: {res.error}"
        attention = next(e for e in Path(res.ptx_path).read_text().split(".entry ")[1:] if "wgmma" in e)
        d = decode.parse_shape(case["shape"])["d"]
        a_ops = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{d // 2}k16\.f32\.bf16\.bf16\s+\{{[^}}]*\}},\s*(\S)", attention)
        regs, descs = a_ops.count("{"), len(a_ops) - a_ops.count("{")
        assert regs > 0 and regs == descs, (case, regs, descs)
        assert re.search(r"barrier\.cta\.arrive\s", attention) and not re.search(r"\bbar\.(sync|arrive)\s+[1-9]", attention), case
