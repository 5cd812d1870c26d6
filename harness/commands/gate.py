"""`dsv4-lab gate`: the regression gate — every baselined case must still hold."""

from __future__ import annotations

from typing import Optional

import typer

from harness.notebook.baselines import BaselineError
from harness.commands.base import Command, option
from harness.core.paths import lab_root
from harness.remote.targets import TargetError


def gate_cmd(
    install_hook: bool = option("install_hook", False, help="install the git pre-commit hook"),
    force: bool = option("force", False, help="with --install-hook: replace a hook the lab did not write"),
    no_run: bool = option("no_run", False, help="never run stale cases; report them"),
    target: Optional[str] = option("target", None, help="prove stale run cases on this target (default: proof_target "
                                                        "in ~/.config/dsv4-lab/targets.yaml; local: here only)"),
    staged: bool = option("staged", False, help="judge what the git index holds, not the working tree "
                                                "(what the pre-commit hook runs)"),
    speed: bool = option("speed", False, help="the speed gate: re-time the speed-baselined bench shapes whose source "
                                              "changed, A/B against the baseline's commit, here on a GPU of the "
                                              "baseline's model; fail on a slowdown beyond noise (docs/BENCH.md)"),
) -> None:
    """Regression gate: every baselined case must still hold on the current tree."""
    from harness.workflows import gate

    root = lab_root()
    if speed:
        from harness.commands.base import UsageError
        from harness.workflows import speedgate

        if install_hook or staged or target or no_run:
            raise UsageError("gate --speed runs here, on the GPU machine: it takes none of --install-hook, --staged, "
                             "--target, --no-run")
        raise typer.Exit(speedgate.main(root))
    if install_hook:
        raise typer.Exit(gate.install_hook(root, force=force))
    raise typer.Exit(gate.main(root, allow_run=not no_run, target=target, staged=staged))


COMMANDS = [Command("gate", gate_cmd, errors=(BaselineError, TargetError))]
