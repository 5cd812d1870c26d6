"""Code identity of a result: git commit, dirty flag, and a hash of the sources a stage's
kernel for one arch depends on. A record is *stale* once that hash no longer matches the tree.

The source hash of (stage, arch) covers: the arch's kernel module, every other file of the
stage folder except the other archs' kernel modules, the stages/common modules those files
import, and the oracle modules the stage uses. Nothing here imports torch or CuTeDSL.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from harness.spec import Stage

HASH_LEN = 12


def _hash_files(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(set(files)):
        h.update(str(f.relative_to(root)).encode())
        h.update(b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:HASH_LEN]


def _lab_imports(root: Path, files: list[Path]) -> list[Path]:
    """The lab's own modules (`stages.*`, `oracles.*`) that `files` import, followed
    transitively."""
    seen: set[Path] = set()
    todo = [f for f in files if f.suffix == ".py"]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if not name.startswith(("stages.", "oracles.")):
                    continue
                path = root / Path(*name.split(".")).with_suffix(".py")
                if path.is_file() and path not in seen:
                    seen.add(path)
                    todo.append(path)
    return sorted(seen)


def source_files(root: Path, stage: Stage, arch: str) -> list[Path]:
    kernel = stage.kernels[arch].path
    files = [kernel, *stage.oracle_files()]
    init = kernel.parent / "__init__.py"
    if init.is_file():
        files.append(init)
    files += _lab_imports(root, files)
    return sorted(set(files))


def source_hash(root: Path, stage: Stage, arch: str) -> str:
    return _hash_files(root, source_files(root, stage, arch))


@lru_cache(maxsize=4)
def git_state(root: Path) -> dict:
    """{"commit": short sha or None, "dirty": bool}. A copy without .git (e.g. on a remote
    target) takes the state its sender passed in DSV4_LAB_GIT="<sha>:<0|1>"."""
    sent = os.environ.get("DSV4_LAB_GIT")
    if sent:
        sha, _, dirty = sent.partition(":")
        return {"commit": sha or None, "dirty": dirty == "1"}
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=normal", "--", ".", ":(exclude)results"],
            cwd=root, capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": True}
    return {"commit": sha, "dirty": bool(status.strip())}


def code_identity(root: Path, stage: Stage, arch: str) -> dict:
    return {**git_state(root), "src": source_hash(root, stage, arch)}
