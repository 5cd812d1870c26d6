"""Code identity of a result: git commit, dirty flag, and a hash of everything that can
change its verdict. A record is *stale* once that hash no longer matches the tree.

The source hash of (stage, arch) covers:
  * the arch's kernel module and the stage's oracle modules (tensors, inputs, oracle, flops,
    peer), every lab module they import — absolute (`stages.common.x`, `oracles.y`, any module
    found under the lab root) or relative (`from .helper import X`, `from . import helper`) —
    followed transitively, and the `__init__.py` of every package on the way (importing a
    module runs them);
  * the lab's own verdict code: every module that builds, launches or judges a case or gives a
    record its status (`VERDICT_MODULES`: compile, worker, metrics, pristine, runner, compilerun,
    bench, statuses, records, and a remote run's channel and sending side) and the lab modules
    they import, transitively — so a change to how outputs are compared, how a verdict is
    applied or what counts as failing makes every result stale. Left out, because nothing they
    decide is stored in a record (tests/test_false_green.py holds this list to the code): the
    gate and baselines (they compare records with baselines afresh at every call) and the
    receiving side of a remote run (its exit code; the lines it writes are checked by the
    channel and records.validate, both hashed);
  * the stage's stages.yaml entry as parsed (kernels, oracle references, matrix, kernel
    parameters, tolerances, timeout) — loosening a tolerance makes its results stale; the
    title and the bench shapes do not decide a verdict and are left out.

Python files are hashed as their code without comments, trailing spaces and blank lines (the
comments found by the tokenizer, cut from the text itself, so the hash is the same under every
Python version), so a change to a comment or to blank lines keeps results fresh while any change
to code, strings or indentation does not. A file that does not tokenize is hashed byte for byte.
Nothing here imports torch or CuTeDSL.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from harness.codetext import code_text
from harness.spec import Stage, module_file

HASH_LEN = 12
HASH_SCHEME = 4  # bump when what the hash covers changes

HARNESS_DIR = Path(__file__).resolve().parent
# The lab modules in which a case is compiled, launched, compared and judged, and a record's
# status is given (what they import is followed: verdict_files).
VERDICT_MODULES = ("compile", "worker", "metrics", "pristine", "runner", "compilerun", "bench", "statuses",
                   "records", "channel", "remote_side")

@lru_cache(maxsize=1024)
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    """A digest of one file: its code without comments and blank lines (Python), or its bytes
    (anything else, or Python that does not tokenize)."""
    data = path.read_bytes()
    if path.suffix == ".py":
        try:
            return "c" + hashlib.sha256(code_text(data)).hexdigest()
        except ValueError:
            pass
    return "b" + hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    st = path.stat()
    return _file_digest(path, st.st_mtime_ns, st.st_size)


def _package_inits(base: Path, path: Path) -> list[Path]:
    """The `__init__.py` files of the packages that contain `path`, up to `base`."""
    out = []
    folder = path.parent
    while folder != base and base in folder.parents:
        init = folder / "__init__.py"
        if init.is_file():
            out.append(init)
        folder = folder.parent
    return out


def _module_name(base: Path, path: Path) -> str:
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1024)
def _imported_names(path: Path, mtime_ns: int, size: int, package: str) -> tuple[str, ...]:
    """Absolute names of every module `path` may import (relative ones resolved against
    `package`), including `pkg.name` for `from pkg import name` (name may be a module)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                parts = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod:
                names.append(mod)
            names += [f"{mod}.{a.name}" if mod else a.name for a in node.names if a.name != "*"]
    return tuple(names)


def follow_imports(base: Path, files: list[Path]) -> list[Path]:
    """`files`, every module under `base` they import (transitively), and the package
    `__init__.py` files on the way."""
    seen: set[Path] = set()
    todo = [f.resolve() for f in files]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.suffix != ".py" or base not in path.parents:
            continue
        todo += [p for p in _package_inits(base, path) if p not in seen]
        name = _module_name(base, path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        st = path.stat()
        for mod in _imported_names(path, st.st_mtime_ns, st.st_size, package):
            found = module_file(base, mod)
            if found is not None and found.resolve() not in seen:
                todo.append(found.resolve())
    return sorted(seen)


def source_files(root: Path, stage: Stage, arch: str) -> list[Path]:
    """The stage's own files for `arch`: kernel module, oracles, and what they import."""
    root = root.resolve()
    return follow_imports(root, [stage.kernels[arch].path, *stage.oracle_files()])


def verdict_files() -> list[Path]:
    """The lab's own code that compiles, runs and judges a case (and what it imports)."""
    base = HARNESS_DIR.parent
    start = [HARNESS_DIR / f"{m}.py" for m in VERDICT_MODULES if (HARNESS_DIR / f"{m}.py").is_file()]
    return [p for p in follow_imports(base, start) if HARNESS_DIR in p.parents]


def stage_entry(stage: Stage, arch: str) -> dict:
    """The verdict-deciding part of a stage's stages.yaml entry, in canonical form."""
    k = stage.kernels[arch]
    refs = {n: str(r) for n, r in (("tensors", stage.tensors), ("inputs", stage.inputs), ("oracle", stage.oracle),
                                   ("flops", stage.flops), ("peer", stage.peer)) if r is not None}
    return {
        "kernel": [k.module, k.entry], "refs": refs,
        "matrix": {a: [repr(v) for v in vals] for a, vals in stage.matrix.items()},
        "kernel_params": list(stage.kernel_params),
        "tolerances": {o: [t.cosine_min, t.rel_l2_max, t.max_abs_max] for o, t in stage.tolerances.items()},
        "timeout_s": stage.timeout_s,
    }


def source_hash(root: Path, stage: Stage, arch: str) -> str:
    root = root.resolve()
    h = hashlib.sha256(f"scheme {HASH_SCHEME}\x00".encode())
    lab_files = [("lab", p, root) for p in source_files(root, stage, arch)]
    harness_files = [("harness", p, HARNESS_DIR.parent) for p in verdict_files()]
    for kind, path, base in sorted(set(lab_files + harness_files)):
        h.update(f"{kind}:{path.relative_to(base).as_posix()}\x00{file_digest(path)}\x00".encode())
    h.update(json.dumps(stage_entry(stage, arch), sort_keys=True).encode())
    return h.hexdigest()[:HASH_LEN]


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
