"""The lab notebook's records: one JSON object per case, JSON Lines, schema-versioned.

Files (all under results/, committed):
  records/<stage>.jsonl   one line per case result (run, compile-only, or skipped)
  runs.jsonl              one line when a run starts and one when it ends (or is interrupted)
  notes.jsonl             annotations of runs (`dsv4-lab note RUN "text"`)

Reading is forgiving: a truncated or corrupt line is skipped with one warning naming
file:line, and every other record is kept. Writing appends and flushes each line the
moment its case ends.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from harness.paths import records_dir, results_dir

RECORD_VERSION = 1
MAX_LINE_BYTES = 64 * 1024

STATUSES = ("pass", "fail", "compile_error", "crash", "timeout", "skipped", "compiled")
# "compiled": built for an arch this machine cannot run; says so, never counts as verified.

REQUIRED = {"v", "id", "run", "t", "stage", "arch", "case", "status"}


@dataclass
class Record:
    id: str
    run: str
    t: str
    stage: str
    arch: str
    case: dict[str, Any]
    status: str
    metrics: dict[str, dict] = field(default_factory=dict)
    timing: dict[str, float] | None = None
    compile: dict[str, Any] | None = None
    env: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] = field(default_factory=dict)
    target: str = "local"
    gpu: int | None = None
    error: str | None = None
    note: str | None = None
    v: int = RECORD_VERSION

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v not in (None, {}, [])}
        d = {"v": d.pop("v"), **d}
        return json.dumps(d, separators=(",", ":"), sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def status_counts(records: list[Record]) -> dict[str, int]:
    """{status: number of records}."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def validate(d: Any) -> str | None:
    """Why a parsed line is not a record we can use; None when it is."""
    if not isinstance(d, dict):
        return "not a JSON object"
    missing = REQUIRED - d.keys()
    if missing:
        return f"missing {', '.join(sorted(missing))}"
    if d["v"] != RECORD_VERSION:
        return f"schema version {d['v']} (this lab reads {RECORD_VERSION})"
    if d["status"] not in STATUSES:
        return f"unknown status {d['status']!r}"
    if not isinstance(d["case"], dict):
        return "case is not an object"
    return None


def stage_file(root: Path, stage: str) -> Path:
    return records_dir(root) / f"{stage}.jsonl"


class Appender:
    """Appends JSON lines to one file, flushing each, so a crash keeps every finished line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, line: str) -> None:
        if "\n" in line:
            raise ValueError("a record must be one line")
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


class RecordWriter:
    """Writes records to results/records/<stage>.jsonl, one appender per stage."""

    def __init__(self, root: Path):
        self.root = root
        self._files: dict[str, Appender] = {}

    def write(self, rec: Record) -> None:
        if rec.stage not in self._files:
            self._files[rec.stage] = Appender(stage_file(self.root, rec.stage))
        self._files[rec.stage].write(rec.to_json())

    def close(self) -> None:
        for a in self._files.values():
            a.close()
        self._files.clear()


def iter_jsonl(path: Path, warn: list[str] | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every line of `path` that parses; a bad line adds one
    warning to `warn` (file:line: why) and is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            if warn is not None:
                warn.append(f"{path}:{lineno}: skipped a corrupt line ({str(exc).splitlines()[0][:80]})")
            continue
        yield lineno, obj


def read_records(root: Path, stages: list[str] | None = None, warn: list[str] | None = None) -> list[dict]:
    """All valid records (as dicts, oldest first within each file) of the given stages."""
    folder = records_dir(root)
    if stages is None:
        files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    else:
        files = [stage_file(root, s) for s in stages]
    out: list[dict] = []
    for path in files:
        for lineno, obj in iter_jsonl(path, warn):
            why = validate(obj)
            if why:
                if warn is not None:
                    warn.append(f"{path}:{lineno}: skipped a record ({why})")
                continue
            out.append(obj)
    return out


def runs_file(root: Path) -> Path:
    return results_dir(root) / "runs.jsonl"


def notes_file(root: Path) -> Path:
    return results_dir(root) / "notes.jsonl"


def append_event(path: Path, obj: dict) -> None:
    a = Appender(path)
    try:
        a.write(json.dumps(obj, separators=(",", ":")))
    finally:
        a.close()


def read_runs(root: Path, warn: list[str] | None = None) -> dict[str, dict]:
    """run id -> merged start/end events."""
    runs: dict[str, dict] = {}
    for _, ev in iter_jsonl(runs_file(root), warn):
        if isinstance(ev, dict) and "run" in ev:
            runs.setdefault(ev["run"], {}).update(ev)
    return runs


def read_notes(root: Path, warn: list[str] | None = None) -> dict[str, list[dict]]:
    notes: dict[str, list[dict]] = {}
    for _, ev in iter_jsonl(notes_file(root), warn):
        if isinstance(ev, dict) and "run" in ev and "text" in ev:
            notes.setdefault(ev["run"], []).append(ev)
    return notes


def print_warnings(warn: list[str], limit: int = 5) -> None:
    for w in warn[:limit]:
        print(f"warning: {w}", file=sys.stderr)
    if len(warn) > limit:
        print(f"warning: … and {len(warn) - limit} more skipped lines", file=sys.stderr)
