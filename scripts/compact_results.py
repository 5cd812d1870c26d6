"""Upkeep of the notebook's size (the tracked tree must stay small enough to carry to a GPU
machine): move the records' inline inventories and env blocks into their stores, stale records
(and those a suite baseline stands for: harness/notebook/baselines.py) into results/archive/<stage>.jsonl.xz and the events of runs no live line names into
results/archive/runs.jsonl.xz, seal each stage's live lines into its segment (a stage with a line
readers skip is left as it is, one line, exit 1), rewrite each store as one xz stream of the
values a line still names (folding in an older plain inventories.jsonl), retire the archive's
oldest stale lines (archive.py `retire`: --keep N, default 0, a bench shape 4; --days M, default
0; named in results/archive/retired.jsonl.xz with HEAD and the `git show` that shows it), and
trim baselines to what the gate compares.  Nothing is lost: every reader sees the same records.
Idempotent; prints what it saved; holds the notebook's lock (results/.lock) throughout.  Every
record is read before and after (`every_record`): one that does not read back the same is one
line, exit 1.

    python3 scripts/compact_results.py [LAB_ROOT] [--force] [--keep N] [--days M]

A store with unreadable parts is left as it is, with the warnings; --force rewrites it from what
can be read."""

from __future__ import annotations

import json
import lzma
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.notebook import baselines  # noqa: E402
from harness.notebook import speedbaselines  # noqa: E402
from harness.notebook.archive import (KEEP_DAYS, KEEP_NEWEST, Held, SealRefused, archive_runs,  # noqa: E402
                                      archive_stale, inline_archive, retire, seal)
from harness.spec.identity import source_hash  # noqa: E402
from harness.notebook.inventories import ContentStore, StoreAppender, Stores, compact_file, rewrite_store  # noqa: E402
from harness.core.notebooklock import LockError, exclusive  # noqa: E402
from harness.core.paths import records_dir, results_dir  # noqa: E402
from harness.core.safeio import Unsafe  # noqa: E402
from harness.notebook.records import (_read_archive, iter_jsonl, notes_file, read_notes, read_records,  # noqa: E402
                                      record_archives, record_segments)
from harness.spec.spec import load_spec  # noqa: E402

ARCHIVE_SUFFIX = ".jsonl.xz"


def _size(*paths: Path | None) -> int:
    return sum(p.stat().st_size for p in paths if p is not None and p.is_file())


def named_ids(root: Path, store: ContentStore) -> set[str] | None:
    """Every id of `store` named by a line of the live records or the archives; None when one cannot
        be read (then nothing may be dropped)."""
    ids: set[str] = set()
    for path in sorted(records_dir(root).glob("*.jsonl")):
        for _, obj in iter_jsonl(path):
            ids |= store.refs(obj)
    for path in record_segments(root) + record_archives(root):
        data = _read_archive(path, None)
        if data is None:
            return None
        for _, obj in iter_jsonl(path, data=data):
            ids |= store.refs(obj)
    return ids


def live_runs_by_stage(root: Path) -> dict[str, set[str]] | None:
    """Per stage, the run ids its live records (plain file and segment) name; None when a segment
    cannot be read (which runs are live is not known)."""
    runs: dict[str, set[str]] = {}
    for path in sorted(records_dir(root).glob("*.jsonl")) + record_segments(root):
        data = _read_archive(path, None) if path.suffix == ".xz" else None
        if path.suffix == ".xz" and data is None:
            return None
        stage_id = path.name[:-len(ARCHIVE_SUFFIX if path.suffix == ".xz" else ".jsonl")]
        runs.setdefault(stage_id, set()).update(obj["run"] for _, obj in iter_jsonl(path, data=data)
                                                if isinstance(obj, dict) and isinstance(obj.get("run"), str))
    return runs


def live_runs(root: Path) -> set[str] | None:
    """The run ids the live records (plain files and segments) of any stage name; None when a
    segment cannot be read (which runs are live is not known, so no run's events may move)."""
    by_stage = live_runs_by_stage(root)
    return None if by_stage is None else set().union(*by_stage.values())


_MENTIONED = re.compile(rb"\d{8}-\d{6}-[0-9a-f]{4,}(?:\.\d+)?")


def named_by_notebook(root: Path) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(record ids, run ids, per stage the run ids) whose archive lines are never retired: records the
        baselines name, runs notes are on or mention, and per stage the runs its live records name.
        BaselineError / OSError (one line) when one cannot be read."""
    ids = {b.record for b in baselines.load(root)} | {b.record for b in speedbaselines.load(root)}
    runs = set(read_notes(root))
    try:
        text = notes_file(root).read_bytes()
    except FileNotFoundError:
        text = b""
    for m in _MENTIONED.findall(text):
        ids.add(m.decode())
        runs.add(m.decode().split(".")[0])
    live = live_runs_by_stage(root)
    if live is None:
        raise OSError("a segment cannot be read (above), so which runs are live is not known")
    return ids, runs, live


def _git(top: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(top), *args], capture_output=True, timeout=120)


def held_at_head(root: Path, archive: Path) -> Held:
    """The ids of the lines the archive at HEAD holds (none when it is not committed there);
    OSError (one phrase) when root is no git checkout with a commit."""
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        head = _git(root, "rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(f"git cannot run ({exc})") from None
    if top.returncode or head.returncode:
        raise OSError("not a git checkout with a commit, so no commit would hold a retired line")
    sha = head.stdout.decode().strip()
    path = archive.resolve().relative_to(Path(top.stdout.decode().strip()).resolve()).as_posix()
    shown = _git(root, "show", f"{sha}:{path}")
    ids: set[str] = set()
    if shown.returncode == 0:
        try:
            text = lzma.decompress(shown.stdout)
        except lzma.LZMAError:
            text = b""
        for _, obj in iter_jsonl(archive, None, data=text):
            if isinstance(obj, dict) and isinstance(obj.get("id"), str):
                ids.add(obj["id"])
    return Held(sha, path, frozenset(ids))


def every_record(root: Path) -> Counter[str]:
    """Every record the notebook reads (archives, segments, plain files, bench too) as full JSON,
        counted: what compaction must leave as it found it."""
    stages = {p.name[:-len(".jsonl")] for p in records_dir(root).glob("*.jsonl")}
    stages |= {p.name[:-len(ARCHIVE_SUFFIX)] for p in [*record_segments(root), *record_archives(root)]}
    return Counter(r.to_json() for r in read_records(root, sorted(stages), [], bench=True))


def main(root: Path, force: bool = False, keep: int = KEEP_NEWEST, days: float = KEEP_DAYS) -> int:
    """Compact the notebook holding its lock exclusive (a run appending meanwhile waits); every record
        but the retired must read back the same afterwards (`every_record`)."""
    try:
        with exclusive(results_dir(root)):
            before = every_record(root)
            retired: set[str] = set()
            code = _compact(root, force, keep, days, retired)
            after = every_record(root)
            lost, new = before - after, after - before
            if new or any(json.loads(line)["id"] not in retired for line in lost):
                gone = next(iter(lost or new))
                print(f"compact_results: {sum(lost.values())} record(s) read before do not read back the same, "
                      f"{sum(new.values())} read now were not read before (e.g. {gone[:120]}…) — a bug in the lab: "
                      f"restore results/ from git (git checkout results) before committing", file=sys.stderr)
                return 1
            return code
    except (LockError, Unsafe) as exc:
        print(f"compact_results: {exc}", file=sys.stderr)
        return 2


def _compact(root: Path, force: bool, keep: int = KEEP_NEWEST, days: float = KEEP_DAYS,
             retired: set[str] | None = None) -> int:
    problems = 0
    stores = Stores(results_dir(root)).each
    store_before = {store.path: _size(store.path, store.plain) for store in stores}
    for store in stores:
        out = StoreAppender(store.path)
        try:
            for path in sorted(records_dir(root).glob("*.jsonl")):
                lines, saved = compact_file(path, store, out.write)
                print(f"{path.relative_to(root)}: {lines} lines, {saved} bytes saved ({store.kind.plural} "
                      f"into {store.path.name})")
        finally:
            out.close()
    unreadable = {path.name[:-len(ARCHIVE_SUFFIX)] for path in record_segments(root) if _read_archive(path, None) is None}
    for stage_id in sorted(unreadable):  # one line each; its stage, and the runs' events, are left as they are
        print(f"{records_dir(root) / stage_id}.jsonl.xz: not an xz segment — left as it is, and stage {stage_id}'s "
              f"records neither archived nor sealed, no run's events archived; restore it (git checkout "
              f"results/records/{stage_id}.jsonl.xz) and run again", file=sys.stderr)
        problems += 1
    spec = load_spec(root / "stages.yaml")
    try:
        summaries = {(b.stage, b.arch): b.src for b in baselines.load(root) if b.kind == "suite"}
    except baselines.BaselineError as exc:  # then no suite's records move: they may be its only proof
        print(f"compact_results: {exc} — no suite's records archived", file=sys.stderr)
        summaries, problems = {}, problems + 1
    for stage in spec.stages.values():
        if stage.id in unreadable:
            continue
        current = {arch: source_hash(spec.root, stage, arch) for arch in stage.kernels}
        summarized = {arch: src for (sid, arch), src in summaries.items() if sid == stage.id}
        try:
            moved, saved = archive_stale(root, stage.id, current, summarized)
        except OSError as exc:
            print(f"warning: {exc}", file=sys.stderr)
            problems += 1
            continue
        if moved:
            print(f"results/records/{stage.id}.jsonl: {moved} stale lines archived, {saved} bytes saved")
    for path in sorted(records_dir(root).glob("*.jsonl")):
        if path.stem in unreadable:
            continue
        try:
            moved, saved = seal(root, path.stem)
        except OSError as exc:  # SealRefused, or the plain file cannot be read: one line, nothing written
            print(f"{'' if isinstance(exc, SealRefused) else 'warning: '}{exc}", file=sys.stderr)
            problems += 1
            continue
        if moved:
            print(f"{path.relative_to(root)}: {moved} lines sealed into {path.name}.xz, {saved} bytes saved")
    live = live_runs(root)  # None when a segment cannot be read (said above): no run's events move
    try:
        moved, saved = archive_runs(root, live) if live is not None else (0, 0)
    except OSError as exc:
        print(f"warning: {exc}", file=sys.stderr)
        problems += 1
    else:
        if moved:
            print(f"results/runs.jsonl: {moved} events of runs no live record names archived, {saved} bytes saved")
    problems += _retire(root, keep, days, retired if retired is not None else set())
    for path in record_archives(root):
        before = path.stat().st_size
        try:
            inlined = inline_archive(root, path.name[:-len(ARCHIVE_SUFFIX)])
        except OSError as exc:
            print(f"warning: {exc}", file=sys.stderr)
            problems += 1
            continue
        if inlined:
            print(f"{path.relative_to(root)}: {inlined} lines given their inventories and env inline "
                  f"({path.stat().st_size - before:+d} bytes)")
    for store in stores:
        unreadable = store.warnings()
        for w in unreadable:
            print(f"warning: {w}", file=sys.stderr)
        if unreadable and not force:
            print(f"{store.path.relative_to(root)}: left as it is (parts of it cannot be read, above); "
                  f"run again with --force to rewrite it from what can be read", file=sys.stderr)
            problems += 1
            continue
        named = named_ids(root, store)
        kept, dropped = rewrite_store(store, named)
        why = "that no line names" if named is not None else "(none: an archive cannot be read, so all are kept)"
        plain = " (with the plain store)" if store.plain is not None else ""
        print(f"{store.path.relative_to(root)}: {kept} {store.kind.plural} kept, {dropped} dropped {why}; "
              f"{store_before[store.path]} -> {_size(store.path, store.plain)} bytes{plain}")
    if not any(f.is_file() for f in (baselines.baselines_file(root), baselines.old_baselines_file(root),
                                      baselines.compile_baselines_file(root))):
        return 1 if problems else 0
    try:
        _trim_baselines(root)
    except baselines.BaselineError as exc:  # one line, the file left as it is
        print(f"compact_results: {exc} — baselines not trimmed", file=sys.stderr)
        problems += 1
    return 1 if problems else 0


def _trim_baselines(root: Path) -> None:
    """Compile baselines to what the gate compares, run baselines' metric values to the digits it
    needs (BaselineError, one line, when the file cannot be read or written)."""
    with baselines.locked(root):
        items = baselines.load(root)
        for b in items:
            if b.compile is not None:
                for table in ("inv", "sass"):
                    if isinstance(b.compile.get(table), dict):
                        b.compile[table] = baselines.gated_counts(b.compile[table])
            else:  # the metric values to the digits the gate needs (the record keeps them all)
                b.metrics = baselines.gated_metrics(b.metrics, b.tolerance)
        before = _baselines_bytes(root)
        baselines.save(root, items, read=items)
        print(f"results/{baselines.RUN_FILE}, {baselines.COMPILE_FILE}: {before - _baselines_bytes(root)} bytes saved")


def _baselines_bytes(root: Path) -> int:
    files = (baselines.baselines_file(root), baselines.old_baselines_file(root), baselines.compile_baselines_file(root))
    return sum(f.stat().st_size for f in files if f.is_file())


def _retire(root: Path, keep: int, days: float, retired: set[str]) -> int:
    """Retire each stage archive's oldest stale lines (module doc); the ids retired go into
    `retired`. Returns the number of problems said (one line each)."""
    archives = record_archives(root)
    if not archives:
        return 0
    try:
        ids, runs, live = named_by_notebook(root)
    except (baselines.BaselineError, OSError) as exc:
        print(f"results/archive: nothing retired — what the notebook names is not known: {exc}", file=sys.stderr)
        return 1
    problems = 0
    for path in archives:
        stage_id = path.name[:-len(ARCHIVE_SUFFIX)]
        try:
            held = held_at_head(root, path)
        except OSError as exc:
            print(f"results/archive: nothing retired — {exc}")
            return 0
        try:
            lines = {o["id"] for _, o in iter_jsonl(path, None, data=_read_archive(path, None) or b"")
                     if isinstance(o, dict) and isinstance(o.get("id"), str)}
            moved, saved = retire(root, stage_id, held, ids, runs | live.get(stage_id, set()), keep, days)
        except OSError as exc:
            print(f"warning: {exc}", file=sys.stderr)
            problems += 1
            continue
        if moved:
            left = {o["id"] for _, o in iter_jsonl(path, None, data=_read_archive(path, None) or b"")
                    if isinstance(o, dict) and isinstance(o.get("id"), str)} if path.exists() else set()
            retired |= lines - left
            print(f"{path.relative_to(root)}: {moved} lines retired, {saved} bytes saved (named in "
                  f"results/archive/retired.jsonl.xz; git show {held.sha[:12]}:{held.path} holds them)")
    return problems


def _args(argv: list[str]) -> tuple[Path, bool, int, float] | str:
    """(root, force, keep, days) from the command line, or why not (one line)."""
    rest, keep, days = [], KEEP_NEWEST, KEEP_DAYS
    it = iter(argv)
    for a in it:
        if a in ("--keep", "--days"):
            value = next(it, "")
            try:
                number = int(value) if a == "--keep" else float(value)
            except ValueError:
                number = -1
            if number < 0 or number != number:
                return f"{a} needs a number >= 0 (got {value!r})"
            keep, days = (int(number), days) if a == "--keep" else (keep, float(number))
        elif a in ("-h", "--help"):
            return "help"
        elif a.startswith("-") and a != "--force":
            return f"unknown option {a!r}"
        elif a != "--force":
            rest.append(a)
    if len(rest) > 1:
        return f"one LAB_ROOT at most (got {' '.join(rest)})"
    return Path(rest[0]).resolve() if rest else Path.cwd(), "--force" in argv, keep, days


if __name__ == "__main__":
    parsed = _args(sys.argv[1:])
    if parsed == "help":
        print(__doc__)
        sys.exit(0)
    if isinstance(parsed, str):
        print(f"compact_results: {parsed} — usage: python3 scripts/compact_results.py [LAB_ROOT] [--force] "
              f"[--keep N] [--days M]", file=sys.stderr)
        sys.exit(2)
    root_, force_, keep_, days_ = parsed
    sys.exit(main(root_, force=force_, keep=keep_, days=days_))
