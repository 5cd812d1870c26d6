"""stages.yaml: load, validate, and expose every stage as typed dataclasses.

Validation never imports a kernel or an oracle (that would pull in torch and CuTeDSL): a
module reference is checked by finding its file under the lab root, and a function or class
by parsing that file. Every problem is one `SpecError` whose text names the file, the line,
the key and the fix.
"""

from __future__ import annotations

import ast
import io
import itertools
import keyword
import math
import re
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from yaml.nodes import Node, ScalarNode, SequenceNode

from harness.core.labels import value_text
from harness.core.optionnames import RESERVED_AXES  # axis names the command line takes for its own options
from harness.peers import PEER_NAMES, PROBLEMS
from harness.core.yamlnodes import TOP, NodeContext, kind as _kind, mapping as _mapping, one_line, read_file
from harness.core.yamlnodes import scalar as _scalar

SCHEMA_VERSION = 1

# The most cases one stage's matrix may have: expanding more would take gigabytes before the first
# case runs. harness/spec/matrix.py refuses the same limit after filters.
MAX_CASES = 100_000
MAX_TIMEOUT_S = 86_400.0  # a case that needs more than a day is a hang
MAX_STAGE_ID = 32  # characters; a stage id names files (results/records/stage-ID.jsonl)

# stages.yaml names archs by short key; the compiler by target name.
ARCHS: dict[str, str] = {"sm90": "sm_90a", "sm100": "sm_100a", "cpu": "cpu"}
# "cpu" is for the lab's own tests: a plain-Python kernel run on the CPU by the same runner.
ARCH_KEYS: dict[str, str] = {v: k for k, v in ARCHS.items()}

TOLERANCE_KEYS = {"cosine_min", "rel_l2_max", "max_abs_max"}
# Each tolerance's range: (lowest, highest, lowest excluded); None is unbounded (but finite).
# A cosine of 0 or below, or a relative error above 1 (as wrong as an output of zeros), holds nothing.
TOLERANCE_RANGES: dict[str, tuple[float, float | None, bool]] = {
    "cosine_min": (0.0, 1.0, True), "rel_l2_max": (0.0, 1.0, False), "max_abs_max": (0.0, None, False),
}
# An output's bounds must constrain: cosine_min at least this, or rel_l2_max at most this (max_abs_max
# alone does not count: its scale is the output's). `a - b` for `a + b` (cosine ~0, rel_l2 ~1) fails both.
COSINE_MIN_FLOOR = 0.9
REL_L2_MAX_CEILING = 0.5

_FILTER_CHARS = set(",=|")  # they separate filters (`--where hd=64|128,n=256`) and case labels
_NONE = object()


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
class ToleranceBy:
    """One entry of an output's `by:` block: the bounds that replace the output's own for the
    cases whose `axis` has `value` (e.g. logits_dtype bf16: {rel_l2_max: 2.0e-3})."""

    axis: str
    value: Any
    bounds: tuple[tuple[str, float], ...]  # (metric, bound): keys of TOLERANCE_KEYS


@dataclass(frozen=True)
class Tolerance:
    cosine_min: float | None = None
    rel_l2_max: float | None = None
    max_abs_max: float | None = None
    suite: bool = False  # a suite stage's output: its criterion's verdict must be there and say ok
    by: tuple[ToleranceBy, ...] = ()  # per axis value bounds (`by:`), laid over these in order by `at`

    def at(self, case: dict[str, Any]) -> Tolerance:
        """The bounds that judge `case`: these, with each matching `by` entry's bounds laid over them (a
                later entry over an earlier)."""
        t = replace(self, by=())
        for b in self.by:
            v = case.get(b.axis, _NONE)
            if type(v) is type(b.value) and v == b.value:  # 1 is not true, nor 1.0
                t = replace(t, **dict(b.bounds))
        return t


@dataclass(frozen=True)
class SuiteRef:
    """A suite stage's `suite:` block: the function listing its cases and the upstream pass rule
    (oracles/suites/, docs/SUITES.md)."""

    cases: FuncRef
    criterion: FuncRef


MAX_BENCH_CASES = 80  # bench shapes per stage: each is compiled and timed against every peer (E: 76, issue 33 item 3)
BENCH_KEYS = {"matrix", "more", "beside", "peers", "problem", "check_rows", "row_axis", "case", "peak", "open_axes",
              "speed_tolerance"}
PEAKS = ("bf16", "fp8")


@dataclass(frozen=True)
class BenchPlan:
    """A stage's `bench:` block: the realistic shapes `dsv4-lab bench` times.  `matrix` holds every
        stage axis (one left out takes the test matrix's first value); numbers may lie outside the
        test matrix, booleans may not, words only on the axes `open_axes` names (shape names the
        stage's tensors() judge).  `more`: further matrices of the same kind.  `beside`: (axis,
        value) pairs — for each, a shape with another value is shown beside its twin with this one."""

    matrix: dict[str, list[Any]]
    peers: tuple[str, ...] = ()
    problem: str | None = None  # what the tensors mean to a peer (harness.peers.PROBLEMS)
    check_rows: int = 256  # rows of the output checked against the oracle before timing
    row_axis: str | None = None  # the axis whose rows are independent (None: check the whole output)
    peak: str = "bf16"  # which calibrated compute peak the roofline uses
    open_axes: tuple[str, ...] = ()  # word axes whose bench words need not be test words
    line: int = 0
    more: tuple[dict[str, list[Any]], ...] = ()  # further bench matrices (their shapes appended)
    beside: tuple[tuple[str, Any], ...] = ()  # (axis, value) pairs: the shape every other value is shown beside
    # `bench --compare` and `gate --speed`: a slowdown beyond this fraction (with its interval
    # excluding no change) is a regression (harness/execution/abtest.py; docs/BENCH.md)
    speed_tolerance: float = 0.03


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
    bench: dict[str, Any] = field(default_factory=dict)  # the test case `run --bench` times ({}: every case)
    line: int = 0
    bench_plan: BenchPlan | None = None  # the bench block's shapes and peers (`dsv4-lab bench`)
    suite: SuiteRef | None = None  # a suite stage: a peer's own case list and pass rule (docs/SUITES.md)
    cases: tuple[tuple[tuple[str, Any], ...], ...] | None = None  # a suite stage's cases, or a matrix with `more:` (its matrix: their values)
    decode: FuncRef | None = None  # decode(outputs, case) -> the outputs compared (the kernel writes another form)

    @property
    def name(self) -> str:
        return f"stage-{self.id}"

    def tolerances_for(self, case: dict[str, Any]) -> dict[str, Tolerance]:
        """Each output's bounds for `case` (its `by:` entries applied: Tolerance.at) — what judges it."""
        return {out: tol.at(case) for out, tol in self.tolerances.items()}

    def oracle_files(self) -> list[Path]:
        refs = [self.tensors, self.inputs, self.oracle] + [r for r in (self.flops, self.peer, self.decode) if r]
        if self.suite:
            refs += [self.suite.cases, self.suite.criterion]
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
        raise ctx.fail(node, key, f"expected {what}, got {_kind(node)} — give {what}")
    value = _scalar(node)
    if isinstance(value, bool) and bool not in types:
        raise ctx.fail(node, key, f"expected {what}, got {value!r} — give {what}")
    if not isinstance(value, types):
        raise ctx.fail(node, key, f"expected {what}, got {_kind(node)} — give {what}")
    return value


def _text(ctx: _Ctx, node: Node, key: str, what: str) -> str:
    """A non-empty one-line string."""
    value = _typed(ctx, node, key, (str,), what)
    if not value.strip():
        raise ctx.fail(node, key, f"empty — give {what}")
    if not value.isprintable():
        raise ctx.fail(node, key, "contains a newline or control character — write it on one line")
    return value


def _number(ctx: _Ctx, node: Node, key: str, what: str, lo: float, hi: float | None,
            lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with lo_open): never NaN or infinite."""
    raw = _typed(ctx, node, key, (int, float), what)
    try:
        value = float(raw)
    except OverflowError:  # an integer of hundreds of digits
        value = math.inf
    if not math.isfinite(value):
        raise ctx.fail(node, key, f"{one_line(str(raw), 20)} is not a finite number — give {what}")
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        span = f"{'more than' if lo_open else 'at least'} {lo:g}" + (f" and at most {hi:g}" if hi is not None else "")
        raise ctx.fail(node, key, f"{value:g} is out of range — it must be {span}")
    return value


_DOTTED_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _identifier(name: str) -> bool:
    return bool(_DOTTED_PART.fullmatch(name)) and not keyword.iskeyword(name)


def _dotted(name: str) -> bool:
    """`stages.A_qk.sm90`: dotted Python identifiers, nothing relative (`.x`, `..x`, `a..b`)."""
    return all(_identifier(part) for part in name.split("."))


def _check_keys(ctx: _Ctx, pairs: list[tuple[Node, Node]], key: str, allowed: set[str], required: set[str],
                node: Node) -> None:
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


def module_file(root: Path, module: str) -> Path | None:
    """The file of dotted `module` under `root` (a module file or a package's __init__.py), or None."""
    rel = Path(*module.split("."))
    for cand in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _defines(path: Path, name: str) -> bool:
    """Whether the module file binds `name` at top level; SyntaxError (with the line) or ValueError for
        a file Python cannot parse."""
    source = path.read_bytes()
    if b"\0" in source:
        raise ValueError("contains a null byte")
    encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)  # SyntaxError: unknown encoding
    try:
        # The whole file must decode (Python itself lets bad bytes in a comment pass; the lab's other
        # readers of sources would not).
        text = source.decode(encoding)
    except UnicodeDecodeError as exc:
        err = SyntaxError(f"not {encoding} text (byte 0x{source[exc.start]:02x}) — save it as UTF-8")
        err.lineno = source[: exc.start].count(b"\n") + 1
        raise err from None
    tree = ast.parse(text, filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def _resolve(ctx: _Ctx, node: Node, key: str, module: str, name: str,
             name_at: tuple[Node, str] | None = None) -> Path:
    """The file of `module`, which must define `name`. An undefined name is blamed on
    `name_at` (its node and key) when the name has a key of its own."""
    if not _dotted(module):
        raise ctx.fail(node, key, f"{module!r} is not a dotted module path — write it like stages.A_qk.sm90 "
                                  "(identifiers joined by single dots, nothing relative)")
    if not _identifier(name):
        node, key = name_at or (node, key)
        raise ctx.fail(node, key, f"{name!r} is not a Python name — give the class or function name")
    path = module_file(ctx.root, module)
    if path is None:
        raise ctx.fail(node, key, f"module '{module}' not found under {ctx.root} — check the dotted path")
    rel = path.relative_to(ctx.root)
    try:
        found = _defines(path, name)
    except SyntaxError as exc:
        at = f"{rel}:{exc.lineno}" if exc.lineno else str(rel)
        fix = "" if " — " in str(exc.msg) else " — fix that file"
        raise ctx.fail(node, key, f"{at} does not parse: {exc.msg}{fix}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ctx.fail(node, key, f"{rel} does not parse: {exc} — fix that file")
    except (RecursionError, MemoryError):
        raise ctx.fail(node, key, f"{rel} does not parse: nested too deeply — fix that file")
    except OSError as exc:
        raise ctx.fail(node, key, f"{rel} cannot be read ({exc.strerror or exc}) — fix its permissions")
    if not found:
        node, key = name_at or (node, key)
        raise ctx.fail(node, key, f"'{name}' is not defined in {path.relative_to(ctx.root)} — check the name")
    return path


def _func_ref(ctx: _Ctx, node: Node, key: str) -> FuncRef:
    text = _text(ctx, node, key, "'package.module:function'")
    if text.count(":") != 1 or not all(text.split(":")):
        raise ctx.fail(node, key, f"expected 'package.module:function', got {one_line(repr(text), 80)} — write it "
                                  "like oracles.qk:reference")
    module, name = text.split(":")
    return FuncRef(module, name, _resolve(ctx, node, key, module, name))


# ---------------------------------------------------------------------------------------

STAGE_KEYS = {
    "title", "dir", "kernels", "tensors", "inputs", "oracle", "flops", "peer", "matrix",
    "kernel_params", "tolerances", "timeout_s", "bench", "suite", "more", "decode",
}
STAGE_REQUIRED = {"title", "dir", "kernels", "tensors", "inputs", "oracle", "tolerances"}  # and matrix or suite
SUITE_KEYS = {"cases", "criterion"}


def _parse_stage(ctx: _Ctx, sid: str, node: Node, key_node: Node) -> Stage:
    key = f"stages.{sid}"
    pairs = _mapping(ctx, node, key)
    _check_keys(ctx, pairs, key, STAGE_KEYS, STAGE_REQUIRED, key_node)
    f = {str(_scalar(k)): v for k, v in pairs}

    title = _text(ctx, f["title"], f"{key}.title", "a string")
    stage_dir = _stage_dir(ctx, f["dir"], f"{key}.dir")
    kernels = _kernels(ctx, f["kernels"], f"{key}.kernels")
    refs = {
        name: _func_ref(ctx, f[name], f"{key}.{name}")
        for name in ("tensors", "inputs", "oracle", "flops", "peer", "decode") if name in f
    }
    suite: SuiteRef | None = None
    cases: tuple | None = None
    if "suite" in f:
        if "matrix" in f:
            mnode = next(k for k, _ in pairs if str(_scalar(k)) == "matrix")
            raise ctx.fail(mnode, f"{key}.matrix", "a suite stage's cases come from suite.cases — remove matrix")
        if "bench" in f:
            bnode = next(k for k, _ in pairs if str(_scalar(k)) == "bench")
            raise ctx.fail(bnode, f"{key}.bench", "a suite stage is not benched — bench the stage it runs on")
        suite, matrix, cases = _suite(ctx, f["suite"], f"{key}.suite")
    elif "matrix" in f:
        matrix = _matrix(ctx, f["matrix"], f"{key}.matrix")
        if "more" in f:
            matrix, cases = _more(ctx, f["more"], f"{key}.more", matrix)
    else:
        raise ctx.fail(node, f"{key}.matrix", "missing required key — add it (or a suite: block)")

    kernel_params: tuple[str, ...] = tuple(matrix)
    if "kernel_params" in f:
        node_kp, kk = f["kernel_params"], f"{key}.kernel_params"
        if not isinstance(node_kp, SequenceNode):
            raise ctx.fail(node_kp, kk, f"expected a list of axis names, got {_kind(node_kp)} — e.g. [m, n, hd]")
        names: list[str] = []
        for n in node_kp.value:
            name = _typed(ctx, n, kk, (str,), "an axis name")
            if name not in matrix:
                raise ctx.fail(n, kk, f"'{name}' is not a matrix axis ({', '.join(matrix)}) — name one of those")
            if name in names:
                raise ctx.fail(n, kk, f"'{name}' is repeated — list each axis once")
            names.append(name)
        kernel_params = tuple(names)

    tolerances = _tolerances(ctx, f["tolerances"], f"{key}.tolerances", matrix)
    if suite is not None:  # every output is judged by the suite's criterion too
        tolerances = {k: replace(v, suite=True) for k, v in tolerances.items()}

    timeout_s = 120.0
    if "timeout_s" in f:
        timeout_s = _number(ctx, f["timeout_s"], f"{key}.timeout_s", "seconds", 0.0, MAX_TIMEOUT_S, lo_open=True)

    bench: dict[str, Any] = {}
    bench_plan: BenchPlan | None = None
    if "bench" in f:
        bench, bench_plan = _bench(ctx, f["bench"], f"{key}.bench", matrix)

    return Stage(
        id=sid, title=title, dir=stage_dir, kernels=kernels,
        tensors=refs["tensors"], inputs=refs["inputs"], oracle=refs["oracle"], flops=refs.get("flops"), peer=refs.get("peer"),
        matrix=matrix, kernel_params=kernel_params, tolerances=tolerances, timeout_s=timeout_s,
        bench=bench, line=node.start_mark.line + 1, bench_plan=bench_plan, suite=suite, cases=cases,
        decode=refs.get("decode"),
    )


def _suite(ctx: _Ctx, node: Node, key: str) -> tuple[SuiteRef, dict[str, list[Any]], tuple]:
    """A suite stage's `suite:` block: (its refs, the matrix its cases span, the cases)."""
    from harness.spec.suitecases import SuiteCasesError, load_cases, matrix_of

    pairs = _mapping(ctx, node, key)
    _check_keys(ctx, pairs, key, SUITE_KEYS, SUITE_KEYS, node)
    f = {str(_scalar(k)): v for k, v in pairs}
    ref = SuiteRef(_func_ref(ctx, f["cases"], f"{key}.cases"), _func_ref(ctx, f["criterion"], f"{key}.criterion"))
    try:
        cases = load_cases(ctx.root, ref.cases.module, ref.cases.name)
        if len(cases) > MAX_CASES:
            raise SuiteCasesError(f"{len(cases)} cases — more than the limit of {MAX_CASES}; return fewer")
        bad = sorted(set(cases[0]) & set(RESERVED_AXES))
        if bad:
            raise SuiteCasesError(f"case key '{bad[0]}' is one of the lab's own options — rename it")
    except SuiteCasesError as exc:
        raise ctx.fail(f["cases"], f"{key}.cases", str(exc))
    return ref, matrix_of(cases), tuple(tuple(c.items()) for c in cases)


def _bench(ctx: _Ctx, node: Node, key: str, matrix: dict[str, list[Any]]) -> tuple[dict[str, Any], BenchPlan | None]:
    """The bench block, or (older form) a mapping axis -> value naming the test case `run --bench` times."""
    pairs = _mapping(ctx, node, key)
    if not any(str(_scalar(k)) in BENCH_KEYS for k, _ in pairs):
        return _bench_case(ctx, pairs, key, matrix), None
    _check_keys(ctx, pairs, key, BENCH_KEYS, {"matrix"}, node)
    f = {str(_scalar(k)): v for k, v in pairs}
    open_axes: list[str] = []
    if "open_axes" in f:
        ok = f"{key}.open_axes"
        if not isinstance(f["open_axes"], SequenceNode):
            raise ctx.fail(f["open_axes"], ok, f"expected a list of word axes, got {_kind(f['open_axes'])} — "
                                               "e.g. [shape]")
        for item in f["open_axes"].value:
            axis = _typed(ctx, item, ok, (str,), "a matrix axis")
            if axis not in matrix or not any(isinstance(v, str) for v in matrix[axis]):
                words = [a for a, v in matrix.items() if any(isinstance(x, str) for x in v)]
                raise ctx.fail(item, ok, f"{one_line(repr(axis), 40)} is not a word axis of the matrix — "
                                         f"word axes: {', '.join(words) or 'none'}")
            if axis in open_axes:
                raise ctx.fail(item, ok, f"'{axis}' is repeated — list each axis once")
            open_axes.append(axis)
    bmatrix = _bench_matrix(ctx, f["matrix"], f"{key}.matrix", matrix, set(open_axes))
    more: list[dict[str, list[Any]]] = []
    if "more" in f:
        mk = f"{key}.more"
        if not isinstance(f["more"], SequenceNode) or not f["more"].value:
            raise ctx.fail(f["more"], mk, f"expected a list of matrices, got {_kind(f['more'])} — e.g. "
                                          "[{kv_format: [v4.1], b: [2, 64]}]")
        more = [_bench_matrix(ctx, item, f"{mk}[{i}]", matrix, set(open_axes)) for i, item in enumerate(f["more"].value)]
        total = sum(math.prod(len(v) for v in m.values()) for m in [bmatrix, *more])
        if total > MAX_BENCH_CASES:
            raise ctx.fail(f["more"], mk, f"{total} bench shapes in all — more than the limit of {MAX_BENCH_CASES}; "
                                          "list fewer values")
    beside: list[tuple[str, Any]] = []
    if "beside" in f:
        bk = f"{key}.beside"
        bpairs = _mapping(ctx, f["beside"], bk)
        if not bpairs:
            raise ctx.fail(f["beside"], bk, "name an axis and its value — e.g. {kv_format: model1}")
        for anode, vnode in bpairs:
            axis = str(_scalar(anode))
            value = _typed(ctx, vnode, f"{bk}.{axis}", (int, str, bool, float), "a scalar")
            shown = [v for m in [bmatrix, *more] for v in m.get(axis, [])]
            if axis not in matrix or not any(type(v) is type(value) and v == value for v in shown):
                raise ctx.fail(vnode, f"{bk}.{axis}", f"{one_line(repr(value), 40)} is not a bench value of "
                                                      f"{one_line(repr(axis), 40)} — name an axis value the bench times")
            beside.append((axis, value))
    peers: list[str] = []
    if "peers" in f:
        pk = f"{key}.peers"
        if not isinstance(f["peers"], SequenceNode):
            raise ctx.fail(f["peers"], pk, f"expected a list of peer names, got {_kind(f['peers'])} — e.g. "
                                           "[torch_sdpa, fa4]")
        for item in f["peers"].value:
            name = _typed(ctx, item, pk, (str,), "a peer name")
            if name not in PEER_NAMES:
                raise ctx.fail(item, pk, f"unknown peer {one_line(repr(name), 40)} — known: {', '.join(PEER_NAMES)}")
            if name in peers:
                raise ctx.fail(item, pk, f"'{name}' is repeated — list each peer once")
            peers.append(name)
    problem = None
    if "problem" in f:
        problem = _text(ctx, f["problem"], f"{key}.problem", "a problem name")
        if problem not in PROBLEMS:
            raise ctx.fail(f["problem"], f"{key}.problem", f"unknown problem {one_line(repr(problem), 40)} — "
                                                          f"known: {', '.join(PROBLEMS)}")
    elif peers:
        raise ctx.fail(f["peers"], f"{key}.problem", f"peers need to know what the tensors mean — add "
                                                     f"problem: one of {', '.join(PROBLEMS)}")
    row_axis: str | None = "m" if "m" in matrix else None
    if "row_axis" in f:
        row_axis = _text(ctx, f["row_axis"], f"{key}.row_axis", "a matrix axis")
        if row_axis not in matrix:
            raise ctx.fail(f["row_axis"], f"{key}.row_axis", f"'{row_axis}' is not a matrix axis "
                                                             f"({', '.join(matrix)}) — name one of those")
    check_rows = 256
    if "check_rows" in f:
        ck = f"{key}.check_rows"
        value = _typed(ctx, f["check_rows"], ck, (int,), "a whole number of rows")
        if isinstance(value, bool) or value < 1 or value > 1 << 20:
            raise ctx.fail(f["check_rows"], ck, f"{one_line(str(value), 20)} is out of range — give 1 to {1 << 20} rows")
        if row_axis is None:
            raise ctx.fail(f["check_rows"], ck, "no axis to sample rows of — add row_axis: AXIS (the axis whose "
                                                "output rows are independent)")
        check_rows = value
    peak = "bf16"
    if "peak" in f:
        peak = _text(ctx, f["peak"], f"{key}.peak", "bf16 or fp8")
        if peak not in PEAKS:
            raise ctx.fail(f["peak"], f"{key}.peak", f"unknown peak {one_line(repr(peak), 20)} — use bf16 or fp8")
    speed_tolerance = 0.03
    if "speed_tolerance" in f:
        sk = f"{key}.speed_tolerance"
        value = _typed(ctx, f["speed_tolerance"], sk, (int, float), "a fraction, e.g. 0.03 for 3 %")
        if isinstance(value, bool) or not (0.005 <= value <= 0.5):
            raise ctx.fail(f["speed_tolerance"], sk, f"{one_line(str(value), 20)} is out of range — give 0.005 to 0.5 "
                                                     "(a fraction: 0.03 is 3 %)")
        speed_tolerance = float(value)
    if "case" in f:
        case = _bench_case(ctx, _mapping(ctx, f["case"], f"{key}.case"), f"{key}.case", matrix)
    else:  # `run --bench` times the test matrix's largest numbers (first word) of each axis
        case = {a: (max(v) if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) else v[0])
                for a, v in matrix.items()}
    plan = BenchPlan(matrix=bmatrix, peers=tuple(peers), problem=problem, check_rows=check_rows,
                     row_axis=row_axis, peak=peak, open_axes=tuple(open_axes), line=node.start_mark.line + 1,
                     more=tuple(more), beside=tuple(beside), speed_tolerance=speed_tolerance)
    return case, plan


def _bench_case(ctx: _Ctx, pairs: list[tuple[Node, Node]], key: str, matrix: dict[str, list[Any]]) -> dict[str, Any]:
    """axis -> value: a test case (its values in the test matrix)."""
    bench: dict[str, Any] = {}
    for anode, vnode in pairs:
        axis = str(_scalar(anode))
        bk = f"{key}.{axis}"
        if axis not in matrix:
            raise ctx.fail(anode, bk, f"not a matrix axis ({', '.join(matrix)}) — name one of those")
        value = _typed(ctx, vnode, bk, (int, str, bool, float), "a scalar")
        same = [v for v in matrix[axis] if type(v) is type(value) and v == value]
        if not same:
            shown = ", ".join(value_text(v) for v in matrix[axis])
            raise ctx.fail(vnode, bk, f"{one_line(repr(value), 60)} is not in the matrix — {axis} takes {shown}")
        bench[axis] = same[0]
    return bench


def _bench_matrix(ctx: _Ctx, node: Node, key: str, matrix: dict[str, list[Any]],
                  open_axes: set[str]) -> dict[str, list[Any]]:
    """The bench shapes: each axis a stage axis; numbers of the axis's type (positive), words from the
        test matrix or any on an `open_axes` axis, booleans from the test matrix.  Axes left out:
        the first test value."""
    out: dict[str, list[Any]] = {}
    pairs = _mapping(ctx, node, key)
    if not pairs:
        raise ctx.fail(node, key, "empty — give at least one axis with its bench values")
    for anode, vnode in pairs:
        axis = str(_scalar(anode))
        ak = f"{key}.{axis}"
        if axis not in matrix:
            raise ctx.fail(anode, ak, f"not a matrix axis ({', '.join(matrix)}) — bench shapes use the stage's axes")
        tests = matrix[axis]

        def accept(item: Node, value: Any, axis: str = axis, ak: str = ak, tests: list[Any] = tests) -> None:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and type(value) in {type(v) for v in tests}:
                if value <= 0:
                    raise ctx.fail(item, ak, f"{value_text(value)} is not a size — give a positive number")
            elif isinstance(value, str) and axis in open_axes:
                pass  # a shape name the test matrix lacks: the stage's tensors() judge it
            elif not any(type(v) is type(value) and v == value for v in tests):
                shown = ", ".join(value_text(v) for v in tests)
                hint = "" if not isinstance(value, str) else f"; or list {axis} in open_axes if it names shapes"
                raise ctx.fail(item, ak, f"{one_line(repr(value), 60)} does not fit the axis — {axis} takes {shown}"
                                         f" (or other numbers of the same type{hint})")

        out[axis] = _axis_values(ctx, vnode, ak, accept, scalar_ok=True)
    full = {a: out.get(a, [v[0]]) for a, v in matrix.items()}
    n = math.prod(len(v) for v in full.values())
    if n > MAX_BENCH_CASES:
        raise ctx.fail(node, key, f"{n} bench shapes — more than the limit of {MAX_BENCH_CASES}; list fewer values")
    return full


def _stage_dir(ctx: _Ctx, node: Node, key: str) -> Path:
    """The stage's folder: an existing folder inside the lab."""
    text = _text(ctx, node, key, "a folder path inside the lab")
    if Path(text).is_absolute() or ".." in Path(text).parts:
        raise ctx.fail(node, key, f"'{text}' is not inside the lab — give a path relative to {ctx.root.name}/")
    stage_dir = ctx.root / text
    if not stage_dir.resolve().is_relative_to(ctx.root):
        raise ctx.fail(node, key, f"'{text}' leads outside the lab (a symlink?) — give a folder inside it")
    if not stage_dir.is_dir():
        raise ctx.fail(node, key, f"folder '{text}' does not exist — create it or fix the path")
    return stage_dir


def _kernels(ctx: _Ctx, node: Node, key: str) -> dict[str, KernelRef]:
    kernels: dict[str, KernelRef] = {}
    kpairs = _mapping(ctx, node, key)
    if not kpairs:
        raise ctx.fail(node, key, "no kernels — declare sm90 and/or sm100")
    for knode, vnode in kpairs:
        akey = str(_scalar(knode))
        kk = f"{key}.{akey}"
        if akey not in ARCHS:
            raise ctx.fail(knode, kk, f"unknown arch — use one of {', '.join(ARCHS)}")
        vpairs = _mapping(ctx, vnode, kk)
        _check_keys(ctx, vpairs, kk, {"module", "entry"}, {"module"}, vnode)
        v = {str(_scalar(a)): b for a, b in vpairs}
        module = _text(ctx, v["module"], f"{kk}.module", "a dotted module path")
        entry = _text(ctx, v["entry"], f"{kk}.entry", "a class name") if "entry" in v else "Kernel"
        path = _resolve(ctx, v["module"], f"{kk}.module", module, entry,
                        (v["entry"], f"{kk}.entry") if "entry" in v else None)
        kernels[ARCHS[akey]] = KernelRef(ARCHS[akey], module, entry, path)
    return kernels


def _axis_value(ctx: _Ctx, node: Node, key: str) -> Any:
    """One matrix value: a finite number, a boolean, or a word that survives a filter and a case label."""
    value = _typed(ctx, node, key, (int, str, bool, float), "a number, true/false or a word")
    if isinstance(value, float) and not math.isfinite(value):
        raise ctx.fail(node, key, f"{value} is not a finite number — give a number")
    if isinstance(value, str):
        if not value or value != value.strip() or not value.isprintable() or _FILTER_CHARS & set(value):
            raise ctx.fail(node, key, f"{one_line(repr(value), 60)} cannot be an axis value — use a word without "
                                      "spaces, control characters or , = |")
    return value


def _matrix(ctx: _Ctx, node: Node, key: str) -> dict[str, list[Any]]:
    """The test matrix: axis (a Python identifier, not one of the lab's options) -> its values."""
    matrix: dict[str, list[Any]] = {}
    mpairs = _mapping(ctx, node, key)
    if not mpairs:
        raise ctx.fail(node, key, "empty matrix — give at least one axis with values")
    for anode, vnode in mpairs:
        axis = str(_scalar(anode))
        ak = f"{key}.{axis}"
        if not _identifier(axis):
            raise ctx.fail(anode, ak, "axis names must be Python identifiers (they are --flags and keyword "
                                      "arguments) — rename it")
        if axis in RESERVED_AXES:
            raise ctx.fail(anode, ak, f"--{axis} is one of the lab's own options — rename the axis")
        matrix[axis] = _axis_values(ctx, vnode, ak, lambda item, value: None, limit=MAX_CASES)
    n = math.prod(len(v) for v in matrix.values())
    if n > MAX_CASES:
        sizes = " × ".join(f"{a} {len(v)}" for a, v in matrix.items())
        raise ctx.fail(node, key, f"{n} cases ({sizes}) — more than the limit of {MAX_CASES}; list fewer values "
                                  "or split the stage")
    return matrix


def _more(ctx: _Ctx, node: Node, key: str, matrix: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], tuple]:
    """A stage's `more:` — further test matrices (axes left out take the matrix's first value).
        Returns (the matrix with each axis's new values appended, the cases: the matrix's product,
        then each further product's cases not already listed)."""
    if not isinstance(node, SequenceNode) or not node.value:
        raise ctx.fail(node, key, f"expected a list of matrices, got {_kind(node)} — e.g. [{{hd: [256]}}]")
    axes = list(matrix)
    union = {a: list(v) for a, v in matrix.items()}
    products = [matrix]
    for i, item in enumerate(node.value):
        ik = f"{key}[{i}]"
        pairs = _mapping(ctx, item, ik)
        if not pairs:
            raise ctx.fail(item, ik, "empty matrix — give at least one axis with values")
        sub: dict[str, list[Any]] = {}
        for anode, vnode in pairs:
            axis = str(_scalar(anode))
            ak = f"{ik}.{axis}"
            if axis not in matrix:
                raise ctx.fail(anode, ak, f"not a matrix axis ({', '.join(axes)}) — name one of those")
            if axis in sub:
                raise ctx.fail(anode, ak, "repeated axis — list each axis once")
            tests = matrix[axis]

            def same_kind(item_node, value, tests=tests, ak=ak):
                if not any(type(value) is type(t) for t in tests):
                    raise ctx.fail(item_node, ak, f"{one_line(repr(value), 40)} is not of the axis's type "
                                                  f"({type(tests[0]).__name__})")

            sub[axis] = _axis_values(ctx, vnode, ak, same_kind, limit=MAX_CASES)
        products.append({a: sub.get(a, [matrix[a][0]]) for a in axes})
        for a, vals in sub.items():
            union[a] += [v for v in vals if not any(type(v) is type(u) and v == u for u in union[a])]
    total = sum(math.prod(len(v) for v in m.values()) for m in products)
    if total > MAX_CASES:
        raise ctx.fail(node, key, f"{total} cases in all — more than the limit of {MAX_CASES}; list fewer values")
    seen: set[tuple] = set()
    cases: list[tuple[tuple[str, Any], ...]] = []
    for m in products:
        for combo in itertools.product(*(m[a] for a in axes)):
            params = tuple(zip(axes, combo))
            mark = tuple((a, type(v).__name__, v) for a, v in params)
            if mark not in seen:
                seen.add(mark)
                cases.append(params)
    return union, tuple(cases)


def _axis_values(ctx: _Ctx, vnode: Node, ak: str, accept, scalar_ok: bool = False,
                 limit: int | None = None) -> list[Any]:
    """One axis's values: a non-empty list (or, with scalar_ok, one value) of at most `limit`, each a
        matrix value `accept` lets through, none twice (1 and "1" print alike; 1, 1.0, true compare
        equal)."""
    if not isinstance(vnode, SequenceNode):
        if not scalar_ok:
            raise ctx.fail(vnode, ak, f"expected a list of values, got {_kind(vnode)} — e.g. [64, 128]")
        items = [vnode]
    else:
        items = vnode.value
    if not items:
        raise ctx.fail(vnode, ak, "empty list — give at least one value")
    if limit is not None and len(items) > limit:
        raise ctx.fail(vnode, ak, f"{len(items)} values — more than the limit of {limit} cases; list fewer values")
    values: list[Any] = []
    by_text: dict[str, Any] = {}
    by_value: dict[Any, Any] = {}
    for item in items:
        value = _axis_value(ctx, item, ak)
        accept(item, value)
        text = value_text(value)
        twin = by_text.get(text, by_value.get(value, _NONE))
        if twin is not _NONE:
            raise ctx.fail(item, ak, f"repeated value {one_line(repr(value), 40)} (same as "
                                     f"{one_line(repr(twin), 40)}) — list each value once")
        by_text[text] = by_value[value] = value
        values.append(value)
    return values


TOLERANCE_BY_EXAMPLE = "e.g. by: {logits_dtype: {bf16: {rel_l2_max: 2.0e-3}}}"


def _tolerances(ctx: _Ctx, node: Node, key: str, matrix: dict[str, list[Any]]) -> dict[str, Tolerance]:
    tolerances: dict[str, Tolerance] = {}
    tpairs = _mapping(ctx, node, key)
    if not tpairs:
        raise ctx.fail(node, key, "no outputs — give each output's tolerances")
    for onode, vnode in tpairs:
        out = str(_scalar(onode))
        ok = f"{key}.{out}"
        if not out.strip() or not out.isprintable():
            raise ctx.fail(onode, ok, "not an output name — name an output of tensors()")
        vpairs = _mapping(ctx, vnode, ok)
        _check_keys(ctx, vpairs, ok, TOLERANCE_KEYS | {"by"}, set(), vnode)
        by_node = next((b for a, b in vpairs if str(_scalar(a)) == "by"), None)
        vpairs = [(a, b) for a, b in vpairs if str(_scalar(a)) != "by"]
        if not vpairs:
            raise ctx.fail(vnode, ok, f"no bounds — give one of {', '.join(sorted(TOLERANCE_KEYS))}")
        vals = _bounds(ctx, vpairs, ok)
        _holds_something(ctx, vnode, ok, vals)
        by = () if by_node is None else _tolerance_by(ctx, by_node, f"{ok}.by", matrix, vals)
        tolerances[out] = Tolerance(**vals, by=by)
    return tolerances


def _bounds(ctx: _Ctx, vpairs: list[tuple[Node, Node]], key: str) -> dict[str, float]:
    """metric -> bound, each a finite number in its range (TOLERANCE_RANGES)."""
    vals: dict[str, float] = {}
    for a, b in vpairs:
        metric = str(_scalar(a))
        lo, hi, lo_open = TOLERANCE_RANGES[metric]
        vals[metric] = _number(ctx, b, f"{key}.{metric}", "a number", lo, hi, lo_open=lo_open)
    return vals


def _holds_something(ctx: _Ctx, node: Node, key: str, vals: dict[str, float]) -> None:
    if not (vals.get("cosine_min", -math.inf) >= COSINE_MIN_FLOOR
            or vals.get("rel_l2_max", math.inf) <= REL_L2_MAX_CEILING):
        raise ctx.fail(node, key, f"bounds that hold nothing — give cosine_min >= {COSINE_MIN_FLOOR:g} or "
                                  f"rel_l2_max <= {REL_L2_MAX_CEILING:g} (see docs/STAGES.md)")


def _tolerance_by(ctx: _Ctx, node: Node, key: str, matrix: dict[str, list[Any]],
                  base: dict[str, float]) -> tuple[ToleranceBy, ...]:
    """An output's `by:` — axis -> {value: bounds} replacing the output's own for the cases with that
        value (each value in the matrix; the result must still hold a bound)."""
    apairs = _mapping(ctx, node, key)
    if not apairs:
        raise ctx.fail(node, key, f"empty — name an axis, its value and the bounds there ({TOLERANCE_BY_EXAMPLE})")
    out: list[ToleranceBy] = []
    for anode, vnode in apairs:
        axis = str(_scalar(anode))
        ak = f"{key}.{axis}"
        if axis not in matrix:
            raise ctx.fail(anode, ak, f"not a matrix axis ({', '.join(matrix)}) — name one of those")
        vpairs = _mapping(ctx, vnode, ak)
        if not vpairs:
            raise ctx.fail(vnode, ak, f"empty — name a value of {axis} and its bounds ({TOLERANCE_BY_EXAMPLE})")
        for valnode, bnode in vpairs:
            value = _axis_value(ctx, valnode, ak)
            vk = f"{ak}.{value_text(value)}"
            if not any(type(value) is type(v) and value == v for v in matrix[axis]):
                raise ctx.fail(valnode, vk, f"not a value of {axis} ({', '.join(value_text(v) for v in matrix[axis])}) "
                                            "— name one of those")
            bpairs = _mapping(ctx, bnode, vk)
            _check_keys(ctx, bpairs, vk, TOLERANCE_KEYS, set(), bnode)
            if not bpairs:
                raise ctx.fail(bnode, vk, f"no bounds — give one of {', '.join(sorted(TOLERANCE_KEYS))}")
            vals = _bounds(ctx, bpairs, vk)
            _holds_something(ctx, bnode, vk, {**base, **vals})
            out.append(ToleranceBy(axis, value, tuple(vals.items())))
    return tuple(out)


def load_spec(path: Path | None = None, root: Path | None = None) -> Spec:
    """Load and validate stages.yaml. Raises SpecError (one line) on any problem."""
    from harness.core.paths import SPEC_NAME, lab_root

    root = (root or (path.parent if path else lab_root())).resolve()
    path = path or root / SPEC_NAME
    ctx = _Ctx(path, root)
    if not path.exists():
        raise SpecError(f"{path}: not found — run from the lab folder or set DSV4_LAB_ROOT")
    doc = read_file(path, ctx)
    if doc is None:
        raise SpecError(f"{path.name}:1: empty file — declare 'version: {SCHEMA_VERSION}' and 'stages:'")
    pairs = _mapping(ctx, doc, TOP)
    _check_keys(ctx, pairs, "", {"version", "stages"}, {"version", "stages"}, doc)
    top = {str(_scalar(k)): v for k, v in pairs}
    version = _typed(ctx, top["version"], "version", (int,), "an integer")
    if version != SCHEMA_VERSION:
        raise ctx.fail(top["version"], "version", f"unsupported version {one_line(str(version), 40)} — "
                                                  f"this lab reads {SCHEMA_VERSION}")
    stages: dict[str, Stage] = {}
    first: dict[str, tuple[str, int]] = {}  # stage id -> (as written, line)
    for knode, vnode in _mapping(ctx, top["stages"], "stages"):
        raw = str(_scalar(knode))
        sid = normalize_stage_name(raw)
        if not re.fullmatch(rf"[A-Z0-9][A-Z0-9_]{{0,{MAX_STAGE_ID - 1}}}", sid):
            raise ctx.fail(knode, f"stages.{raw}", f"stage ids are short names like A or D1 (letters, digits, _; "
                                                   f"at most {MAX_STAGE_ID}) — rename it")
        if sid in first:
            was, line = first[sid]
            raise ctx.fail(knode, f"stages.{raw}", f"same stage as '{was}' (line {line}) — stage ids ignore case and "
                                                   "a 'stage-' prefix; rename one")
        first[sid] = (raw, knode.start_mark.line + 1)
        stages[sid] = _parse_stage(ctx, sid, vnode, knode)
    if not stages:
        raise ctx.fail(top["stages"], "stages", "no stages declared — add one")
    return Spec(path=path, root=root, stages=stages)
