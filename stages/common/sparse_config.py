"""Stage E's case word: the config axis `s{s_q}h{h_q}_m{topk}bs{block}[_x{extra_topk}bs{extra_block}]`
(e.g. s2h128_m128bs256_x1024bs64, FlashMLA's MODEL1 CONFIG2), parsed once for the kernels and the
oracle.

    s_q, h_q           query tokens per sequence, query heads
    topk, block        the main list's length and its cache's page block size (tokens)
    extra_topk, extra_block
                       the extra (SWA) list's; extra_topk 0: no extra branch (block 1)
    tiles()            64-key tiles (TILE) of the combined key list, each branch padded to whole tiles
MAX_TOPK (32768, FlashMLA's largest) bounds each list in the kernels (they refuse longer ones).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TILE = 64  # keys per tile: the unit of split-KV and of the scratch capacity
MAX_TOPK = 32768  # the longest list (main or extra) the kernels take: FlashMLA's largest topk

_CONFIG = re.compile(r"s(\d+)h(\d+)_m(\d+)bs(\d+)(?:_x(\d+)bs(\d+))?")


@dataclass(frozen=True)
class SparseConfig:
    s_q: int
    h_q: int
    topk: int
    block: int
    extra_topk: int  # 0: no extra branch
    extra_block: int

    @property
    def has_extra(self) -> bool:
        return self.extra_topk > 0

    @staticmethod
    def parse(word: str) -> "SparseConfig":
        m = _CONFIG.fullmatch(str(word))
        if not m:
            raise ValueError(f"config {word!r} is not s<S>h<H>_m<TOPK>bs<BLOCK>[_x<TOPK>bs<BLOCK>], "
                             f"e.g. s2h128_m128bs256_x1024bs64")
        s_q, h_q, topk, block = (int(x) for x in m.groups()[:4])
        xt, xb = (int(m.group(5)), int(m.group(6))) if m.group(5) else (0, 1)
        if min(s_q, h_q, topk, block, xb) < 1 or (m.group(5) and xt < 1):
            raise ValueError(f"config {word!r}: every size must be positive")
        return SparseConfig(s_q, h_q, topk, block, xt, xb)

    def seq_tokens(self, topk: int, block: int) -> int:
        """Tokens per sequence in a branch's cache: room for 2 · topk positions, whole blocks."""
        return -(-max(2 * topk, block) // block) * block

    def num_blocks(self, b: int, extra: bool) -> int:
        """Blocks of a branch's cache: every sequence's blocks plus one spare (never indexed)."""
        if extra and not self.has_extra:
            return 1
        topk, block = (self.extra_topk, self.extra_block) if extra else (self.topk, self.block)
        return b * self.seq_tokens(topk, block) // block + 1

    def tiles(self) -> int:
        """64-key tiles of the combined key list (each branch padded to whole tiles)."""
        return -(-self.topk // TILE) + (-(-self.extra_topk // TILE) if self.has_extra else 0)
