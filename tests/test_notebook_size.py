"""The notebook stays small losslessly; the tracked tree fits the device carry."""

import json
import lzma
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from harness.notebook import baselines
from harness.notebook.archive import archive_stale, inline_archive
from harness.notebook.inventories import (EnvStore, InventoryStore, StoreAppender, compact_file, content_id, plain_store_file,
                                 rewrite_store, store_file)
from harness.core.paths import results_dir
from harness.notebook import inventories
from harness.notebook.records import (Record, _read_archive, archive_file, iter_records, read_records,
                                      segment_file, stage_file)
from harness.spec.identity import source_hash
from harness.spec.spec import load_spec
from tests.conftest import ROOT, load_script, write_records

# tracked tree + CuTeDSL pack share one 64 MiB carry.
TRACKED_BUDGET = 3 * 1024 * 1024
CARRY_CAP = 64 * 1024 * 1024
PACK_SIZE_KNOWN = "59.9 MiB"


def _tracked_sizes(root: Path) -> dict[str, int]:
    import os

    import pytest

    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"git ls-files cannot run here ({exc})")
    if out.returncode != 0 or not out.stdout:
        pytest.skip("not a git checkout: no tracked tree to measure")
    sizes = {}
    for name in filter(None, out.stdout.decode("utf-8", "surrogateescape").split("\0")):
        try:
            sizes[name] = os.lstat(root / name).st_size  # as `du -b` counts
        except OSError:
            continue
    return sizes


def test_the_tracked_tree_fits_the_device_carry(project_root):
    sizes = _tracked_sizes(project_root)
    total = sum(sizes.values())
    pack = project_root / ".device"
    pack_bytes = sum(p.stat().st_size for p in pack.rglob("*") if p.is_file()) if pack.is_dir() else None
    pack_said = f"{pack_bytes / 2**20:.1f} MiB here" if pack_bytes else f"{PACK_SIZE_KNOWN}, not here"
    largest = ", ".join(f"{n} {b:,}" for n, b in sorted(sizes.items(), key=lambda x: -x[1])[:5])
    assert total <= TRACKED_BUDGET, (
        f"the tracked tree is {total:,} bytes, {total - TRACKED_BUDGET:,} over its budget of 3 MiB "
        f"({TRACKED_BUDGET:,}): the GPU machine receives it with the CuTeDSL pack (.device, {pack_said}) in one "
        f"carry of at most 64 MiB. Largest tracked files: {largest}. Compact the notebook "
        f"(python3 scripts/compact_results.py, then commit results/) or shrink what grew.")
    if pack_bytes:
        assert total + pack_bytes <= CARRY_CAP, (
            f"the tracked tree ({total:,} bytes) and the CuTeDSL pack (.device, {pack_said}) together are "
            f"{total + pack_bytes:,} bytes, past the carry's 64 MiB ({CARRY_CAP:,})")


INV = {"(all)": 120, "wgmma.mma_async.m64n64k16.f32.bf16.bf16": 32, "ld.global.128b": 12}
SASS = {"(all)": 200, "HGMMA.64x64x16.F32.BF16": 32, "LDG.E.128": 12}


def rec(i: int, src: str = "0123456789ab", inv: dict | None = None, arch: str = "sm_90a") -> Record:
    return Record(
        id=f"r1.{i}", run="r1", t="2026-11-22T00:00:00Z", stage="A", arch=arch, case={"n": i}, status="pass",
        metrics={"S": {"cosine": 0.999999, "rel_l2": 1e-6, "max_abs": 1e-5}},
        compile={"key": "k", "regs": 90, "spill": 0, "inv": dict(inv or INV), "sass": dict(SASS)},
        code={"commit": "abc", "dirty": False, "src": src},
    )


_write_all = write_records


def test_each_inventory_is_stored_once_and_read_back_in_place(tmp_path):
    _write_all(tmp_path, [rec(0), rec(1), rec(2), rec(3, inv={**INV, "ld.global.128b": 13})])
    store = [json.loads(x) for x in lzma.decompress(store_file(results_dir(tmp_path)).read_bytes()).splitlines()]
    assert len(store) == 3  # INV, SASS and the changed INV; not 8
    lines = stage_file(tmp_path, "A").read_text().splitlines()
    assert all('"#' in x and "wgmma" not in x for x in lines)
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert not warn
    assert [r.compile["inv"] for r in got] == [INV, INV, INV, {**INV, "ld.global.128b": 13}]
    assert got[0] == rec(0) and all(r.compile["sass"] == SASS for r in got)


def test_a_tampered_store_line_or_an_unknown_id_costs_that_table_only(tmp_path):
    _write_all(tmp_path, [rec(0)])
    path = store_file(results_dir(tmp_path))
    entries = [json.loads(x) for x in lzma.decompress(path.read_bytes()).splitlines()]
    inv_entry = next(e for e in entries if e["counts"] == INV)
    inv_entry["counts"]["wgmma.mma_async.m64n64k16.f32.bf16.bf16"] = 31  # no longer hashes to its id
    path.write_bytes(lzma.compress(("\n".join(json.dumps(e) for e in entries) + "\n").encode()))
    line = json.loads(stage_file(tmp_path, "A").read_text())
    line["id"] = "r1.9"
    line["compile"]["sass"] = "#" + "0" * 16  # an id nobody stored
    with open(stage_file(tmp_path, "A"), "a") as fh:
        fh.write(json.dumps(line) + "\n")
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in got] == ["r1.0", "r1.9"]
    assert "inv" not in got[0].compile and got[0].compile["sass"] == SASS and got[0].compile["regs"] == 90
    assert "inv" not in got[1].compile and "sass" not in got[1].compile
    assert any("must hash to the id" in x for x in warn) and any("does not hold" in x for x in warn)
    assert baselines.compile_facts(got[0]) is None  # never an untrusted inventory


def test_compacting_an_old_notebook_keeps_every_record_and_every_bad_line(tmp_path):
    path = stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    path.write_text(rec(0).to_json() + "\n{broken line\n" + rec(1).to_json() + "\n")
    before = read_records(tmp_path, ["A"], [])
    store = InventoryStore(results_dir(tmp_path))
    out = StoreAppender(store.path)
    lines, saved = compact_file(path, store, out.write)
    lines2, saved2 = compact_file(path, store, out.write)
    out.close()
    assert saved > 0 and saved2 == 0 and lines == lines2
    assert "{broken line" in path.read_text().splitlines()
    assert read_records(tmp_path, ["A"], []) == before
    assert content_id(INV) == content_id(dict(reversed(list(INV.items()))))  # key order never matters


def test_stale_lines_move_to_the_archive_and_read_back_first(tmp_path):
    _write_all(tmp_path, [rec(i, src) for i, src in enumerate(["old1", "old1", "new", "old2", "new"])]
               + [rec(5, "other", arch="sm_100a")])  # an arch the caller does not name: stays
    before = read_records(tmp_path, ["A"], [])
    moved, saved = archive_stale(tmp_path, "A", {"sm_90a": "new"})
    assert moved == 3 and saved > 0
    assert archive_file(stage_file(tmp_path, "A")).is_file()
    live = [json.loads(x)["id"] for x in stage_file(tmp_path, "A").read_text().splitlines()]
    assert live == ["r1.2", "r1.4", "r1.5"]
    after = read_records(tmp_path, ["A"], [])
    assert sorted(r.id for r in after) == sorted(r.id for r in before)
    assert [r.id for r in after] == ["r1.0", "r1.1", "r1.3", "r1.2", "r1.4", "r1.5"]  # archive = the older part
    newest = [r.id for r in iter_records(stage_file(tmp_path, "A"), [], newest_first=True)]
    assert newest == list(reversed([r.id for r in after]))
    # A second pass: nothing lost or doubled.
    _write_all(tmp_path, [rec(6, "new")])
    assert archive_stale(tmp_path, "A", {"sm_90a": "newer"})[0] == 3
    assert sorted(r.id for r in read_records(tmp_path, ["A"], [])) == sorted([r.id for r in before] + ["r1.6"])


def test_a_corrupt_archive_is_one_warning_and_never_overwritten(tmp_path):
    _write_all(tmp_path, [rec(0, "old"), rec(1, "new")])
    archive = archive_file(stage_file(tmp_path, "A"))
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"not xz")
    warn: list[str] = []
    assert [r.id for r in read_records(tmp_path, ["A"], warn)] == ["r1.0", "r1.1"]
    assert any("not an xz archive" in x for x in warn)
    try:
        archive_stale(tmp_path, "A", {"sm_90a": "new"})
        raise AssertionError("archived over a corrupt archive")
    except OSError as exc:
        assert "not an xz archive" in str(exc)
    assert archive.read_bytes() == b"not xz" and len(stage_file(tmp_path, "A").read_text().splitlines()) == 2
    archive.write_bytes(lzma.compress(b""))
    assert archive_stale(tmp_path, "A", {"sm_90a": "new"})[0] == 1


def test_a_compile_baseline_keeps_the_total_and_the_mma_counters(tmp_path):
    r = replace(rec(0), status="compiled", arch="sm_100a")
    facts = baselines.compile_facts(r)
    assert facts["inv"] == {"(all)": 120, "wgmma.mma_async.m64n64k16.f32.bf16.bf16": 32}
    assert facts["sass"] == {"(all)": 200, "HGMMA.64x64x16.F32.BF16": 32}
    b = baselines.Baseline("A", "sm_100a", "n=0", r.id, "0123456789ab", compile=facts,
                           tolerance=dict(baselines.COMPILE_TOLERANCE))
    (tmp_path / "stages.yaml").write_text("")
    baselines.save(tmp_path, [b])
    text = lzma.decompress(baselines.compile_baselines_file(tmp_path).read_bytes()).decode()
    assert "inv: {" in text and "tolerance" not in text  # default tolerances unwritten
    assert baselines.load(tmp_path) == [b]
    b.tolerance = {**b.tolerance, "regs": 16}  # a changed tolerance is written, and read back
    baselines.save(tmp_path, [b])
    assert "tolerance: {" in lzma.decompress(baselines.compile_baselines_file(tmp_path).read_bytes()).decode()
    assert baselines.load(tmp_path) == [b]


# --- the xz store

def _variant(i: int) -> dict[str, int]:
    return {**INV, "ld.global.128b": 100 + i}


def _write(root, ids, src: str = "0123456789ab") -> None:
    _write_all(root, [rec(i, src, inv=_variant(i)) for i in ids])


def _streams(path) -> int:
    return path.read_bytes().count(b"\xfd7zXZ\x00")


def test_inventories_are_appended_as_xz_streams_and_read_back_across_them(tmp_path):
    _write(tmp_path, range(2))
    _write(tmp_path, range(2, 4))  # a second writer appends to the same store
    path = store_file(results_dir(tmp_path))
    assert path.name == "inventories.jsonl.xz" and not plain_store_file(results_dir(tmp_path)).exists()
    assert _streams(path) == 5  # one xz stream per line
    lines = lzma.decompress(path.read_bytes()).splitlines()  # concatenated streams: one valid xz file
    assert sorted(json.loads(x)["id"] for x in lines) == sorted(
        {content_id(SASS)} | {content_id(_variant(i)) for i in range(4)})
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert not warn and [r.compile["inv"] for r in got] == [_variant(i) for i in range(4)]
    assert all(r.compile["sass"] == SASS for r in got)


def test_a_cut_off_last_stream_costs_one_warning_and_keeps_every_stream_before(tmp_path):
    _write(tmp_path, range(3))
    path = store_file(results_dir(tmp_path))
    whole = path.read_bytes()
    last = whole.rindex(b"\xfd7zXZ\x00")
    path.write_bytes(whole[:-7])  # a crash in the middle of the last append
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in got] == ["r1.0", "r1.1", "r1.2"]
    assert [r.compile.get("inv") for r in got] == [_variant(0), _variant(1), None]  # only the cut-off table is lost
    cut = [x for x in warn if "xz stream" in x]
    assert len(cut) == 1 and f"byte {last}:" in cut[0] and str(path) in cut[0] and "cut off" in cut[0]
    # A later writer: still one warning.
    _write(tmp_path, [3])
    warn = []
    got = read_records(tmp_path, ["A"], warn)
    assert got[-1].compile["inv"] == _variant(3) and got[0].compile["inv"] == _variant(0)
    assert len([x for x in warn if "xz stream" in x]) == 1


def test_a_store_that_is_no_xz_at_all_is_one_warning_and_costs_only_the_tables(tmp_path):
    _write(tmp_path, range(2))
    path = store_file(results_dir(tmp_path))
    path.write_bytes(b'{"id": "not compressed"}\n' * 3)
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in got] == ["r1.0", "r1.1"] and all(r.compile["regs"] == 90 for r in got)
    assert all("inv" not in r.compile and "sass" not in r.compile for r in got)
    assert len([x for x in warn if "xz stream" in x]) == 1 and any("not an xz store" in x for x in warn)


def _compact_script():
    return load_script("compact_results")


def test_compacting_keeps_what_a_line_names_and_a_dropped_inventory_costs_one_table(tmp_path):
    _write(tmp_path, range(3))
    lines = stage_file(tmp_path, "A").read_text().splitlines()
    stage_file(tmp_path, "A").write_text("\n".join(lines[1:]) + "\n")  # r1.0's line is gone: its INV is named by none
    store = InventoryStore(results_dir(tmp_path))
    named = _compact_script().named_ids(tmp_path, InventoryStore(results_dir(tmp_path)))
    assert named == {content_id(SASS), content_id(_variant(1)), content_id(_variant(2))}
    assert rewrite_store(store, named) == (3, 1)
    path = store_file(results_dir(tmp_path))
    assert _streams(path) == 1 and len(lzma.decompress(path.read_bytes()).splitlines()) == 3
    assert [r.compile["inv"] for r in read_records(tmp_path, ["A"], [])] == [_variant(1), _variant(2)]
    # A dropped inventory keeps the rest.
    with open(stage_file(tmp_path, "A"), "a") as fh:
        fh.write(lines[0] + "\n")
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert got[-1].id == "r1.0" and "inv" not in got[-1].compile and got[-1].compile["sass"] == SASS
    assert len(warn) == 1 and "does not hold" in warn[0] and "compile.inv" in warn[0]


def test_a_plain_store_of_an_older_notebook_is_read_beside_the_xz_one_and_folded_in(tmp_path):
    results = results_dir(tmp_path)
    results.mkdir(parents=True)
    old = [{"id": content_id(c), "counts": c} for c in (_variant(0), SASS)]
    plain_store_file(results).write_text("".join(json.dumps(e) + "\n" for e in old))
    path = stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    compacted = [{**rec(0, inv=_variant(0)).to_dict()}]
    compacted[0]["compile"] = {**compacted[0]["compile"], "inv": "#" + old[0]["id"], "sass": "#" + old[1]["id"]}
    path.write_text(json.dumps(compacted[0]) + "\n")  # written before compression
    _write(tmp_path, [1])  # new INV to the xz store
    assert _streams(store_file(results)) == 1
    warn: list[str] = []
    before = read_records(tmp_path, ["A"], warn)
    assert not warn and [r.compile["inv"] for r in before] == [_variant(0), _variant(1)]
    assert all(r.compile["sass"] == SASS for r in before)
    assert rewrite_store(InventoryStore(results), None) == (3, 0)
    assert not plain_store_file(results).exists() and _streams(store_file(results)) == 1
    assert read_records(tmp_path, ["A"], warn) == before and not warn


def test_archived_lines_carry_their_inventories_inline(tmp_path):
    _write(tmp_path, range(2), src="old")
    _write(tmp_path, [2], src="new")
    before = read_records(tmp_path, ["A"], [])
    assert archive_stale(tmp_path, "A", {"sm_90a": "new"})[0] == 2
    archived = [json.loads(x) for x in _read_archive(archive_file(stage_file(tmp_path, "A")), None).splitlines()]
    assert [a["compile"]["inv"] for a in archived] == [_variant(0), _variant(1)]
    assert all(a["compile"]["sass"] == SASS for a in archived)
    # Compacting keeps the live tables.
    assert _compact_script().named_ids(tmp_path, InventoryStore(results_dir(tmp_path))) == {content_id(SASS), content_id(_variant(2))}
    rewrite_store(InventoryStore(results_dir(tmp_path)), _compact_script().named_ids(tmp_path, InventoryStore(results_dir(tmp_path))))
    warn: list[str] = []
    assert read_records(tmp_path, ["A"], warn) == before and not warn


def _archive_the_old_way(root) -> Path:
    """Stage A's lines moved to its archive as they are."""
    path = stage_file(root, "A")
    archive = archive_file(path)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(lzma.compress(path.read_bytes()))
    path.write_text("")
    return archive


def test_an_old_archive_that_names_ids_is_read_and_inlined(tmp_path):
    _write(tmp_path, range(2), src="old")
    archive = _archive_the_old_way(tmp_path)
    assert _compact_script().named_ids(tmp_path, InventoryStore(results_dir(tmp_path))) == {content_id(SASS), content_id(_variant(0)), content_id(_variant(1))}
    warn: list[str] = []
    before = read_records(tmp_path, ["A"], warn)
    assert not warn and [r.compile["inv"] for r in before] == [_variant(0), _variant(1)]
    assert inline_archive(tmp_path, "A") == 2 and inline_archive(tmp_path, "A") == 0
    assert b'"#' not in _read_archive(archive, None)
    assert read_records(tmp_path, ["A"], warn) == before and not warn


def test_a_reader_loads_the_store_once_per_file_not_once_per_record(tmp_path, monkeypatch):
    _write_all(tmp_path, [rec(i) for i in range(5)])
    calls = []
    real = inventories.InventoryStore._load
    monkeypatch.setattr(inventories.InventoryStore, "_load", lambda self: calls.append(1) or real(self))
    got = read_records(tmp_path, ["A"], [])
    assert [r.compile["inv"] for r in got] == [INV] * 5 and len(calls) == 1


def test_runs_no_live_record_names_move_to_the_archive_and_read_back(tmp_path):
    from harness.notebook.archive import archive_runs
    from harness.notebook.records import append_event, read_runs, runs_archive_file, runs_file

    path = runs_file(tmp_path)
    path.parent.mkdir(parents=True)
    for run in ("old1", "live", "old2"):
        append_event(path, {"run": run, "t": "t0", "event": "start", "cases": 3})
        append_event(path, {"run": run, "t": "t1", "event": "end", "counts": {"pass": 3}})
    with path.open("a") as fh:
        fh.write("not json\n")
    before = read_runs(tmp_path)
    assert archive_runs(tmp_path, {"live"})[0] == 4
    assert read_runs(tmp_path) == before  # nothing lost, start and end still merged
    kept = path.read_text().splitlines()
    assert kept[-1] == "not json" and all('"live"' in x for x in kept[:-1]) and len(kept) == 3
    assert archive_runs(tmp_path, {"live"}) == (0, 0)  # idempotent
    from harness.notebook.records import archive_file, record_archives, stage_file
    stage_archive = archive_file(stage_file(tmp_path, "A"))
    stage_archive.write_bytes(b"")
    assert record_archives(tmp_path) == [stage_archive]  # the runs' archive is not a stage's
    append_event(path, {"run": "old1", "event": "note"})  # a later line of an archived run wins
    assert archive_runs(tmp_path, set())[0] == 3
    assert read_runs(tmp_path)["old1"]["event"] == "note" and read_runs(tmp_path)["live"] == before["live"]
    runs_archive_file(tmp_path).write_bytes(b"garbage")
    warn: list[str] = []
    read_runs(tmp_path, warn)
    assert any("not an xz archive" in w for w in warn)  # a bad archive costs a warning, not a crash


# --- env blocks in results/envs.jsonl.xz

ENV_GPU = {"host": "vm", "torch": "2.11.0+cu130", "cute": "4.8.1", "gpu": "NVIDIA H100 80GB HBM3", "cc": "9.0",
           "cuda": "13.0", "driver": "580.159.04"}
ENV_CPU = {"host": "vm", "cute": "4.8.1", "cpus": 2}


def env_rec(i: int, env: dict, src: str = "0123456789ab", stage: str = "A", arch: str = "sm_90a") -> Record:
    return replace(rec(i, src, arch=arch), stage=stage, env=dict(env))


def _env_lines(root) -> list[dict]:
    return [json.loads(x) for x in lzma.decompress(EnvStore(results_dir(root)).path.read_bytes()).splitlines()]


def test_each_env_block_is_stored_once_and_every_reader_gets_the_record_as_written(tmp_path):
    written = [env_rec(i, ENV_GPU if i % 2 else ENV_CPU) for i in range(5)]
    _write_all(tmp_path, written)
    store = _env_lines(tmp_path)
    assert EnvStore(results_dir(tmp_path)).path.name == "envs.jsonl.xz"
    assert sorted(e["id"] for e in store) == sorted([content_id(ENV_GPU), content_id(ENV_CPU)])  # 2 lines, not 5
    lines = [json.loads(x) for x in stage_file(tmp_path, "A").read_text().splitlines()]
    assert [x["env"] for x in lines] == ["#" + content_id(ENV_GPU if i % 2 else ENV_CPU) for i in range(5)]
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert not warn and got == written
    assert [r.to_json() for r in got] == [r.to_json() for r in written]  # key order too
    newest = list(iter_records(stage_file(tmp_path, "A"), warn, newest_first=True))
    assert newest == list(reversed(written)) and not warn


def test_the_env_store_is_written_and_fsynced_before_the_record(tmp_path, monkeypatch):
    seen: list[tuple[str, int]] = []
    real = inventories.StoreAppender.write

    def write(self, line: str) -> None:
        real(self, line)
        path = stage_file(tmp_path, "A")
        seen.append((self.path.name, len(path.read_text().splitlines()) if path.exists() else 0))

    monkeypatch.setattr(inventories.StoreAppender, "write", write)
    _write_all(tmp_path, [env_rec(0, ENV_GPU), env_rec(1, ENV_GPU), env_rec(2, ENV_CPU)])
    assert [s for s in seen if s[0] == "envs.jsonl.xz"] == [("envs.jsonl.xz", 0), ("envs.jsonl.xz", 2)]


def test_an_env_id_the_store_lacks_costs_the_env_and_one_warning_only(tmp_path):
    _write_all(tmp_path, [env_rec(0, ENV_GPU)])
    line = json.loads(stage_file(tmp_path, "A").read_text())
    line["id"] = "r1.1"
    line["env"] = "#" + "0" * 16  # an id nobody stored
    with open(stage_file(tmp_path, "A"), "a") as fh:
        fh.write(json.dumps(line) + "\n")
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in got] == ["r1.0", "r1.1"]
    assert got[0].env == ENV_GPU and got[1].env == {}
    assert got[1].compile["inv"] == INV and got[1].metrics == got[0].metrics and got[1].code == got[0].code
    assert len(warn) == 1 and f"{stage_file(tmp_path, 'A')}:2: env names env block" in warn[0]
    assert "envs.jsonl.xz does not hold" in warn[0] and "restore" in warn[0]


def test_a_record_with_its_env_inline_reads_as_before(tmp_path):
    old = [env_rec(0, ENV_GPU), env_rec(1, ENV_CPU)]
    path = stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    path.write_text("".join(r.to_json() + "\n" for r in old))  # written before the env store: env inline
    warn: list[str] = []
    assert read_records(tmp_path, ["A"], warn) == old and not warn
    assert not EnvStore(results_dir(tmp_path)).path.exists()  # reading never writes a store


def test_archived_lines_carry_their_env_inline_and_the_store_serves_the_live_ones(tmp_path):
    _write_all(tmp_path, [env_rec(0, ENV_CPU, src="old"), env_rec(1, ENV_GPU, src="new")])
    before = read_records(tmp_path, ["A"], [])
    assert archive_stale(tmp_path, "A", {"sm_90a": "new"})[0] == 1
    archived = [json.loads(x) for x in _read_archive(archive_file(stage_file(tmp_path, "A")), None).splitlines()]
    assert [a["env"] for a in archived] == [ENV_CPU] and archived[0]["compile"]["inv"] == INV
    assert json.loads(stage_file(tmp_path, "A").read_text())["env"] == "#" + content_id(ENV_GPU)
    store = EnvStore(results_dir(tmp_path))
    assert _compact_script().named_ids(tmp_path, store) == {content_id(ENV_GPU)}
    assert rewrite_store(store, _compact_script().named_ids(tmp_path, store)) == (1, 1)
    warn: list[str] = []
    assert read_records(tmp_path, ["A"], warn) == before and not warn


def test_an_old_archive_that_names_an_env_id_is_read_and_inlined(tmp_path):
    _write_all(tmp_path, [env_rec(0, ENV_CPU, src="old")])
    archive = _archive_the_old_way(tmp_path)
    before = read_records(tmp_path, ["A"], [])
    assert before[0].env == ENV_CPU
    assert inline_archive(tmp_path, "A") == 1
    assert json.loads(_read_archive(archive, None))["env"] == ENV_CPU
    assert read_records(tmp_path, ["A"], []) == before


def test_compacting_folds_inline_envs_into_the_store_and_drops_unused_ones(fake_lab):
    spec = load_spec(root=fake_lab)
    fresh = source_hash(spec.root, spec.stages["OK"], "cpu")
    unused = {**ENV_CPU, "cpus": 64}
    _write_all(fake_lab, [env_rec(9, unused, fresh, "OK", "cpu")])  # the store now holds an env...
    path = stage_file(fake_lab, "OK")
    path.write_text("")  # ...that no line names any more
    old = [env_rec(0, ENV_GPU, fresh, "OK", "cpu"), env_rec(1, ENV_GPU, fresh, "OK", "cpu"),
           env_rec(2, ENV_CPU, "0ld0ld0ld0ld", "OK", "cpu")]
    path.write_text("".join(r.to_json() + "\n" for r in old) + "{broken line\n")  # an old notebook: env inline
    warn: list[str] = []
    before = read_records(fake_lab, ["OK"], warn)
    assert before == old and len(warn) == 1
    assert _compact_script().main(fake_lab) == 1  # broken line: OK.jsonl not sealed
    assert sorted(e["id"] for e in _env_lines(fake_lab)) == [content_id(ENV_GPU)]  # unused and archived: dropped
    assert _streams(EnvStore(results_dir(fake_lab)).path) == 1
    lines = path.read_text().splitlines()
    assert [json.loads(x)["env"] for x in lines[:2]] == ["#" + content_id(ENV_GPU)] * 2 and lines[2] == "{broken line"
    assert [json.loads(x)["id"] for x in lines[:2]] == ["r1.0", "r1.1"]  # ids and every other field unchanged
    assert {k: v for k, v in json.loads(lines[0]).items() if k not in ("env", "compile")} == {
        k: v for k, v in json.loads(old[0].to_json()).items() if k not in ("env", "compile")}
    archived = _read_archive(archive_file(path), None)
    assert json.loads(archived)["env"] == ENV_CPU
    warn = []
    after = read_records(fake_lab, ["OK"], warn)
    assert sorted(after, key=lambda r: r.id) == before and len(warn) == 1  # the broken line, as before
    size = path.stat().st_size
    assert _compact_script().main(fake_lab) == 1 and path.stat().st_size == size  # idempotent
    path.write_text("\n".join(lines[:2]) + "\n")  # mended: sealed
    assert _compact_script().main(fake_lab) == 0 and path.read_bytes() == b""
    assert _read_archive(segment_file(path), None) == ("\n".join(lines[:2]) + "\n").encode()
    assert sorted(read_records(fake_lab, ["OK"], warn), key=lambda r: r.id) == before
    assert _compact_script().main(fake_lab) == 0 and path.read_bytes() == b""  # idempotent


def test_a_corrupt_env_store_line_or_stream_costs_one_warning_each_and_nothing_else(tmp_path):
    _write_all(tmp_path, [env_rec(0, ENV_GPU), env_rec(1, ENV_CPU)])
    path = EnvStore(results_dir(tmp_path)).path
    entries = _env_lines(tmp_path)
    assert entries[0]["env"] == ENV_GPU
    entries[0]["env"] = {**ENV_GPU, "host": "elsewhere"}  # no longer hashes to its id
    body = "".join(json.dumps(e) + "\n" for e in entries) + "{not json\n"
    cut = lzma.compress(b'{"id": "0123456789abcdef", "env": {}}\n')[:-7]  # a crash in the middle of an append
    path.write_bytes(lzma.compress(body.encode()) + cut)
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in got] == ["r1.0", "r1.1"] and all(r.compile["inv"] == INV for r in got)
    assert got[0].env == {} and got[1].env == ENV_CPU and got[0].metrics == got[1].metrics
    assert len([w for w in warn if f"{path}:1: skipped an env block" in w and "must hash to the id" in w]) == 1
    assert len([w for w in warn if f"{path}:3: skipped a corrupt line" in w]) == 1
    assert len([w for w in warn if f"{path}: byte " in w and "cut off" in w]) == 1
    assert len([w for w in warn if "does not hold" in w]) == 1 and len(warn) == 4


def test_show_and_the_dashboard_read_an_env_by_id_and_a_missing_one_is_one_line(fake_lab):
    from tests.conftest import run_cli

    spec = load_spec(root=fake_lab)
    fresh = source_hash(spec.root, spec.stages["OK"], "cpu")
    r = replace(env_rec(0, ENV_GPU, fresh, "OK", "cpu"), compile=None, case={"n": 16},
                metrics={"out": {"cosine": 1.0, "rel_l2": 0.0}})
    _write_all(fake_lab, [r])
    assert '"env":"#' in stage_file(fake_lab, "OK").read_text()
    out = run_cli(["show", "r1.0"], cwd=fake_lab)
    assert out.returncode == 0 and '"NVIDIA H100 80GB HBM3"' in out.stdout and "580.159.04" in out.stdout, out.stderr
    dash = run_cli(["dashboard"], cwd=fake_lab)
    assert dash.returncode == 0 and "H100 80GB HBM3 @ vm" in dash.stdout, dash.stdout + dash.stderr
    EnvStore(results_dir(fake_lab)).path.unlink()
    out = run_cli(["show", "r1.0"], cwd=fake_lab)
    assert out.returncode == 0 and '"r1.0"' in out.stdout and "NVIDIA" not in out.stdout
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "OK.jsonl:1: env names env block" in out.stderr and "does not hold" in out.stderr


# --- sealed segments ---

def _seal(root, stage: str = "A"):
    from harness.notebook.archive import seal

    return seal(root, stage)


def test_records_read_archive_then_segment_then_plain_in_order(tmp_path):
    _write_all(tmp_path, [rec(i, "old" if i < 2 else "new") for i in range(6)])
    assert archive_stale(tmp_path, "A", {"sm_90a": "new"})[0] == 2  # r1.0, r1.1: the archive
    path = stage_file(tmp_path, "A")
    moved, saved = _seal(tmp_path)  # r1.2 .. r1.5: the segment
    assert moved == 4 and saved > 0 and path.read_bytes() == b""
    segment = segment_file(path)
    assert segment.name == "A.jsonl.xz" and segment.parent == path.parent and _streams(segment) == 1
    _write_all(tmp_path, [rec(6, "new"), rec(7, "new")])  # appended to the plain file, as ever
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["r1.6", "r1.7"]
    warn: list[str] = []
    ids = [f"r1.{i}" for i in range(8)]
    assert [r.id for r in read_records(tmp_path, ["A"], warn)] == ids and not warn
    assert [r.id for r in read_records(tmp_path, None, warn)] == ids and not warn
    assert [r.id for r in iter_records(path, warn, newest_first=True)] == ids[::-1]
    assert read_records(tmp_path, ["A"], warn)[3] == rec(3, "new")  # ids in the segment read back as values
    path.unlink()  # sealed stages still have records
    assert [r.id for r in read_records(tmp_path, None, warn)] == ids[:6] and not warn
    # A bad segment line is named.
    lines = lzma.decompress(segment.read_bytes()).splitlines()
    segment.write_bytes(lzma.compress(b"\n".join([lines[0], b'{"v": 1, "id": "cut', *lines[1:]]) + b"\n"))
    assert [r.id for r in read_records(tmp_path, ["A"], warn)] == ids[:6]
    assert len(warn) == 1 and warn[0].startswith(f"{segment}:2: skipped a corrupt line"), warn


def test_a_record_only_in_the_segment_is_found_by_newest_newest_by_case_and_the_gate(fake_lab):
    from harness.notebook.records import newest, newest_by_case
    from harness.workflows import gate
    from tests.test_gate import C64, add_hd_stage, base, decide, rec as gate_rec, write

    add_hd_stage(fake_lab)
    spec = load_spec(root=fake_lab)
    write(fake_lab, gate_rec(spec, "HD", "sm_90a", C64, 0.9999))
    baselines.save(fake_lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    assert _seal(fake_lab, "HD")[0] == 1 and stage_file(fake_lab, "HD").read_bytes() == b""
    records = read_records(fake_lab, ["HD"])
    assert newest(records, "HD", "sm_90a", C64).id == "run1.1"
    assert list(newest_by_case(records)) == ["hd=64,n=16"]
    code, text = decide(fake_lab)
    assert code == 0 and "1 baselined case(s) hold" in text, text
    write(fake_lab, gate_rec(spec, "HD", "sm_90a", C64, 0.5, i=2))  # a newer plain line still decides
    assert decide(fake_lab)[0] == 1
    assert _seal(fake_lab, "HD")[0] == 1 and decide(fake_lab)[0] == 1  # and still does once sealed
    baselines.baselines_file(fake_lab).unlink()  # segment records count for the gate
    assert gate.notebook_has_records(fake_lab)
    code, text = decide(fake_lab)
    assert code == 1 and "restore it" in text, text


def _fresh_ok(lab, i: int) -> Record:
    spec = load_spec(root=lab)
    return env_rec(i, ENV_GPU, source_hash(spec.root, spec.stages["OK"], "cpu"), "OK", "cpu")


def _compact_cli(lab):
    script = ROOT / "scripts" / "compact_results.py"
    return subprocess.run([sys.executable, str(script), str(lab)], capture_output=True, text=True, timeout=300)


def test_compaction_refuses_a_stage_with_a_line_readers_skip_in_one_line(fake_lab):
    path = stage_file(fake_lab, "OK")
    _write_all(fake_lab, [_fresh_ok(fake_lab, 0)])
    with open(path, "a") as fh:
        fh.write('{"v": 1, "id": "cut off\n')  # a crash mid-line
    _write_all(fake_lab, [_fresh_ok(fake_lab, 1)])
    out = _compact_cli(fake_lab)
    data = path.read_bytes()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and f"{path}:2: a corrupt line" in out.stderr, out.stderr
    assert "not sealed" in out.stderr and "mend or delete that line" in out.stderr
    assert not segment_file(path).exists() and len(data.splitlines()) == 3  # nothing moved, nothing lost
    lines = data.splitlines()
    path.write_bytes(b"\n".join([lines[0], b'{"v": 1, "id": "r9"}', lines[2]]) + b"\n")  # JSON, but no record
    out = _compact_cli(fake_lab)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and f"{path}:2: not a record this lab reads (missing" \
        in out.stderr, out.stderr
    path.write_bytes(b"\n".join([lines[0], lines[2]]) + b"\n")  # mended: sealed
    out = _compact_cli(fake_lab)
    assert out.returncode == 0 and not out.stderr and path.read_bytes() == b"", out.stderr
    assert [r.id for r in read_records(fake_lab, ["OK"])] == ["r1.0", "r1.1"]
    # A segment that is no xz: the stage is not sealed (one line), neither file changes.
    _write_all(fake_lab, [_fresh_ok(fake_lab, 2)])
    segment_file(path).write_bytes(b"not xz")
    before = path.read_bytes()
    out = _compact_cli(fake_lab)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(segment_file(path)) in out.stderr and "not an xz" in out.stderr
    assert path.read_bytes() == before and segment_file(path).read_bytes() == b"not xz"


def test_a_duplicate_id_across_segment_and_plain_reads_as_it_does_across_archive_and_plain(tmp_path):
    first, second = rec(0), replace(rec(0), status="fail")  # one id, two lines (a hand edit, a merge)
    path = stage_file(tmp_path, "A")
    notebooks = {}
    for where in ("archive", "segment"):
        root = tmp_path / where
        _write_all(root, [first, rec(1)])
        if where == "archive":
            archive_stale(root, "A", {"sm_90a": "moved"})
        else:
            _seal(root)
        _write_all(root, [second])
        notebooks[where] = read_records(root, ["A"])
    assert [(r.id, r.status) for r in notebooks["segment"]] == [("r1.0", "pass"), ("r1.1", "pass"), ("r1.0", "fail")]
    assert notebooks["segment"] == notebooks["archive"]  # both read, newest later
    from harness.notebook.records import newest
    assert newest(notebooks["segment"], "A", "sm_90a", {"n": 0}).status == "fail"
    # Sealing again: no line sealed twice.
    root = tmp_path / "segment"
    path = stage_file(root, "A")
    leftover = lzma.decompress(segment_file(path).read_bytes()).splitlines()[1]
    with open(path, "ab") as fh:
        fh.write(leftover + b"\n")
    assert [r.id for r in read_records(root, ["A"])] == ["r1.0", "r1.1", "r1.0", "r1.1"]
    assert _seal(root)[0] == 1  # `second`; the leftover is not added again
    assert [(r.id, r.status) for r in read_records(root, ["A"])] == [("r1.0", "pass"), ("r1.1", "pass"),
                                                                     ("r1.0", "fail")]
    assert path.read_bytes() == b""


def test_a_stale_line_sealed_earlier_moves_from_the_segment_to_the_archive(tmp_path):
    _write_all(tmp_path, [rec(0, "old"), rec(1, "new")])
    _seal(tmp_path)
    _write_all(tmp_path, [rec(2, "old"), rec(3, "new")])
    before = read_records(tmp_path, ["A"])
    assert archive_stale(tmp_path, "A", {"sm_90a": "new"})[0] == 2
    path = stage_file(tmp_path, "A")
    archived = [json.loads(x) for x in _read_archive(archive_file(path), None).splitlines()]
    assert [a["id"] for a in archived] == ["r1.0", "r1.2"] and archived[0]["compile"]["inv"] == INV  # inline
    assert [json.loads(x)["id"] for x in _read_archive(segment_file(path), None).splitlines()] == ["r1.1"]
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["r1.3"]
    assert sorted(read_records(tmp_path, ["A"]), key=lambda r: r.id) == before
    assert archive_stale(tmp_path, "A", {"sm_90a": "newer"})[0] == 2  # the last sealed line goes: no empty segment
    assert not segment_file(path).exists() and sorted(r.id for r in read_records(tmp_path, ["A"])) == [r.id for r in before]


def test_compaction_that_would_lose_a_record_says_so_in_one_line(fake_lab, monkeypatch, capsys):
    from harness.core.jsonl import replace_file

    _write_all(fake_lab, [_fresh_ok(fake_lab, 0), _fresh_ok(fake_lab, 1)])
    script = _compact_script()
    assert sum(script.every_record(fake_lab).values()) == 2

    def lossy_seal(root, stage_id):  # a buggy seal seals nothing
        replace_file(stage_file(root, stage_id), b"")
        return 2, 0

    monkeypatch.setattr(script, "seal", lossy_seal)
    assert script.main(fake_lab) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 record(s) read before do not read back the same" in err, err
    assert '"id":"r1.' in err and "git checkout results" in err


def test_compact_results_help_and_an_unknown_option_touch_nothing(tmp_path):
    """`--help` exits 0, an unknown option is one line (exit 2); neither is taken for LAB_ROOT."""
    script = ROOT / "scripts" / "compact_results.py"
    for args, code, text in ((["--help"], 0, "compact_results.py [LAB_ROOT]"), (["--bogus"], 2, "unknown option '--bogus'")):
        r = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == code and text in (r.stdout + r.stderr), r.stdout + r.stderr
        assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []
