"""What a commit would hold: the lab as the git index has it, exported to a temporary folder.

`gate --staged` (the pre-commit hook) judges this snapshot, not the working tree: the index's
files (`git checkout-index`, honouring GIT_INDEX_FILE) with two exceptions:

* `results/` is the real lab's (a symlink): records are read and written where they are.
* the baselines files are the index's, kept beside the snapshot (`Snapshot.baselines_root`,
  xz bytes as git stores them; an older clone's plain baselines.yaml too).

The compile cache stays the real lab's (DSV4_LAB_CACHE), and records written from the snapshot
carry `HEAD` + "dirty" when the index differs from HEAD (DSV4_LAB_GIT)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from harness.core.paths import SPEC_NAME, cache_dir, results_dir


# What must hold, as the index has it (harness/notebook/baselines.py: run and compile baselines).
BASELINE_FILES = ("results/baselines.yaml.xz", "results/compile_baselines.yaml.xz",
                  "results/baselines.yaml")  # the last: the run baselines' plain form in an older clone


class StagedError(Exception):
    """The index cannot be exported (not a git repository, git failed), as one line."""


@dataclass(frozen=True)
class Snapshot:
    """The index's lab at `folder`, standing for the real lab `lab`; `files` (relative to the
    lab, results/ left out) are what travels to a target."""

    lab: Path
    folder: Path
    baselines_root: Path  # a folder whose results/ baselines files are the index's
    files: tuple[str, ...]


def _git(root: Path, *args: str, stdin: bytes | None = None) -> bytes:
    try:
        out = subprocess.run(["git", *args], cwd=root, input=stdin, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StagedError(f"{root}: git {args[0]} failed ({exc}) — `gate --staged` reads what git would commit")
    if out.returncode != 0:
        why = out.stderr.decode("utf-8", "replace").strip().splitlines()
        raise StagedError(f"{root}: git {args[0]} failed ({why[-1] if why else f'exit {out.returncode}'}) — "
                          "`gate --staged` judges the git index; run it inside the lab's git repository")
    return out.stdout


def _code_token(root: Path) -> str:
    """`<HEAD>:<0|1>` for DSV4_LAB_GIT: 1 when the index differs from HEAD outside results/."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                          text=True, timeout=30).stdout.strip()
    if not head:
        return ":1"  # no commit yet: everything staged is new
    same = subprocess.run(["git", "diff", "--cached", "--quiet", "--", ".", ":(exclude)results"], cwd=root,
                          capture_output=True, timeout=60).returncode == 0
    return f"{head}:{0 if same else 1}"


@contextmanager
def index_snapshot(root: Path) -> Iterator[Snapshot]:
    """Export the index's lab (see the module doc); removed afterwards. Raises StagedError."""
    root = root.resolve()
    prefix = _git(root, "rev-parse", "--show-prefix").decode().strip()
    names = [n for n in _git(root, "ls-files", "-z", "--cached").decode("utf-8", "surrogateescape").split("\0") if n]
    if SPEC_NAME not in names:
        raise StagedError(f"{root / SPEC_NAME}: not in the git index — `gate --staged` judges what the commit holds: "
                          f"git add {SPEC_NAME}")
    tree = [n for n in names if not n.startswith("results/")]
    tmp = Path(tempfile.mkdtemp(prefix="dsv4-lab-staged-"))
    saved = {k: os.environ.get(k) for k in ("DSV4_LAB_CACHE", "DSV4_LAB_GIT")}
    try:
        out = tmp / "index"
        _git(root, "checkout-index", f"--prefix={out}/", "-z", "--stdin",
             stdin=b"".join(n.encode("utf-8", "surrogateescape") + b"\0" for n in tree))
        folder = out / prefix if prefix else out
        folder.mkdir(parents=True, exist_ok=True)
        base = tmp / "baselines"
        staged = [f for f in BASELINE_FILES if f in names]
        if staged:
            _git(root, "checkout-index", f"--prefix={base}/", "--", *staged)
            if prefix:  # checkout-index writes the path from the repository's top
                (base / "results").parent.mkdir(parents=True, exist_ok=True)
                (base / prefix / "results").rename(base / "results")
        real = results_dir(root)
        real.mkdir(parents=True, exist_ok=True)  # a re-proof writes its records there
        os.symlink(real, results_dir(folder), target_is_directory=True)
        os.environ["DSV4_LAB_CACHE"] = str(cache_dir(root).resolve())
        if not os.environ.get("DSV4_LAB_GIT"):
            os.environ["DSV4_LAB_GIT"] = _code_token(root)
        yield Snapshot(lab=root, folder=folder, baselines_root=base, files=tuple(tree))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        link = results_dir(tmp / "index" / prefix) if prefix else results_dir(tmp / "index")
        if link.is_symlink():
            link.unlink()  # never follow it into the real notebook
        shutil.rmtree(tmp, ignore_errors=True)
