"""part_combine.py and ZeroFlags for sm_90a: a row's slot loads fly before use."""

import os
import re
import subprocess
import sys

import pytest

from stages.common.part_combine import GROUP, load_groups
from tests.conftest import ROOT


@pytest.mark.parametrize("cap", range(1, 40))
def test_load_groups_cover_every_slot_once_in_the_fewest_even_groups(cap):
    groups = load_groups(cap)
    assert [j for g in groups for j in g] == list(range(cap))
    assert len(groups) == -(-cap // GROUP)  # the fewest round trips …
    sizes = [len(g) for g in groups]
    assert max(sizes) <= GROUP and max(sizes) - min(sizes) <= 1  # … of even size (registers)


def test_load_groups_at_the_small_batch_shapes():
    assert [len(g) for g in load_groups(9)] == [5, 4]  # b 2, h 128: 9 pieces, 2 round trips (was 9)
    assert [len(g) for g in load_groups(18)] == [6, 6, 6]  # a part a tile: 18 pieces, 3 (was 18)
    assert [len(g) for g in load_groups(9, group=1)] == [1] * 9  # the old chain, for experiments
    with pytest.raises(ValueError):
        load_groups(0)


_PROBE = r'''
import os, sys
import cutlass, cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from stages.common.part_scheduler import PartGrid
from stages.common.part_combine import PartCombine
from stages.common.part_merge import ZeroFlags

hb, tokens, b, T, L = (int(x) for x in sys.argv[1:6])
g = PartGrid(hb, tokens, b, T, L)
heads, rows = 64 * hb, g.sequences * 64 * hb


class Host:
    @cute.jit
    def __call__(self, op, lp, o, lse, sink, stream):
        ZeroFlags(g, 64).launch(lp, stream)
        PartCombine(g, heads, 512, fast=True).launch(op, lp, o, lse, sink, stream)


def F(dt, shape):
    return make_fake_compact_tensor(dt, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=16)


c = cute.compile(Host(), F(cutlass.Float32, (g.capacity * rows, 512)), F(cutlass.Float32, (g.capacity * rows,)),
                 F(cutlass.BFloat16, (rows, 512)), F(cutlass.Float32, (rows,)), F(cutlass.Float32, (heads,)),
                 make_fake_stream())
raw = c.__ptx__ or ""
ptx = open(raw).read() if raw and "\n" not in raw and os.path.isfile(raw) else raw
open(sys.argv[6], "w").write(ptx)
'''


def _ptx(tmp_path, grid: tuple) -> dict[str, str]:
    """{kernel name: PTX body} of ZeroFlags and PartCombine."""
    probe, dump, out = tmp_path / "probe.py", tmp_path / "dump", tmp_path / "out.ptx"
    probe.write_text(_PROBE)
    dump.mkdir()
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(dump),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(probe), *map(str, grid), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    ptx = out.read_text()
    bodies = {}
    for m in re.finditer(r"\.entry\s+(\S+)\(", ptx):
        nxt = ptx.find(".entry", m.end())
        bodies[m.group(1)] = ptx[m.start(): nxt if nxt >= 0 else len(ptx)]
    return bodies


def test_the_fast_combine_issues_a_groups_loads_before_it_uses_them(tmp_path):
    """`fast`, b 2 s_q 2 h_q 128: loads issued before use; no launch_dependents."""
    bodies = _ptx(tmp_path, (2, 2, 2, 18, 2))
    combine = next(v for k, v in bodies.items() if "PartCombine" in k)
    zero = next(v for k, v in bodies.items() if "ZeroFlags" in k)
    assert combine.count("@p ld.global.cg.f32") == 9  # the LSEs, predicated (slot < n)
    assert combine.count("@p ld.global.cg.v4.f32") == 9 * 4
    assert not re.search(r"\bld\.global(\.nc)?\.(v4\.)?f32", combine)  # no other load of the partials
    first_fma = combine.index("fma.rn.f32")
    assert combine[:first_fma].count("ld.global.cg.v4.f32") == 5 * 4
    assert combine.index("griddepcontrol.wait") < combine.index("ld.global.cg")
    assert "griddepcontrol.launch_dependents" not in zero + combine


@pytest.mark.parametrize("hb,tokens,b,T,L", [(2, 2, 2, 18, 2), (1, 2, 2, 18, 1), (2, 2, 1, 18, 1), (1, 1, 16, 18, 3),
                                             (2, 2, 8, 18, 6), (1, 2, 3, 5, 3), (2, 1, 74, 18, 21), (1, 1, 74, 18, 11)])
def test_the_combine_launches_a_cta_for_every_cut_row_block_and_no_idle_ones(hb, tokens, b, T, L):
    """Every 4 rows of every cut sequence get one CTA; `fast` leaves none idle."""
    from stages.common.part_combine import PartCombine
    from stages.common.part_scheduler import PartGrid

    g = PartGrid(hb, tokens, b, T, L)
    cut = [s for s in range(g.sequences) if g.pieces(s) > 1]
    for fast in (False, True):
        pc = PartCombine(g, 64 * hb, 512, fast=fast)
        seen = []
        for bidx in range(pc.ctas):
            s, mine = pc.cta_sequence(bidx)
            if mine:
                seen.append((s, bidx % pc.chunks))
        assert sorted(seen) == [(s, c) for s in cut for c in range(pc.chunks)]
        if fast and L < T:
            assert pc.ctas == len(seen) == g.sequences * pc.chunks
        else:
            assert pc.ctas == max(g.parts - 1, 1) * pc.chunks  # the default: e5b5443's grid
        if (hb, tokens, b, T, L) == (2, 2, 2, 18, 2):
            assert pc.ctas == (128 if fast else 1120)
