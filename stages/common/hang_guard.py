"""Bounded mbarrier waits for a debug build (`dsv4-lab run … --debug-hangs`): a hang says where.

Off (the default) nothing here emits anything: the PTX / SASS is unchanged
(tests/test_hang_guard.py).  On (DSV4_DEBUG_HANGS=1 while a kernel is traced; the lab sets it in
its compile workers, the compile cache key and the record) every mbarrier wait becomes

    t0 = %globaltimer
    until mbarrier.try_wait.parity(bar, phase):
        if %globaltimer − t0 > BUDGET_NS:
            lane 0 of the warp: printf("DSV4-HANG role=… pipeline=… slot=… phase=… cta=(x,y,z)
                                         tile=(x,y,z) warp=… thread=… waited_ns=…")
            trap

so a deadlock ends within BUDGET_NS (4 s) with the trap's CUDA error and a line naming it:
role (`role("mma")` at the top of a role method; "?" elsewhere), pipeline (its name + ".full" /
".empty"; a direct wait names itself), slot, phase (the parity waited for), cta/tile (blockIdx).

Call sites need at most one line: importing this module wraps `MbarrierArray.wait` (every
cutlass.pipeline waits through it) once, process-wide, with `_wait` (the original unless the flag
is on); a pipeline is named at `create(…, name=name("kv"))`; a bare wait becomes
`mbarrier_wait(bar, phase, "q")`.  Named barriers (bar.sync) cannot be bounded: a hang there
ends as the case's timeout."""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.pipeline import MbarrierArray

ENV = "DSV4_DEBUG_HANGS"
BUDGET_NS = 4_000_000_000
TAG = "DSV4-HANG"

_role: list[str] = ["?"]


def enabled() -> bool:
    """Whether the kernel being traced is a --debug-hangs build."""
    return os.environ.get(ENV, "") == "1"


def name(pipeline: str) -> str:
    """A pipeline's `name=`: `pipeline` in a debug build, "" otherwise.  Pipelines are made before the
        roles run, so this also forgets the previous kernel's role."""
    _role[0] = "?"
    return pipeline if enabled() else ""


def role(what: str) -> None:
    """Trace time: the waits emitted from here on belong to warp role `what` (call it first
    thing in each role method; it emits nothing)."""
    _role[0] = what


def _label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-:+?" else "_" for c in text) or "?"


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """PTX `trap`: the kernel stops with a CUDA error (the context is lost)."""
    llvm.intr_trap(loc=loc, ip=ip)


@cute.jit
def _bounded_wait(bar, phase, slot, what: cutlass.Constexpr[str], budget_ns: cutlass.Constexpr[int]):
    t0 = cute.arch.globaltimer()
    done = cute.arch.mbarrier_try_wait(bar, phase)
    while not done:
        done = cute.arch.mbarrier_try_wait(bar, phase)
        if not done:
            waited = cute.arch.globaltimer() - t0
            if waited > budget_ns:
                tidx, _, _ = cute.arch.thread_idx()
                bx, by, bz = cute.arch.block_idx()
                if tidx % 32 == 0:
                    cute.printf(
                        TAG + " " + what + " slot=%d phase=%d cta=(%d,%d,%d) tile=(%d,%d,%d) warp=%d thread=%d "
                        "waited_ns=%lld\n",
                        cutlass.Int32(slot), cutlass.Int32(phase), bx, by, bz, bx, by, bz, tidx // 32, tidx,
                        waited,
                    )
                trap()


def _identity(pipeline: str) -> str:
    return f"role={_label(_role[0])} pipeline={_label(pipeline)}"


def mbarrier_wait(bar, phase, pipeline: str, slot=0) -> None:
    """`cute.arch.mbarrier_wait(bar, phase)`, bounded in a debug build; `pipeline` names the
    barrier in the hang line, `slot` its index (0 for a lone barrier)."""
    if not enabled():
        cute.arch.mbarrier_wait(bar, phase)
        return
    _bounded_wait(bar, phase, slot, _identity(pipeline), BUDGET_NS)


_ORIGINAL_WAIT = MbarrierArray.wait


def _wait(self, index, phase, *, loc=None, ip=None) -> None:
    """MbarrierArray.wait: the library's own unless this is a debug build."""
    if not enabled():
        return _ORIGINAL_WAIT(self, index, phase, loc=loc, ip=ip)
    _bounded_wait(self.get_barrier(index), phase, index, _identity(getattr(self, "name", "") or "unnamed"),
                  BUDGET_NS)


if not getattr(MbarrierArray.wait, "_dsv4_hang_guard", False):
    _wait._dsv4_hang_guard = True  # type: ignore[attr-defined]
    MbarrierArray.wait = _wait  # type: ignore[method-assign]
