"""The in-kernel merge of a cut sequence: roles, when it merges, staging."""

import itertools

import pytest

from stages.common.part_merge import (merges_in_kernel, staged_copies, staged_offset, staged_read_bases,
                                      staged_read_offset)
from stages.common.part_scheduler import PartGrid

GRIDS = [PartGrid(hb, tokens, b, T, L) for hb, tokens, b, T, L in itertools.product(
    (1, 2), (1, 2), (1, 3, 74), (2, 5, 18), (1, 2, 3, 9, 13, 21, 42))]


@pytest.mark.parametrize("g", [g for g in GRIDS if any(g.pieces(s) == 2 for s in range(g.sequences))],
                         ids=lambda g: f"hb{g.head_blocks}t{g.tokens}b{g.batches}T{g.num_tiles}L{g.part_tiles}")
def test_piece_0_is_a_parts_last_segment_and_piece_1_the_next_parts_first(g):
    """merge_roles: no wait cycle."""
    roles = {}
    for p in range(g.parts):
        n = g.segments(p)
        for k in range(n):
            w, _ = g.segment(0, p, k)
            s = w.batch * g.tokens + w.token
            if g.pieces(s) != 2:
                continue
            assert w.split in (0, 1)
            roles.setdefault(s, {})[w.split] = (p, k, n)
    two = [s for s in range(g.sequences) if g.pieces(s) == 2]
    assert sorted(roles) == two
    for s, r in roles.items():
        (p0, k0, n0), (p1, k1, _) = r[0], r[1]
        assert p1 == p0 + 1, (s, r)
        assert k0 == n0 - 1, (s, r)  # piece 0: its part's last segment
        assert k1 == 0, (s, r)  # piece 1: its part's first segment


def test_a_launch_merges_only_what_it_can_and_only_when_resident():
    g = PartGrid(2, 2, 74, 18, 42)  # b 74, h 128: 42 sequences cut in two, 128 CTAs
    assert g.cut == 42 and g.capacity == 2 and merges_in_kernel(g, 132)
    assert not merges_in_kernel(g, 127)  # 128 CTAs are not resident at once on 127 SMs
    assert not merges_in_kernel(PartGrid(2, 2, 64, 18, 36), 132)  # nothing cut
    assert not merges_in_kernel(PartGrid(2, 2, 3, 18, 5), 132)  # every cut sequence has 4 or 5 pieces
    mixed = PartGrid(1, 2, 3, 5, 3)  # pieces 2 and 3: split between kernel and PartCombine
    assert {mixed.pieces(s) for s in range(mixed.sequences)} == {2, 3} and merges_in_kernel(mixed, 132)


ROWS, ROW_BYTES, THREADS = 64, 512 * 4, 256  # stage E: 64 rows of fp32 O, 256 threads


def test_staging_copies_every_byte_of_the_block_once():
    src, dst = [], []
    for t in range(THREADS):
        for s, d in staged_copies(t, THREADS, ROWS, ROW_BYTES):
            src.append(s)
            dst.append(d)
    size = ROWS * ROW_BYTES
    assert sorted(src) == list(range(0, size, 16))
    assert sorted(dst) == list(range(0, size, 16))
    for s, d in zip(src, dst):  # and each to where staged_offset says
        assert d == staged_offset(s // ROW_BYTES, s % ROW_BYTES, ROW_BYTES)


def _wavefronts(byte_addresses) -> int:
    """smem wavefronts of one warp's 8-byte loads: most distinct words a bank serves."""
    words_by_bank: dict[int, set[int]] = {}
    for at in byte_addresses:
        for word in (at // 4, at // 4 + 1):
            words_by_bank.setdefault(word % 32, set()).add(word)
    return max(len(w) for w in words_by_bank.values())


@pytest.mark.parametrize("col0", [0, 256])
def test_staged_reads_find_the_accumulators_values_on_two_wavefronts(col0):
    """add_staged_rows reads the staged places in two wavefronts a warp."""
    for warp in range(4):
        for h in range(2):
            for g in range(256 // 8):
                got = []
                for lane in range(32):
                    t = warp * 32 + lane
                    got.append(staged_read_bases(t, ROW_BYTES, col0)[g % 8] + staged_read_offset(h, g, ROW_BYTES))
                    row, col = 16 * warp + lane // 4 + 8 * h, col0 + 8 * g + 2 * (lane % 4)
                    assert got[-1] == staged_offset(row, col * 4, ROW_BYTES), (warp, lane, h, g)
                assert _wavefronts(got) <= 2, (warp, h, g)


def test_without_the_swizzle_the_reads_would_conflict():
    """The count can fail: unswizzled row-major takes 8."""
    for g in range(256 // 8):
        plain = [(lane // 4) * ROW_BYTES + (8 * g + 2 * (lane % 4)) * 4 for lane in range(32)]
        assert _wavefronts(plain) == 8, g
