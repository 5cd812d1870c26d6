"""Compaction retires old stale archive lines, never named ones; show/history say where."""

import json
import lzma
import subprocess
from dataclasses import replace
from pathlib import Path

from harness.notebook import baselines, speedbaselines
from harness.notebook.records import (Record, _read_archive, append_event, archive_file, notes_file,
                                      stage_file)
from harness.notebook.retired import encode_ids, read_retired, retired_file, where
from tests.conftest import commit_all, run_cli, write_baselines, write_records
from tests.test_notebook_size import _compact_script

STALE = "0ld0ld0ld0ld"


def _rec(run: str, i: int, n: int, t: str = "2020-01-01T00:00:00Z") -> Record:
    return Record(id=f"{run}.{i}", run=run, t=t, stage="OK", arch="cpu", case={"n": n}, status="pass",
                  metrics={"out": {"cosine": 1.0, "rel_l2": 0.0}}, code={"commit": "abc", "dirty": False, "src": STALE})


_write = write_records


_commit = commit_all


def _archived_ids(root: Path) -> list[str]:
    data = _read_archive(archive_file(stage_file(root, "OK")), None) or b""
    return [json.loads(x)["id"] for x in data.splitlines() if x.strip()]


def _lab_with_history(lab: Path) -> tuple[list[str], str]:
    """Five stale runs archived and committed, some named -> (ids, commit)."""
    runs = [f"2020010{k}-000000-000{k}" for k in range(1, 6)]
    _write(lab, [_rec(run, i, n, f"2020-01-0{k + 1}T00:00:00Z") for k, run in enumerate(runs)
                 for i, n in enumerate((16, 32))])
    baselines.save(lab, [baselines.Baseline("OK", "cpu", "n=16", f"{runs[1]}.0", STALE,
                                            metrics={"out": {"cosine": 1.0}})])
    speedbaselines.save(lab, [speedbaselines.SpeedBaseline("OK", "cpu", "n=32", f"{runs[2]}.1", STALE, "abc", 10.0,
                                                           gpu={"name": "GPU"})], [])
    append_event(notes_file(lab), {"run": runs[0], "t": "2020-01-09T00:00:00Z", "text": "the first light"})
    compact = _compact_script()
    assert compact.main(lab) == 0  # none at HEAD yet: none retires
    ids = _archived_ids(lab)
    assert len(ids) == 10 and not retired_file(lab).exists()
    return ids, _commit(lab, "results")


def test_retention_keeps_the_newest_n_per_case_and_what_a_baseline_or_a_note_names(fake_lab):
    ids, sha = _lab_with_history(fake_lab)
    assert _compact_script().main(fake_lab, keep=2) == 0
    r = [i.split(".")[0] for i in ids[::2]]  # the five runs, oldest first
    kept = set(_archived_ids(fake_lab))
    # kept: newest 2 per case and the named ones
    assert kept == {f"{r[3]}.0", f"{r[3]}.1", f"{r[4]}.0", f"{r[4]}.1", f"{r[0]}.0", f"{r[0]}.1", f"{r[1]}.0",
                    f"{r[2]}.1"}
    gone = set(ids) - kept
    assert gone == {f"{r[1]}.1", f"{r[2]}.0"}
    # keep 1: one more per case goes
    _commit(fake_lab, "retired")
    assert _compact_script().main(fake_lab, keep=1) == 0
    assert set(_archived_ids(fake_lab)) == kept - {f"{r[3]}.0", f"{r[3]}.1"}


def test_each_retiring_is_one_line_naming_every_id_and_a_commit_that_holds_it(fake_lab):
    ids, sha = _lab_with_history(fake_lab)
    assert _compact_script().main(fake_lab, keep=2) == 0
    gone = set(ids) - set(_archived_ids(fake_lab))
    entries = read_retired(fake_lab)
    assert len(entries) == 1
    e = entries[0]
    assert e["stage"] == "OK" and e["lines"] == 2 and e["from"] == sha
    assert e["how"] == f"git show {sha}:results/archive/OK.jsonl.xz"
    assert e["oldest_t"] == "2020-01-02T00:00:00Z" and e["newest_t"] == "2020-01-03T00:00:00Z" and e["bytes"] > 0
    held = subprocess.run(e["how"].split(), cwd=fake_lab, capture_output=True, check=True).stdout
    held_ids = {json.loads(x)["id"] for x in lzma.decompress(held).splitlines() if x.strip()}
    assert gone <= held_ids
    assert all(where(fake_lab, i) == ("record", e) for i in gone)
    assert all(where(fake_lab, i) is None for i in _archived_ids(fake_lab))


def test_a_second_compaction_is_a_no_op(fake_lab):
    _lab_with_history(fake_lab)
    assert _compact_script().main(fake_lab, keep=2) == 0
    archive = archive_file(stage_file(fake_lab, "OK"))
    state = (archive.read_bytes(), retired_file(fake_lab).read_bytes())
    _commit(fake_lab, "retired")
    assert _compact_script().main(fake_lab, keep=2) == 0
    assert (archive.read_bytes(), retired_file(fake_lab).read_bytes()) == state


def test_recent_lines_and_lines_no_commit_holds_are_not_retired(fake_lab):
    import time

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 7200))  # two hours ago
    runs = [f"2020010{k}-000000-000{k}" for k in range(1, 5)]
    _write(fake_lab, [_rec(run, 0, 16, now) for run in runs])  # four of one case, all of today
    assert _compact_script().main(fake_lab, keep=2) == 0
    _commit(fake_lab, "results")
    assert _compact_script().main(fake_lab, keep=2, days=1) == 0 and len(_archived_ids(fake_lab)) == 4  # the last day's stay
    assert _compact_script().main(fake_lab, keep=2) == 0 and len(_archived_ids(fake_lab)) == 2  # keep 2: only the newest 2
    # uncommitted archive lines stay; the two at HEAD go
    new = [f"2020020{k}-000000-000{k}.0" for k in range(1, 4)]
    _write(fake_lab, [_rec(i.split(".")[0], 0, 16) for i in new])
    assert _compact_script().main(fake_lab, keep=2, days=0) == 0
    assert _archived_ids(fake_lab) == new and len(read_retired(fake_lab)) == 2


def test_show_and_history_of_a_retired_record_say_where_it_is(fake_lab):
    ids, sha = _lab_with_history(fake_lab)
    assert _compact_script().main(fake_lab, keep=2) == 0
    gone = sorted(set(ids) - set(_archived_ids(fake_lab)))[0]
    out = run_cli(["show", gone], cwd=fake_lab)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert f"record {gone} was retired" in lines[0]
    assert f"git show {sha}:results/archive/OK.jsonl.xz | xz -d | grep '\"id\":\"{gone}\"'" in lines[0]
    out = run_cli(["show", "2020010999-nope"], cwd=fake_lab)
    assert out.returncode == 2 and "no record or run" in out.stderr  # an id nothing names, as before
    hist = run_cli(["history", "OK"], cwd=fake_lab)
    said = [x for x in hist.stdout.splitlines() if "retired" in x]
    assert hist.returncode == 0 and len(said) == 1, hist.stdout + hist.stderr
    assert "2 older record(s) of stage OK" in said[0] and f"git show {sha}:results/archive/OK.jsonl.xz" in said[0]


def test_a_runs_live_lines_hold_its_archived_lines_of_their_own_stage_only(fake_lab):
    """Stale OK lines retire despite live BAD lines; a live OK line holds its stale one."""
    from harness.spec.identity import source_hash
    from harness.spec.spec import load_spec

    spec = load_spec(fake_lab / "stages.yaml")
    a, b = "20200101-000000-000a", "20200102-000000-000b"
    live_bad = replace(_rec(a, 2, 16), stage="BAD", case={"n": 16, "mode": "ok"},
                       code={"src": source_hash(fake_lab, spec.stages["BAD"], "cpu")})
    live_ok = replace(_rec(b, 1, 32), code={"src": source_hash(fake_lab, spec.stages["OK"], "cpu")})
    _write(fake_lab, [_rec(a, 0, 16), _rec(a, 1, 32), live_bad, _rec(b, 0, 16), live_ok])
    assert _compact_script().main(fake_lab) == 0 and _archived_ids(fake_lab) == [f"{a}.0", f"{a}.1", f"{b}.0"]
    _commit(fake_lab, "results")
    assert _compact_script().main(fake_lab) == 0
    assert _archived_ids(fake_lab) == [f"{b}.0"] and where(fake_lab, f"{a}.0")[0] == "record"
    out = run_cli(["show", a], cwd=fake_lab)
    said = out.stdout.splitlines()  # the BAD line left; the retired ones' place
    assert out.returncode == 0 and "n=16,mode=ok" in out.stdout and "n=32" not in out.stdout, out.stdout + out.stderr
    assert [x for x in said if "retired" in x] == [x for x in said if f"records of run {a} were retired" in x
                                                   and "(stage OK" in x and "git show" in x] != []


def test_ids_are_kept_as_ranges_per_run():
    ids = ["r1.1", "r1.2", "r1.3", "r1.7", "r2.10", "odd", "r1.03"]
    enc = encode_ids(ids)
    assert enc == {"r1": "1-3,7", "r2": "10", "": ["odd", "r1.03"]}


def test_nothing_retires_outside_a_git_checkout(tmp_path):
    import shutil

    from tests.conftest import make_fake_lab

    lab = make_fake_lab(tmp_path / "lab")
    shutil.rmtree(lab / ".git")
    _write(lab, [replace(_rec(f"2020010{k}-000000-000{k}", 0, 16)) for k in range(1, 6)])
    assert _compact_script().main(lab, keep=2, days=0) == 0
    assert len(_archived_ids(lab)) == 5 and not retired_file(lab).exists()


def test_a_baselines_file_that_cannot_be_read_retires_nothing_in_one_line(fake_lab, capsys):
    ids, _ = _lab_with_history(fake_lab)
    write_baselines(fake_lab, "OK: [unclosed\n")
    capsys.readouterr()
    assert _compact_script().main(fake_lab) == 1  # the trim says it in one line
    said = capsys.readouterr().err
    assert "Traceback" not in said and "baselines not trimmed" in said
    err = [x for x in said.splitlines() if "retired" in x]
    assert len(err) == 1 and "nothing retired" in err[0] and "baselines.yaml.xz:" in err[0]
    assert _archived_ids(fake_lab) == ids and not retired_file(fake_lab).exists()


def test_bad_options_are_one_line():
    script = Path(__file__).resolve().parent.parent / "scripts" / "compact_results.py"
    out = subprocess.run(["python3", str(script), "--keep", "two"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "--keep needs a number" in out.stderr


def test_the_default_keeps_no_stale_test_line_but_four_bench_lines_a_shape():
    """By default no stale test-case line is kept, but a bench shape's newest four stay."""
    from harness.notebook import archive

    assert _compact_script().KEEP_NEWEST == 0 and archive.KEEP_BENCH == 4

    def line(i: int, bench: bool) -> bytes:
        rec = {"id": f"r{i}.1", "run": f"r{i}", "arch": "sm_90a", "case": {"n": 1}, "t": f"2020-01-0{i}T00:00:00Z"}
        return json.dumps({**rec, "note": "bench"} if bench else rec).encode()

    lines = [line(i, bench) for i in range(1, 7) for bench in (False, True)]  # oldest first
    held = frozenset(f"r{i}.1" for i in range(1, 7))
    gone = archive.retirable(lines, 0, "2030-01-01T00:00:00Z", set(), set(), held)
    kept = [json.loads(ln) for ln, g in zip(lines, gone) if not g]
    assert [(r["run"], "note" in r) for r in kept] == [(f"r{i}", True) for i in range(3, 7)]


def test_the_retirings_are_kept_compressed_and_an_old_plain_file_is_folded_in(fake_lab):
    """retired.jsonl.xz: one stream; old plain file folded in; a bad .xz warns, retires nothing."""
    from harness.notebook.retired import old_retired_file, retired_lines

    old_line = b'{"stage":"E","lines":1,"from":"abc","how":"git show abc:x","ids":{"r1":"1"}}'
    old_retired_file(fake_lab).parent.mkdir(parents=True, exist_ok=True)
    old_retired_file(fake_lab).write_bytes(old_line)
    assert [e["ids"] for e in read_retired(fake_lab)] == [{"r1": "1"}] and where(fake_lab, "r1.1")[0] == "record"
    retired_file(fake_lab).write_bytes(lzma.compress(b'{"stage":"E","lines":2,"from":"d","how":"h","ids":{"r2":"1-2"}}\n',
                                                     format=lzma.FORMAT_XZ))
    assert [e["lines"] for e in read_retired(fake_lab)] == [1, 2] and retired_lines(fake_lab).startswith(old_line + b"\n")
    bad = b"not xz at all"
    retired_file(fake_lab).write_bytes(bad)
    warn: list[str] = []
    assert read_retired(fake_lab, warn) == [] and "not a readable xz file" in warn[0] and "\n" not in warn[0]
