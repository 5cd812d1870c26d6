"""Hopper (sm_90a) register reallocation: warpgroups move registers between them with `setmaxnreg`.

Math
    At launch every thread holds launch_registers(threads) = ⌊65 536 / threads / 8⌋ · 8
    registers.  A plan [(n_i, r_i)] — n_i threads (whole warpgroups) asking for r_i each — fits
    when the groups cover the CTA, every r_i is a multiple of 8 in 24 … 256, and
    Σ n_i · r_i ≤ threads · launch_registers(threads).  A plan that does not fit hangs
    (setmaxnreg.inc waits for registers nobody frees).

    register_plan   None when a plan fits, else why not (one line)
    set_registers   .inc above the launch allocation, .dec below, nothing at it (an .inc to
                    fewer registers than a warp holds is an illegal instruction)"""

from __future__ import annotations

import cutlass.cute as cute


def launch_registers(threads: int) -> int:
    """Registers a thread holds at launch: 65 536 / threads, rounded down to a multiple of 8."""
    return 65536 // threads // 8 * 8


def register_plan(threads: int, plan: list[tuple[int, int]]) -> str | None:
    """None when the setmaxnreg plan [(thread count, registers per thread), …] — one entry per
    group of warps — fits the CTA's allocation at launch (threads × (65 536 / threads rounded
    down to a multiple of 8)); else why not.  A plan that does not fit hangs: setmaxnreg.inc
    waits for registers nobody frees."""
    at_launch = threads * launch_registers(threads)
    want = sum(n * r for n, r in plan)
    if sum(n for n, _ in plan) != threads or any(r % 8 or not 24 <= r <= 256 for _, r in plan):
        return f"setmaxnreg plan {plan} must cover the {threads} threads with multiples of 8 in 24 … 256"
    if want > at_launch:
        return f"setmaxnreg plan {plan} needs {want} registers, the CTA holds {at_launch} (a hang)"
    return None


def set_registers(regs: int, threads: int) -> None:
    """setmaxnreg to `regs` for the calling warpgroup: .inc above the launch allocation, .dec
    below it (an .inc to fewer registers than a warp holds is an illegal instruction)."""
    if regs > launch_registers(threads):
        cute.arch.setmaxregister_increase(regs)
    elif regs < launch_registers(threads):
        cute.arch.setmaxregister_decrease(regs)
