"""`dsv4-lab gate`: the regression gate — every baselined case must still hold."""

from __future__ import annotations

import re
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
                                              "changed, A/B against the baseline's commit, on a GPU of the "
                                              "baseline's model — here, or on --target NAME (one SSH target: the "
                                              "records come back here); fail on a slowdown beyond noise "
                                              "(docs/BENCH.md)"),
    gpu: Optional[int] = option("gpu", None, help="with --speed: the GPU to time on (default 0; on a target: the "
                                                  "first of its gpus)"),
    emit_jsonl: bool = option("emit_jsonl", False, help="with --speed: remote mode, send the records on the record "
                                                        "channel (used by gate --speed --target)"),
    rev_tree: Optional[str] = option("rev_tree", None, help="with --emit-jsonl: the baseline commits (full shas, "
                                                            "comma-separated) whose trees were sent with the copy "
                                                            "(used by gate --speed --target)"),
) -> None:
    """Regression gate: every baselined case must still hold on the current tree."""
    from harness.workflows import gate

    root = lab_root()
    if speed:
        from harness.commands.base import UsageError
        from harness.workflows import speedgate

        if install_hook or staged or no_run:
            raise UsageError("gate --speed re-times bench shapes (here, or on --target NAME): it takes none of "
                             "--install-hook, --staged, --no-run")
        if emit_jsonl:  # the far side of `gate --speed --target NAME` (harness/remote/remote_speedgate.py)
            if target:
                raise UsageError("gate --speed --emit-jsonl is the far side of --target: give no --target")
            shas = [sha for sha in (rev_tree or "").split(",") if sha]
            bad = [sha for sha in shas if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha)]
            if bad:
                raise UsageError(f"--rev-tree {bad[0]}: not a full commit sha (40 or 64 hex digits)")
            raise typer.Exit(speedgate.main_emitting(root, gpu or 0, shas))
        if rev_tree:
            raise UsageError("--rev-tree goes with --emit-jsonl (the far side of gate --speed --target NAME)")
        if target and target != "local":
            if "," in target:
                raise UsageError(f"--target {target}: gate --speed times on one target — name one "
                                 "(a speed baseline is re-timed on one GPU model)")
            if gpu is not None:
                raise UsageError("gate --speed --target NAME times on the target's first GPU (its gpus in "
                                 "targets.yaml): give no --gpu")
            raise typer.Exit(speedgate.main_remote(root, target))
        raise typer.Exit(speedgate.main(root, gpu or 0))
    if gpu is not None or emit_jsonl or rev_tree:
        from harness.commands.base import UsageError

        raise UsageError("--gpu, --emit-jsonl and --rev-tree go with --speed")
    if install_hook:
        raise typer.Exit(gate.install_hook(root, force=force))
    raise typer.Exit(gate.main(root, allow_run=not no_run, target=target, staged=staged))


COMMANDS = [Command("gate", gate_cmd, errors=(BaselineError, TargetError))]
