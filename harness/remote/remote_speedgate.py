"""`dsv4-lab gate --speed --target NAME`: the speed gate timed on a target's GPU, written here.

The sending side is harness/workflows/speedgate.py `main_remote`; the steps (the trees shipped as
`.dsv4-revs/<sha>/` by harness/remote/treecopy.py, `remote_side gate --speed --emit-jsonl
--rev-tree` there, the compare records back on remote_run.py's signed channel, the verdict lines
printed here) are docs/BENCH.md, "The speed gate on a target".
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from harness.notebook.staged import Snapshot
from harness.remote.remote_run import STDERR_TAIL_LINES, TargetRun, _Session, case_key, stream_runs
from harness.remote.ssh import ssh_binary, ssh_config_args
from harness.remote.targets import Target, TargetError, resolve_targets, slurm_target
from harness.remote.treecopy import place_files, tree_files
from harness.spec.spec import Spec

REV_DIR = ".dsv4-revs"  # the commits' trees, inside the copy: `<work folder>/.dsv4-revs/<full sha>/`
SPEED_FILES = ("results/speed_baselines.yaml.xz", "results/speed_baselines.yaml")  # the plain one: an older clone's


def speed_target(root: Path, name: str) -> Target:
    """The one SSH target `name` names (TargetError, one line: an unknown name says what `run
    --target` says; a slurm target is refused)."""
    if slurm_target(root, name) is not None:
        raise TargetError(f"--target {name}: a slurm target — gate --speed runs on an SSH target (or here, on the "
                          "GPU machine)")
    (t,) = resolve_targets(root, name)
    return t


@dataclass
class RemoteGate:
    """What came back from the target's speed gate."""

    run: TargetRun
    interrupted: bool
    signum: int
    local_error: str | None


def _tree(root: Path, revs: dict[str, Path], folder: Path) -> Snapshot:
    """The files that travel, gathered in `folder`: the working tree, the speed baselines, and
    each commit's tree under REV_DIR/<sha>/."""
    files = tree_files(root)
    files += [f for f in SPEED_FILES if f not in files and (root / f).is_file()]  # ignored by git, yet the plan's input
    place_files(root, files, folder)
    for sha, tree in sorted(revs.items()):
        dest = folder / REV_DIR / sha
        shutil.copytree(tree, dest, symlinks=True)
        files += sorted(str(p.relative_to(folder)) for p in dest.rglob("*") if p.is_file() or p.is_symlink())
    return Snapshot(lab=root, folder=folder, baselines_root=folder, files=tuple(files))


def remote_args(t: Target, revs: dict[str, Path]) -> list[str]:
    """The far side's command line (after `python -m harness.remote.remote_side`)."""
    args = ["gate", "--speed", "--emit-jsonl", "--rev-tree", ",".join(sorted(revs))]
    return args + (["--gpu", str(t.gpus[0])] if t.gpus else [])


def gate_on_target(spec: Spec, t: Target, planned: list[tuple[str, str, dict[str, Any]]], revs: dict[str, Path],
                   argv: list[str], sync_method: str | None = None) -> RemoteGate:
    """Ship the tree and the commits' trees (`revs`) to `t`, run the speed gate there, write each
        compare record of a `planned` shape here as it arrives.  A failed link is in the result."""
    root = spec.root
    ssh_binary()
    ssh_config_args()
    tr = TargetRun(t, None, {case_key(s, a, c) for s, a, c in planned})
    session = _Session(spec, [tr], list(argv))
    session.console.print(f"[bold]gate --speed on {escape(t.name)}[/]: {len(planned)} bench shape(s) to re-time "
                          f"against {len(revs)} commit(s)", highlight=False)
    with tempfile.TemporaryDirectory(prefix="dsv4-speedgate-") as tmp:
        snapshot = _tree(root, revs, Path(tmp) / "tree")
        interrupted, signum, local_error = stream_runs(session, {t.name: remote_args(t, revs)}, sync_method, snapshot)
    return RemoteGate(tr, interrupted, signum, local_error)


def problems(res: RemoteGate) -> list[str]:
    """What went wrong, one line each: rejected lines, the link, a run that never finished (with its
        stderr), the remote's errors, planned shapes missing from a gate that claimed success."""
    tr, name = res.run, res.run.target.name
    out: list[str] = []
    if tr.rejected:
        out.append(f"{name}: rejected {tr.rejected} line(s) from the remote, none written (first: {tr.first_reject})")
    if tr.link_error:
        out.append(tr.link_error)
    elif res.local_error:
        out.append(f"{res.local_error} — the remote gate was stopped; records written so far are kept")
    elif res.interrupted:
        out.append(f"interrupted here: the remote gate was stopped; {len(tr.records)} record(s) received are kept")
    elif tr.end is None:
        out.append(f"{tr.lost or name + ': the remote gate ended without finishing'} — "
                   f"{len(tr.records)} record(s) received are kept; nothing else is proven")
        out += [f"  {ln}" for ln in tr.stderr_tail[-STDERR_TAIL_LINES:]]
    for err in (tr.end or {}).get("errors", []):
        out.append(f"{name}: the remote gate failed: {err}")
    if tr.end is not None and tr.rc == 0 and tr.missing:
        out.append(f"{name}: {tr.missing} of {len(tr.plan)} planned bench shape(s) never came back — nothing is "
                   "proven about them")
    return out
