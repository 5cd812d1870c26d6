"""Stage D4 on Blackwell (sm_100a): D3's SWA decode attention with the causal rule.  Compiled and
inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math: token t sits at key position swa_lens[b] − s_q + t and sees keys j ≤ that (and j <
swa_lens[b]): key limit max(swa_lens[b] − s_q + t + 1, 0); a token with no key: O = 0, LSE = +∞.

New in this rung (the rest: sm100_decode.WindowSm100): a 128-row block holds one or two tokens,
so the limit is per ROW — the CTA visits the tiles of its last token's limit (BranchKeys,
block_last_token) and each softmax thread masks with its own row's limit.  The MMA warp still
zeroes V rows from the FILL level on (rows below it past a causal limit are finite, P = 0)."""

from stages.common.sm100_decode import WindowSm100


class Kernel(WindowSm100):
    """D3's sm100 kernel with D4's causal rule (constructor and tensors as D3's:
    stages/common/sm100_decode.WindowSm100)."""

    NAME = "stage D4 sm100"
    CAUSAL = True
