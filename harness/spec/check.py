"""`dsv4-lab check`: a stage's contract, proven on the CPU without compiling or a GPU.

For each stage:
  * the oracle-side modules import; `tensors(case)` is a valid TensorSpec list for every case
    (unique names, known dtypes, positive shapes, an output); every output has tolerances;
  * each arch's kernel module imports; its entry is a class whose `__init__` takes exactly the
    stage's kernel parameters as keywords and whose `__call__` takes the tensors in
    `tensors(case)` order (then `stream`);
  * on the smallest case, `make_inputs` and the oracle return exactly the declared tensors;
    `flops(case)`, when declared, is a positive finite number.

Every problem is one line, `FILE:LINE: key: problem — fix` (core.userfault), never a traceback.
main(spec, stages) -> int (0 ok, 2 problems); the worker uses inputs_problems /
outputs_problems at run time."""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from yaml.nodes import MappingNode, Node

from harness.core.labels import case_label
from harness.spec.matrix import expand
from harness.spec.spec import FuncRef, Spec, Stage, normalize_stage_name
from harness.core.userfault import describe, user_frame, where_defined
from harness.core.yamlnodes import NodeContext, read_file

MAX_CASES_SCANNED = 4096  # tensors(case) is evaluated on at most this many cases
DTYPES = ("bfloat16", "float16", "float32", "int32", "uint8", "float8_e4m3fn")
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")  # the ones the harness can poison


class ContractError(Exception):
    """A contract violation found at run time, already one line."""


class _Unreadable(Exception):
    """stages.yaml could not be read again for line numbers (it loaded a moment ago)."""


# ---------------------------------------------------------------------------------------
# Where things are: lines of stages.yaml keys.


class _SpecLines:
    """Line numbers of keys in stages.yaml: ("matrix", "hd") under a stage -> line."""

    def __init__(self, spec: Spec):
        self.name = spec.path.name
        self._stages: dict[str, Node] = {}
        try:  # bounded like load_spec's own reading (alias bombs, depth, size)
            doc = read_file(spec.path, NodeContext(spec.path.name, _Unreadable))
        except _Unreadable:
            doc = None
        stages = _child(doc, "stages")
        if isinstance(stages, MappingNode):
            for k, v in stages.value:
                self._stages[normalize_stage_name(str(k.value))] = (k, v)  # type: ignore[assignment]

    def at(self, stage: Stage, *path: str) -> str:
        """`stages.yaml:LINE` of the deepest key of `path` found under the stage."""
        entry = self._stages.get(stage.id)
        line = stage.line
        if entry is not None:
            knode, node = entry  # type: ignore[misc]
            line = knode.start_mark.line + 1
            for key in path:
                found = _child_pair(node, key)
                if found is None:
                    break
                knode, node = found
                line = knode.start_mark.line + 1
        return f"{self.name}:{line}"


def _child_pair(node: Node | None, key: str) -> tuple[Node, Node] | None:
    if not isinstance(node, MappingNode):
        return None
    for k, v in node.value:
        if str(k.value) == key:
            return k, v
    return None


def _child(node: Node | None, key: str) -> Node | None:
    pair = _child_pair(node, key)
    return pair[1] if pair else None


# ---------------------------------------------------------------------------------------
# Pure checks of values against TensorSpecs (shared with the worker).


def _fn_site(fn: Callable, root: Path, what: str) -> str:
    return f"{where_defined(fn, root)}: {what}"


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _names(xs) -> str:
    return ", ".join(xs) if xs else "none"


def _returned_problems(specs: list, got: Any, fn: Callable, root: Path, context: str, role: str,
                       default_name: str) -> tuple[str, list, list[str]]:
    """(site, the declared specs of `role` present in `got`, problems) for a stage function's return
        value against tensors()'s `role` tensors: a dict of torch tensors of the declared names and
        shapes."""
    import torch

    site = _fn_site(fn, root, getattr(fn, "__name__", default_name))
    what = "inputs" if role == "in" else "outputs"
    want = [s for s in specs if s.role == role]
    names = [s.name for s in want]
    if not isinstance(got, dict):
        return site, [], [f"{site}: returned {type(got).__name__}, expected a dict of the {what} {{{_names(names)}}}{context}"]
    problems = []
    missing = [n for n in names if n not in got]
    extra = [str(k) for k in got if k not in names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"returned {_names(extra)}, not an {what[:-1]} of tensors()")
        problems.append(f"{site}: {'; '.join(parts)} — the {what} are {_names(names)}{context}")
    present = []
    for s in want:
        if s.name not in got:
            continue
        t = got[s.name]
        if not isinstance(t, torch.Tensor):
            problems.append(f"{site}: '{s.name}' is a {type(t).__name__}, expected a torch tensor{context}")
        elif _shape(t) != tuple(s.shape):
            problems.append(f"{site}: '{s.name}' has shape {_shape(t)}, tensors() declares {tuple(s.shape)}{context}")
        else:
            present.append(s)
    return site, present, problems


def inputs_problems(specs: list, inputs: Any, fn: Callable, root: Path, context: str = "") -> list[str]:
    """Problems with a generator's inputs: names, shapes, dtypes, compact 16-byte-aligned storage."""
    site, present, problems = _returned_problems(specs, inputs, fn, root, context, "in", "make_inputs")
    for s in present:
        t = inputs[s.name]
        if _dtype(t) != s.dtype:
            problems.append(f"{site}: '{s.name}' has dtype {_dtype(t)}, tensors() declares {s.dtype}{context}")
        elif not t.is_contiguous():  # the kernel was compiled for compact row-major tensors
            problems.append(f"{site}: '{s.name}' is not contiguous (strides {tuple(t.stride())}) — the kernel reads "
                            f"row-major tensors: return .contiguous(){context}")
        elif t.numel() and t.data_ptr() % 16:
            problems.append(f"{site}: '{s.name}' is not 16-byte aligned (a view into a larger tensor?) — return a "
                            f"fresh tensor (.clone()){context}")
    return problems


def outputs_problems(specs: list, outputs: Any, fn: Callable, root: Path, context: str = "") -> list[str]:
    """Problems with what an oracle returned, against the declared outputs (names and shapes
    only: an oracle may compute in a wider dtype)."""
    return _returned_problems(specs, outputs, fn, root, context, "out", "reference")[2]


def compared_problems(compared: Any, ref: Any, decode_fn: Callable, oracle_fn: Callable, root: Path,
                      context: str = "") -> list[str]:
    """A stage with `decode`: decode's output and the oracle's must be dicts of tensors of the same
        names and shapes."""
    import torch

    dsite = _fn_site(decode_fn, root, getattr(decode_fn, "__name__", "decode"))
    osite = _fn_site(oracle_fn, root, getattr(oracle_fn, "__name__", "reference"))
    if not isinstance(compared, dict) or not all(isinstance(v, torch.Tensor) for v in compared.values()):
        return [f"{dsite}: returned {type(compared).__name__}, expected a dict of torch tensors (the outputs compared){context}"]
    if not isinstance(ref, dict):
        return [f"{osite}: returned {type(ref).__name__}, expected a dict of the outputs {{{_names(list(compared))}}}{context}"]
    if set(compared) != set(ref):
        return [f"{osite}: returned {_names(list(ref))}, but {dsite} makes {_names(list(compared))} of the kernel's "
                f"outputs — the two must name the same outputs{context}"]
    problems = []
    for name, t in compared.items():
        r = ref[name]
        if not isinstance(r, torch.Tensor):
            problems.append(f"{osite}: '{name}' is a {type(r).__name__}, expected a torch tensor{context}")
        elif tuple(r.shape) != tuple(t.shape):
            problems.append(f"{osite}: '{name}' has shape {tuple(r.shape)}, {dsite} makes {tuple(t.shape)} of the "
                            f"kernel's{context}")
    return problems


def specs_problems(specs: Any, fn: Callable, root: Path, context: str = "") -> list[str]:
    """Problems with a list of TensorSpecs as `tensors(case)` returned it."""
    site = _fn_site(fn, root, getattr(fn, "__name__", "tensors"))
    if not isinstance(specs, (list, tuple)) or not specs:
        return [f"{site}: returned {type(specs).__name__}, expected a non-empty list of TensorSpec{context}"]
    seen: set[str] = set()
    for s in specs:
        if not all(hasattr(s, a) for a in ("name", "shape", "dtype", "role")):
            return [f"{site}: returned a {type(s).__name__}, expected TensorSpec(name, shape, dtype, role){context}"]
        if s.name in seen:
            return [f"{site}: '{s.name}' listed twice — tensor names must be unique{context}"]
        seen.add(s.name)
        if s.role not in ("in", "out", "scratch"):
            return [f"{site}: '{s.name}' has role {s.role!r} — use \"in\", \"out\" or \"scratch\"{context}"]
        if s.dtype not in DTYPES:
            return [f"{site}: '{s.name}' has dtype {s.dtype!r} — use one of {', '.join(DTYPES)}{context}"]
        if s.role in ("out", "scratch") and s.dtype not in OUTPUT_DTYPES:
            return [f"{site}: output '{s.name}' has dtype {s.dtype} — outputs are poisoned with NaN, "
                    f"so use one of {', '.join(OUTPUT_DTYPES)}{context}"]
        shape = s.shape
        if not isinstance(shape, (tuple, list)) or not shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
        ):
            return [f"{site}: '{s.name}' has shape {shape!r} — expected a tuple of positive ints{context}"]
    if not any(s.role == "out" for s in specs):
        return [f"{site}: no output — mark the tensors the kernel writes with role \"out\"{context}"]
    return []


# ---------------------------------------------------------------------------------------
# One stage.


@dataclass
class _StageCheck:
    spec: Spec
    stage: Stage
    lines: _SpecLines

    @property
    def root(self) -> Path:
        return self.spec.root

    def _import(self, module: str) -> tuple[Any, str | None]:
        if str(self.root) not in sys.path:
            sys.path.insert(0, str(self.root))
        try:
            return importlib.import_module(module), None
        except (Exception, SystemExit) as exc:
            return None, describe(exc, self.root)

    def _fn(self, ref: FuncRef, errors: dict[str, str]) -> Callable | None:
        mod, err = self._import(ref.module)
        if err is not None:
            errors.setdefault(ref.module, err)
            return None
        fn = getattr(mod, ref.name, None)
        if not callable(fn):
            key = {self.stage.tensors: "tensors", self.stage.inputs: "inputs", self.stage.oracle: "oracle",
                   self.stage.flops: "flops", self.stage.peer: "peer", self.stage.decode: "decode"}.get(ref, "oracle")
            errors.setdefault(str(ref), f"{self.lines.at(self.stage, key)}: stages.{self.stage.id}.{key}: "
                                        f"{ref} is not a function — point it at a def")
            return None
        return fn

    def _call(self, fn: Callable, *args) -> tuple[Any, str | None]:
        try:
            return fn(*args), None
        except (Exception, SystemExit) as exc:
            if user_frame(exc, self.root) is None:  # raised before any line of the user's (e.g. a
                # class named as the oracle, called with the wrong arguments): name what was called
                return None, f"{where_defined(fn, self.root)}: in {getattr(fn, '__name__', fn)}: {describe(exc, self.root)}"
            return None, describe(exc, self.root)

    def run(self) -> list[str]:
        st = self.stage
        problems: list[str] = []
        import_errors: dict[str, str] = {}
        fns = {name: self._fn(ref, import_errors) for name, ref in
               (("tensors", st.tensors), ("inputs", st.inputs), ("oracle", st.oracle),
                ("flops", st.flops), ("peer", st.peer), ("decode", st.decode)) if ref is not None}
        kernel_errors, kernels = self._kernel_classes()
        problems += list(import_errors.values()) + kernel_errors
        problems += self._init_problems(kernels)
        tensors_fn = fns.get("tensors")
        if tensors_fn is None:
            return problems
        smallest, specs, p = self._smallest(tensors_fn)
        if p:
            return problems + p
        if st.decode is None:
            problems += self._tolerance_problems(specs)
        problems += self._call_problems(kernels, specs, tensors_fn)
        ctx = f" ({st.name}, case {case_label(smallest)})"
        if fns.get("flops") is not None:
            value, err = self._call(fns["flops"], smallest)
            if err:
                problems.append(err + ctx)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                problems.append(f"{_fn_site(fns['flops'], self.root, 'flops')}: returned {value!r}, expected a positive "
                                f"number of floating-point operations{ctx}")
        if fns.get("inputs") is None or fns.get("oracle") is None:
            return problems
        inputs, err = self._call(fns["inputs"], smallest, _seed(st.id, smallest), "cpu")
        if err:
            return problems + [err + ctx]
        bad = inputs_problems(specs, inputs, fns["inputs"], self.root, ctx)
        if bad:
            return problems + bad
        ref, err = self._call(fns["oracle"], inputs, smallest)
        if err:
            return problems + [err + ctx]
        if st.decode is None:
            return problems + outputs_problems(specs, ref, fns["oracle"], self.root, ctx)
        if fns.get("decode") is None:
            return problems
        # decode, on the kernel's outputs as the harness allocates them: what it makes is compared,
        # so it names the outputs the oracle returns and the tolerances judge
        import torch

        from oracles.common import TensorSpec

        raw = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs if s.role == "out"}
        compared, err = self._call(fns["decode"], raw, smallest)
        if err:
            return problems + [err + ctx]
        bad = compared_problems(compared, ref, fns["decode"], fns["oracle"], self.root, ctx)
        if bad:
            return problems + bad
        return problems + self._tolerance_problems([TensorSpec(n, tuple(t.shape), "float32", "out")
                                                    for n, t in compared.items()])

    # -- tensors ----------------------------------------------------------------------------

    def _smallest(self, tensors_fn: Callable) -> tuple[dict, list, list[str]]:
        """The case with the fewest elements, its specs, or the problem with tensors()."""
        best: tuple[int, dict, list] | None = None
        for case in expand(self.stage)[:MAX_CASES_SCANNED]:
            d = case.dict
            ctx = f" ({self.stage.name}, case {case.label})"
            specs, err = self._call(tensors_fn, d)
            if err:
                return d, [], [err + ctx]
            bad = specs_problems(specs, tensors_fn, self.root, ctx)
            if bad:
                return d, [], bad
            size = sum(math.prod(s.shape) for s in specs)
            if best is None or size < best[0]:
                best = (size, d, list(specs))
        assert best is not None  # the spec refuses an empty matrix
        return best[1], best[2], []

    def _tolerance_problems(self, specs: list) -> list[str]:
        st = self.stage
        outs = [s.name for s in specs if s.role == "out"]
        problems = []
        for key in st.tolerances:
            if key not in outs:
                close = [o for o in outs if o.lower() == key.lower() and o not in st.tolerances]
                hint = f" — did you mean '{close[0]}'?" if close else " — name an output"
                problems.append(f"{self.lines.at(st, 'tolerances', key)}: stages.{st.id}.tolerances.{key}: "
                                f"no output '{key}' (outputs are {_names(outs)}){hint}")
        if problems:
            return problems
        for o in outs:
            if o not in st.tolerances:
                problems.append(f"{self.lines.at(st, 'tolerances')}: stages.{st.id}.tolerances: output '{o}' has no "
                                f"tolerances, so nothing would check it — add '{o}: {{cosine_min: ...}}'")
        return problems

    # -- kernels ----------------------------------------------------------------------------

    def _kernel_classes(self) -> tuple[list[str], dict[str, type]]:
        st = self.stage
        problems, classes = [], {}
        from harness.spec.spec import ARCH_KEYS

        for arch, kref in st.kernels.items():
            key = f"stages.{st.id}.kernels.{ARCH_KEYS.get(arch, arch)}"
            mod, err = self._import(kref.module)
            if err is not None:
                problems.append(err)
                continue
            cls = getattr(mod, kref.entry, None)
            if not inspect.isclass(cls):
                problems.append(f"{self.lines.at(st, 'kernels', ARCH_KEYS.get(arch, arch))}: {key}.entry: "
                                f"{kref.module}:{kref.entry} is not a class — the entry is a class with __init__ "
                                f"and __call__ (docs/KERNEL_CONTRACT.md)")
                continue
            classes[arch] = cls
        return problems, classes

    def _init_problems(self, kernels: dict[str, type]) -> list[str]:
        st = self.stage
        params = list(st.kernel_params)
        untaken: dict[str, list[str]] = {}
        problems = []
        for arch, cls in kernels.items():
            init = cls.__init__
            if init is object.__init__:  # object's own takes no keywords, whatever its signature says
                if params:
                    problems.append(f"{where_defined(cls, self.root)}: {cls.__name__} defines no __init__ — it must take "
                                    f"the kernel parameters as keywords: def __init__(self, *, {', '.join(params)})")
                continue
            site = where_defined(init, self.root)
            try:
                sig = inspect.signature(init)
            except (TypeError, ValueError):
                problems.append(f"{site}: {cls.__name__}.__init__: signature cannot be read")
                continue
            ps = list(sig.parameters.values())[1:]  # drop self
            var_kw = any(p.kind is p.VAR_KEYWORD for p in ps)
            named = {p.name: p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            for axis in params:
                if axis not in named and not var_kw:
                    untaken.setdefault(axis, []).append(site)
            required = [p.name for p in ps if p.default is p.empty
                        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
                        and p.name not in params]
            if required:
                src = "kernel_params" if st.kernel_params != tuple(st.matrix) else "matrix axes"
                problems.append(f"{site}: {cls.__name__}.__init__ requires {_names(required)}, not among the stage's "
                                f"{src} ({_names(params)}) — give it a default or add it to stages.{st.id}.matrix")
        for axis, sites in untaken.items():
            if st.kernel_params != tuple(st.matrix):
                where, key = self.lines.at(st, "kernel_params"), f"stages.{st.id}.kernel_params"
                fix = "add it to __init__ or drop it from kernel_params"
            else:
                where, key = self.lines.at(st, "matrix", axis), f"stages.{st.id}.matrix.{axis}"
                fix = "add it to __init__, or list the axes the kernel takes in kernel_params"
            problems.append(f"{where}: {key}: Kernel.__init__ takes no '{axis}' ({', '.join(sites)}) — {fix}")
        return problems

    def _call_problems(self, kernels: dict[str, type], specs: list, tensors_fn: Callable) -> list[str]:
        names = [s.name for s in specs]
        mismatched: dict[tuple[str, ...], list[str]] = {}
        problems = []
        for arch, cls in kernels.items():
            call = next((vars(c)["__call__"] for c in cls.__mro__ if c is not object and "__call__" in vars(c)), None)
            if call is None:
                problems.append(f"{where_defined(cls, self.root)}: {cls.__name__} defines no __call__ — add "
                                f"@cute.jit def __call__(self, {', '.join(names)}{', stream' if arch != 'cpu' else ''})")
                continue
            site = where_defined(call, self.root)
            try:
                sig = inspect.signature(call)
            except (TypeError, ValueError):
                problems.append(f"{site}: {cls.__name__}.__call__: signature cannot be read")
                continue
            ps = list(sig.parameters.values())[1:]  # drop self
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
                problems.append(f"{site}: {cls.__name__}.__call__ takes *args/**kwargs — name each tensor "
                                f"({_names(names)}) so the check can match them")
                continue
            if arch != "cpu":
                if not ps or ps[-1].name != "stream":
                    problems.append(f"{site}: {cls.__name__}.__call__ must end with a 'stream' parameter "
                                    f"(cuda.CUstream): the harness calls kernel({', '.join(names)}, stream)")
                    continue
                ps = ps[:-1]
            taken = tuple(p.name for p in ps)
            if list(taken) != names:
                mismatched.setdefault(taken, []).append(site)
        tsite = where_defined(tensors_fn, self.root)
        for taken, sites in mismatched.items():
            if len(taken) != len(names):
                what = f"lists {len(names)} tensors ({_names(names)}) but __call__ takes {len(taken)} ({_names(taken)})"
            else:
                what = f"lists the tensors as ({_names(names)}) but __call__ takes ({_names(taken)})"
            also = f" (also {', '.join(sites[1:])})" if len(sites) > 1 else ""
            problems.append(f"{sites[0]}: Kernel.__call__{also}: tensors() ({tsite}) {what} — __call__ takes the "
                            f"tensors in tensors()' order, then stream")
        return problems


def _seed(stage_id: str, case: dict) -> int:
    try:
        from oracles.common import case_seed

        return case_seed(stage_id, case, 0)
    except Exception:
        return 0


def check_stage(spec: Spec, stage: Stage) -> list[str]:
    """Every contract problem of one stage, each one line; empty when it holds."""
    return _StageCheck(spec, stage, _SpecLines(spec)).run()


def dynamic_warnings(spec: Spec, stage: Stage) -> list[str]:
    """One line per call in the stage's sources that loads code or data imports do not show
        (identity.dynamic_uses), and what is hashed in its place."""
    from harness.spec.identity import dynamic_uses, fallback_folders

    seen: dict[tuple[Path, int, str], None] = {}
    for arch in sorted(stage.kernels):
        for use in dynamic_uses(spec.root, stage, arch):
            seen.setdefault((use.path, use.line, use.call), None)
    if not seen:
        return []
    from harness.spec.identity import DynamicUse

    uses = [DynamicUse(p, line, call) for p, line, call in seen]
    folders = ", ".join(_rel(spec.root, f) + "/" for f in fallback_folders(spec.root, stage, uses))
    return [f"{_rel(spec.root, u.path)}:{u.line}: warning: {u.call} loads code or data the staleness hash cannot "
            f"follow — {stage.name}'s results are hashed over every file of {folders} instead" for u in uses]


def _rel(root: Path, path: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def main(spec: Spec, stages: list[Stage]) -> int:
    """Check `stages`: `ok` lines on stdout, problems on stderr; 0, or 2 on problems.  Warnings go to
        stderr and change nothing."""
    lines = _SpecLines(spec)
    total = 0
    for st in stages:
        for w in dynamic_warnings(spec, st):
            print(w, file=sys.stderr)
        problems = _StageCheck(spec, st, lines).run()
        if problems:
            for p in problems:
                print(p, file=sys.stderr)
            total += len(problems)
        else:
            archs = ", ".join(st.kernels)
            print(f"check: {st.name} ok ({archs})")
    if total:
        print(f"check: {total} problem{'s' if total != 1 else ''} — fix them, then run again", file=sys.stdout)
        return 2
    return 0
