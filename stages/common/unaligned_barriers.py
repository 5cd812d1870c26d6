"""Named barriers met from different instructions (Hopper and later): `barrier.cta.sync` and
`barrier.cta.arrive` without `.aligned`.

The aligned forms (`bar.sync` / `bar.arrive`, what cute.arch.barrier emits) promise that every
participant executes the same instruction.  Warpgroups that meet from different code — each its
own copy of a loop (stage E's MMA warpgroups, compiled for their own register counts), a sync
on one side and an arrive on the other — break that promise, and compute-sanitizer's synccheck
reports the barrier as divergent.  The ids are stages/common/barriers.py's; `STAGED` is the
next free one, kept here so the registry the proven stages compile against is unchanged:

    STAGED   stage E's producer threads have staged the split's idx entries in shared memory;
             every producer thread may read them                  (all arrive + wait)
    Q_FREE   stage E's warpgroup 0 is past the last S of a segment: Q's shared memory may be
             loaded again                                         (warpgroup 0 arrives + waits)
    FLAG_SEEN  stage E's warpgroup 0, piece 0 of a two-piece sequence: its first thread has
             seen piece 1's flag; piece 1's LSEs may be read      (warpgroup 0 arrives + waits)
"""

from __future__ import annotations

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from stages.common.barriers import MAX_NAMED_BARRIERS, NamedBarrier

STAGED = 6
Q_FREE = 7
FLAG_SEEN = 8
_OURS = {STAGED, Q_FREE, FLAG_SEEN}
assert len(_OURS) == 3 and not _OURS & {int(b) for b in NamedBarrier} and max(_OURS) < MAX_NAMED_BARRIERS


@dsl_user_op
def named_sync(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """Wait at named barrier `barrier` until `threads` threads have arrived (unaligned)."""
    llvm.inline_asm(None, [], f"barrier.cta.sync {int(barrier)}, {int(threads)};", "",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def named_arrive(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """Arrive at named barrier `barrier` without waiting (unaligned)."""
    llvm.inline_asm(None, [], f"barrier.cta.arrive {int(barrier)}, {int(threads)};", "",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
