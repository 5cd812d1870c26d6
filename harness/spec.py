"""stages.yaml: load, validate, and expose every stage as typed dataclasses.

Validation never imports a kernel or an oracle (that would pull in torch and CuTeDSL): a
module reference is checked by finding its file under the lab root, and a function or class
by parsing that file. Every problem is one `SpecError` whose text names the file, the line,
the key and the fix.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import Node, ScalarNode, SequenceNode

from harness.yamlnodes import TOP, NodeContext, kind as _kind, mapping as _mapping, scalar as _scalar

SCHEMA_VERSION = 1

# stages.yaml names archs by short key; the compiler by target name.
ARCHS: dict[str, str] = {"sm90": "sm_90a", "sm100": "sm_100a", "cpu": "cpu"}
# "cpu" is for the lab's own tests: a plain-Python kernel run on the CPU by the same runner.
ARCH_KEYS: dict[str, str] = {v: k for k, v in ARCHS.items()}

TOLERANCE_KEYS = {"cosine_min", "rel_l2_max", "max_abs_max"}


class SpecError(Exception):
    """A problem in a spec file, already phrased as one line: `file:line: key: problem`."""


@dataclass(frozen=True)
class FuncRef:
    """`package.module:name`, resolved to a file under the lab root."""

    module: str
    name: str
    path: Path

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass(frozen=True)
class KernelRef:
    arch: str  # compiler target, e.g. "sm_90a"
    module: str
    entry: str
    path: Path


@dataclass(frozen=True)
class Tolerance:
    cosine_min: float | None = None
    rel_l2_max: float | None = None
    max_abs_max: float | None = None


@dataclass(frozen=True)
class Stage:
    id: str
    title: str
    dir: Path
    kernels: dict[str, KernelRef]  # by arch target
    tensors: FuncRef
    inputs: FuncRef
    oracle: FuncRef
    flops: FuncRef | None
    peer: FuncRef | None
    matrix: dict[str, list[Any]]
    kernel_params: tuple[str, ...]
    tolerances: dict[str, Tolerance]
    timeout_s: float
    bench: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    @property
    def name(self) -> str:
        return f"stage-{self.id}"

    def oracle_files(self) -> list[Path]:
        refs = [self.tensors, self.inputs, self.oracle] + [r for r in (self.flops, self.peer) if r]
        return sorted({r.path for r in refs})


@dataclass(frozen=True)
class Spec:
    path: Path
    root: Path
    stages: dict[str, Stage]

    def stage(self, name: str) -> Stage:
        sid = normalize_stage_name(name)
        if sid not in self.stages:
            known = ", ".join(self.stages) or "none"
            raise SpecError(f"{self.path.name}: no stage '{name}' (known: {known})")
        return self.stages[sid]


def normalize_stage_name(name: str) -> str:
    """`stage-D1`, `stage_d1`, `D1` and `d1` all name stage D1."""
    s = name.strip()
    for prefix in ("stage-", "stage_", "stage"):
        if s.lower().startswith(prefix):
            s = s[len(prefix):]
            break
    return s.upper()


# ---------------------------------------------------------------------------------------
# Node-level helpers: every check knows the line of what it checks.


class _Ctx(NodeContext):
    """Reading stages.yaml: module references resolve under the lab root."""

    def __init__(self, path: Path, root: Path):
        super().__init__(path.name, SpecError)
        self.root = root


def _typed(ctx: _Ctx, node: Node, key: str, types: tuple[type, ...], what: str) -> Any:
    if not isinstance(node, ScalarNode):
        raise ctx.fail(node, key, f"expected {what}, got {_kind(node)}")
    value = _scalar(node)
    if isinstance(value, bool) and bool not in types:
        raise ctx.fail(node, key, f"expected {what}, got {value!r}")
    if not isinstance(value, types):
        raise ctx.fail(node, key, f"expected {what}, got {_kind(node)}")
    return value


def _check_keys(ctx: _Ctx, pairs, key: str, allowed: set[str], required: set[str], node: Node):
    names = {str(_scalar(k)): k for k, _ in pairs}
    for name, knode in names.items():
        if name not in allowed:
            raise ctx.fail(
                knode, f"{key}.{name}" if key else name,
                f"unknown key — allowed: {', '.join(sorted(allowed))}",
            )
    for name in sorted(required):
        if name not in names:
            raise ctx.fail(node, f"{key}.{name}" if key else name, "missing required key — add it")


def _module_file(root: Path, module: str) -> Path | None:
    rel = Path(*module.split("."))
    for cand in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
    return False


def _resolve(ctx: _Ctx, node: Node, key: str, module: str, name: str,
             name_at: tuple[Node, str] | None = None) -> Path:
    """The file of `module`, which must define `name`. An undefined name is blamed on
    `name_at` (its node and key) when the name has a key of its own."""
    path = _module_file(ctx.root, module)
    if path is None:
        raise ctx.fail(node, key, f"module '{module}' not found under {ctx.root} — check the dotted path")
    try:
        found = _defines(path, name)
    except SyntaxError as exc:
        raise ctx.fail(node, key, f"{path.relative_to(ctx.root)} does not parse: line {exc.lineno}: {exc.msg}")
    if not found:
        node, key = name_at or (node, key)
        raise ctx.fail(node, key, f"'{name}' is not defined in {path.relative_to(ctx.root)} — check the name")
    return path


def _func_ref(ctx: _Ctx, node: Node, key: str) -> FuncRef:
    text = _typed(ctx, node, key, (str,), "'package.module:function'")
    if text.count(":") != 1 or not all(text.split(":")):
        raise ctx.fail(node, key, f"expected 'package.module:function', got {text!r}")
    module, name = text.split(":")
    return FuncRef(module, name, _resolve(ctx, node, key, module, name))


# ---------------------------------------------------------------------------------------

STAGE_KEYS = {
    "title", "dir", "kernels", "tensors", "inputs", "oracle", "flops", "peer", "matrix",
    "kernel_params", "tolerances", "timeout_s", "bench",
}
STAGE_REQUIRED = {"title", "dir", "kernels", "tensors", "inputs", "oracle", "matrix", "tolerances"}


def _parse_stage(ctx: _Ctx, sid: str, node: Node, key_node: Node) -> Stage:
    key = f"stages.{sid}"
    pairs = _mapping(ctx, node, key)
    _check_keys(ctx, pairs, key, STAGE_KEYS, STAGE_REQUIRED, key_node)
    f = {str(_scalar(k)): v for k, v in pairs}

    title = _typed(ctx, f["title"], f"{key}.title", (str,), "a string")
    dir_text = _typed(ctx, f["dir"], f"{key}.dir", (str,), "a folder path")
    stage_dir = ctx.root / dir_text
    if not stage_dir.is_dir():
        raise ctx.fail(f["dir"], f"{key}.dir", f"folder '{dir_text}' does not exist — create it or fix the path")

    kernels: dict[str, KernelRef] = {}
    kpairs = _mapping(ctx, f["kernels"], f"{key}.kernels")
    if not kpairs:
        raise ctx.fail(f["kernels"], f"{key}.kernels", "no kernels — declare sm90 and/or sm100")
    for knode, vnode in kpairs:
        akey = str(_scalar(knode))
        kk = f"{key}.kernels.{akey}"
        if akey not in ARCHS:
            raise ctx.fail(knode, kk, f"unknown arch — use one of {', '.join(ARCHS)}")
        vpairs = _mapping(ctx, vnode, kk)
        _check_keys(ctx, vpairs, kk, {"module", "entry"}, {"module"}, vnode)
        v = {str(_scalar(a)): b for a, b in vpairs}
        module = _typed(ctx, v["module"], f"{kk}.module", (str,), "a dotted module path")
        entry = _typed(ctx, v["entry"], f"{kk}.entry", (str,), "a class name") if "entry" in v else "Kernel"
        path = _resolve(ctx, v["module"], f"{kk}.module", module, entry,
                        (v["entry"], f"{kk}.entry") if "entry" in v else None)
        kernels[ARCHS[akey]] = KernelRef(ARCHS[akey], module, entry, path)

    refs = {
        name: _func_ref(ctx, f[name], f"{key}.{name}")
        for name in ("tensors", "inputs", "oracle", "flops", "peer") if name in f
    }

    matrix: dict[str, list[Any]] = {}
    mpairs = _mapping(ctx, f["matrix"], f"{key}.matrix")
    if not mpairs:
        raise ctx.fail(f["matrix"], f"{key}.matrix", "empty matrix — give at least one axis with values")
    for anode, vnode in mpairs:
        axis = str(_scalar(anode))
        ak = f"{key}.matrix.{axis}"
        if not axis.isidentifier():
            raise ctx.fail(anode, ak, "axis names must be identifiers (used as --flags)")
        if not isinstance(vnode, SequenceNode):
            raise ctx.fail(vnode, ak, f"expected a list of values, got {_kind(vnode)}")
        if not vnode.value:
            raise ctx.fail(vnode, ak, "empty list — give at least one value")
        values = [_typed(ctx, item, ak, (int, str, bool, float), "a scalar") for item in vnode.value]
        if len(set(values)) != len(values):
            raise ctx.fail(vnode, ak, "repeated value — list each value once")
        matrix[axis] = values

    kernel_params: tuple[str, ...] = tuple(matrix)
    if "kernel_params" in f:
        node_kp = f["kernel_params"]
        if not isinstance(node_kp, SequenceNode):
            raise ctx.fail(node_kp, f"{key}.kernel_params", f"expected a list of axis names, got {_kind(node_kp)}")
        kernel_params = tuple(_typed(ctx, n, f"{key}.kernel_params", (str,), "an axis name") for n in node_kp.value)
        for name, n in zip(kernel_params, node_kp.value):
            if name not in matrix:
                raise ctx.fail(n, f"{key}.kernel_params", f"'{name}' is not a matrix axis ({', '.join(matrix)})")

    tolerances: dict[str, Tolerance] = {}
    tpairs = _mapping(ctx, f["tolerances"], f"{key}.tolerances")
    if not tpairs:
        raise ctx.fail(f["tolerances"], f"{key}.tolerances", "no outputs — give each output's tolerances")
    for onode, vnode in tpairs:
        out = str(_scalar(onode))
        ok = f"{key}.tolerances.{out}"
        vpairs = _mapping(ctx, vnode, ok)
        _check_keys(ctx, vpairs, ok, TOLERANCE_KEYS, set(), vnode)
        if not vpairs:
            raise ctx.fail(vnode, ok, f"no bounds — give one of {', '.join(sorted(TOLERANCE_KEYS))}")
        vals = {
            str(_scalar(a)): float(_typed(ctx, b, f"{ok}.{_scalar(a)}", (int, float), "a number"))
            for a, b in vpairs
        }
        tolerances[out] = Tolerance(**vals)

    timeout_s = 120.0
    if "timeout_s" in f:
        timeout_s = float(_typed(ctx, f["timeout_s"], f"{key}.timeout_s", (int, float), "seconds"))
        if timeout_s <= 0:
            raise ctx.fail(f["timeout_s"], f"{key}.timeout_s", "must be positive")

    bench: dict[str, Any] = {}
    if "bench" in f:
        bpairs = _mapping(ctx, f["bench"], f"{key}.bench")
        for anode, vnode in bpairs:
            axis = str(_scalar(anode))
            if axis not in matrix:
                raise ctx.fail(anode, f"{key}.bench.{axis}", f"not a matrix axis ({', '.join(matrix)})")
            value = _typed(ctx, vnode, f"{key}.bench.{axis}", (int, str, bool, float), "a scalar")
            if value not in matrix[axis]:
                raise ctx.fail(vnode, f"{key}.bench.{axis}", f"{value!r} is not in the matrix {matrix[axis]}")
            bench[axis] = value

    return Stage(
        id=sid, title=title, dir=stage_dir, kernels=kernels,
        tensors=refs["tensors"], inputs=refs["inputs"], oracle=refs["oracle"], flops=refs.get("flops"), peer=refs.get("peer"),
        matrix=matrix, kernel_params=kernel_params, tolerances=tolerances, timeout_s=timeout_s,
        bench=bench, line=node.start_mark.line + 1,
    )


def load_spec(path: Path | None = None, root: Path | None = None) -> Spec:
    """Load and validate stages.yaml. Raises SpecError (one line) on any problem."""
    from harness.paths import SPEC_NAME, lab_root

    root = (root or (path.parent if path else lab_root())).resolve()
    path = path or root / SPEC_NAME
    ctx = _Ctx(path, root)
    if not path.is_file():
        raise SpecError(f"{path}: not found — run from the lab folder or set DSV4_LAB_ROOT")
    try:
        doc = yaml.compose(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path.name}:{line}: not valid YAML: {problem}")
    if doc is None:
        raise SpecError(f"{path.name}:1: empty file — declare 'version: {SCHEMA_VERSION}' and 'stages:'")
    pairs = _mapping(ctx, doc, TOP)
    _check_keys(ctx, pairs, "", {"version", "stages"}, {"version", "stages"}, doc)
    top = {str(_scalar(k)): v for k, v in pairs}
    version = _typed(ctx, top["version"], "version", (int,), "an integer")
    if version != SCHEMA_VERSION:
        raise ctx.fail(top["version"], "version", f"unsupported version {version} — this lab reads {SCHEMA_VERSION}")
    stages: dict[str, Stage] = {}
    for knode, vnode in _mapping(ctx, top["stages"], "stages"):
        raw = str(_scalar(knode))
        sid = normalize_stage_name(raw)
        if not sid or not sid.replace("_", "").isalnum():
            raise ctx.fail(knode, f"stages.{raw}", "stage ids are short names like A or D1")
        stages[sid] = _parse_stage(ctx, sid, vnode, knode)
    if not stages:
        raise ctx.fail(top["stages"], "stages", "no stages declared")
    return Spec(path=path, root=root, stages=stages)
