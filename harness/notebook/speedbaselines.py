"""Speed baselines: per stage, arch and bench shape, how fast the kernel was, in
results/speed_baselines.yaml.xz, kept as baselines.py keeps its file (`_speed_path`).

One entry per bench shape (`dsv4-lab baseline accept STAGE --speed`), from the newest fresh,
passing bench record of that shape:

    record   the bench record's id          src      its source hash (stale when it moves)
    commit   the commit it was made at      us       the kernel's median µs
    spread   (max - min) / median of its repetitions; p10_us, p90_us; reps
    peers    {peer: peer µs / kernel µs}    (above 1: the kernel is faster)
    gpu      {name, sm_mhz, sm_max_mhz, mem_mhz, power_w, temp_c} — what the record says

Compared only with a time from the same GPU model (`same_gpu`).  The speed gate re-times the
baseline's commit beside the tree (abtest.py); the stored µs are for the dashboard's Δ % and
`history --speed`.  A bad file is one line `results/speed_baselines.yaml.xz:LINE: key: problem
— fix` (BaselineError, exit 2)."""

from __future__ import annotations

import lzma
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.core import yamlnodes
from harness.core.jsonl import replace_file
from harness.core.labels import case_label
from harness.core.paths import results_dir
from harness.core.safeio import Unsafe, open_regular, xz_decompress
from harness.notebook.baselines import (BaselineError, _display, _NoAliasDumper, _results_folder, locked,
                                        newer_or_older, remove_older)
from harness.notebook.records import Record, newest

SPEED_VERSION = 1
MAX_BYTES = 16 * 1024 * 1024
GPU_KEYS = ("gpu_name", "sm_mhz", "sm_max_mhz", "mem_mhz", "power_w", "temp_c")
TIME_KEYS = ("us", "spread", "p10_us", "p90_us", "reps")
HEADER = (
    "# dsv4-lab speed baselines: the kernel's median µs per bench shape, and the GPU it ran on\n"
    "# (see harness/notebook/speedbaselines.py). Written by `dsv4-lab baseline accept STAGE --speed`.\n"
)


@dataclass
class SpeedBaseline:
    stage: str
    arch: str
    case: str  # the bench shape's label
    record: str
    src: str
    commit: str | None
    us: float
    spread: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    reps: int | None = None
    peers: dict[str, float] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=dict)  # name, sm_mhz, mem_mhz, power_w … (what the record had)
    dirty: bool = False  # the record came from a tree with uncommitted changes: `commit` is not what was timed

    @property
    def gpu_name(self) -> str | None:
        name = self.gpu.get("name")
        return name if isinstance(name, str) else None

    def to_yaml(self) -> dict[str, Any]:
        d: dict[str, Any] = {"record": self.record, "src": self.src, "commit": self.commit, "us": self.us}
        for k in ("spread", "p10_us", "p90_us", "reps"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.peers:
            d["peers"] = dict(self.peers)
        d["gpu"] = dict(self.gpu)
        if self.dirty:
            d["dirty"] = True
        return d


SPEED_FILE = "speed_baselines.yaml.xz"
OLD_SPEED_FILE = "speed_baselines.yaml"  # an older clone's plain form: read until the next write


def speed_file(root: Path) -> Path:
    return results_dir(root) / SPEED_FILE


def old_speed_file(root: Path) -> Path:
    return results_dir(root) / OLD_SPEED_FILE


def same_gpu(b: SpeedBaseline, gpu_name: str | None) -> bool:
    """Whether a time measured on `gpu_name` may be compared with the baseline (same model)."""
    return bool(gpu_name) and b.gpu_name == gpu_name


def delta(b: SpeedBaseline, us: float) -> float:
    """The change against the baseline, as a fraction (+0.05: 5 % slower)."""
    return us / b.us - 1


def from_record(rec: Record, src: str) -> SpeedBaseline | None:
    """The speed baseline a passing bench record gives (None without a timing)."""
    t = rec.timing or {}
    us = t.get("us")
    if rec.status != "pass" or not isinstance(us, (int, float)) or not (math.isfinite(us) and us > 0):
        return None

    def num(k: str) -> float | None:
        v = t.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    peers = {k[len("peer_"):-len("_ratio")]: round(float(v), 4) for k, v in t.items()
             if k.startswith("peer_") and k.endswith("_ratio") and isinstance(v, (int, float)) and math.isfinite(v)}
    gpu: dict[str, Any] = {}
    if isinstance(t.get("gpu_name"), str):
        gpu["name"] = t["gpu_name"]
    elif isinstance((rec.env or {}).get("gpu"), str):
        gpu["name"] = rec.env["gpu"]
    for k in GPU_KEYS[1:]:
        if num(k) is not None:
            gpu[k] = num(k)
    reps = t.get("reps")
    return SpeedBaseline(rec.stage, rec.arch, case_label(rec.case), rec.id, src, (rec.code or {}).get("commit"),
                         float(us), num("spread"), num("p10_us"), num("p90_us"),
                         reps if isinstance(reps, int) and not isinstance(reps, bool) else None, peers, gpu,
                         (rec.code or {}).get("dirty") is True)


# ---------------------------------------------------------------------------------------
# Reading and writing.


class _Bad(Exception):
    def __init__(self, keys: tuple, problem: str):
        super().__init__(problem)
        self.keys, self.problem = keys, problem


def _entry(stage: str, arch: str, label: str, e: Any) -> SpeedBaseline:
    keys = ("speed", stage, arch, label)
    if not isinstance(e, dict):
        raise _Bad(keys, "expected a mapping (record, src, commit, us, …)")
    allowed = ("record", "src", "commit", "us", "spread", "p10_us", "p90_us", "reps", "peers", "gpu", "dirty")
    extra = [k for k in e if k not in allowed]
    if extra:
        raise _Bad((*keys, extra[0]), f"unknown key — expected one of {', '.join(allowed)}")
    for k in ("record", "src"):
        if not isinstance(e.get(k), str) or not e[k]:
            raise _Bad((*keys, k), "expected a non-empty string")
    if e.get("commit") is not None and not isinstance(e["commit"], str):
        raise _Bad((*keys, "commit"), "expected a commit (text) or null")

    def number(k: str, required: bool = False) -> float | None:
        v = e.get(k)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (k == "us" and v <= 0):
            raise _Bad((*keys, k), "expected a finite number " + ("> 0" if k == "us" else ">= 0"))
        return float(v)

    us = number("us", True)
    assert us is not None
    reps = e.get("reps")
    if reps is not None and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise _Bad((*keys, "reps"), "expected a whole number >= 1")
    peers = e.get("peers") or {}
    if not isinstance(peers, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              and math.isfinite(v) and v > 0 for v in peers.values()):
        raise _Bad((*keys, "peers"), "expected a mapping of peer -> ratio (a number > 0)")
    gpu = e.get("gpu") or {}
    if not isinstance(gpu, dict) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                            for v in gpu.values()):
        raise _Bad((*keys, "gpu"), "expected a mapping (name, sm_mhz, mem_mhz, power_w …)")
    if not isinstance(e.get("dirty", False), bool):
        raise _Bad((*keys, "dirty"), "expected true or false")
    return SpeedBaseline(stage, arch, label, e["record"], e["src"], e.get("commit"), us, number("spread"),
                         number("p10_us"), number("p90_us"), reps, {str(k): float(v) for k, v in peers.items()},
                         {str(k): v for k, v in gpu.items()}, e.get("dirty", False))


def _tree(doc: Any) -> list[SpeedBaseline]:
    from harness.spec.spec import ARCHS

    if doc is None:
        return []
    if not isinstance(doc, dict):
        raise _Bad((), "expected a mapping with 'version' and 'speed'")
    extra = [k for k in doc if k not in ("version", "speed")]
    if extra:
        raise _Bad((extra[0],), "unknown key — expected version, speed")
    if doc.get("version") != SPEED_VERSION or isinstance(doc.get("version"), bool):
        raise _Bad(("version",), f"expected {SPEED_VERSION}")
    out: list[SpeedBaseline] = []
    stages = doc.get("speed") or {}
    if not isinstance(stages, dict):
        raise _Bad(("speed",), "expected a mapping of stage -> arch -> bench shape")
    for stage, archs in stages.items():
        if not isinstance(archs, dict):
            raise _Bad(("speed", stage), "expected a mapping of arch -> bench shape")
        for arch, cases in archs.items():
            if arch not in ARCHS.values():
                raise _Bad(("speed", stage, arch), f"unknown arch — expected one of {', '.join(ARCHS.values())}")
            if not isinstance(cases, dict):
                raise _Bad(("speed", stage, arch), "expected a mapping of bench shape -> speed baseline")
            out += [_entry(str(stage), str(arch), str(label), e) for label, e in cases.items()]
    return out


def _speed_path(root: Path) -> Path:
    """The file to read: results/speed_baselines.yaml.xz, or an older clone's plain
    results/speed_baselines.yaml where only that one is there (both: one line, `newer_or_older`)."""
    return newer_or_older(root, speed_file(root), old_speed_file(root), lambda path: _read(root, path),
                          "speed baselines", "dsv4-lab baseline accept STAGE --speed", "speed baselines")


def load(root: Path) -> list[SpeedBaseline]:
    """Every speed baseline ([] when there is no file); BaselineError (one line) for a bad file."""
    _results_folder(root)
    return _read(root, _speed_path(root))


def _read(root: Path, path: Path) -> list[SpeedBaseline]:
    """The speed baselines of one file, xz-compressed or (an older clone's) plain: `path`'s name."""
    shown = _display(root, path)
    fix = "fix it, or re-create the entry with `dsv4-lab baseline accept STAGE --speed`"
    if not os.path.lexists(path):
        return []
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except Unsafe as exc:
        raise BaselineError(f"{shown}:1: {exc.strerror} — it must be the YAML file `baseline accept --speed` writes")
    except OSError as exc:
        raise BaselineError(f"{shown}:1: cannot be read ({exc.strerror or exc}) — fix its permissions") from None
    if len(data) > MAX_BYTES:
        raise BaselineError(f"{shown}:1: larger than {MAX_BYTES >> 20} MiB — not a speed baselines file")
    if path.name.endswith(".xz"):
        try:
            data = xz_decompress(data, cap=MAX_BYTES)
        except ValueError as exc:
            raise BaselineError(f"{shown}:1: not a readable xz file ({exc}) — restore it: git checkout {shown}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BaselineError(f"{shown}:{line}: not UTF-8 text — {fix}") from None
    alias = yamlnodes.anchor_line(text)
    if alias is not None:
        raise BaselineError(f"{shown}:{alias}: YAML anchors and aliases are not allowed here — write the values out")
    node = yamlnodes.compose(text, yamlnodes.NodeContext(shown, BaselineError))
    if node is not None:
        dup = yamlnodes.duplicate_key(node)
        if dup is not None:
            line, key, first = dup
            raise BaselineError(f"{shown}:{line}: {yamlnodes.one_line(key, 200)}: duplicate key (also at line "
                                f"{first}) — keep one of the two")
    try:
        doc = yamlnodes.scalar(node)
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as exc:
        raise BaselineError(f"{shown}:1: cannot be read ({type(exc).__name__}) — {fix}") from None
    try:
        return _tree(doc)
    except _Bad as bad:
        key = ".".join(str(k) for k in bad.keys) or "(top level)"
        raise BaselineError(f"{shown}:{yamlnodes.line_of(node, bad.keys)}: {key}: {bad.problem} — {fix}") from None


def save(root: Path, items: list[SpeedBaseline], read: list[SpeedBaseline]) -> None:
    """Write results/speed_baselines.yaml.xz holding exactly `items` (every key of `read` still among
        them; text and bytes read back before the rename); an older plain file is removed once the
        .xz holds it."""
    shown = _display(root, speed_file(root))
    path = _speed_path(root)  # both the .xz and the plain file: one line, nothing written
    keys = {(b.stage, b.arch, b.case) for b in items}
    if len(keys) != len(items) or not {(b.stage, b.arch, b.case) for b in read} <= keys:
        raise BaselineError(f"{shown}: not written — it would lose or double a speed baseline (a bug in the lab); "
                            "the file is unchanged")
    tree: dict[str, Any] = {}
    for b in sorted(items, key=lambda b: (b.stage, b.arch, b.case)):
        tree.setdefault(b.stage, {}).setdefault(b.arch, {})[b.case] = b.to_yaml()
    text = HEADER + yaml.dump({"version": SPEED_VERSION, "speed": tree}, Dumper=_NoAliasDumper, sort_keys=False,
                              width=120, allow_unicode=True)
    back = _tree(yaml.load(text, Loader=yamlnodes.fast_loader()))
    order = lambda b: (b.stage, b.arch, b.case)  # noqa: E731
    raw = text.encode("utf-8")
    data = lzma.compress(raw, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    if sorted(back, key=order) != sorted(items, key=order) or xz_decompress(data, cap=MAX_BYTES) != raw:
        raise BaselineError(f"{shown}: not written — the new text does not read back (a bug in the lab)")
    replace_file(speed_file(root), data)  # under the baselines lock (`locked`)
    if path == old_speed_file(root):  # an older clone's plain file: the .xz now holds all it held
        remove_older(root, path, speed_file(root))


def find(items: list[SpeedBaseline], stage: str, arch: str, label: str) -> SpeedBaseline | None:
    return next((b for b in items if (b.stage, b.arch, b.case) == (stage, arch, label)), None)


# ---------------------------------------------------------------------------------------
# The command.


def accept(root: Path, stage, archs: list[str] | None, cases: list[dict[str, Any]]) -> int:
    """For each selected bench shape (bench.plan_cases) the newest fresh passing bench record becomes
        its speed baseline.  0 when one was taken, 1 when none."""
    from rich.console import Console

    from harness.notebook.records import print_warnings, read_records
    from harness.spec.identity import source_hash

    console = Console(highlight=False, markup=False)
    taken: list[SpeedBaseline] = []
    missing: dict[str, int] = {}
    with locked(root):
        current = load(root)  # a bad file stops here: nothing is overwritten
        warn: list[str] = []
        records = read_records(root, [stage.id], warn, bench=True)
        print_warnings(warn)
        index = {(b.stage, b.arch, b.case): b for b in current}
        for arch in stage.kernels:
            if archs and arch not in archs:
                continue
            src = source_hash(root, stage, arch)
            for case in cases:
                rec = newest(records, stage.id, arch, case, src,
                             lambda r: r.is_bench and r.status == "pass" and bool(r.timing))
                b = from_record(rec, src) if rec is not None else None
                if b is None:
                    missing[arch] = missing.get(arch, 0) + 1
                    continue
                index[(b.stage, b.arch, b.case)] = b
                taken.append(b)
        if taken:
            save(root, list(index.values()), current)
    for b in taken:
        console.print(f"speed baseline {stage.name} {b.arch} {b.case} ← {b.record}: {b.us:.2f} µs "
                      f"(spread {100 * (b.spread or 0):.1f} %) on {b.gpu_name or 'an unnamed GPU'}"
                      + (" — from a tree with uncommitted changes: gate --speed cannot re-time its commit; "
                         "commit, bench and accept again" if b.dirty else ""))
    for arch, n in sorted(missing.items()):
        console.print(f"{arch}: {n} bench shape(s) have no passing bench record for the current source — "
                      f"time them first: dsv4-lab bench {stage.name}")
    if not taken:
        console.print(f"no speed baseline taken for {stage.name} with these filters")
        return 1
    return 0


def drop_gone(root: Path, stage, archs: list[str] | None, shapes: list[dict[str, Any]]) -> list[SpeedBaseline]:
    """Remove the stage's speed baselines whose shape is not among `shapes` (its bench plan: after an
        axis was added or a shape left the bench block they name nothing `gate --speed` times);
        the dropped ones (the file untouched when none)."""
    labels = {case_label(c) for c in shapes}
    with locked(root):
        current = load(root)
        gone = [b for b in current if b.stage == stage.id and (not archs or b.arch in archs) and b.case not in labels]
        if gone:
            out = {id(b) for b in gone}
            keep = [b for b in current if id(b) not in out]
            save(root, keep, keep)
    return gone


def show(root: Path, stage: Any = None, archs: list[str] | None = None) -> int:
    """Print the speed baselines (of one stage, or all)."""
    from rich.console import Console

    console = Console(highlight=False, markup=False)
    items = [b for b in load(root) if (stage is None or b.stage == stage.id) and (not archs or b.arch in archs)]
    if not items:
        console.print("no speed baselines" + (f" for {stage.name}" if stage is not None else ""))
        return 0
    for b in sorted(items, key=lambda b: (b.stage, b.arch, b.case)):
        peers = ", ".join(f"{p} ×{r:.2f}" for p, r in b.peers.items())
        console.print(f"stage-{b.stage} {b.arch} {b.case}: {b.us:.2f} µs ± {100 * (b.spread or 0):.1f} % on "
                      f"{b.gpu_name or '?'} (commit {b.commit or '?'}, {b.record})" + (f"; peers {peers}" if peers else ""))
    return 0
