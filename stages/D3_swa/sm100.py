"""Stage D3 on Blackwell (sm_100a): D2's decode attention over a sliding window filled to a
per-batch level — the SWA length mask.  tcgen05 MMAs, S and O in TMEM, P through shared memory.
Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math: O = softmax(Q·Kᵀ · scale) · V over keys j < swa_lens[b] (docs/MASKED_DECODE.md); keys past
the fill level may hold NaN; a row with no valid key: O = 0, LSE = +∞.  Tensors: Q [b, s_q, h_q,
d], KV [b, n_alloc, d], swa_lens [b] int32, O, LSE, O_part, LSE_part.

New in this rung (the rest is the sm100 house, stages/common/sm100_decode.py): the CTA's keys are
a one-branch `BranchKeys` (sm100_keys.py) with a fill level: only tiles below it are visited (an
empty split writes the empty partial), and on the boundary tile the MMA warp zeroes the V rows
past the fill level (sm100_masks.clean_v_rows) and each softmax thread masks its row's scores
(mask_row_scores).  An all-masked row keeps m = −∞, ℓ = 0 (sm100_softmax.py): O = 0, LSE = +∞
(one split) or −∞ (a partial).

Trace-time checks beyond D2's: the ring's key rows are whole 128-byte lines (check_lines), and
register i of every softmax thread's S fragment holds the same key column (row_key_columns)."""

from stages.common.sm100_decode import WindowSm100


class Kernel(WindowSm100):
    """D2's sm100 decode kernel with the SWA fill-level mask (constructor and tensors as
    stages/common/sm100_decode.WindowSm100's)."""

    NAME = "stage D3 sm100"
    CAUSAL = False
