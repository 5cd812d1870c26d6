"""The statuses a case's record can carry, defined once for the whole lab.

  pass           ran on a GPU (or the CPU test arch) and met every tolerance
  fail           ran, and an output missed its tolerance (or was unwritten / non-finite)
  compile_error  the kernel did not compile
  crash          the worker died, raised, or the device faulted
  timeout        no result within the case's time limit; the worker was killed
  hang           a --debug-hangs build's bounded mbarrier wait expired (stages/common/hang_guard.py)
  skipped        not attempted
  compiled       built for an arch this machine cannot run: never counts as verified
  prepared       compiled, and its host path run up to the launch on a GPU of another arch
                 (`run --prepare`): evidence, never a run — not in RAN, never a run baseline,
                 never passes the gate"""

from __future__ import annotations

STATUSES: tuple[str, ...] = ("pass", "fail", "compile_error", "crash", "timeout", "skipped", "compiled", "hang",
                           "prepared")

# A run with any of these exits non-zero.
FAILING: tuple[str, ...] = ("fail", "compile_error", "crash", "timeout", "hang")

# A run's verdict on a device: the case was launched (what the gate and the dashboard judge).
RAN: tuple[str, ...] = ("pass", "fail", "crash", "timeout", "hang")

# What compiling alone can prove (compile-only baselines of archs no device here runs).
COMPILED: tuple[str, ...] = ("compiled", "compile_error")

# Built, and its host path run up to the launch on a GPU of another arch: not a run.
PREPARED: tuple[str, ...] = ("prepared",)

# How each status is shown: glyph and rich style.
STYLE: dict[str, tuple[str, str]] = {
    "pass": ("✓", "green"), "fail": ("✗", "red"), "compile_error": ("✗", "red"), "crash": ("✗", "red"),
    "timeout": ("⏱", "red"), "skipped": ("-", "dim"), "compiled": ("○", "yellow"),
    "hang": ("⏱", "red"),
    "prepared": ("◐", "cyan"),
}
