"""Named barriers met from different instructions (Hopper and later): `barrier.cta.sync` and
`barrier.cta.arrive` without `.aligned`.

The aligned forms (`bar.sync` / `bar.arrive`, what cute.arch.barrier emits) promise that every
participant executes the same instruction.  Warpgroups that meet from different code — each its
own copy of a loop (stage E's MMA warpgroups, compiled for their own register counts), a sync
on one side and an arrive on the other — break that promise, and compute-sanitizer's synccheck
reports the barrier as divergent.  The ids are stages/common/barriers.py's NamedBarrier (the one
registry; stage E's STAGED, Q_FREE and FLAG_SEEN are described there); `int(barrier)` is the id.
"""

from __future__ import annotations

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


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
