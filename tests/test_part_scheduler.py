"""The persistent decode schedule: every (sequence, tile) once, in order; the chooser."""

import itertools

import pytest

from stages.common.part_scheduler import PartGrid, choose_part_tiles, part_cost, resolve_part_tiles


def _walk(g: PartGrid, head_block: int = 0):
    """{(sequence, tile): (part, slot, complete)}; each part's segments contiguous, in order."""
    seen = {}
    for p in range(g.parts):
        done = 0
        for k in range(g.segments(p)):
            w, before = g.segment(head_block, p, k)
            assert before == done, (g, p, k)
            assert 0 <= w.tile_begin < w.tile_end <= g.num_tiles, (g, p, k, w)
            assert w.head_block == head_block
            s = w.batch * g.tokens + w.token
            assert 0 <= w.token < g.tokens and 0 <= w.batch < g.batches
            for t in range(w.tile_begin, w.tile_end):
                assert (s, t) not in seen, (g, p, k, s, t)
                seen[(s, t)] = (p, w.split, g.complete(w))
            assert g.row_block(w) == s * g.head_blocks + head_block
            assert g.partial_row_block(w) == w.split * g.row_blocks + g.row_block(w)
            done += w.tile_end - w.tile_begin
        assert done == min((p + 1) * g.part_tiles, g.total) - p * g.part_tiles
    return seen


@pytest.mark.parametrize("T,L", [(18, 1), (18, 2), (18, 5), (18, 18), (18, 36), (18, 41), (5, 3), (2, 7), (10, 4), (1, 1)])
def test_segments_cover_every_tile_once_with_their_slots(T, L):
    for tokens, batches in ((1, 1), (2, 3), (1, 7)):
        g = PartGrid(2, tokens, batches, T, L)
        seen = _walk(g, head_block=1)
        assert set(seen) == set(itertools.product(range(g.sequences), range(T)))
        assert g.parts == -(-g.sequences * T // L) and g.grid == (2, g.parts, 1)
        for s in range(g.sequences):
            parts = sorted({seen[(s, t)][0] for t in range(T)})
            slots = sorted({seen[(s, t)][1] for t in range(T)})
            assert parts == list(range(parts[0], parts[-1] + 1))  # consecutive parts
            assert slots == list(range(len(parts)))  # slots 0 … n − 1, one a part
            assert g.pieces(s) == len(parts) <= g.capacity <= T  # what the combine reads
            whole = len(parts) == 1
            assert all(seen[(s, t)][2] == whole for t in range(T))  # a whole sequence writes O itself
        assert g.cut == sum(g.pieces(s) > 1 for s in range(g.sequences))
        assert (g.cut == 0) == (g.capacity == 1)
        assert g.chunk == min(L, T)
        assert all(g.segments(p) <= -(-(L - 1) // T) + 1 for p in range(g.parts))


@pytest.mark.parametrize("T,L", [(18, 1), (18, 2), (18, 5), (18, 17), (18, 18), (18, 36), (18, 41), (18, 42),
                                 (5, 3), (2, 7), (10, 4), (1, 1)])
def test_cut_at_names_every_cut_sequence_once(T, L):
    """PartGrid.cut_at: exactly the cut sequences, one boundary each."""
    for tokens, batches in ((1, 1), (2, 3), (1, 7), (2, 74)):
        g = PartGrid(2, tokens, batches, T, L)
        named = [g.cut_at(b)[0] for b in range(1, g.parts) if g.cut_at(b)[1]]
        assert len(named) == len(set(named)), (T, L, tokens, batches)
        assert set(named) == {s for s in range(g.sequences) if g.pieces(s) > 1}, (T, L, tokens, batches)


def test_bad_grids_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="PartGrid"):
            PartGrid(1, 1, 1, 18, bad)


def test_resolve_maps_the_matrix_values():
    kw = dict(head_blocks=2, tokens=2, batches=3, num_tiles=18)
    assert resolve_part_tiles(1, **kw) == 18  # a whole sequence a segment: nothing to combine
    assert resolve_part_tiles(4, **kw) == 5 and resolve_part_tiles(18, **kw) == 1 and resolve_part_tiles(40, **kw) == 1
    assert resolve_part_tiles("many", **kw) == 1
    assert resolve_part_tiles("auto", **kw) == choose_part_tiles(2, 2, 3, 18)
    for bad in (0, -2, "some", 2.0, True, 1000):
        with pytest.raises(ValueError, match="splits"):
            resolve_part_tiles(bad, **kw)


@pytest.mark.parametrize("hb", [1, 2])
def test_the_chooser_fills_the_gpu_and_cuts_only_where_it_pays(hb):
    """Bench launches: whole sequences at b 64, 128, 256; cut at b 74, 148; never more CTAs than SMs."""
    for b in (2, 64, 74, 128, 148, 256):
        L = choose_part_tiles(hb, 2, b, 18)
        g = PartGrid(hb, 2, b, 18, L)
        assert g.parts * hb <= 132, (hb, b, L)
        if b in (64, 128, 256):
            assert g.cut == 0 and L % 18 == 0, (hb, b, L)
        if b in (74, 148):
            assert g.cut > 0 and part_cost(g) < part_cost(PartGrid(hb, 2, b, 18, 18 * -(-2 * b * hb // 132))), (hb, b)
        assert part_cost(g) == min(part_cost(PartGrid(hb, 2, b, 18, x)) for x in range(1, 18 * -(-2 * b * hb // 132) + 1))


@pytest.mark.parametrize("hb,tokens,b,want", [(2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 1, 2), (2, 1, 2, 2),
                                              (2, 2, 2, 2), (2, 1, 4, 2), (2, 2, 8, 6), (1, 1, 16, 3),
                                              (1, 2, 32, 9), (2, 2, 64, 36)])
def test_the_chooser_counts_a_sequences_pieces(hb, tokens, b, want):
    """PIECE_COST moves b ≤ 2 to L = 2, larger b unchanged."""
    from stages.common.part_scheduler import choose_part_tiles

    choose_part_tiles.cache_clear()
    assert choose_part_tiles(hb, tokens, b, 18, 132) == want
