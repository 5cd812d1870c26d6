"""Stage D4 on Blackwell (sm_100a): D3's SWA decode attention with the causal rule — the s_q
query tokens are the newest tokens of the window.  tcgen05 MMAs, S and O in TMEM.

Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math:  query token t (0 … s_q−1) sits at key position swa_lens[b] − s_q + t and sees key j iff
j ≤ swa_lens[b] − s_q + t (and j < swa_lens[b]): key limit max(swa_lens[b] − s_q + t + 1, 0)
(stages/common/scheduler.key_limit).  When swa_lens[b] < s_q the first tokens see no key:
O = 0, LSE = +∞.  Tensors: D3's, in the same order.

What is new in this rung (everything else is D3's: stages/common/sm100_decode.WindowSm100)
    The branch is causal.  A 128-row block holds one token (h_q = 128) or two (h_q = 64,
    s_q = 2: rows 0–63 token 0, rows 64–127 token 1), so the limit is per ROW, not per CTA:
      - the CTA visits the tiles of its last token's limit (the largest; BranchKeys, with
        block_last_token), and
      - each softmax thread masks with its own row's token (mask_row_scores with its limit),
        so token 0 of a shared block does not see token 1's newest key.
    The MMA warp still zeroes V rows from the FILL level (swa_lens[b]) on: rows between a
    token's causal limit and the fill level are real keys, finite, with P = 0.
"""

from stages.common.sm100_decode import WindowSm100


class Kernel(WindowSm100):
    """D3's sm100 kernel with D4's causal rule (constructor and tensors as D3's:
    stages/common/sm100_decode.WindowSm100)."""

    NAME = "stage D4 sm100"
    CAUSAL = True
