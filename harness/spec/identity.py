"""Code identity of a result: git commit, dirty flag, and a hash of everything that can
change its verdict. A record is *stale* once that hash no longer matches the tree.

The source hash of (stage, arch) covers:
  * the arch's kernel module and the stage's oracle modules, every lab module they import
    (absolute or relative) transitively, and the `__init__.py` of every package on the way;
  * the lab's verdict code (`VERDICT_MODULES`: the modules that build, launch or judge a case or
    give a record its status) and what they import, transitively. Left out, because nothing they
    decide is stored in a record (tests/test_false_green.py holds this list to the code): the
    gate and baselines, and the receiving side of a remote run (its lines are checked by the
    channel and records.validate, both hashed);
  * where the stage's sources load code or data in a way imports do not show (importlib,
    `__import__`, exec / eval / compile, runpy, sys.path, a file opened: dynamic_uses), every
    file of the stage's folder, stages/common and the lab folder of such a load outside stages/;
    `check` warns of each such call;
  * the stage's stages.yaml entry as parsed, but for the title and the bench shapes.

Python files are hashed as their code without comments, trailing spaces and blank lines (cut by
the tokenizer, so the hash is the same under every Python version): a comment change keeps
results fresh, any change to code, strings or indentation does not. A file that does not
tokenize is hashed byte for byte. Nothing here imports torch or CuTeDSL."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import stat
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from harness.spec.codetext import code_text
from harness.spec.spec import Stage, module_file

HASH_LEN = 12
HASH_SCHEME = 5  # bump when what the hash covers changes

HARNESS_DIR = Path(__file__).resolve().parents[1]  # harness/ (this file: harness/spec/identity.py)
# The lab modules in which a case is compiled, launched, compared and judged, and a record's
# status is given (what they import is followed: verdict_files).
VERDICT_MODULES = ("execution.compile", "execution.executor", "execution.worker", "execution.metrics",
                   "execution.pristine", "execution.runner", "execution.compilerun", "execution.bench",
                   "core.statuses", "notebook.records", "remote.channel", "remote.remote_side", "remote.slurm_run",
                   "execution.abbench", "execution.ncuprofile")  # bench --compare and profile record statuses too


def verdict_module_file(module: str) -> Path:
    """The file of a VERDICT_MODULES entry (dotted, under harness/); a missing one is an error,
    never a smaller hash."""
    path = HARNESS_DIR.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        raise FileNotFoundError(f"harness/spec/identity.py: VERDICT_MODULES names {module}, which is not "
                                f"{path.relative_to(HARNESS_DIR.parent)} — update the list")
    return path

@lru_cache(maxsize=1024)
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    """A digest of one file: its code without comments and blank lines (Python), or its bytes
    (anything else, or Python that does not tokenize)."""
    if path.suffix != ".py":  # a data file (a dynamic load's fallback folder) may be large: read in pieces
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for piece in iter(lambda: fh.read(1 << 20), b""):
                h.update(piece)
        return "b" + h.hexdigest()
    data = path.read_bytes()
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
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module | None:
    """`path` parsed (None: not Python that parses)."""
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return None


@lru_cache(maxsize=1024)
def _imported_names(path: Path, mtime_ns: int, size: int, package: str) -> tuple[str, ...]:
    """Absolute names of every module `path` may import (relative ones against `package`), with
        `pkg.name` for `from pkg import name`."""
    tree = _parsed(path, mtime_ns, size)
    if tree is None:
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


# Calls whose code or data cannot be followed by reading imports: a module named at run time,
# code run from text or a path, a changed module search path, a file read.
DYNAMIC_NAMES = {"__import__", "exec", "eval", "compile", "open", "import_module", "run_path", "run_module",
                 "execfile", "spec_from_file_location", "SourceFileLoader"}
DYNAMIC_ATTRS = {"import_module", "run_path", "run_module", "spec_from_file_location", "spec_from_loader",
                 "exec_module", "load_module", "module_from_spec", "SourceFileLoader", "reload", "read_text",
                 "read_bytes", "open", "fromfile", "loadtxt", "genfromtxt", "memmap", "load_file"}
LOADERS = {"torch", "np", "numpy", "pickle", "json", "yaml", "marshal", "dill", "joblib", "safetensors"}
MAX_FOLDER_FILES = 10_000  # a fallback folder with more is hashed this far (sorted), and says so


@dataclass(frozen=True)
class DynamicUse:
    """A call in a stage's or oracle's source whose code or data the hash cannot follow."""

    path: Path
    line: int
    call: str


def _dotted_name(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # an AST unparse cannot print: still a dynamic use
        return "?"


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("path", "meta_path", "path_hooks")
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


@lru_cache(maxsize=1024)
def _dynamic_calls(path: Path, mtime_ns: int, size: int) -> tuple[tuple[int, str], ...]:
    """(line, call) of every dynamic load in `path`: importlib / __import__ / exec / eval /
    compile / runpy, a change to sys.path, a file opened or read."""
    tree = _parsed(path, mtime_ns, size)
    if tree is None:
        return ()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            hit = ((isinstance(f, ast.Name) and f.id in DYNAMIC_NAMES)
                   or (isinstance(f, ast.Attribute) and (f.attr in DYNAMIC_ATTRS or _is_sys_path(f.value)
                                                         or (f.attr in ("load", "loads") and isinstance(f.value, ast.Name)
                                                             and f.value.id in LOADERS))))
            if hit:
                found.append((node.lineno, _dotted_name(f) + "()"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if _is_sys_path(base):
                    found.append((node.lineno, f"{_dotted_name(base)} changed"))
    return tuple(sorted(set(found)))


def dynamic_uses(root: Path, stage: Stage, arch: str) -> list[DynamicUse]:
    """Every dynamic load in the stage's followed sources for `arch` (kernel, oracles and what
    they import): code or data the import graph does not reach."""
    return _dynamic_in(_followed(root.resolve(), stage, arch))


def _dynamic_in(files: list[Path]) -> list[DynamicUse]:
    out = []
    for path in files:
        if HARNESS_DIR in path.parents:  # the lab's own code (its peers load adapters by name): not the stage's
            continue
        if path.suffix == ".py" and path.is_file():
            st = path.stat()
            out += [DynamicUse(path, line, call) for line, call in _dynamic_calls(path, st.st_mtime_ns, st.st_size)]
    return out


def fallback_folders(root: Path, stage: Stage, uses: list[DynamicUse]) -> list[Path]:
    """Where dynamically loaded code may live: the stage's folder and stages/common, and for a load
        outside stages/ the lab folder holding it."""
    root = root.resolve()
    folders = {stage.dir.resolve(), root / "stages" / "common"}
    for use in uses:
        try:
            rel = use.path.resolve().relative_to(root)
        except ValueError:  # outside the lab: nothing of the lab's to add
            continue
        if len(rel.parts) > 1 and rel.parts[0] != "stages":
            folders.add(root / rel.parts[0])
        elif len(rel.parts) > 2:  # stages/<other>/…: that stage folder too
            folders.add(root / rel.parts[0] / rel.parts[1])
    return sorted(f for f in folders if f.is_dir() and root in f.parents)


def folder_files(folder: Path) -> list[Path]:
    """Every regular file under `folder` (data files too), caches and symlinks left out, sorted."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if name.endswith((".pyc", ".pyo")) or name.startswith("."):
                continue
            try:
                if stat.S_ISREG(p.lstat().st_mode):  # a FIFO or device would hang the read; a link may leave the lab
                    out.append(p)
            except OSError:
                continue
        if len(out) >= MAX_FOLDER_FILES:
            break
    return sorted(out)[:MAX_FOLDER_FILES]


def _followed(root: Path, stage: Stage, arch: str) -> list[Path]:
    return follow_imports(root, [stage.kernels[arch].path, *stage.oracle_files()])


def source_files(root: Path, stage: Stage, arch: str) -> list[Path]:
    """The stage's files for `arch`: kernel module, oracles, what they import, and where any loads
        code or data dynamically, every file of the folders it may come from (fallback_folders)."""
    root = root.resolve()
    files = _followed(root, stage, arch)
    uses = _dynamic_in(files)
    if not uses:
        return files
    extra = [p.resolve() for folder in fallback_folders(root, stage, uses) for p in folder_files(folder)]
    return sorted(set(files) | set(extra))


_verdict_memo: dict[tuple, list[Path]] = {}


def verdict_files() -> list[Path]:
    """The lab's own code that compiles, runs and judges a case (and what it imports).
    Remembered while no file of the harness changed (size and mtime)."""
    base = HARNESS_DIR.parent
    try:
        key = (HARNESS_DIR, tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                                         for p in HARNESS_DIR.rglob("*.py"))))
    except OSError:  # a file went while listing: no memo
        key = None
    if key is not None and key in _verdict_memo:
        return list(_verdict_memo[key])
    start = [verdict_module_file(m) for m in VERDICT_MODULES]
    files = [p for p in follow_imports(base, start) if HARNESS_DIR in p.parents]
    if key is not None:
        _verdict_memo.clear()
        _verdict_memo[key] = files
    return list(files)


def stage_entry(stage: Stage, arch: str) -> dict:
    """The verdict-deciding part of a stage's stages.yaml entry, in canonical form."""
    k = stage.kernels[arch]
    refs = {n: str(r) for n, r in (("tensors", stage.tensors), ("inputs", stage.inputs), ("oracle", stage.oracle),
                                   ("flops", stage.flops), ("peer", stage.peer), ("decode", stage.decode))
            if r is not None}
    return {
        "kernel": [k.module, k.entry], "refs": refs,
        "matrix": {a: [repr(v) for v in vals] for a, vals in stage.matrix.items()},
        "kernel_params": list(stage.kernel_params),
        "tolerances": {o: [t.cosine_min, t.rel_l2_max, t.max_abs_max]  # with `by:` bounds, those too
                       + [[b.axis, repr(b.value), [list(x) for x in b.bounds]] for b in t.by]
                       for o, t in stage.tolerances.items()},
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
    """{"commit": short sha or None, "dirty": bool}; a copy without .git takes DSV4_LAB_GIT="<sha>:<0|1>"."""
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
