"""The notebook stays small without losing anything: inventories kept once
(harness/inventories.py), stale lines archived (harness/archive.py), compile baselines trimmed to
what the gate compares and written compactly (harness/baselines.py)."""

from __future__ import annotations

import json
import lzma
from dataclasses import replace

from harness import baselines
from harness.archive import archive_stale
from harness.inventories import InventoryStore, compact_file, inventory_id, store_file
from harness.paths import results_dir
from harness.records import Appender, Record, RecordWriter, archive_file, iter_records, read_records, stage_file

INV = {"(all)": 120, "wgmma.mma_async.m64n64k16.f32.bf16.bf16": 32, "ld.global.128b": 12}
SASS = {"(all)": 200, "HGMMA.64x64x16.F32.BF16": 32, "LDG.E.128": 12}


def rec(i: int, src: str = "0123456789ab", inv: dict | None = None, arch: str = "sm_90a") -> Record:
    return Record(
        id=f"r1.{i}", run="r1", t="2026-11-22T00:00:00Z", stage="A", arch=arch, case={"n": i}, status="pass",
        metrics={"S": {"cosine": 0.999999, "rel_l2": 1e-6, "max_abs": 1e-5}},
        compile={"key": "k", "regs": 90, "spill": 0, "inv": dict(inv or INV), "sass": dict(SASS)},
        code={"commit": "abc", "dirty": False, "src": src},
    )


def test_each_inventory_is_stored_once_and_read_back_in_place(tmp_path):
    w = RecordWriter(tmp_path)
    for i in range(3):
        w.write(rec(i))
    w.write(rec(3, inv={**INV, "ld.global.128b": 13}))
    w.close()
    store = [json.loads(x) for x in store_file(results_dir(tmp_path)).read_text().splitlines()]
    assert len(store) == 3  # INV, SASS and the changed INV; not 8
    lines = stage_file(tmp_path, "A").read_text().splitlines()
    assert all('"#' in x and "wgmma" not in x for x in lines)
    warn: list[str] = []
    got = read_records(tmp_path, ["A"], warn)
    assert not warn
    assert [r.compile["inv"] for r in got] == [INV, INV, INV, {**INV, "ld.global.128b": 13}]
    assert got[0] == rec(0) and all(r.compile["sass"] == SASS for r in got)


def test_a_tampered_store_line_or_an_unknown_id_costs_that_table_only(tmp_path):
    w = RecordWriter(tmp_path)
    w.write(rec(0))
    w.close()
    path = store_file(results_dir(tmp_path))
    entries = [json.loads(x) for x in path.read_text().splitlines()]
    inv_entry = next(e for e in entries if e["counts"] == INV)
    inv_entry["counts"]["wgmma.mma_async.m64n64k16.f32.bf16.bf16"] = 31  # no longer hashes to its id
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
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
    assert baselines.compile_facts(got[0]) is None  # the gate is never shown an inventory it cannot trust


def test_compacting_an_old_notebook_keeps_every_record_and_every_bad_line(tmp_path):
    path = stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    path.write_text(rec(0).to_json() + "\n{broken line\n" + rec(1).to_json() + "\n")
    before = read_records(tmp_path, ["A"], [])
    store = InventoryStore(results_dir(tmp_path))
    out = Appender(store.path)
    lines, saved = compact_file(path, store, out.write)
    lines2, saved2 = compact_file(path, store, out.write)
    out.close()
    assert saved > 0 and saved2 == 0 and lines == lines2
    assert "{broken line" in path.read_text().splitlines()
    assert read_records(tmp_path, ["A"], []) == before
    assert inventory_id(INV) == inventory_id(dict(reversed(list(INV.items()))))  # key order never matters


def test_stale_lines_move_to_the_archive_and_read_back_first(tmp_path):
    w = RecordWriter(tmp_path)
    for i, src in enumerate(["old1", "old1", "new", "old2", "new"]):
        w.write(rec(i, src))
    w.write(rec(5, "other", arch="sm_100a"))  # an arch the caller does not name: stays
    w.close()
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
    # A second pass appends to the archive; nothing is lost or doubled.
    w = RecordWriter(tmp_path)
    w.write(rec(6, "new"))
    w.close()
    assert archive_stale(tmp_path, "A", {"sm_90a": "newer"})[0] == 3
    assert sorted(r.id for r in read_records(tmp_path, ["A"], [])) == sorted([r.id for r in before] + ["r1.6"])


def test_a_corrupt_archive_is_one_warning_and_never_overwritten(tmp_path):
    w = RecordWriter(tmp_path)
    w.write(rec(0, "old"))
    w.write(rec(1, "new"))
    w.close()
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
    text = baselines.baselines_file(tmp_path).read_text()
    assert "inv: {" in text and "tolerance: {" in text  # plain mappings on one line
    assert baselines.load(tmp_path) == [b]
