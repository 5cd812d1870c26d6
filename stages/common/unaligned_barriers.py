"""Named barriers met from different instructions (Hopper and later): `barrier.cta.sync` and
`barrier.cta.arrive` without `.aligned`.

The aligned forms (`bar.sync` / `bar.arrive`) promise that every participant executes the same
instruction; warpgroups that meet from different code (stage E's MMA warpgroups, each its own
copy of the loop) break it, and synccheck reports the barrier as divergent.  The ids are
barriers.py's NamedBarrier; `int(barrier)` is the id."""

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
