"""`dsv4-lab new stage`: scaffold a stage that passes `check` and compiles for both archs.

The flags (`--axes`, `--in`/`--out` NAME:DIMS[:DTYPE], `--title`, `--slug`), what it writes
(stages/<ID>_<slug>/, oracles/<id>.py with a `reference` mirroring the placeholder elementwise
kernel, the stages.yaml block, rolled back when it does not load) and the dtypes each side takes:
docs/STAGES.md, "From new to baselined", step 1.  main(root, ...) -> int (one line on a problem,
exit code 2)."""

from __future__ import annotations

import ast
import json
import keyword
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IN_DTYPES = ("bfloat16", "float16", "float32", "int32", "uint8", "float8_e4m3fn")
OUT_DTYPES = ("float32", "bfloat16", "float16")
RESERVED = {  # names the generated code uses itself
    "self", "stream", "cute", "cutlass", "cuda", "torch", "case", "seed", "device", "inputs", "specs",
    "TensorSpec", "Any", "Kernel", "THREADS", "annotations", "math",
}


class ScaffoldError(Exception):
    """A bad `new stage` request, as one line."""


@dataclass(frozen=True)
class TensorDecl:
    name: str
    dims: tuple[str, ...]  # expressions over int axes, validated
    dtype: str
    role: str


@dataclass
class Created:
    stage_id: str
    files: list[Path] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Parsing the flags.


def _value(text: str) -> Any:
    t = text.strip()
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", t):
        return t
    raise ScaffoldError(f"--axes: value '{text}' — use integers, true/false, or plain words")


def parse_axes(items: list[str]) -> dict[str, list[Any]]:
    axes: dict[str, list[Any]] = {}
    if not items:
        raise ScaffoldError("--axes: give at least one axis, e.g. --axes n=128,256")
    for item in items:
        if "=" not in item:
            raise ScaffoldError(f"--axes {item}: expected NAME=V1,V2 (e.g. --axes hd=64,128)")
        name, values = (s.strip() for s in item.split("=", 1))
        if not name.isidentifier() or keyword.iskeyword(name) or name in RESERVED or name.startswith("_"):
            raise ScaffoldError(f"--axes {item}: '{name}' cannot be an axis name — use a plain identifier "
                                f"(not {', '.join(sorted(RESERVED))})")
        if name in axes:
            raise ScaffoldError(f"--axes {item}: axis '{name}' given twice — give all its values at once")
        vals = [_value(v) for v in values.split(",") if v.strip()]
        if not vals:
            raise ScaffoldError(f"--axes {item}: no values — e.g. --axes {name}=128,256")
        if len(set(map(repr, vals))) != len(vals):
            raise ScaffoldError(f"--axes {item}: a value is repeated — list each value once")
        if len({type(v) for v in vals}) != 1:
            raise ScaffoldError(f"--axes {item}: mixed value types — an axis holds ints, booleans or words")
        axes[name] = vals
    return axes


_ALLOWED_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)


def _check_dim(expr: str, int_axes: set[str], flag: str, axes: dict[str, list[Any]]) -> str:
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ScaffoldError(f"{flag}: dimension '{expr}' is not an expression like n, 64, hd*2 or hd//2")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id in axes and node.id not in int_axes:  # `--axes m=abc --in Q:m`: it was declared
                raise ScaffoldError(f"{flag}: dimension '{expr}' names axis '{node.id}' (not an int axis) — its "
                                    f"values are {','.join(map(str, axes[node.id]))}; a dimension needs an int "
                                    f"axis, e.g. --axes {node.id}=128")
            if node.id not in int_axes:
                known = ", ".join(sorted(int_axes)) or "none"
                extra = " (not an int axis)" if node.id in axes else ""
                raise ScaffoldError(f"{flag}: dimension '{expr}' names '{node.id}'{extra} — use an int axis "
                                    f"({known}) or a number; declare it with --axes {node.id}=...")
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, int) or isinstance(node.value, bool) or node.value <= 0:
                raise ScaffoldError(f"{flag}: dimension '{expr}': numbers must be positive integers")
        elif isinstance(node, ast.BinOp):
            if not isinstance(node.op, _ALLOWED_OPS):
                raise ScaffoldError(f"{flag}: dimension '{expr}': only + - * // are allowed")
        elif not isinstance(node, (ast.Expression, ast.Load, *_ALLOWED_OPS)):
            raise ScaffoldError(f"{flag}: dimension '{expr}' is not an expression like n, 64, hd*2 or hd//2")
    return ast.unparse(tree)


def parse_tensor(text: str, role: str, axes: dict[str, list[Any]]) -> TensorDecl:
    flag = f"--{role} {text}"
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ScaffoldError(f"{flag}: expected NAME:DIMS[:DTYPE], e.g. --{role} Q:m,hd:bfloat16")
    name = parts[0].strip()
    allowed = IN_DTYPES if role == "in" else OUT_DTYPES
    dtype = parts[2].strip() if len(parts) == 3 else allowed[0]
    if not name.isidentifier() or keyword.iskeyword(name) or name in RESERVED or name.startswith("_"):
        raise ScaffoldError(f"{flag}: '{name}' cannot be a tensor name — use a plain identifier like Q or O")
    if dtype not in allowed:
        raise ScaffoldError(f"{flag}: dtype '{dtype}' — an {'input' if role == 'in' else 'output'} takes one of "
                            f"{', '.join(allowed)}")
    int_axes = {a for a, vs in axes.items() if all(isinstance(v, int) and not isinstance(v, bool) for v in vs)}
    dims = tuple(_check_dim(d, int_axes, flag, axes) for d in parts[1].split(","))
    if not dims or any(not d for d in dims):
        raise ScaffoldError(f"{flag}: no dimensions — e.g. {name}:m,hd")
    return TensorDecl(name, dims, dtype, role)


def _eval_dim(expr: str, case: dict[str, Any]) -> int:
    return int(eval(compile(expr, "<dim>", "eval"), {"__builtins__": {}}, dict(case)))  # validated above


MAX_DIM = 2**31 - 1  # a tensor dimension past a 32-bit index is a typo (`--axes m=99999999999999999999999`)


def _check_shapes(axes: dict[str, list[Any]], tensors: list[TensorDecl]) -> None:
    """Every dimension is a positive integer on every case of the matrix."""
    import itertools

    names = list(axes)
    for values in itertools.product(*(axes[a] for a in names)):
        case = dict(zip(names, values))
        for t in tensors:
            for d in t.dims:
                v = _eval_dim(d, case)
                if v <= 0 or v > MAX_DIM:
                    label = ",".join(f"{k}={x}" for k, x in case.items())
                    raise ScaffoldError(f"--{t.role} {t.name}: dimension '{d}' is {v} on case {label} — "
                                        + ("every dimension must be positive" if v <= 0 else
                                           f"a dimension is at most {MAX_DIM} (a 32-bit index)"))


# ---------------------------------------------------------------------------------------
# The generated text.

ARCH_TEXT = {
    "sm90": ("Hopper (sm_90a)", "WGMMA, TMA, accumulators in registers"),
    "sm100": ("Blackwell (sm_100a)", "tcgen05.mma, TMA, accumulators in TMEM"),
}


def _py_type(values: list[Any]) -> str:
    return type(values[0]).__name__


def kernel_source(stage_id: str, title: str, arch: str, axes: dict[str, list[Any]], tensors: list[TensorDecl]) -> str:
    where, units = ARCH_TEXT[arch]
    ins = [t for t in tensors if t.role == "in"]
    outs = [t for t in tensors if t.role == "out"]
    params = ", ".join(f"{a}: {_py_type(v)}" for a, v in axes.items())
    assigns = "\n".join(f"        self.{a} = {a}" for a in axes)
    call_args = ", ".join(f"{t.name}: cute.Tensor" for t in tensors)
    names = ", ".join(t.name for t in tensors)
    sizes = ", ".join(f"cute.size({t.name})" for t in outs)
    largest = f"max({sizes})" if len(outs) > 1 else sizes
    src = ins[0].name
    writes = "\n".join(
        f"        if i < cute.size({t.name}):\n"
        f"            {t.name}[i] = {src}[i % cute.size({src})].to({t.name}.element_type)"
        for t in outs
    )
    shapes = "\n".join(f"        {t.name}: [{', '.join(t.dims)}] {t.dtype}{' (output)' if t.role == 'out' else ''}"
                       for t in tensors)
    return f'''"""Stage {stage_id} on {where}: {title}

Scaffolded by `dsv4-lab new stage`. The body is a PLACEHOLDER that only proves the plumbing:
every output element i gets the first input's element i mod its size, converted (the
scaffolded oracle mirrors it, so the stage passes as it is). Replace it with the real
kernel ({units}); then replace the oracle with the exact math.

Tensors (row-major, 16-byte aligned, static shapes), in the order the harness passes them:
{shapes}
"""

import cuda.bindings.driver as cuda

import cutlass  # noqa: F401  (element types, once the real kernel needs them)
import cutlass.cute as cute


class Kernel:
    """Stage {stage_id}: {title} — placeholder elementwise body."""

    THREADS = 128  # threads per CTA of the placeholder body

    def __init__(self, *, {params}):
        # validate here: raise ValueError("...") for a configuration the kernel cannot do
{assigns}

    @cute.jit
    def __call__(self, {call_args}, stream: cuda.CUstream):
        largest = {largest}
        self.kernel({names}).launch(
            grid=((largest + self.THREADS - 1) // self.THREADS, 1, 1),
            block=(self.THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, {call_args}):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.THREADS + tidx
{writes}
'''


def oracle_source(stage_id: str, title: str, axes: dict[str, list[Any]], tensors: list[TensorDecl]) -> str:
    used = sorted({n.id for t in tensors for d in t.dims for n in ast.walk(ast.parse(d, mode="eval"))
                   if isinstance(n, ast.Name)}, key=list(axes).index)
    unpack = ""
    if used:
        values = ", ".join(f'case["{a}"]' for a in used)
        unpack = f"    {', '.join(used)}{',' if len(used) == 1 else ''} = {values}\n"

    def shape(t: TensorDecl) -> str:
        return f"({', '.join(t.dims)}{',' if len(t.dims) == 1 else ''})"

    specs = "\n".join(
        f'        TensorSpec("{t.name}", {shape(t)}, "{t.dtype}"{", " + repr("out") if t.role == "out" else ""}),'
        for t in tensors
    ).replace("'out'", '"out"')
    return f'''"""Stage {stage_id}: {title}

Scaffolded by `dsv4-lab new stage`. `reference` MIRRORS THE PLACEHOLDER KERNEL (every output
element i, in CuTe's column-major order of a linear index, gets the first input's element
i mod its size): replace it with the exact math of the stage, in float64 from the same
inputs, and `flops` with the stage's real operation count.
"""

from __future__ import annotations

import math
from typing import Any

from oracles.common import TensorSpec


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    """Every kernel argument, inputs first, then outputs."""
{unpack}    return [
{specs}
    ]


def _draw(spec: TensorSpec, g):
    """Seeded values for one input: never zeros, never constant."""
    import torch

    if spec.dtype == "int32":
        return torch.randint(1, 1000, spec.shape, generator=g, dtype=torch.int32)
    if spec.dtype == "uint8":
        return torch.randint(1, 256, spec.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    return torch.randn(spec.shape, generator=g).to(getattr(torch, spec.dtype))


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {{s.name: _draw(s, g).to(device) for s in tensors(case) if s.role == "in"}}


def _colex(t):
    """A tensor's elements in CuTe's order of a linear index (first mode fastest)."""
    return t.permute(*reversed(range(t.dim()))).reshape(-1)


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    import torch

    specs = tensors(case)
    first = next(s for s in specs if s.role == "in")
    src = _colex(inputs[first.name].double())
    out = {{}}
    for s in specs:
        if s.role == "out":
            idx = torch.arange(math.prod(s.shape), device=src.device) % src.numel()
            out[s.name] = src[idx].reshape(tuple(reversed(s.shape))).permute(*reversed(range(len(s.shape))))
    return out


def flops(case: dict[str, Any]) -> float:
    """The stage's floating-point operations (placeholder: one per output element)."""
    return float(sum(math.prod(s.shape) for s in tensors(case) if s.role == "out"))
'''


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v), ensure_ascii=False)


def yaml_block(stage_id: str, title: str, folder: str, oracle_mod: str, axes: dict[str, list[Any]],
               tensors: list[TensorDecl], indent: int) -> str:
    p = " " * indent
    q = p + "  "
    r = q + "  "
    module = folder.replace("/", ".")
    lines = [
        f"{p}{stage_id}:",
        f"{q}title: {_yaml_scalar(title)}",
        f"{q}dir: {folder}",
        f"{q}kernels:",
        f"{r}sm90: {{module: {module}.sm90}}",
        f"{r}sm100: {{module: {module}.sm100}}",
        f"{q}tensors: {oracle_mod}:tensors",
        f"{q}inputs: {oracle_mod}:make_inputs",
        f"{q}oracle: {oracle_mod}:reference",
        f"{q}flops: {oracle_mod}:flops",
        f"{q}matrix:",
        *(f"{r}{a}: [{', '.join(_yaml_scalar(v) for v in vs)}]" for a, vs in axes.items()),
        f"{q}tolerances:",
        *(f"{r}{t.name}: {{cosine_min: 0.999, rel_l2_max: 1.0e-2}}" for t in tensors if t.role == "out"),
        f"{q}timeout_s: 120",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------


def _stage_indent(spec_path: Path) -> int:
    """The column of the existing stage ids under `stages:` (2 when there are none)."""
    from yaml.nodes import MappingNode

    doc = _read_bounded(spec_path)
    if isinstance(doc, MappingNode):
        for k, v in doc.value:
            if k.value == "stages" and isinstance(v, MappingNode) and v.value and not v.flow_style:
                return v.value[0][0].start_mark.column
    return 2


def _read_bounded(spec_path: Path):
    """stages.yaml's node tree, read with the lab's bounded reader; None when it cannot be."""
    from harness.core.yamlnodes import NodeContext, read_file

    try:
        return read_file(spec_path, NodeContext(spec_path.name, ScaffoldError))
    except ScaffoldError:
        return None


def _no_stages_yet(spec_path: Path) -> bool:
    """stages.yaml declares `stages:` last, with nothing under it yet."""
    from yaml.nodes import MappingNode, ScalarNode

    doc = _read_bounded(spec_path)
    if not isinstance(doc, MappingNode) or not doc.value:
        return False
    key, value = doc.value[-1]
    return key.value == "stages" and isinstance(value, ScalarNode) and value.value in ("", "~", "null")


def _slugify(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "_".join(words[:3]) or "stage"


def scaffold_stage(root: Path, stage_id: str, axes_flags: list[str], in_flags: list[str], out_flags: list[str],
                   title: str | None = None, slug: str | None = None) -> Created:
    """Create the stage's files and its stages.yaml block; raise ScaffoldError (one line)
    on a bad request, leaving the lab as it was."""
    from harness.core.paths import SPEC_NAME
    from harness.spec.spec import SpecError, load_spec, normalize_stage_name

    root = root.resolve()
    sid = normalize_stage_name(stage_id)
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", sid):
        raise ScaffoldError(f"new stage {stage_id}: stage ids are a letter then letters, digits or _ (e.g. E2)")
    axes = parse_axes(axes_flags)
    if not in_flags or not out_flags:
        raise ScaffoldError("new stage: give at least one --in and one --out tensor (e.g. --in Q:m,hd --out S:m,n)")
    tensors = [parse_tensor(t, "in", axes) for t in in_flags] + [parse_tensor(t, "out", axes) for t in out_flags]
    names = [t.name for t in tensors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ScaffoldError(f"new stage: tensor '{dup[0]}' declared twice — tensor names are unique")
    _check_shapes(axes, tensors)
    slug = slug or (_slugify(title) if title else "new")
    title = (title or f"stage {sid} (scaffold): say what it computes").strip()
    if not re.fullmatch(r"[a-z0-9_]+", slug):
        raise ScaffoldError(f"--slug {slug}: use lower-case letters, digits and _")

    spec_path = root / SPEC_NAME
    try:
        existing = load_spec(spec_path, root).stages
    except SpecError as exc:
        if not _no_stages_yet(spec_path):  # a fresh lab's `stages:` with nothing under it is fine
            raise ScaffoldError(f"{exc} (fix stages.yaml before adding a stage)")
        existing = {}
    if sid in existing:
        raise ScaffoldError(f"{SPEC_NAME}:{existing[sid].line}: stages.{sid}: stage {sid} exists — pick another id")
    folder = f"stages/{sid}_{slug}"
    stage_dir = root / folder
    oracle_file = root / "oracles" / f"{sid.lower()}.py"
    for path in (stage_dir, oracle_file):
        if path.exists():
            raise ScaffoldError(f"{path.relative_to(root)}: exists — pick another id or --slug, or remove it")
    if not (root / "oracles" / "common.py").is_file():
        raise ScaffoldError("oracles/common.py: not found — the oracle imports TensorSpec from it")

    original = spec_path.read_text()
    created = Created(sid)
    try:
        stage_dir.mkdir(parents=True)
        files = {
            stage_dir / "__init__.py": "",
            stage_dir / "sm90.py": kernel_source(sid, title, "sm90", axes, tensors),
            stage_dir / "sm100.py": kernel_source(sid, title, "sm100", axes, tensors),
            oracle_file: oracle_source(sid, title, axes, tensors),
        }
        for path, text in files.items():
            path.write_text(text)
            created.files.append(path)
        block = yaml_block(sid, title, folder, f"oracles.{sid.lower()}", axes, tensors, _stage_indent(spec_path))
        sep = "" if original.endswith("\n") or not original else "\n"
        spec_path.write_text(original + sep + "\n" + block)
        created.files.append(spec_path)
        try:
            load_spec(spec_path, root)
        except SpecError as exc:
            raise ScaffoldError(f"the new block does not load ({exc}) — stages.yaml left as it was; "
                                "is `stages:` the last top-level key, in block style?")
    except BaseException:
        spec_path.write_text(original)
        shutil.rmtree(stage_dir, ignore_errors=True)
        if oracle_file in created.files:
            oracle_file.unlink(missing_ok=True)
        raise
    return created


def main(root: Path, stage_id: str, axes: list[str], inputs: list[str], outputs: list[str],
         title: str | None = None, slug: str | None = None) -> int:
    try:
        created = scaffold_stage(root, stage_id, axes, inputs, outputs, title, slug)
    except ScaffoldError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dsv4-lab: new stage: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 2
    for path in created.files:
        print(f"{'appended' if path.name == 'stages.yaml' else 'created'}  {path.relative_to(root.resolve())}")
    sid = created.stage_id
    print(f"next: dsv4-lab check stage-{sid}; dsv4-lab compile stage-{sid} --arch sm_90a "
          f"(then write the real kernel and oracle; docs/STAGES.md)")
    return 0
