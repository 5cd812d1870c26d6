"""Stage D3 on Blackwell (sm_100a): D2's decode attention over a sliding window filled to a
per-batch level — the SWA length mask.  tcgen05 MMAs, S and O in TMEM, P through shared memory.

Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math:  O = softmax(Q·Kᵀ · scale) · V over the keys j < swa_lens[b] only (scale = 1/sqrt(d));
keys at or past the fill level may hold anything, NaN included, and must not reach O.  A row
with no valid key (swa_lens[b] = 0): O = 0, LSE = +∞, never NaN.  Tensors
(oracles/masked_decode.py): D2's plus swa_lens [b] int32, in the order
    Q [b, s_q, h_q, d], KV [b, n_alloc, d], swa_lens [b], O, LSE, O_part, LSE_part.

What is new in this rung (everything else is D2's sm100 house, stages/common/sm100_decode.py: its
TMEM plan — S double-buffered, O over 2 CTAs at d = 512 —, KV ring, pipelines and roles)
    The CTA's keys are a `BranchKeys` of one branch with a fill level
    (stages/common/sm100_keys.py): it reads swa_lens[b], visits only the tiles below the fill
    level (scheduler.visit_tiles: a split above it is empty and writes the empty partial,
    a CTA with no tile writes O = 0, LSE = +∞ / −∞ directly), and on the one boundary tile
      - the MMA warp zeroes the V rows at and past the fill level in the ring slot before
        P·V reads them (sm100_masks.clean_v_rows; 0 · NaN = NaN inside the MMA), and
      - each softmax thread sets its row's scores of those keys to −∞ (mask_row_scores: a
        select, before the row max).
    A row whose keys are all masked keeps m = −∞ and ℓ = 0 (stages/common/sm100_softmax.py's
    lonely-row rule): O = 0, LSE = +∞ (one split) or −∞ (a partial, skipped by the combine).

Trace-time checks beyond D2's: the ring's key rows are whole 128-byte lines under the swizzle
(sm100_masks.check_lines, every element of a slot), so zeroing rows rem … 63 touches exactly
those keys; register i of every softmax thread's S fragment holds the same key column
(row_key_columns, all 128 threads), so the mask compares with constants.  Cost: 64 compares +
selects a softmax thread on every visited tile (unconditional: branching on the boundary tile
cost 42 registers) and, on the boundary tile, the zeroing of this CTA's V rows.
"""

from stages.common.sm100_decode import WindowSm100


class Kernel(WindowSm100):
    """D2's sm100 decode kernel with the SWA fill-level mask (constructor and tensors as
    stages/common/sm100_decode.WindowSm100's)."""

    NAME = "stage D3 sm100"
    CAUSAL = False
