"""Baselines: per stage, arch and case, the metric values that must hold, their tolerance,
and the record they came from. Kept in results/baselines.yaml (human-readable, reviewed in
diffs) and written atomically (temp file + rename).

Tolerance semantics, per output metric:
  cosine   absolute: now >= baseline - tol
  rel_l2   relative: now <= baseline * (1 + tol) + 1e-12
  max_abs  relative: now <= baseline * (1 + tol) + 1e-12
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.labels import case_label
from harness.paths import results_dir
from harness.records import Record

BASELINE_VERSION = 1
DEFAULT_TOLERANCE = {"cosine": 1e-6, "rel_l2": 0.25, "max_abs": 0.25}
HEADER = (
    "# dsv4-lab baselines: the metric values each case must keep (see harness/baselines.py).\n"
    "# Written by `dsv4-lab baseline accept|drop`; review changes in diffs.\n"
)


class BaselineError(Exception):
    """A missing or invalid baselines file, or a bad baseline command (one line)."""


@dataclass
class Baseline:
    stage: str
    arch: str
    case: str  # the case label, e.g. "hd=64,n=128,m=128"
    record: str
    src: str
    metrics: dict[str, dict[str, float]]
    tolerance: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))
    timing_us: float | None = None

    def to_yaml(self) -> dict[str, Any]:
        d: dict[str, Any] = {"record": self.record, "src": self.src, "metrics": self.metrics, "tolerance": self.tolerance}
        if self.timing_us is not None:
            d["us"] = self.timing_us
        return d


def baselines_file(root: Path) -> Path:
    return results_dir(root) / "baselines.yaml"


def load(root: Path, must_exist: bool = False) -> list[Baseline]:
    path = baselines_file(root)
    if not path.is_file():
        if must_exist:
            raise BaselineError(f"{path}: not found — create baselines with `dsv4-lab baseline accept STAGE`")
        return []
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(path.read_text(), Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise BaselineError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {getattr(exc, 'problem', exc)}")
    if doc is None:
        return []
    if not isinstance(doc, dict) or doc.get("version") != BASELINE_VERSION or not isinstance(doc.get("baselines", {}), dict):
        raise BaselineError(f"{path}:1: expected 'version: {BASELINE_VERSION}' and a 'baselines:' mapping — "
                            "fix the file or re-create it with `dsv4-lab baseline accept`")
    out: list[Baseline] = []
    for stage, archs in (doc.get("baselines") or {}).items():
        for arch, cases in (archs or {}).items():
            for label, entry in (cases or {}).items():
                try:
                    out.append(Baseline(
                        stage=str(stage), arch=str(arch), case=str(label), record=str(entry["record"]),
                        src=str(entry["src"]), metrics=dict(entry["metrics"]),
                        tolerance={**DEFAULT_TOLERANCE, **(entry.get("tolerance") or {})},
                        timing_us=entry.get("us"),
                    ))
                except (KeyError, TypeError) as exc:
                    line = _line_of(path, str(label))
                    raise BaselineError(f"{path}:{line}: baselines.{stage}.{arch}.{label}: missing {exc} — "
                                        "each case needs record, src and metrics")
    return out


def _line_of(path: Path, needle: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    return 1


def save(root: Path, items: list[Baseline]) -> None:
    tree: dict[str, Any] = {}
    for b in sorted(items, key=lambda b: (b.stage, b.arch, b.case)):
        tree.setdefault(b.stage, {}).setdefault(b.arch, {})[b.case] = b.to_yaml()
    text = HEADER + yaml.safe_dump({"version": BASELINE_VERSION, "baselines": tree}, sort_keys=False, width=120)
    path = baselines_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".baselines.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def metrics_of(record: Record) -> dict[str, dict[str, float]]:
    """The gated metric values of a record, per output."""
    return {
        out: {k: m[k] for k in ("cosine", "rel_l2", "max_abs") if m.get(k) is not None}
        for out, m in record.metrics.items()
    }


# ---------------------------------------------------------------------------------------
# Commands.


def accept(spec, stage, archs: list[str] | None, cases) -> int:
    """Take the newest passing, fresh record of each selected case as its baseline."""
    from rich.console import Console

    from harness.identity import source_hash
    from harness.records import read_records

    console = Console()
    root = spec.root
    warn: list[str] = []
    records = read_records(root, [stage.id], warn)
    current = load(root)
    index = {(b.stage, b.arch, b.case): b for b in current}
    taken, missing = [], []
    for arch in stage.kernels:
        if archs and arch not in archs:
            continue
        src = source_hash(root, stage, arch)
        for case in cases:
            label = case_label(case.dict)
            rec = newest(records, stage.id, arch, case.dict, src, statuses=("pass",))
            if rec is None:
                missing.append(f"{arch} {label}")
                continue
            index[(stage.id, arch, label)] = Baseline(
                stage=stage.id, arch=arch, case=label, record=rec.id, src=src, metrics=metrics_of(rec),
                timing_us=(rec.timing or {}).get("us"),
            )
            taken.append((arch, label, rec.id))
    if not taken:
        console.print(f"no passing, fresh record for {stage.name} with these filters — run it first: "
                      f"dsv4-lab run {stage.name}", highlight=False)
        return 1
    save(root, list(index.values()))
    for arch, label, rid in taken:
        console.print(f"baseline {stage.name} {arch} {label} ← {rid}", highlight=False)
    by_arch: dict[str, int] = {}
    for item in missing:
        arch = item.split(" ", 1)[0]
        by_arch[arch] = by_arch.get(arch, 0) + 1
    for arch, n in by_arch.items():
        console.print(f"{arch}: {n} case(s) have no passing result for the current source — not baselined "
                      "(an arch that was only compiled is never baselined)", highlight=False)
    return 0


def newest(records: list[Record], stage: str, arch: str, case: dict, src: str | None,
           statuses: tuple[str, ...] | None = None) -> Record | None:
    for rec in reversed(records):
        if rec.stage != stage or rec.arch != arch or rec.case != case:
            continue
        if src is not None and rec.code.get("src") != src:
            continue
        if statuses is not None and rec.status not in statuses:
            continue
        return rec
    return None


def show(root: Path, stage: str | None) -> int:
    from rich.console import Console
    from rich.table import Table

    from harness.spec import normalize_stage_name

    items = load(root, must_exist=True)
    if stage:
        sid = normalize_stage_name(stage)
        items = [b for b in items if b.stage == sid]
    console = Console()
    if not items:
        console.print("no baselines" + (f" for {stage}" if stage else "") + " — add some with `dsv4-lab baseline accept STAGE`")
        return 0
    t = Table(title="baselines")
    for col in ("stage", "arch", "case", "output", "cosine", "rel L2", "max abs", "µs", "record"):
        t.add_column(col)
    for b in items:
        for out, m in b.metrics.items():
            t.add_row(b.stage, b.arch, b.case, out, _f(m.get("cosine"), ".9f"), _f(m.get("rel_l2"), ".2e"),
                      _f(m.get("max_abs"), ".2e"), _f(b.timing_us, ".2f"), b.record)
    console.print(t)
    return 0


def drop(spec, stage, archs: list[str] | None, cases) -> int:
    from rich.console import Console

    labels = {case_label(c.dict) for c in cases}
    items = load(spec.root, must_exist=True)
    keep = [b for b in items if not (b.stage == stage.id and (not archs or b.arch in archs) and b.case in labels)]
    n = len(items) - len(keep)
    if n:
        save(spec.root, keep)
    Console().print(f"dropped {n} baseline(s) of {stage.name}", highlight=False)
    return 0


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)
