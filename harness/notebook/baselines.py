"""Baselines: per stage, arch and case, what must keep holding (README: Gate, the notebook).
Run baselines in results/baselines.yaml.xz, compile baselines in results/compile_baselines.yaml.xz:
YAML, one line a case, xz-compressed, written atomically under one lock (results/.baselines.lock)
so concurrent `accept`/`drop` lose nothing. A compile baseline still in the run file is moved at
the next write; an older clone's plain results/baselines.yaml is read where it is the only one and
moved by `save`; one case in both files, or both run files at once, is one line naming both.

* **run**: the newest passing, fresh record's metric values and their tolerance:
    cosine   absolute: now >= baseline - tol
    rel_l2   relative: now <= baseline * (1 + tol) + 1e-12
    max_abs  relative: now <= baseline * (1 + tol) + 1e-12
* **suite** (a stage with a `suite:` block, an arch the lab's GPUs run): one baseline for the whole
  case list, label SUITE_LABEL — every case's newest fresh result passed at source `src` (the
  peer's own rule and the stage's bounds), `suite: {cases: N, runs: [...]}` naming the runs that
  showed it, `record` the newest of them (a run: no one record stands for the list). Its records may then leave the live notebook for git history (compaction retires
  them: a case list of thousands would outgrow the tree a GPU machine is sent); the gate holds it
  while the stage's source hash is `src`, and otherwise wants every case's fresh result, each a pass.
* **compile** (an arch no device here runs): from the newest fresh `compiled` record, status,
  registers, spill bytes, shared memory, named barriers, the inventory's total and tensor-core
  MMA counters. The gate refuses a compile error, a new spill, registers past the margin
  (REGS_MARGIN or REGS_MARGIN_REL, the larger) and any changed MMA counter.

`accept` never replaces a run baseline with a compile-only one. A bad file (not UTF-8 or YAML,
aliases, a duplicate key, a wrong type or non-finite number, a corrupt or oversized xz) is one
line `results/baselines.yaml.xz:LINE: key: problem — fix` (BaselineError, exit 2): the gate never
passes on it, accept/drop never overwrite it, `save` never writes a file that lost a baseline.
The parsed copy in .cache/baselines/ is used only when it names these bytes' full content hash."""

from __future__ import annotations

import fcntl
import hashlib
import json
import lzma
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml
from yaml.nodes import Node

from harness.core import yamlnodes
from harness.core.jsonl import replace_file
from harness.core.labels import case_label
from harness.core.paths import cache_dir, results_dir
from harness.core.notebooklock import LockError, open_lock
from harness.notebook.records import Record, is_fresh, newest, shows_compile  # noqa: F401  (shows_compile: named here too)
from harness.core.safeio import Unsafe, open_regular, xz_decompress
from harness.spec.spec import ARCH_KEYS

BASELINE_VERSION = 1
RUN_METRICS = ("cosine", "rel_l2", "max_abs")
DEFAULT_TOLERANCE = {"cosine": 1e-6, "rel_l2": 0.25, "max_abs": 0.25}
# The label of a suite stage's one baseline (module doc: suite); no matrix case has it.
SUITE_LABEL = "all-cases"
# Compile-only: registers may grow by this many, or by this fraction, whichever is larger.
REGS_MARGIN = 8
REGS_MARGIN_REL = 0.05
COMPILE_TOLERANCE = {"regs": REGS_MARGIN, "regs_rel": REGS_MARGIN_REL}
# The loosest tolerance a baseline may carry: beyond it the baseline holds nothing (a cosine that
# may drop by 2, a relative error that may grow 1e300-fold). cosine: the drop allowed; rel_l2 and
# max_abs: the growth allowed, as a fraction (1: may double); regs: registers; regs_rel: a fraction.
MAX_TOLERANCE = {"cosine": 1e-2, "rel_l2": 1.0, "max_abs": 1.0, "regs": 64, "regs_rel": 0.5}
COMPILE_INTS = ("regs", "spill", "stack", "smem", "static_smem", "barriers")
MAX_BYTES = 64 * 1024 * 1024
HEADER = (
    "# dsv4-lab baselines: what each case must keep (see harness/notebook/baselines.py).\n"
    "# Written by `dsv4-lab baseline accept|drop`; review changes in diffs.\n"
)


class BaselineError(Exception):
    """A missing or invalid baselines file, or a bad baseline command (one line)."""


@dataclass
class Baseline:
    stage: str
    arch: str
    case: str  # the case label (harness.core.labels.case_label)
    record: str
    src: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))
    timing_us: float | None = None
    compile: dict[str, Any] | None = None  # compile-only: status, regs, spill, smem, barriers, inv, sass
    suite: dict[str, Any] | None = None  # a suite's whole case list: {"cases": N, "runs": [run ids]}

    @property
    def kind(self) -> str:
        return "compile" if self.compile is not None else ("suite" if self.suite is not None else "run")

    def to_yaml(self) -> dict[str, Any]:
        d: dict[str, Any] = {"record": self.record, "src": self.src}
        if self.suite is not None:
            return {"kind": "suite", **d, "suite": self.suite}
        if self.compile is not None:
            d = {"kind": "compile", **d, "compile": self.compile}
        else:
            d["metrics"] = self.metrics
        default = COMPILE_TOLERANCE if self.compile is not None else DEFAULT_TOLERANCE
        if self.tolerance != default:  # the defaults are filled in on reading; only a changed one is written
            d["tolerance"] = self.tolerance
        if self.timing_us is not None:
            d["us"] = self.timing_us
        return d


def baselines_file(root: Path) -> Path:
    """The run baselines: YAML, xz-compressed like the compile baselines (`compile_baselines_file`)."""
    return results_dir(root) / RUN_FILE


def old_baselines_file(root: Path) -> Path:
    """Where an older clone keeps the run baselines: plain YAML, read until the next write
    compresses it into `baselines_file`."""
    return results_dir(root) / OLD_RUN_FILE


RUN_FILE = "baselines.yaml.xz"
OLD_RUN_FILE = "baselines.yaml"


def compile_baselines_file(root: Path) -> Path:
    """The compile baselines: machine-written counters, xz-compressed (one stream, preset
    9|extreme) — `git config diff.xz.textconv "xz -dc"` shows their text in diffs."""
    return results_dir(root) / COMPILE_FILE


COMPILE_FILE = "compile_baselines.yaml.xz"


def _display(root: Path, path: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------
# Reading: strict, one line per problem.


class _Bad(Exception):
    def __init__(self, keys: tuple[Any, ...], problem: str):
        super().__init__(problem)
        self.keys = keys
        self.problem = problem


def _what(v: Any) -> str:
    if v is None:
        return "nothing (an empty value)"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}"


def _mapping(v: Any, keys: tuple, what: str = "a mapping") -> dict:
    if not isinstance(v, dict):
        raise _Bad(keys, f"expected {what}, got {_what(v)}")
    for k in v:
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise _Bad(keys, f"key {k!r} is not a name")
    return v


def _number(v: Any, keys: tuple, minimum: float | None = None, positive: bool = False,
            maximum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(keys, f"expected a number, got {_what(v)}")
    if not math.isfinite(v):
        raise _Bad(keys, f"{v} is not a finite number")
    if positive and v <= 0:
        raise _Bad(keys, f"{v} must be greater than 0")
    if minimum is not None and v < minimum:
        raise _Bad(keys, f"{v} must be at least {minimum}")
    if maximum is not None and v > maximum:
        raise _Bad(keys, f"{v:g} holds nothing — give at most {maximum:g} (or drop the key for the default)")
    return v


def _tolerance_value(k: str, v: Any, keys: tuple) -> float:
    """A baseline tolerance: finite, from 0 to MAX_TOLERANCE[k]."""
    return _number(v, keys + ("tolerance", k), minimum=0, maximum=MAX_TOLERANCE[k])


def _count(v: Any, keys: tuple) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _Bad(keys, f"expected a count (an integer >= 0), got {_what(v)}")
    return v


def _text(v: Any, keys: tuple) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(keys, f"expected a non-empty string, got {_what(v)}")
    return v


def _only(d: dict, allowed: tuple[str, ...], keys: tuple) -> None:
    for k in d:
        if k not in allowed:
            raise _Bad(keys + (k,), f"unknown key — expected one of {', '.join(allowed)}")


def _entry(stage: str, arch: str, label: str, e: Any) -> Baseline:
    keys: tuple = ("baselines", stage, arch, label)
    e = _mapping(e, keys)
    _only(e, ("kind", "record", "src", "metrics", "tolerance", "us", "compile", "suite"), keys)
    kind = e.get("kind", "run")
    if kind not in ("run", "compile", "suite"):
        raise _Bad(keys + ("kind",), f"expected run, compile or suite, got {_what(kind)}")
    if kind == "suite":
        return _suite_entry(stage, arch, label, e, keys)
    for req in ("record", "src") + (("compile",) if kind == "compile" else ("metrics",)):
        if req not in e:
            raise _Bad(keys, f"missing '{req}' — a {kind} baseline needs record, src and "
                             f"{'compile' if kind == 'compile' else 'metrics'}")
    record = _text(e["record"], keys + ("record",))
    src = _text(e["src"], keys + ("src",))
    tol_in = e.get("tolerance") or {}
    tol_in = _mapping(tol_in, keys + ("tolerance",))
    if kind == "run":
        metrics: dict[str, dict[str, float]] = {}
        mm = _mapping(e["metrics"], keys + ("metrics",))
        if not mm:
            raise _Bad(keys + ("metrics",), "no outputs — a run baseline holds at least one output's metrics")
        for out, m in mm.items():
            m = _mapping(m, keys + ("metrics", out))
            _only(m, RUN_METRICS, keys + ("metrics", out))
            if not m:
                raise _Bad(keys + ("metrics", out), "no metric values")
            metrics[str(out)] = {name: float(_number(v, keys + ("metrics", out, name))) for name, v in m.items()}
        _only(tol_in, RUN_METRICS, keys + ("tolerance",))
        tol = {**DEFAULT_TOLERANCE, **{k: float(_tolerance_value(k, v, keys)) for k, v in tol_in.items()}}
        us = e.get("us")
        us = None if us is None else float(_number(us, keys + ("us",), positive=True))
        return Baseline(str(stage), str(arch), str(label), record, src, metrics, tol, us)
    comp = _mapping(e["compile"], keys + ("compile",))
    _only(comp, ("status",) + COMPILE_INTS + ("inv", "sass"), keys + ("compile",))
    if comp.get("status") != "compiled":
        raise _Bad(keys + ("compile", "status"), f"expected compiled, got {_what(comp.get('status'))}")
    if "inv" not in comp:
        raise _Bad(keys + ("compile",), "missing 'inv' — a compile baseline holds the instruction inventory")
    out_c: dict[str, Any] = {"status": "compiled"}
    for k in COMPILE_INTS:
        if k in comp:
            out_c[k] = _count(comp[k], keys + ("compile", k))
    for k in ("inv", "sass"):
        if k in comp:
            inv = _mapping(comp[k], keys + ("compile", k))
            out_c[k] = {str(name): _count(v, keys + ("compile", k, name)) for name, v in inv.items()}
    _only(tol_in, tuple(COMPILE_TOLERANCE), keys + ("tolerance",))
    tol = {**COMPILE_TOLERANCE, **{k: _tolerance_value(k, v, keys) for k, v in tol_in.items()}}
    return Baseline(str(stage), str(arch), str(label), record, src, {}, tol, None, out_c)


def _suite_entry(stage: str, arch: str, label: str, e: dict, keys: tuple) -> Baseline:
    """A suite's one baseline (module doc): record, src and suite {cases, runs}, nothing else."""
    _only(e, ("kind", "record", "src", "suite"), keys)
    if label != SUITE_LABEL:
        raise _Bad(keys, f"a suite baseline is labelled {SUITE_LABEL} (it holds every case of the list)")
    for req in ("record", "src", "suite"):
        if req not in e:
            raise _Bad(keys, f"missing '{req}' — a suite baseline needs record, src and suite")
    record = _text(e["record"], keys + ("record",))
    src = _text(e["src"], keys + ("src",))
    body = _mapping(e["suite"], keys + ("suite",))
    _only(body, ("cases", "runs"), keys + ("suite",))
    for req in ("cases", "runs"):
        if req not in body:
            raise _Bad(keys + ("suite",), f"missing '{req}' — a suite baseline counts its cases and names its runs")
    cases = _count(body["cases"], keys + ("suite", "cases"))
    if cases == 0:
        raise _Bad(keys + ("suite", "cases"), "0 cases hold nothing")
    runs = body["runs"]
    if not isinstance(runs, list) or not runs:
        raise _Bad(keys + ("suite", "runs"), f"expected a non-empty list of run ids, got {_what(runs)}")
    runs = [_text(r, keys + ("suite", "runs")) for r in runs]
    return Baseline(str(stage), str(arch), str(label), record, src, {}, {}, None, None,
                    {"cases": cases, "runs": runs})


def _tree(doc: Any) -> list[Baseline]:
    from harness.spec.spec import ARCHS

    if doc is None:
        return []
    doc = _mapping(doc, (), "a mapping with 'version' and 'baselines'")
    _only(doc, ("version", "baselines"), ())
    version = doc.get("version")
    if version != BASELINE_VERSION or isinstance(version, bool):
        raise _Bad(("version",), f"expected {BASELINE_VERSION}, got {_what(version)}")
    stages = doc.get("baselines")
    if stages is None:
        return []
    stages = _mapping(stages, ("baselines",))
    arch_names = tuple(ARCHS.values())
    out: list[Baseline] = []
    for stage, archs in stages.items():
        archs = _mapping(archs, ("baselines", stage), "a mapping of arch -> cases")
        for arch, cases in archs.items():
            if arch not in arch_names:
                raise _Bad(("baselines", stage, arch), f"unknown arch — expected one of {', '.join(arch_names)}")
            cases = _mapping(cases, ("baselines", stage, arch), "a mapping of case -> baseline")
            for label, entry in cases.items():
                out.append(_entry(str(stage), str(arch), str(label), entry))
    return out


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # the file never holds anchors or aliases
        return True


def _depth(v: Any) -> int:
    """How deep mappings nest in `v`: 0 for a plain value, 1 for a mapping of plain values."""
    return 1 + max((_depth(x) for x in v.values()), default=0) if isinstance(v, dict) else 0


def _represent_mapping(dumper: yaml.SafeDumper, data: dict) -> yaml.MappingNode:
    """A case's baseline in flow style on one line (one case is one line of a diff); the
        mappings above it (arch, stage) in blocks."""
    flow = isinstance(data, _Case) or (_depth(data) <= 2 and not any(isinstance(v, list) for v in data.values()))
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow)


class _Case(dict):
    """One case's baseline as written: a flow mapping on one line, however shallow or deep."""


_NoAliasDumper.add_representer(dict, _represent_mapping)
_NoAliasDumper.add_representer(_Case, _represent_mapping)


def _results_folder(root: Path) -> None:
    """BaselineError (one line) when results/ is there but is no folder (the notebook is gone)."""
    folder = results_dir(root)
    if os.path.lexists(folder) and not folder.is_dir():
        raise BaselineError(f"{_display(root, folder)}: is not a folder — it is the lab's notebook (records and "
                            "baselines): move the file away and restore it: git checkout results")


def _run_path(root: Path) -> Path:
    """The run-baselines file to read: results/baselines.yaml.xz, or an older clone's plain one where
        only it exists; both: BaselineError naming both."""
    return newer_or_older(root, baselines_file(root), old_baselines_file(root),
                          lambda path: _read_file(root, path, xz=path.name.endswith(".xz")) or [],
                          "run baselines", "dsv4-lab baseline accept", "baselines")


def newer_or_older(root: Path, new: Path, old: Path, read: Any, what: str, command: str, counted: str) -> Path:
    """`new` (an .xz file) or, where only it is there, `old` (its plain form); both at once:
        BaselineError naming both (`read(path)`: a file's items, to tell a cut-short write from two
        that differ)."""
    if not os.path.lexists(old) or not os.path.lexists(new):
        return old if os.path.lexists(old) else new
    shown_new, shown_old = _display(root, new), _display(root, old)
    try:
        a, b = read(new), read(old)
    except BaselineError:
        a = b = None
    order = lambda x: (x.stage, x.arch, x.case)  # noqa: E731
    if a is not None and b is not None and sorted(a, key=order) == sorted(b, key=order):
        fix = f"both hold the same {len(a)} {counted} (a write cut short?): remove the plain one (git rm {shown_old})"
    else:
        held = f" ({len(a)} and {len(b)} {counted})" if a is not None and b is not None else ""
        fix = (f"they differ{held}: keep the one that holds the truth — `git rm {shown_old}` keeps {shown_new}; "
               f"`git rm {shown_new}` keeps {shown_old}, which the next `{command}` compresses "
               f"(`xz -dc {shown_new}` shows its text)")
    raise BaselineError(f"{shown_new} and {shown_old}: both present — the {what} are kept in {shown_new} "
                        f"only ({shown_old} is their plain form in an older clone, or a merge from one); {fix}")


def _read_runs(root: Path) -> tuple[Path, list[Baseline] | None]:
    """(the run-baselines file, its baselines: None when it is not there) — `_run_path`."""
    path = _run_path(root)
    return path, _read_file(root, path, xz=path.name.endswith(".xz"))


def load(root: Path, must_exist: bool = False) -> list[Baseline]:
    """Every baseline of the run file and the compile file ([] when neither, unless `must_exist`);
        BaselineError (one line) for anything wrong — a duplicate key at any level, or one case in
        both files."""
    _results_folder(root)
    run_path, plain = _read_runs(root)
    packed = _read_file(root, compile_baselines_file(root), xz=True)
    if plain is None and packed is None:
        if must_exist:
            raise BaselineError(f"{_display(root, baselines_file(root))}: not found — create baselines with "
                                "`dsv4-lab baseline accept STAGE`")
        return []
    if not packed:
        return plain or []
    seen = {(b.stage, b.arch, b.case) for b in plain or []}
    for b in packed:
        if (b.stage, b.arch, b.case) in seen:
            raise BaselineError(
                f"{_display(root, compile_baselines_file(root))}: baselines.{b.stage}.{b.arch}.{b.case}: also in "
                f"{_display(root, run_path)} — one case has one baseline: remove it from one of the two "
                "files (a merge resolved badly?), or `dsv4-lab baseline accept` it again")
    return sorted((plain or []) + packed, key=lambda b: (b.stage, b.arch, b.case))  # stable: save's order


def _read_file(root: Path, path: Path, xz: bool) -> list[Baseline] | None:
    """The baselines of one file (None when missing); BaselineError (`FILE:LINE: key: problem — fix`,
        the decompressed text's line for xz)."""
    shown = _display(root, path)
    fix = "fix it, or re-create the entry with `dsv4-lab baseline accept`"
    if not os.path.lexists(path):
        return None
    try:
        fd = open_regular(path)
    except Unsafe as exc:
        raise BaselineError(f"{shown}:1: {exc.strerror} — it must be the "
                            f"{'xz-compressed YAML' if xz else 'YAML'} file `dsv4-lab baseline accept` writes") from None
    except OSError as exc:
        raise BaselineError(f"{shown}:1: cannot be read ({exc.strerror or exc}) — fix its permissions") from None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise BaselineError(f"{shown}:1: cannot be read ({exc.strerror or exc}) — fix its permissions")
    if len(data) > MAX_BYTES:
        raise BaselineError(f"{shown}:1: larger than {MAX_BYTES // (1024 * 1024)} MiB — not a baselines file")
    if xz:
        try:
            data = xz_decompress(data, cap=MAX_BYTES)
        except ValueError as exc:
            raise BaselineError(f"{shown}:1: not a readable xz file ({exc}) — restore it: git checkout {shown}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise BaselineError(f"{shown}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}) — {fix}")
    digest = hashlib.sha256(data).hexdigest()  # of the text: the xz file's parsed copy is found by it too
    parsed = _parsed_cache(root, digest)
    cached = _cached(parsed, digest)
    if cached is not None:  # these very bytes were read and found valid before
        return cached
    alias = yamlnodes.anchor_line(text)
    if alias is not None:
        raise BaselineError(f"{shown}:{alias}: YAML anchors and aliases are not allowed here — write the values out")
    node = yamlnodes.compose(text, yamlnodes.NodeContext(shown, BaselineError), max_nodes=MAX_NODES)
    if node is not None:
        _refuse_duplicates(node, shown)
    try:
        doc = yamlnodes.scalar(node)
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as exc:
        raise BaselineError(f"{shown}:1: cannot be read ({type(exc).__name__}) — {fix}")
    try:
        items = _tree(doc)
    except _Bad as bad:
        key = ".".join(str(k) for k in bad.keys) or "(top level)"
        line = yamlnodes.line_of(node, bad.keys)
        raise BaselineError(f"{shown}:{line}: {key}: {bad.problem} — {fix}")
    if parsed is not None and isinstance(doc, dict):
        _remember(parsed, digest, doc, len(items))
    return items


MAX_NODES = 5_000_000  # values in a baselines file (about 30 per case; composing takes ~15 µs a value)
CACHE_VERSION = 2  # of a parsed copy in .cache/baselines/


def _refuse_duplicates(root_node: Node, shown: str) -> None:
    """BaselineError (file:line: key: the fix) for the first mapping holding a key twice, at any level
        (keys compared as text: `1` and "1" are one)."""
    dup = yamlnodes.duplicate_key(root_node)
    if dup is not None:
        line, key, first = dup
        raise BaselineError(f"{shown}:{line}: {yamlnodes.one_line(key, 200)}: duplicate key (also at line "
                            f"{first}) — keep one of the two (a merge resolved badly?): YAML would "
                            "keep the last and silently lose the first")


def _cached(path: Path | None, digest: str) -> list[Baseline] | None:
    """The baselines of a parsed copy this lab wrote for these very bytes (version, full content
        hash, shape, count all match); else None (parse the YAML again)."""
    if path is None:
        return None
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
        entry = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(entry, dict) and entry.get("v") == CACHE_VERSION and entry.get("sha256") == digest
            and isinstance(entry.get("doc"), dict) and isinstance(entry.get("n"), int)):
        return None
    try:
        items = _tree(entry["doc"])
    except (_Bad, RecursionError, TypeError, ValueError):
        return None
    if len(items) != entry["n"] or len({(b.stage, b.arch, b.case) for b in items}) != len(items):
        return None
    return items


def _parsed_cache(root: Path, digest: str) -> Path | None:
    """Where a baselines file's parsed form is kept (JSON, keyed by the hash of its bytes: parsing
        YAML is most of a read). Checked on read (`_cached`), never trusted."""
    try:
        folder = cache_dir(root) / "baselines"
    except OSError:
        return None
    return folder / f"{digest[:32]}.json"


def _remember(path: Path, digest: str, doc: Any, n: int) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"v": CACHE_VERSION, "sha256": digest, "n": n, "doc": doc}, default=str))
        tmp.replace(path)
    except (OSError, TypeError, ValueError):
        pass  # a cache only


def save(root: Path, items: list[Baseline], read: list[Baseline] | None = None) -> None:
    """Write exactly `items`: run baselines to results/baselines.yaml.xz, compile baselines to
        results/compile_baselines.yaml.xz (when there are any, or it exists), each atomically; an
        older clone's plain file is removed once the .xz holds it. With `read` (what the files held
        under the lock), every case read must still be among `items`. The new text is parsed back
        before the rename and must hold exactly its baselines (else BaselineError, the old file
        stays). A case changing kind is written to its new file first: a crash leaves it in both
        (one line at the next read), never in neither."""
    shown = _display(root, baselines_file(root))
    keys = [(b.stage, b.arch, b.case) for b in items]
    if len(set(keys)) != len(keys):
        raise BaselineError(f"{shown}: not written — two baselines for one case (a bug in the lab); the file is "
                            "unchanged")
    if read is not None:
        lost = {(b.stage, b.arch, b.case) for b in read} - set(keys)
        if lost:
            stage, arch, case = sorted(lost)[0]
            raise BaselineError(f"{shown}: not written — it would lose {len(lost)} of the {len(read)} baselines it "
                                f"holds (stage-{stage} {arch} {case} …); the file is unchanged")
    runs = [b for b in items if b.kind != "compile"]  # a suite's baseline is a run baseline of its own kind
    comps = [b for b in items if b.kind == "compile"]
    # What the run file holds of the cases the compile file will hold (a run baseline turned compile-only,
    # a compile baseline written before the split) stays there until the compile file holds them.
    run_path = _run_path(root)  # both the .xz and an older clone's plain file: one line, nothing written
    try:
        now = _read_file(root, run_path, xz=run_path.name.endswith(".xz")) or []
    except BaselineError:
        now = []  # callers read (and refused) a bad file before: nothing of it is kept
    to_xz = {(b.stage, b.arch, b.case) for b in comps}
    leaving = [b for b in now if (b.stage, b.arch, b.case) in to_xz]
    run_data = _encode(root, baselines_file(root), runs + leaving, xz=True)
    packed = None
    if comps or os.path.lexists(compile_baselines_file(root)):
        packed = _encode(root, compile_baselines_file(root), comps, xz=True)
    _results_folder(root)
    _write(root, baselines_file(root), *run_data)
    if packed is not None:
        _write(root, compile_baselines_file(root), *packed)
    if leaving:
        _write(root, baselines_file(root), *_encode(root, baselines_file(root), runs, xz=True))
    if run_path == old_baselines_file(root):  # an older clone's plain file: the .xz now holds all it held
        remove_older(root, run_path, baselines_file(root))


def remove_older(root: Path, old: Path, new: Path) -> None:
    """Remove `old`, the plain file `new` now holds (git sees it go); BaselineError when it stays."""
    try:
        old.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise BaselineError(f"{_display(root, old)}: written to {_display(root, new)} but not removed "
                            f"({exc.strerror or exc}) — remove it (git rm {_display(root, old)})") from None


def _encode(root: Path, path: Path, items: list[Baseline], xz: bool) -> tuple[bytes, bytes, Any, int]:
    """(bytes, text, parsed document, count) for `items` in `path`'s layout; BaselineError when the
        text does not read back as exactly `items`."""
    tree: dict[str, Any] = {}
    for b in sorted(items, key=lambda b: (b.stage, b.arch, b.case)):
        tree.setdefault(b.stage, {}).setdefault(b.arch, {})[b.case] = _Case(b.to_yaml())
    doc = {"version": BASELINE_VERSION, "baselines": tree}
    text = HEADER + yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False, width=1 << 20, allow_unicode=True)
    loaded = yaml.load(text, Loader=yamlnodes.fast_loader())
    back = _tree(loaded)
    order = lambda b: (b.stage, b.arch, b.case)  # noqa: E731
    if sorted(back, key=order) != sorted(items, key=order):
        raise BaselineError(f"{_display(root, path)}: not written — the new text reads back as {len(back)} "
                            f"baselines that differ from the {len(items)} to write (a bug in the lab); the file is "
                            "unchanged")
    raw = text.encode("utf-8")
    data = lzma.compress(raw, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME) if xz else raw
    if xz and xz_decompress(data, cap=MAX_BYTES) != raw:
        raise BaselineError(f"{_display(root, path)}: not written — the compressed text does not read back (a bug "
                            "in the lab); the file is unchanged")
    return data, raw, loaded, len(items)


def _write(root: Path, path: Path, data: bytes, raw: bytes, loaded: Any, n: int) -> None:
    replace_file(path, data)  # under the baselines lock (`locked`): one writer at a time
    digest = hashlib.sha256(raw).hexdigest()
    parsed = _parsed_cache(root, digest)
    if parsed is not None:  # the next read (the gate, every commit) skips the YAML
        _remember(parsed, digest, loaded, n)


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the baselines lock (results/.baselines.lock, beside the file) for a
    read-modify-write: concurrent accepts and drops take turns, none is lost."""
    _results_folder(root)
    lock = results_dir(root) / ".baselines.lock"
    try:
        fd = open_lock(lock)
    except LockError as exc:
        raise BaselineError(str(exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def metrics_of(record: Record) -> dict[str, dict[str, float]]:
    """The gated metric values of a record, per output, as a baseline with the default
    tolerances keeps them (gated_metrics)."""
    return gated_metrics({
        out: {k: m[k] for k in RUN_METRICS if m.get(k) is not None}
        for out, m in record.metrics.items()
    }, DEFAULT_TOLERANCE)


SIG_DIGITS = 8  # a run baseline's metric values; the record it names keeps them in full
ROUND_BELOW_TOL = 1e-6  # rounding moves a value by ≤ 5e-8 of itself: far inside any tolerance from this


def gated_metrics(metrics: dict[str, dict[str, float]], tolerance: dict[str, float]) -> dict[str, dict[str, float]]:
    """A run baseline's metric values as the file keeps them: SIG_DIGITS significant digits where
        the tolerance is at least ROUND_BELOW_TOL (the comparison moves by at most 5e-8 of the
        value), exact below it.  The record the baseline names keeps every digit."""
    def rounded(name: str, v: float) -> float:
        if not isinstance(v, float) or not math.isfinite(v) or tolerance.get(name, 0.0) < ROUND_BELOW_TOL:
            return v
        return float(f"{v:.{SIG_DIGITS}g}")
    return {out: {name: rounded(name, v) for name, v in m.items()} for out, m in metrics.items()}


def compile_facts(record: Record) -> dict[str, Any] | None:
    """What a compile-only baseline keeps of a record's compile summary (None when the
    record does not carry the inventory: written before the lab kept it)."""
    c = record.compile or {}
    if record.status == "compile_error" or not isinstance(c.get("inv"), dict):
        return None
    out: dict[str, Any] = {"status": "compiled"}
    for k in COMPILE_INTS:
        if isinstance(c.get(k), int) and not isinstance(c.get(k), bool):
            out[k] = c[k]
    out["inv"] = gated_counts(c["inv"])
    if isinstance(c.get("sass"), dict) and c["sass"]:
        out["sass"] = gated_counts(c["sass"])
    return out


def gated_counts(inv: dict[str, int]) -> dict[str, int]:
    """What a compile baseline keeps of an inventory: the total and the tensor-core MMA counters
        the gate compares (the record keeps the whole inventory)."""
    from harness.notebook.inventory import ALL, mma_counts

    return {**({ALL: inv[ALL]} if ALL in inv else {}), **mma_counts(inv)}


def _passed(rec: Record) -> bool:
    return rec.status == "pass"


def runnable_archs() -> set[str]:
    from harness.core.environment import gpu_capabilities

    return {a for _, a in gpu_capabilities().values() if a} | {"cpu"}


# ---------------------------------------------------------------------------------------
# Commands.


def accept(spec, stage, archs: list[str] | None, cases, compile_only: bool = False) -> int:
    """For each selected case the newest passing, fresh record becomes its run baseline; where
        there is none and this machine cannot run the arch (or `compile_only`), the newest fresh
        `compiled` record becomes a compile-only baseline — unless a run baseline exists."""
    from rich.console import Console

    from harness.spec.identity import source_hash
    from harness.notebook.records import print_warnings, read_records

    console = Console(highlight=False, markup=False)
    root = spec.root
    runnable = runnable_archs()
    run_archs = [a for a in stage.kernels if (a in LAB_RUN_ARCHS or a in runnable) and (not archs or a in archs)]
    if stage.suite is not None and not compile_only and run_archs:  # a suite's archs that run: one baseline each
        return accept_suite(spec, stage, run_archs, cases)
    with locked(root):
        current = load(root)  # a bad file stops here: nothing is overwritten
        warn: list[str] = []
        records = read_records(root, [stage.id], warn)
        print_warnings(warn)
        index = {(b.stage, b.arch, b.case): b for b in current}
        taken: list[tuple[str, str, str, str]] = []
        why_not: dict[tuple[str, str], int] = {}
        hopper: dict[tuple[str, str], int] = {}  # cases of an arch the lab's GPUs run, with no pass to take
        for arch in stage.kernels:
            if archs and arch not in archs:
                continue
            src = source_hash(root, stage, arch)
            for case in cases:
                label = case_label(case.dict)
                key = (stage.id, arch, label)
                rec = None if compile_only else newest(records, stage.id, arch, case.dict, src, _passed)
                if rec is not None:
                    index[key] = Baseline(stage.id, arch, label, rec.id, src, metrics_of(rec),
                                          timing_us=(rec.timing or {}).get("us"))
                    taken.append((arch, label, rec.id, "run"))
                    continue
                if arch in runnable and not compile_only:
                    _bump(why_not, arch, f"no passing result for the current source — run it first: "
                                         f"dsv4-lab run {stage.name} --arch {arch}")
                    continue
                if arch in LAB_RUN_ARCHS:  # what compiling proves is not the proof a lab GPU gives
                    _bump(hopper, arch, "")
                    continue
                old = index.get(key)
                if old is not None and old.kind == "run" and not compile_only:
                    _bump(why_not, arch, "keep their run baseline (no passing result for the current source here; "
                                         "a compile-only baseline never replaces a run baseline)")
                    continue
                crec = newest(records, stage.id, arch, case.dict, src, shows_compile)
                if crec is None:
                    _bump(why_not, arch, "have no compiled record for the current source — compile them first: "
                                         f"dsv4-lab compile {stage.name} --arch {arch}")
                    continue
                facts = compile_facts(crec)
                if facts is None:
                    _bump(why_not, arch, "do not compile for the current source (compile_error) — fix the build "
                                         "first; a broken build is never baselined")
                    continue
                index[key] = Baseline(stage.id, arch, label, crec.id, src, {}, dict(COMPILE_TOLERANCE), None, facts)
                taken.append((arch, label, crec.id, "compile-only"))
        if taken:
            save(root, list(index.values()), read=current)
    for arch, label, rid, kind in taken:
        console.print(f"baseline {stage.name} {arch} {label} ← {rid} ({kind})")
    for (arch, why), n in sorted(why_not.items()):
        console.print(f"{arch}: {n} case(s) {why}")
    for (arch, _), n in sorted(hopper.items()):
        line = (f"{arch} runs on {LAB_RUN_ARCHS[arch]}: {n} case(s) of {stage.name} have no passing result for the "
                f"current source, and compile-only baselines are only for archs no lab machine runs "
                f"({', '.join(a for a in ARCH_KEYS if a not in LAB_RUN_ARCHS and a != 'cpu')}) — run them on a "
                f"{LAB_RUN_ARCHS[arch]} GPU (dsv4-lab run {stage.name} --arch {arch}, here or with --target NAME), "
                "then accept")
        if not taken:  # nothing else was asked for: bad usage, one line
            print(f"dsv4-lab: {line}", file=sys.stderr)
            return 2
        console.print(line)
    if not taken:
        console.print(f"no baseline taken for {stage.name} with these filters")
        return 1
    return 0


SUITE_SHOWN = 3  # accept of a suite: how many of the cases that stop it its line names


def accept_suite(spec, stage, archs: list[str], cases) -> int:
    """A suite stage's one baseline per arch the lab's GPUs run (module doc: suite): taken only when
        every case of its list has a fresh result and each passed; otherwise one line naming how many
        did not and the first few, exit 1.  It replaces the stage's per-case baselines of that arch."""
    from rich.console import Console

    from harness.notebook.records import print_warnings, read_records
    from harness.spec.identity import source_hash
    from harness.spec.matrix import expand

    console = Console(highlight=False, markup=False, soft_wrap=True)
    every = expand(stage)
    if len(cases) != len(every):
        print(f"dsv4-lab: {stage.name} is a suite: its baseline holds every one of its {len(every)} cases — "
              "accept it without filters", file=sys.stderr)
        return 2
    root = spec.root
    code = 0
    with locked(root):
        current = load(root)
        warn: list[str] = []
        records = read_records(root, [stage.id], warn)
        print_warnings(warn)
        keep = list(current)
        taken: list[Baseline] = []
        labels = [case_label(c.dict) for c in every]
        for arch in archs:
            src = source_hash(root, stage, arch)
            by_case = fresh_verdicts(records, arch, src)
            missing = [label for label in labels if label not in by_case]
            failed = [f"{label}: {by_case[label].status} {by_case[label].id}" for label in labels
                      if label in by_case and by_case[label].status != "pass"]
            if missing or failed:
                parts = [f"{len(xs)} {what} ({_few(xs)})" for xs, what in
                         ((failed, "failed"), (missing, "have no result for the current source")) if xs]
                console.print(f"{stage.name} {arch}: no suite baseline — it holds every one of the {len(every)} cases "
                              f"passing, and {' and '.join(parts)}: run them (dsv4-lab run {stage.name} --arch {arch})")
                code = 1
                continue
            chosen = [by_case[label] for label in labels]
            newest_rec = max(chosen, key=lambda r: r.t)
            runs = sorted({r.run for r in chosen})
            keep = [b for b in keep if not (b.stage == stage.id and b.arch == arch)]
            taken.append(Baseline(stage.id, arch, SUITE_LABEL, newest_rec.run, src, {}, {}, None, None,
                                  {"cases": len(every), "runs": runs}))
        if taken:
            save(root, keep + taken, read=keep)
    for b in taken:
        console.print(f"baseline {stage.name} {b.arch} {SUITE_LABEL}: all {b.suite['cases']} cases pass "
                      f"← runs {', '.join(b.suite['runs'])} (suite: compaction may now retire its records)")
    return code


def fresh_verdicts(records: list[Record], arch: str, src: str) -> dict[str, Record]:
    """Case label -> the newest record of `arch` made at source `src` with a verdict (pass, fail, …)."""
    from harness.core.statuses import RAN
    from harness.notebook.records import newest_by_case

    return newest_by_case([r for r in records if r.arch == arch and is_fresh(r, src)], lambda r: r.status in RAN)


def _few(items: list[str]) -> str:
    return "; ".join(items[:SUITE_SHOWN]) + (" …" if len(items) > SUITE_SHOWN else "")


# The archs the lab's own GPUs run (Hopper: H100/H200), each with the GPU that runs it: a case of
# one is baselined from a passing run, never from compiling alone.
LAB_RUN_ARCHS: dict[str, str] = {"sm_90a": "Hopper"}


def _bump(counts: dict[tuple[str, str], int], arch: str, why: str) -> None:
    counts[(arch, why)] = counts.get((arch, why), 0) + 1


GONE_SHOWN = 5  # `drop --gone`: how many of the dropped labels its line names


def drop(spec, stage, archs: list[str] | None, cases, every: bool = False, gone: bool = False) -> int:
    """Remove the stage's baselines of `cases`; `every`: all of them (cases the matrix no longer
        has included); `gone`: only those naming no case of the current matrix (`more:` and suite
        cases included). `gone` dropping nothing is "nothing gone", exit 0."""
    from rich.console import Console

    from harness.spec.matrix import expand

    labels = {case_label(c.dict) for c in (expand(stage) if gone else cases)}
    if stage.suite is not None and (gone or len(labels) == len(expand(stage))):  # its one baseline (suite)
        labels.add(SUITE_LABEL)
    with locked(spec.root):
        items = load(spec.root, must_exist=True)
        mine = [b for b in items if b.stage == stage.id and (not archs or b.arch in archs)]
        if gone:
            dropped = [b for b in mine if b.case not in labels]
        else:
            dropped = [b for b in mine if every or b.case in labels]
        out = {id(b) for b in dropped}
        keep = [b for b in items if id(b) not in out]
        n = len(dropped)
        if n:
            save(spec.root, keep, read=keep)
    where = f" for {', '.join(archs)}" if archs else ""
    console = Console(highlight=False, markup=False, soft_wrap=True)  # one line, however long the labels
    if gone:
        if not n:
            console.print(f"nothing gone: {len(mine)} baseline(s) of {stage.name}{where}, each names a case of its matrix")
            return 0
        shown = ", ".join(f"{b.arch} {b.case}" for b in dropped[:GONE_SHOWN])
        more = f" and {n - GONE_SHOWN} more" if n > GONE_SHOWN else ""
        console.print(f"dropped {n} baseline(s) of {stage.name} whose case its matrix no longer has: {shown}{more}; "
                      f"kept {len(mine) - n}")
        return 0
    if not n:  # a typo'd arch or filter must not read as done: say so, exit 1
        import sys

        what = "is kept" if every else "matches these filters"
        print(f"dsv4-lab: no baseline of {stage.name}{where} {what} — nothing dropped "
              f"(see dsv4-lab baseline show {stage.name})", file=sys.stderr)
        return 1
    console.print(f"dropped {n} baseline(s) of {stage.name}")
    return 0


def select(items: list[Baseline], stage: str | None = None, archs: list[str] | None = None,
           labels: set[str] | None = None) -> list[Baseline]:
    return [b for b in items if (stage is None or b.stage == stage) and (not archs or b.arch in archs)
            and (labels is None or b.case in labels)]


def show(root: Path, stage: Any = None, archs: list[str] | None = None, cases: list | None = None) -> int:
    """The baselines, filtered: `stage` (a Stage or a name), `archs`, and `cases` (the
    stage's matrix cases that the axis filters selected)."""
    from rich.markup import escape
    from rich.table import Table

    from harness.core.console import make_console
    from harness.notebook.inventory import mma_counts
    from harness.spec.spec import normalize_stage_name

    items = load(root, must_exist=True)
    sid = None if stage is None else (stage.id if hasattr(stage, "id") else normalize_stage_name(str(stage)))
    labels = None if cases is None else {case_label(c.dict) for c in cases} | {SUITE_LABEL}  # a suite's, whatever the filter
    items = sorted(select(items, sid, archs, labels), key=matrix_order(root))
    console = make_console()
    if not items:
        console.print("no baselines match" + (f" for stage-{escape(sid)}" if sid else "")
                      + " — add some with `dsv4-lab baseline accept STAGE`", highlight=False)
        return 0
    runs = [b for b in items if b.kind == "run"]
    comps = [b for b in items if b.kind == "compile"]
    if runs:
        t = Table(title="baselines (run)")
        for col in ("stage", "arch", "case", "output", "cosine", "rel L2", "max abs", "µs", "record"):
            t.add_column(col)
        for b in runs:
            for out, m in b.metrics.items():
                t.add_row(escape(b.stage), b.arch, escape(b.case), escape(out), _f(m.get("cosine"), ".9f"), _f(m.get("rel_l2"), ".2e"),
                          _f(m.get("max_abs"), ".2e"), _f(b.timing_us, ".2f"), escape(b.record))
        console.print(t)
    suites = [b for b in items if b.kind == "suite"]
    if suites:
        t = Table(title="baselines (suite: every case of the list passed)")
        for col in ("stage", "arch", "cases", "src", "runs", "record"):
            t.add_column(col)
        for b in suites:
            s = b.suite or {}
            t.add_row(escape(b.stage), b.arch, str(s.get("cases")), escape(b.src[:12]),
                      escape(", ".join(s.get("runs", []))), escape(b.record))
        console.print(t)
    if comps:
        t = Table(title="baselines (compile-only)")
        for col in ("stage", "arch", "case", "regs", "spill", "smem", "bar", "MMA (PTX)", "MMA (SASS)", "record"):
            t.add_column(col)
        for b in comps:
            c = b.compile or {}
            t.add_row(escape(b.stage), b.arch, escape(b.case), _f(c.get("regs"), "d"), _f(c.get("spill"), "d"), _f(c.get("smem"), "d"),
                      _f(c.get("barriers"), "d"), _mma(mma_counts(c.get("inv", {}))),
                      _mma(mma_counts(c.get("sass", {}))) if c.get("sass") else "—", escape(b.record))
        console.print(t)
    return 0


def matrix_order(root: Path):
    """Sort key in the lab's order: stages as stages.yaml lists them, archs as the stage lists its
        kernels, cases in matrix order; unknown baselines after, in natural order."""
    import re

    from harness.spec.spec import SpecError, load_spec

    try:
        spec = load_spec(root=root)
    except (SpecError, OSError):
        spec = None
    stages = list(spec.stages.values()) if spec else []
    stage_pos = {st.id: i for i, st in enumerate(stages)}
    arch_pos = {(st.id, a): i for st in stages for i, a in enumerate(st.kernels)}
    value_pos = {(st.id, axis, case_label({axis: v})): i
                 for st in stages for axis, vals in st.matrix.items() for i, v in enumerate(vals)}

    def natural(text: str) -> tuple:
        return tuple((0, float(t), "") if re.fullmatch(r"-?\d+(\.\d+)?", t) else (1, 0.0, t)
                     for t in re.split(r"(-?\d+(?:\.\d+)?)", text) if t)

    def case_key(b: Baseline) -> tuple:
        parts = b.case.split(",")
        pos = []
        for part in parts:
            axis = part.split("=", 1)[0]
            if (b.stage, axis, part) not in value_pos:
                return (1, natural(b.case))
            pos.append(value_pos[(b.stage, axis, part)])
        return (0, tuple(pos))

    def key(b: Baseline) -> tuple:
        return (stage_pos.get(b.stage, len(stage_pos)), natural(b.stage), arch_pos.get((b.stage, b.arch), 99),
                b.arch, case_key(b))

    return key


def _mma(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "0"


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)
