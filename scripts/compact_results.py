"""Upkeep of the notebook's size (the tracked tree must stay small enough to carry to a GPU
machine): move the records' inline instruction inventories and env blocks into their stores,
move stale records into results/archive/<stage>.jsonl.xz (their inventories and env inline) and
the events of runs no live line names into results/archive/runs.jsonl.xz, seal the live lines
of each results/records/<stage>.jsonl into its segment results/records/<stage>.jsonl.xz (one xz
stream; the plain file is left empty — a stage with a line readers skip is left as it is, with
one line naming it, and the exit code is 1), rewrite each store
(results/inventories.jsonl.xz, results/envs.jsonl.xz) as one xz stream holding only the values a
line still names (an older notebook's plain results/inventories.jsonl is folded in and removed),
and trim compile baselines to what the gate compares and run baselines' metric values to the
digits it needs (harness/notebook/inventories.py, harness/notebook/archive.py, harness/notebook/baselines.py). Nothing is
lost: every reader sees the same records afterwards.
Idempotent; prints what it saved. It holds the notebook's lock (results/.lock) throughout: runs appending meanwhile wait,
and nothing they write is lost. It reads every record before and after (`every_record`): one that
does not read back the same is one line, and the exit code is 1.

    python3 scripts/compact_results.py [LAB_ROOT] [--force]

A store with parts that cannot be read (a stream cut off by a crash, a corrupt line) is left as
it is, with the warnings printed; --force rewrites it from what can be read.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.notebook import baselines  # noqa: E402
from harness.notebook.archive import SealRefused, archive_runs, archive_stale, inline_archive, seal  # noqa: E402
from harness.spec.identity import source_hash  # noqa: E402
from harness.notebook.inventories import ContentStore, StoreAppender, Stores, compact_file, rewrite_store  # noqa: E402
from harness.core.notebooklock import LockError, exclusive  # noqa: E402
from harness.core.paths import records_dir, results_dir  # noqa: E402
from harness.core.safeio import Unsafe  # noqa: E402
from harness.notebook.records import (_read_archive, iter_jsonl, read_records, record_archives,  # noqa: E402
                                      record_segments)
from harness.spec.spec import load_spec  # noqa: E402

ARCHIVE_SUFFIX = ".jsonl.xz"


def _size(*paths: Path | None) -> int:
    return sum(p.stat().st_size for p in paths if p is not None and p.is_file())


def named_ids(root: Path, store: ContentStore) -> set[str] | None:
    """Every id of `store` that a line of the live records (plain files and segments) or of the
    archives names; None when a segment or an archive cannot be read (what it names is not
    known, so nothing may be dropped)."""
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


def live_runs(root: Path) -> set[str] | None:
    """The run ids the live records (plain files and segments) name; None when a segment cannot
    be read (which runs are live is not known, so no run's events may move)."""
    runs: set[str] = set()
    for path in sorted(records_dir(root).glob("*.jsonl")) + record_segments(root):
        data = _read_archive(path, None) if path.suffix == ".xz" else None
        if path.suffix == ".xz" and data is None:
            return None
        runs |= {obj["run"] for _, obj in iter_jsonl(path, data=data)
                 if isinstance(obj, dict) and isinstance(obj.get("run"), str)}
    return runs


def every_record(root: Path) -> Counter[str]:
    """Every record the notebook reads — archives, segments and plain files of every stage on
    disk, bench records too — as its full JSON, counted: what compaction must leave as it found
    it (in another order: stale lines move to the archive)."""
    stages = {p.name[:-len(".jsonl")] for p in records_dir(root).glob("*.jsonl")}
    stages |= {p.name[:-len(ARCHIVE_SUFFIX)] for p in [*record_segments(root), *record_archives(root)]}
    return Counter(r.to_json() for r in read_records(root, sorted(stages), [], bench=True))


def main(root: Path, force: bool = False) -> int:
    """Compact the notebook, holding its lock exclusive throughout (harness/core/notebooklock.py): a
    run appending meanwhile waits at its next record and then appends to the rewritten file.
    Every record must read back the same afterwards (`every_record`)."""
    try:
        with exclusive(results_dir(root)):
            before = every_record(root)
            code = _compact(root, force)
            after = every_record(root)
            if after != before:
                lost, new = before - after, after - before
                gone = next(iter(lost or new))
                print(f"compact_results: {sum(lost.values())} record(s) read before do not read back the same, "
                      f"{sum(new.values())} read now were not read before (e.g. {gone[:120]}…) — a bug in the lab: "
                      f"restore results/ from git (git checkout results) before committing", file=sys.stderr)
                return 1
            return code
    except (LockError, Unsafe) as exc:
        print(f"compact_results: {exc}", file=sys.stderr)
        return 2


def _compact(root: Path, force: bool) -> int:
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
    for stage in spec.stages.values():
        if stage.id in unreadable:
            continue
        current = {arch: source_hash(spec.root, stage, arch) for arch in stage.kernels}
        try:
            moved, saved = archive_stale(root, stage.id, current)
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
    if not baselines.baselines_file(root).is_file():
        return 1 if problems else 0
    with baselines.locked(root):
        items = baselines.load(root)
        for b in items:
            if b.compile is not None:
                for table in ("inv", "sass"):
                    if isinstance(b.compile.get(table), dict):
                        b.compile[table] = baselines.gated_counts(b.compile[table])
            else:  # the metric values to the digits the gate needs (the record keeps them all)
                b.metrics = baselines.gated_metrics(b.metrics, b.tolerance)
        before = baselines.baselines_file(root).stat().st_size
        baselines.save(root, items, read=items)
        print(f"results/baselines.yaml: {before - baselines.baselines_file(root).stat().st_size} bytes saved")
    return 1 if problems else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--force"]
    sys.exit(main(Path(args[0]).resolve() if args else Path.cwd(), force="--force" in sys.argv[1:]))
