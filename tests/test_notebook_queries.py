"""The notebook's queries answer as the old code (kept verbatim) did."""

import json
from pathlib import Path

import pytest

from harness.notebook import records as R
from harness.core.labels import case_label
from harness.core.statuses import RAN

ROOT = Path(__file__).resolve().parent.parent


# The old code, verbatim.


def old_shows_compile(rec) -> bool:
    return rec.status == "compile_error" or bool(rec.compile and isinstance(rec.compile.get("inv"), dict))


def old_newest(records, stage, arch, case, src, statuses=None):  # baselines.newest
    for rec in reversed(records):
        if rec.stage != stage or rec.arch != arch or rec.case != case:
            continue
        if src is not None and rec.code.get("src") != src:
            continue
        if statuses is not None and rec.status not in statuses:
            continue
        return rec
    return None


def old_newest_compiled(records, stage, arch, case, src):  # baselines.newest_compiled
    for rec in reversed(records):
        if rec.stage != stage or rec.arch != arch or rec.case != case:
            continue
        if src is not None and rec.code.get("src") != src:
            continue
        if old_shows_compile(rec):
            return rec
    return None


def old_gate_scan(path, stage, todo_in, src):  # gate.newest_records
    todo = dict(todo_in)
    found = []
    for rec in R.iter_records(path, [], newest_first=True) if todo else ():
        kind = todo.get((rec.arch, case_label(rec.case))) if rec.stage == stage else None
        if kind is None or rec.code.get("src") != src[(rec.arch, case_label(rec.case))]:
            continue
        found.append(rec)
        if (old_shows_compile(rec) if kind == "compile" else rec.status in RAN):
            del todo[(rec.arch, case_label(rec.case))]
            if not todo:
                break
    return list(reversed(found))


def old_newest_builds(path, todo_in, src):  # compilerun.newest_builds, one stage
    out = {}
    todo = set(todo_in)
    for rec in R.iter_records(path, [], newest_first=True):
        key = (rec.stage, rec.arch, case_label(rec.case))
        if key not in todo or rec.code.get("src") != src.get((rec.stage, rec.arch)):
            continue
        if rec.status == "compile_error" or (rec.compile and isinstance(rec.compile.get("inv"), dict)):
            out[key] = rec
            todo.discard(key)
            if not todo:
                break
    return out


def old_archive_stale(obj, current_src) -> bool:  # archive.archive_stale's test
    arch = obj.get("arch") if isinstance(obj, dict) else None
    code = obj.get("code") if isinstance(obj, dict) else None
    src = code.get("src") if isinstance(code, dict) else None
    return isinstance(arch, str) and arch in current_src and isinstance(src, str) and src != current_src[arch]




@pytest.fixture(scope="module")
def real_notebook():
    folder = ROOT / "results" / "records"
    if not any(folder.glob("*.jsonl")):
        pytest.skip("no committed notebook in this tree")
    warn: list[str] = []
    recs = R.read_records(ROOT, warn=warn, bench=True)  # read only: nothing here writes
    return recs, warn


def _ids(recs) -> list[str]:
    return [r.id for r in recs]


def test_real_notebook_newest_and_fresh_answers_are_unchanged(real_notebook):
    recs, _ = real_notebook
    assert len(recs) > 100
    groups: dict[tuple, list] = {}
    for r in recs:
        groups.setdefault((r.stage, r.arch), []).append(r)
    checked = 0
    for (stage, arch), mine in groups.items():
        tests = [r for r in mine if not r.is_bench]
        srcs = sorted({R.code_src(r) for r in mine if R.code_src(r)})[-2:] + ["0" * 12]
        cases = {case_label(r.case): r.case for r in mine}
        labels = sorted(cases)
        for case in [cases[lab] for lab in labels[:: max(1, len(labels) // 12)]]:  # a spread of cases: fast
            for src in [None, *srcs]:
                for pool in (mine, tests):
                    assert R.newest(pool, stage, arch, case) is old_newest(pool, stage, arch, case, None)
                    assert (R.newest(pool, stage, arch, case, src, lambda r: r.status == "pass")
                            is old_newest(pool, stage, arch, case, src, ("pass",)))
                    assert (R.newest(pool, stage, arch, case, src, R.shows_compile)
                            is old_newest_compiled(pool, stage, arch, case, src))
                    checked += 1
        # newest per case, freshness
        assert _ids(R.newest_by_case([r for r in tests if r.status in RAN]).values()) == _ids(
            {case_label(r.case): r for r in tests if r.status in RAN}.values())
        lines = [{"arch": r.arch, "code": r.code} for r in mine]  # what the archive reads of a raw line
        for src in srcs:
            assert [R.is_fresh(r, src) for r in mine] == [r.code.get("src") == src for r in mine]
            assert [R.code_src(d) is not None and not R.is_fresh(d, src) for d in lines] == [
                old_archive_stale(d, {arch: src}) for d in lines]
    assert checked > 100


def test_real_notebook_scans_from_the_newest_line_are_unchanged(real_notebook):
    recs, _ = real_notebook
    by_stage: dict[str, list] = {}
    for r in recs:
        if not r.is_bench:
            by_stage.setdefault(r.stage, []).append(r)
    for stage, mine in by_stage.items():
        path = R.stage_file(ROOT, stage)
        # each case's newest source hash
        src = {(r.arch, case_label(r.case)): R.code_src(r) for r in mine}
        for kind in ("compile", "run"):
            todo = {k: kind for k in src}
            wanted = {k: (src[k], R.shows_compile if kind == "compile" else (lambda r: r.status in RAN)) for k in src}
            _, met = R.newest_fresh_in_file(path, wanted, lambda r, s=stage: (r.arch, case_label(r.case))
                                            if r.stage == s else None)
            assert _ids(met) == _ids(old_gate_scan(path, stage, todo, src))
        per_arch = {a: s for (a, _), s in src.items()}
        keys = {(stage, a, lab) for (a, lab) in src}
        wanted = {k: (per_arch.get(k[1]), R.shows_compile) for k in keys}
        found, _ = R.newest_fresh_in_file(path, wanted, lambda r: (r.stage, r.arch, case_label(r.case)), [])
        old = old_newest_builds(path, keys, {(stage, a): s for a, s in per_arch.items()})
        assert {k: v.id for k, v in found.items()} == {k: v.id for k, v in old.items()}


OLD_LINES = [  # lines as older writers wrote them
    {"v": 1, "id": "r1.1", "run": "r1", "t": "2026-11-01T00:00:00Z", "stage": "A", "arch": "sm_90a",
     "case": {"hd": 64}, "status": "pass", "metrics": {"O": {"cosine": 0.99999}},
     "timing": {"us": 2.5, "tflops": 10.0, "gbps": 100.0, "peer_us": 7.5, "peer_tflops": 3.3},
     "code": {"src": "aaaaaaaaaaaa", "commit": "abcd1234", "dirty": False}},
    {"v": 1, "id": "r2.1", "run": "r2", "t": "2026-11-02T00:00:00Z", "stage": "A", "arch": "sm_90a",
     "case": {"hd": 64}, "status": "fail", "metrics": {"O": {"cosine": 0.5}}, "code": {"src": "bbbbbbbbbbbb"}},
    {"v": 1, "id": "r3.1", "run": "r3", "t": "2026-11-03T00:00:00Z", "stage": "A", "arch": "sm_90a",
     "case": {"hd": 64, "n": 4096}, "status": "pass", "note": "bench", "code": {"src": "bbbbbbbbbbbb"},
     "timing": {"us": 100.0, "peer_torch_sdpa_us": 150.0, "peer_torch_sdpa_ratio": 1.5, "peer_fa4": "not installed"}},
    {"v": 1, "id": "r4.1", "run": "r4", "t": "2026-11-04T00:00:00Z", "stage": "A", "arch": "sm_90a",
     "case": {"hd": 64}, "status": "compiled", "compile": {"regs": 80, "inv": {"(all)": 10}}},
]


def test_old_format_notebook_reads_as_before(tmp_path):
    path = R.stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in OLD_LINES))
    warn: list[str] = []
    tests = R.read_records(tmp_path, ["A"], warn)
    every = R.read_records(tmp_path, ["A"], warn, bench=True)
    assert not warn and _ids(tests) == ["r1.1", "r2.1", "r4.1"] and len(every) == 4
    assert [R.is_bench(r) for r in every] == [False, False, True, False]
    case = {"hd": 64}
    assert R.newest(tests, "A", "sm_90a", case).id == "r4.1"
    assert R.newest(tests, "A", "sm_90a", case, "aaaaaaaaaaaa").id == "r1.1"
    assert R.newest(tests, "A", "sm_90a", case, "bbbbbbbbbbbb").id == "r2.1"
    assert R.newest(tests, "A", "sm_90a", case, "bbbbbbbbbbbb", lambda r: r.status == "pass") is None
    assert R.code_src(tests[2]) is None and not R.is_fresh(tests[2], "aaaaaaaaaaaa")
    assert R.run_peer_us(tests[0]) == 7.5 and R.peer_times(every[2].timing) == {"torch_sdpa": 150.0}


# One notebook module: records.py.

HARNESS = ROOT / "harness"


def _sources() -> dict[str, str]:
    """Every harness module's text by file name, commands apart."""
    files = [p for p in sorted(HARNESS.rglob("*.py")) if p.name != "__init__.py" and p.parent.name != "commands"]
    src = {p.name: p.read_text() for p in files}
    assert len(src) == len(files) > 40, "harness modules not found, or two of one name"
    return src


def test_schema_queries_and_sessions_are_written_once():
    src = _sources()
    assert [n for n, t in src.items() if "_COMPILE_NUMBERS =" in t] == ["records.py"]
    assert [n for n, t in src.items() if 'get("src")' in t] == ["records.py"]  # freshness: records.code_src
    assert [n for n, t in src.items() if "def is_bench" in t] == ["records.py"]
    assert [n for n, t in src.items() if "append_event(runs_file" in t] == ["records.py"]  # RunLog
    assert [n for n, t in src.items() if "\ndef newest(" in t] == ["records.py"]
    assert "harness.execution.bench" not in src["dashboard.py"]  # bench-or-not comes from the notebook
    assert [n for n, t in src.items() if "yaml.scan(" in t] == ["yamlnodes.py"]  # one line-aware YAML reader


def test_strict_validation_is_the_notebooks(tmp_path):
    good = OLD_LINES[0]
    assert R.validate(good) is None and R.validate(good, strict=True) is None
    loose_ok = [  # valid records a remote line may still not be
        ({**good, "compile": {"regs": 80, "odd": [1]}}, "compile.odd is not a number, a flag or text"),
        ({**good, "env": {"extra": {"x": [1]}}}, "env.extra is not plain values"),
        ({**good, "code": {"src": "a", "commit": "xyz"}}, "code.commit is not a git commit id"),
        ({**good, "t": "yesterday"}, "t is not a UTC time"),
        ({**good, "timing": {"us": 1.0, "peer_us": "fast"}}, "timing.peer_us is not a number"),
    ]
    for d, why in loose_ok:
        assert R.validate(d) is None
        assert why in (R.validate(d, strict=True) or ""), d


def test_run_log_writes_its_events_once(tmp_path):
    log = R.RunLog(tmp_path)
    log.plan(target="local", argv=["run"], cases=2)
    rec = R.Record(id=f"{log.run_id}.1", run=log.run_id, t=R.now_iso(), stage="A", arch="cpu", case={"n": 1},
                   status="pass")
    assert not R.runs_file(tmp_path).exists()  # planned, not written: no trace
    log.write(rec)
    log.write(rec)
    log.close()
    log.end(True, 15, planned=2, counts={"pass": 2})
    runs = R.read_runs(tmp_path)
    assert list(runs) == [log.run_id]
    ev = runs[log.run_id]
    assert ev["target"] == "local" and ev["interrupted"] is True and ev["signal"] == "SIGTERM"
    assert ev["planned"] == 2 and ev["counts"] == {"pass": 2}
    lines = R.runs_file(tmp_path).read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["start", "end"]
    assert len(R.read_records(tmp_path, ["A"])) == 2


def test_yaml_line_helpers():
    from harness.core import yamlnodes

    text = "a:\n  b: 1\n  c:\n    d: 2\n    d: 3\n"
    node = yamlnodes.compose(text, yamlnodes.NodeContext("x.yaml", ValueError))
    assert yamlnodes.line_of(node, ("a", "c", "d")) == 4 and yamlnodes.line_of(node, ("a", "zz")) == 1
    assert yamlnodes.duplicate_key(node) == (5, "a.c.d", 4)
    assert yamlnodes.anchor_line("a: 1\nb: &x 2\nc: *x\n") == 2 and yamlnodes.anchor_line("a: 1\n") is None
