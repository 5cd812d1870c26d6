"""FlashMLA's Hopper FP8 sparse decode for stage E as a serving engine calls it each decode step:
its scheduler metadata computed in every call (get_mla_metadata() afresh, filled by that call)
rather than once and reused — the same kernel and inputs as harness/peers/flashmla_sparse.py,
whose timing is the faster of the two (issue 30: record both, compare against the faster)."""

from __future__ import annotations

from typing import Any, Callable

from harness.peers import flashmla_sparse
from harness.peers.flashmla_sparse import PROBLEMS, check_cosine, installed, unsupported

__all__ = ["PROBLEMS", "check_cosine", "installed", "unsupported", "make"]


def make(problem: str, dims: dict[str, Any], inputs: dict) -> Callable[[], dict]:
    return flashmla_sparse.make(problem, dims, inputs, per_call=True)
