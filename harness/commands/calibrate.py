"""`dsv4-lab calibrate [--fp8]`: measure this GPU's peaks for the roofline."""

from __future__ import annotations

import typer

from harness.commands.base import Command, option
from harness.core.paths import lab_root


def calibrate_cmd(fp8: bool = option("fp8", False, help="also measure FP8 tensor-core throughput")) -> None:
    """Measure this GPU's peaks once (bf16 matmul, FP8 with --fp8, device copy bandwidth) and
    record them in results/calibration.jsonl for the roofline of bench and dashboard."""
    from harness.execution import calibrate

    raise typer.Exit(calibrate.main(lab_root(), fp8=fp8))


COMMANDS = [Command("calibrate", calibrate_cmd)]
