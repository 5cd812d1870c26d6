"""The combine inside stage E's attention kernel (stages/common/resident_combine.py): who combines
which rows, when it applies, and the arrive/wait protocol's deadlock argument, on ints — the
kernel runs these same functions traced."""

from __future__ import annotations

import pytest

from stages.common.part_scheduler import PartGrid, resolve_part_tiles
from stages.common.resident_combine import counter_index, resident_combines, share_row, share_rows


@pytest.mark.parametrize("rows", [64, 7])
def test_the_pieces_shares_cover_every_row_exactly_once(rows):
    for n in range(2, 80):
        seen = [share_row(j, n, i) for j in range(n) for i in range(share_rows(j, n, rows))]
        assert sorted(seen) == list(range(rows)), n
        # the shares differ by at most one row: no piece combines much more than another
        sizes = [share_rows(j, n, rows) for j in range(min(n, rows))]
        assert max(sizes) - min(sizes) <= 1, n
        # row 0 (the counter's word) is piece 0's first
        assert share_row(0, n, 0) == 0


def test_the_counters_are_distinct_row_0_words():
    assert [counter_index(rb, 64) for rb in range(4)] == [0, 64, 128, 192]


def _grid(b: int, s_q: int, h_q: int, tiles: int, splits, sm_count: int = 132) -> PartGrid:
    L = resolve_part_tiles(splits, head_blocks=h_q // 64, tokens=s_q, batches=b, num_tiles=tiles, sm_count=sm_count)
    return PartGrid(h_q // 64, s_q, b, tiles, L)


def test_the_residency_condition():
    g = _grid(2, 2, 128, 18, "auto")  # b 2 s2 h128: 36 parts of 2 tiles, 72 CTAs, 9 pieces a sequence
    assert (g.parts, g.part_tiles, g.capacity) == (36, 2, 9)
    assert resident_combines(g, 132) and resident_combines(g, 72)
    assert not resident_combines(g, 71)  # one CTA without an SM: the combine stays a launch of its own
    assert not resident_combines(_grid(2, 2, 128, 18, 1), 132)  # nothing cut: nothing to combine
    many = _grid(2, 2, 128, 18, "many")  # 72 parts × 2 head blocks = 144 CTAs
    assert not resident_combines(many, 132) and resident_combines(many, 144)


def _simulate(grid: PartGrid, resident: int) -> bool:
    """The kernel's protocol, a CTA a part (head blocks walk alike), at most `resident` parts
    running at once (the next part starts when one ends, in order): a cut sequence's piece
    arrives, waits for n(s) arrivals, then goes on.  True iff every part ends."""
    count: dict[int, int] = {}
    pieces: dict[int, set] = {}
    state = {p: 0 for p in range(grid.parts)}  # segment index; arrival recorded as a half step
    arrived: set = set()
    running = list(range(min(resident, grid.parts)))
    waiting = list(range(len(running), grid.parts))
    done = 0
    while running:
        moved = False
        for p in list(running):
            while state[p] < grid.segments(p):
                work, _ = grid.segment(0, p, state[p])
                s = work.batch * grid.tokens + work.token
                n = grid.pieces(s)
                if n > 1:
                    if (p, state[p]) not in arrived:
                        arrived.add((p, state[p]))
                        count[s] = count.get(s, 0) + 1
                        pieces.setdefault(s, set()).add(work.split)
                        moved = True
                    if count[s] < n:
                        break
                state[p] += 1
                moved = True
            if state[p] == grid.segments(p):
                running.remove(p)
                done += 1
                if waiting:
                    running.append(waiting.pop(0))
                moved = True
        if not moved:
            return False
    assert done == grid.parts
    # every cut sequence's pieces are the slots 0 … n − 1, each once
    for s, got in pieces.items():
        assert got == set(range(grid.pieces(s))) and count[s] == grid.pieces(s)
    return True


@pytest.mark.parametrize("b,s_q,h_q,tiles,splits", [
    (1, 2, 128, 18, "auto"), (2, 2, 128, 18, "auto"), (2, 2, 64, 18, "auto"), (4, 1, 128, 18, "auto"),
    (8, 2, 128, 18, "auto"), (16, 1, 64, 18, "auto"), (3, 2, 64, 18, 2), (3, 2, 64, 5, 3), (5, 1, 64, 7, "many"),
])
def test_every_piece_arrives_when_the_grid_is_resident(b, s_q, h_q, tiles, splits):
    """The deadlock argument of the module doc, run: with every part resident each wait ends;
    with one part running at a time a piece 0 waits for a part that never starts — why the
    combine is only used under the residency condition."""
    g = _grid(b, s_q, h_q, tiles, splits)
    assert g.cut > 0
    assert _simulate(g, g.parts)
    assert not _simulate(g, 1)
