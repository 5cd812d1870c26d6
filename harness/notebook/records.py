"""The lab notebook's records: one JSON object per case, JSON Lines, schema-versioned.

Files (all under results/, committed):
  records/<stage>.jsonl     one line per case result (run, compile-only, or skipped), appended
                            the moment it arrives
  records/<stage>.jsonl.xz  the stage's segment: lines compaction moved out of the plain file,
                            byte for byte, one xz stream (archive.py `seal`)
  inventories.jsonl.xz      each distinct instruction inventory once; a record names it by id
                            (inventories.py; an older notebook's plain inventories.jsonl is
                            read beside it until compacted)
  envs.jsonl.xz             each distinct env block once, the same way
  archive/<stage>.jsonl.xz  the stage's stale lines, their inventories and env inline
                            (archive.py; older lines may name ids)
  runs.jsonl                one line when a run starts and one when it ends (or is interrupted)
  archive/runs.jsonl.xz     the events of runs no live record names
  notes.jsonl               annotations of runs (`dsv4-lab note RUN "text"`)
Readers read archive, segment, then the plain file.

A truncated, corrupt or wrongly typed line is skipped with one warning naming file:line, every
other record kept; what is read comes back as the typed `Record` that was written. Each line is
appended and flushed the moment its case ends, on a fresh line (a crash's truncated last line
never swallows the next record)."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.notebook.inventories import ContentStore, StoreAppender, Stores
from harness.core.jsonl import Appender, iter_jsonl, read_bytes
from harness.core.labels import case_label, printable
from harness.core.notebooklock import lock_path, open_lock, shared
from harness.core.paths import records_dir, results_dir
from harness.core.safeio import xz_decompress
from harness.core.statuses import STATUSES

RECORD_VERSION = 1

REQUIRED = {"v", "id", "run", "t", "stage", "arch", "case", "status"}

# A record of `dsv4-lab bench` carries this note: its case is a bench shape, not a test case, so
# the readers that judge the test matrix (gate, baselines, history) leave it out.
BENCH_NOTE = "bench"


class RecordError(ValueError):
    """Why a parsed JSON object is not a record this lab can use (one phrase)."""


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
    trace: str | None = None  # the full traceback of a failure in user code (`dsv4-lab show ID`)
    compare: dict[str, Any] | None = None  # `bench --compare REV`: rev, commit, both medians, ratio, interval, verdict
    profile: dict[str, Any] | None = None  # `profile`: Nsight Compute's metrics of one launch (harness/execution/ncuprofile.py)
    v: int = RECORD_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v not in (None, {}, [])}
        return {"v": d.pop("v"), **d}

    def to_json(self) -> str:
        return _line(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> "Record":
        """A Record from a parsed JSON object; RecordError (one phrase) when its keys or
        types are not those of a record. Unknown keys are ignored (newer writers)."""
        why = validate(d)
        if why:
            raise RecordError(why)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def is_bench(self) -> bool:
        return is_bench(self)

    def metric(self, output: str, name: str) -> float | None:
        return (self.metrics.get(output) or {}).get(name)


def is_bench(record: Any) -> bool:
    """Whether a record is a bench result (its case is a bench shape, not a test case)."""
    return getattr(record, "note", None) == BENCH_NOTE


def peer_times(timing: dict[str, Any] | None) -> dict[str, float]:
    """{peer: µs} of a record's timing: its `peer_<name>_us` keys, and an older `run --bench` record's
        `peer_us` as "torch"."""
    out: dict[str, float] = {}
    for key, value in (timing or {}).items():
        if key.startswith("peer_") and key.endswith("_us") and _finite(value):
            out[key[5:-3] or "torch"] = value
    return out


def run_peer_us(record: Any) -> float | None:
    """The µs of a `run --bench` record's PyTorch peer, whichever format; None for a bench record or a
        record without one."""
    if is_bench(record):
        return None
    return next(iter(peer_times(getattr(record, "timing", None)).values()), None)


def _line(d: dict[str, Any]) -> str:
    return json.dumps(d, separators=(",", ":"), sort_keys=False, allow_nan=False)


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


_NUM = (int, float)
_OPTIONAL_TYPES: dict[str, tuple[type, ...]] = {
    "metrics": (dict,), "timing": (dict,), "compile": (dict,), "env": (dict,), "code": (dict,),
    "target": (str,), "gpu": (int,), "error": (str,), "note": (str,), "trace": (str,),
    "compare": (dict,), "profile": (dict,),
}


def _finite(x: Any) -> bool:
    return isinstance(x, _NUM) and not isinstance(x, bool) and math.isfinite(x)


def validate(d: Any, strict: bool = False) -> str | None:
    """Why a parsed line is not a record we can use; None when it is. Checks every key's type (no
        NaN or infinite metric, timing in µs > 0). `strict` (a line from another machine): also only
        numbers in the timing, compile summary, env and code of this lab's shapes, `t` a UTC time."""
    why = _validate(d)
    if why is None and strict:
        why = _strict_problem(d)
    return why


def _validate(d: Any) -> str | None:
    if not isinstance(d, dict):
        return "not a JSON object"
    missing = REQUIRED - d.keys()
    if missing:
        return f"missing {', '.join(sorted(missing))}"
    if d["v"] != RECORD_VERSION or isinstance(d["v"], bool):
        return f"schema version {str(d['v'])[:20]} (this lab reads {RECORD_VERSION})"
    for key in ("id", "run", "t", "stage", "arch", "status"):
        if not isinstance(d[key], str) or not d[key]:
            return f"{key} is not a non-empty string"
    if d["status"] not in STATUSES:
        return f"unknown status {d['status'][:40]!r}"
    if not isinstance(d["case"], dict) or not all(
            isinstance(v, (int, float, str, bool)) for v in d["case"].values()):
        return "case is not an object of scalar values"
    for key, types in _OPTIONAL_TYPES.items():
        value = d.get(key)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"{key} is not {'an object' if types == (dict,) else 'a ' + types[0].__name__}"
    for out, m in (d.get("metrics") or {}).items():
        if not isinstance(m, dict):
            return f"metrics.{out} is not an object"
        for name, value in m.items():
            if value is not None and not _finite(value):
                return f"metrics.{out}.{name} is not a finite number"
    timing = d.get("timing")
    if timing is not None:
        if not (_finite(timing.get("us")) and timing["us"] > 0):
            return "timing.us is not a positive number"
        for name, value in timing.items():
            if value is not None and not isinstance(value, str) and not _finite(value):
                return f"timing.{name} is not a finite number"
    why = _compile_problem(d.get("compile"))
    if why:
        return why
    code = d.get("code") or {}
    if code.get("src") is not None and not isinstance(code["src"], str):
        return "code.src is not a string"
    for key in ("host", "gpu", "cc", "driver", "cuda", "torch", "cute"):
        value = (d.get("env") or {}).get(key)
        if value is not None and not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return f"env.{key} is not a string"
    return None


_COMPILE_NUMBERS = ("s", "regs", "spill", "stack", "static_smem", "smem", "barriers")
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
_COMMIT = re.compile(r"[0-9a-f]{4,64}")


def _strict_problem(d: dict) -> str | None:
    """Why a valid record is still not one this lab writes (a remote line's extra checks)."""
    for name, value in (d.get("timing") or {}).items():
        if value is not None and not _finite(value) and not (_timing_text(name) and isinstance(value, str)
                                                              and _plain(value)):
            return f"timing.{printable(str(name), 40)} is not a number"
    why = _compile_shape(d.get("compile") or {}) or _env_shape(d.get("env") or {}) or \
        _code_shape(d.get("code") or {})
    if why:
        return why
    if not _TIME.fullmatch(d["t"]):
        return f"t is not a UTC time like 2026-01-01T00:00:00Z ({printable(d['t'], 40)!r})"
    return None


# The timing keys this lab writes as text: how it timed (graph or events), the GPU, the rows a
# bench shape checked, why there is no roofline fraction and what bounds it, and a peer's one-line
# reason for not running (`peer_<name>`; its numbers are `peer_<name>_us`, `_ratio`, … and stay numbers).
_TIMING_TEXT = {"method", "gpu_name", "checked", "roofline", "bound_by"}
_PEER_NUMBER = re.compile(r"^peer_.+_(us|spread|tflops|ratio|cos)$")


def _timing_text(name: Any) -> bool:
    return isinstance(name, str) and (name in _TIMING_TEXT or (name.startswith("peer_") and not
                                                               _PEER_NUMBER.match(name) and name != "peer_us"))


def _compile_shape(c: dict) -> str | None:
    """Why a record's compile summary is not one this lab writes (numbers where the gate computes,
        short text elsewhere); None when it is."""
    for name, value in c.items():
        where = f"compile.{printable(str(name), 40)}"
        if name in _COMPILE_NUMBERS and not _finite(value):
            return f"{where} is not a number"
        if isinstance(value, dict):
            if not all(isinstance(k, str) and _finite(v) for k, v in value.items()):
                return f"{where} is not an object of numbers"
        elif isinstance(value, str):
            if len(value) > 200 or not value.isprintable():
                return f"{where} is not a short line of text"
        elif not (isinstance(value, bool) or _finite(value)):
            return f"{where} is not a number, a flag or text"
    return None


def _plain(x: Any) -> bool:
    """A value shown as is: a flag, a finite number, or a short line of printable text."""
    if isinstance(x, str):
        return len(x) <= 300 and x.isprintable()
    return x is None or isinstance(x, bool) or _finite(x)


def _env_shape(env: dict) -> str | None:
    for name, value in env.items():
        ok = _plain(value) or (isinstance(value, list) and all(_plain(v) for v in value)) or (
            isinstance(value, dict) and all(isinstance(k, str) and _plain(v) for k, v in value.items()))
        if not (ok and isinstance(name, str) and _plain(name)):
            return f"env.{printable(str(name), 40)} is not plain values"
    return None


def _code_shape(code: dict) -> str | None:
    commit = code.get("commit")
    if commit is not None and not (isinstance(commit, str) and _COMMIT.fullmatch(commit)):
        return "code.commit is not a git commit id"
    if "dirty" in code and not isinstance(code["dirty"], bool):
        return "code.dirty is not true or false"
    if code.get("src") is not None and not _plain(code["src"]):
        return "code.src is not a short line of text"
    return None


def _compile_problem(c: Any) -> str | None:
    """Why a record's compile summary cannot be trusted by the tables and the gate."""
    if c is None:
        return None
    for key in _COMPILE_NUMBERS:
        value = c.get(key)
        if value is not None and not (_finite(value) and value >= 0):
            return f"compile.{key} is not a number >= 0"
    if c.get("key") is not None and not isinstance(c["key"], str):
        return "compile.key is not a string"
    for table in ("inv", "sass"):
        counts = c.get(table)
        if counts is None:
            continue
        if not isinstance(counts, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items()):
            return f"compile.{table} is not an object of counts"
    return None


# ---------------------------------------------------------------------------------------
# The queries every reader needs: freshness, the newest record of a case, bench or not.


def code_src(rec: Any) -> str | None:
    """The source hash (harness/spec/identity.py) a record — or a raw record line, a dict — was made
    with: its `code.src`; None when it names none."""
    code = rec.get("code") if isinstance(rec, dict) else getattr(rec, "code", None)
    src = code.get("src") if isinstance(code, dict) else None
    return src if isinstance(src, str) else None


def is_fresh(rec: Any, src: str | None) -> bool:
    """Whether a record was made by the code whose source hash is `src` now; a record of any
    other code is stale (what it says may no longer hold)."""
    return code_src(rec) == src


def shows_compile(rec: Record) -> bool:
    """Whether a record says what compiling gave: a compile error, or a build whose summary
    carries the inventory (whatever ran after it)."""
    return rec.status == "compile_error" or bool(rec.compile and isinstance(rec.compile.get("inv"), dict))


def newest(records: list[Record], stage: str, arch: str, case: dict, src: str | None = None,
           accept: Callable[[Record], bool] | None = None) -> Record | None:
    """The newest record of a case among `records` (oldest first); `src`: the newest fresh; `accept`:
        the newest it accepts."""
    for rec in reversed(records):
        if rec.stage != stage or rec.arch != arch or rec.case != case:
            continue
        if src is not None and not is_fresh(rec, src):
            continue
        if accept is not None and not accept(rec):
            continue
        return rec
    return None


def newest_by_case(records: list[Record], accept: Callable[[Record], bool] | None = None) -> dict[str, Record]:
    """Case label -> the newest record of that case among `records` (oldest first; one stage and
    arch) that `accept` accepts, in the order the cases were first met."""
    out: dict[str, Record] = {}
    for rec in records:
        if accept is None or accept(rec):
            out[case_label(rec.case)] = rec
    return out


def newest_fresh_in_file(path: Path, wanted: dict[Any, tuple[str | None, Callable[[Record], bool]]],
                         key: Callable[[Record], Any], warn: list[str] | None = None
                         ) -> tuple[dict[Any, Record], list[Record]]:
    """Read one records file from its newest line back until each wanted case (`key` -> (its
        current source hash, what its record must show)) has its newest fresh record showing it.
        Returns (case -> that record, every fresh record of a still-wanted case met on the way,
        oldest first). A bad line is skipped (a file:line warning into `warn`)."""
    todo = dict(wanted)
    found: dict[Any, Record] = {}
    met: list[Record] = []
    for rec in iter_records(path, warn, newest_first=True) if todo else ():
        k = key(rec)
        want = todo.get(k)
        if want is None or not is_fresh(rec, want[0]):
            continue
        met.append(rec)
        if want[1](rec):
            found[k] = rec
            del todo[k]
            if not todo:  # stop before the generator reads another line
                break
    met.reverse()
    return found, met


def stage_file(root: Path, stage: str) -> Path:
    return records_dir(root) / f"{stage}.jsonl"


class RecordWriter:
    """Writes records to results/records/<stage>.jsonl, their inventories and env block to the
        stores first (inventories.py), each record holding the notebook's lock shared
        (core/notebooklock.py) from the store look-up to the record line, so compaction cannot drop
        a value in between."""

    def __init__(self, root: Path):
        self.root = root
        self._files: dict[str, Appender] = {}
        self._stores = Stores(results_dir(root))
        self._store_files: dict[Path, StoreAppender] = {}
        self._lock_fd = -1

    def _lock(self) -> int:
        if self._lock_fd < 0:
            self._lock_fd = open_lock(lock_path(results_dir(self.root)))
        return self._lock_fd

    def open(self, stage: str) -> Appender:
        """The appender of a stage's records file (opened once; raises OSError when the
        file cannot be written)."""
        self._lock()
        if stage not in self._files:
            self._files[stage] = Appender(stage_file(self.root, stage))
        return self._files[stage]

    def _store_append(self, store: ContentStore, line: str) -> None:
        if store.path not in self._store_files:
            self._store_files[store.path] = StoreAppender(store.path)
        self._store_files[store.path].write(line)

    def write(self, rec: Record) -> None:
        appender = self.open(rec.stage)
        with shared(self._lock()):
            appender.write(_line(self._stores.compact(rec.to_dict(), self._store_append)))

    def close(self) -> None:
        for a in [*self._files.values(), *self._store_files.values()]:
            a.close()
        self._files.clear()
        self._store_files.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def archive_file(path: Path) -> Path:
    """Where the stale lines of records file `path` are kept, compressed:
    results/archive/<stage>.jsonl.xz (harness/notebook/archive.py moves them)."""
    return path.parent.parent / "archive" / (path.name + ".xz")


def segment_file(path: Path) -> Path:
    """Where compaction keeps the live lines moved out of records file `path`:
        results/records/<stage>.jsonl.xz (archive.py `seal`)."""
    return path.with_name(path.name + ".xz")


def record_sources(path: Path) -> tuple[Path, Path, Path]:
    """The files holding records file `path`'s lines, oldest first: its archive, its segment, the plain
        file."""
    return archive_file(path), segment_file(path), path


def _read_archive(path: Path, warn: list[str] | None) -> bytes | None:
    """An archive's text (None, and one warning, when it is no regular file, no xz, or would
    decompress past the cap: harness/core/safeio.py)."""
    data = read_bytes(path, warn)
    if data is None:
        return None
    try:
        return xz_decompress(data)
    except ValueError as exc:
        if warn is not None:
            warn.append(f"{path}: not an xz archive ({exc}) — skipped")
        return None


def iter_records(path: Path, warn: list[str] | None = None, newest_first: bool = False,
                 bench: bool = False) -> Iterator[Record]:
    """Every valid record of one records file, its segment and its archive (`record_sources`
        order), typed, oldest first (or newest first: a reader may stop early). Bad lines: file:line
        warnings; bench records only with `bench=True`. An id a later line repeats is read twice."""
    sources = record_sources(path)
    for src in (reversed(sources) if newest_first else sources):
        data = _read_archive(src, warn) if src != path else None
        if src != path and data is None:
            continue
        yield from _records(src, warn, newest_first, bench, data)


def _records(path: Path, warn: list[str] | None, newest_first: bool, bench: bool,
             data: bytes | None) -> Iterator[Record]:
    """The records of one file (or of the archive's `data`). Inventory and env ids are read
    back from the results folder's stores (harness/notebook/inventories.py)."""
    store = Stores(path.parent.parent)
    store_warned = False
    for lineno, obj in iter_jsonl(path, warn, newest_first, data):
        expanded = store.expand(obj, warn, f"{path}:{lineno}")
        if expanded is not obj and not store_warned:
            store_warned = True
            if warn is not None:
                warn.extend(store.warnings())
        obj = expanded
        try:
            rec = Record.from_dict(obj)
        except RecordError as exc:
            if warn is not None:
                warn.append(f"{path}:{lineno}: skipped a record ({exc})")
            continue
        if bench or not rec.is_bench:
            yield rec


def read_records(root: Path, stages: list[str] | None = None, warn: list[str] | None = None,
                 bench: bool = False) -> list[Record]:
    """All valid records of the given stages, typed, oldest first within each file; bench records
        only with `bench=True` (never taken for a case's newest result)."""
    folder = records_dir(root)
    if stages is None:
        try:  # a stage whose lines are all in its segment has no plain file, or an empty one
            files = sorted({*folder.glob("*.jsonl"), *(p.with_name(p.name[:-3]) for p in folder.glob("*.jsonl.xz"))}
                           ) if folder.is_dir() else []
        except OSError:
            files = []
    else:
        files = [stage_file(root, s) for s in stages]
    return [rec for path in files for rec in iter_records(path, warn, bench=bench)]


def runs_file(root: Path) -> Path:
    return results_dir(root) / "runs.jsonl"


def notes_file(root: Path) -> Path:
    return results_dir(root) / "notes.jsonl"


def append_event(path: Path, obj: dict) -> None:
    """Append one event to a JSON Lines file of results/ (runs.jsonl, notes.jsonl), under the
    notebook's lock (harness/core/notebooklock.py)."""
    a = Appender(path, lock_path(path.parent))
    try:
        a.write(json.dumps(obj, separators=(",", ":")))
    finally:
        a.close()


class RunLog:
    """One writing command's session: its run id, its record writer, its events in
        results/runs.jsonl — `start` (once: at once, or with the first record when the session may
        write nothing) and `end` (interrupted or not, which signal).  `run_id`: one given elsewhere
        (a remote run's); `writer`: shared with other sessions (a split remote run)."""

    def __init__(self, root: Path, run_id: str | None = None, writer: RecordWriter | None = None):
        self.root = root
        self.run_id = run_id or new_run_id()
        self.writer = writer if writer is not None else RecordWriter(root)
        self.started = False
        self.ended = False
        self._start: dict[str, Any] = {"run": self.run_id, "t": now_iso(), "event": "start"}

    def plan(self, **fields: Any) -> None:
        """What the start event will say (the time it says is now's), without writing it yet."""
        self._start = {"run": self.run_id, "t": now_iso(), "event": "start", **fields}

    def start(self) -> None:
        """Write the start event, once (OSError when runs.jsonl cannot be written)."""
        if not self.started:
            append_event(runs_file(self.root), self._start)
            self.started = True

    def write(self, rec: Record) -> None:
        """Write a record of this session (its start event first, when not written yet)."""
        self.start()
        self.writer.write(rec)

    def end(self, interrupted: bool | None = None, signum: int | None = None, **fields: Any) -> None:
        """Write the end event (interrupted or not, which signal, then `fields`), once; OSError when
                runs.jsonl cannot be written."""
        import signal

        ev: dict[str, Any] = {"run": self.run_id, "t": now_iso(), "event": "end"}
        if interrupted is not None:
            ev["interrupted"] = interrupted
        if signum is not None:
            ev["signal"] = signal.Signals(signum).name
        self.ended = True
        append_event(runs_file(self.root), {**ev, **fields})

    def close(self) -> None:
        self.writer.close()


def runs_archive_file(root: Path) -> Path:
    """Where the events of runs no live record names are kept, compressed (harness/notebook/archive.py)."""
    return results_dir(root) / "archive" / "runs.jsonl.xz"


def record_archives(root: Path) -> list[Path]:
    """The archives of stale record lines, results/archive/<stage>.jsonl.xz (not the runs' events
    archive beside them), sorted."""
    runs = runs_archive_file(root)
    return [p for p in sorted((results_dir(root) / "archive").glob("*.jsonl.xz")) if p != runs]


def record_segments(root: Path) -> list[Path]:
    """The segments of sealed live lines, results/records/<stage>.jsonl.xz, sorted."""
    return sorted(records_dir(root).glob("*.jsonl.xz"))


def has_record_lines(root: Path) -> bool:
    """Whether results/ holds any record line: a records file, a segment or an archive of a
    stage that is not empty (the runs' events archive is no records file)."""
    runs = runs_archive_file(root)
    for folder, pattern in ((records_dir(root), "*.jsonl"), (records_dir(root), "*.jsonl.xz"),
                            (results_dir(root) / "archive", "*.jsonl.xz")):
        try:
            if any(p != runs and p.stat().st_size > 0 for p in folder.glob(pattern)):
                return True
        except OSError:
            continue
    return False


def read_runs(root: Path, warn: list[str] | None = None) -> dict[str, dict]:
    """run id -> merged start/end events; the archive's (older) lines first, then runs.jsonl."""
    runs: dict[str, dict] = {}
    archive = runs_archive_file(root)
    sources: list[tuple[Path, bytes | None]] = []
    if archive.exists():
        data = _read_archive(archive, warn)
        if data is not None:
            sources.append((archive, data))
    sources.append((runs_file(root), None))
    for path, data in sources:
        for _, ev in iter_jsonl(path, warn, False, data):
            if isinstance(ev, dict) and isinstance(ev.get("run"), str):
                runs.setdefault(ev["run"], {}).update(ev)
    return runs


def read_notes(root: Path, warn: list[str] | None = None) -> dict[str, list[dict]]:
    notes: dict[str, list[dict]] = {}
    path = notes_file(root)
    for lineno, ev in iter_jsonl(path, warn):
        if (isinstance(ev, dict) and isinstance(ev.get("run"), str) and isinstance(ev.get("text"), str)
                and isinstance(ev.get("t", ""), str)):
            notes.setdefault(ev["run"], []).append(ev)
        elif warn is not None:
            warn.append(f"{path}:{lineno}: skipped a note (needs run, t and text as strings)")
    return notes


def print_warnings(warn: list[str], limit: int = 5) -> None:
    for w in warn[:limit]:
        print(f"warning: {w}", file=sys.stderr)
    if len(warn) > limit:
        print(f"warning: … and {len(warn) - limit} more skipped lines", file=sys.stderr)
