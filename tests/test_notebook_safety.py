"""Nothing in the notebook is lost or hangs a reader (issue 27)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.notebook.records import read_records, read_runs
from tests.conftest import ROOT, load_script

CHILD = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from harness.notebook.records import Record, RecordWriter, append_event, runs_file
root, n = Path(sys.argv[1]), int(sys.argv[2])
w = RecordWriter(root)
append_event(runs_file(root), {"run": "child", "t": "2026-01-01T00:00:00Z", "event": "start"})
print("started", flush=True)
for i in range(n):
    fresh = i % 2 == 0  # half of them stale: compaction moves those to the archive
    w.write(Record(id=f"child.{i}", run="child", t="2026-01-01T00:00:00Z", stage="OK", arch="cpu",
                   case={"n": 16}, status="pass", env={"host": "h", "gpu": f"g{i % 7}", "i": i % 5},
                   code={"src": sys.argv[4] if fresh else "0ld0ld0ld0ld"}))
    time.sleep(0.03)
w.close()
append_event(runs_file(root), {"run": "child", "t": "2026-01-01T00:00:01Z", "event": "end"})
"""


def test_compacting_while_a_run_appends_loses_no_record(fake_lab, capsys):
    """30 records appended while compaction runs again and again: all survive."""
    spec = load_spec(root=fake_lab)
    fresh = source_hash(spec.root, spec.stages["OK"], "cpu")
    compact = load_script("compact_results")
    n = 30
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(fake_lab), str(n), str(ROOT), fresh],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "started"
    rounds = 0
    while child.poll() is None:
        assert compact.main(fake_lab) == 0
        rounds += 1
        time.sleep(0.1)  # flock is not fair
    assert child.wait() == 0
    assert rounds >= 3, rounds  # compaction really ran during the run
    warn: list[str] = []
    ids = [r.id for r in read_records(fake_lab, ["OK"], warn) if r.run == "child"]
    assert not warn, warn
    assert sorted(ids) == sorted(f"child.{i}" for i in range(n)), f"{n - len(set(ids))} of {n} lost"
    envs = {r.id: r.env for r in read_records(fake_lab, ["OK"]) if r.run == "child"}
    assert all(envs[f"child.{i}"] == {"host": "h", "gpu": f"g{i % 7}", "i": i % 5} for i in range(n))
    assert compact.main(fake_lab) == 0  # once more: still all there
    assert len([r for r in read_records(fake_lab, ["OK"]) if r.run == "child"]) == n
    assert read_runs(fake_lab, warn)["child"]["event"] == "end"


# -- baselines: duplicates, forgeries, losing writes

import lzma  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from harness.notebook import baselines  # noqa: E402
from harness.notebook.records import Record, RecordWriter  # noqa: E402
from harness.spec.identity import source_hash  # noqa: E402
from harness.spec.spec import load_spec  # noqa: E402
from tests.conftest import baselines_text, run_cli, write_baselines  # noqa: E402


def _records(lab: Path, cases=(16, 32)) -> None:
    spec = load_spec(root=lab)
    src = source_hash(spec.root, spec.stages["OK"], "cpu")
    w = RecordWriter(lab)
    for i, n in enumerate(cases):
        w.write(Record(id=f"r.{i}", run="r", t="2026-01-01T00:00:00Z", stage="OK", arch="cpu", case={"n": n},
                       status="pass", metrics={"out": {"cosine": 0.99999, "rel_l2": 1e-6, "max_abs": 1e-6}},
                       env={"host": "h"}, code={"commit": "x", "dirty": False, "src": src}))
    w.close()


@pytest.fixture
def based(fake_lab):
    """Fake lab, two passing OK records, both baselined."""
    _records(fake_lab)
    r = run_cli(["baseline", "accept", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(baselines.load(fake_lab)) == 2
    return fake_lab


def _gate(lab: Path, *extra: str, timeout: float = 120):
    return run_cli(["gate", "--no-run", *extra], cwd=lab, timeout=timeout)


def test_a_duplicate_key_in_baselines_is_refused_and_accept_never_rewrites_the_file(based):
    path = baselines.baselines_file(based)
    assert "2 baselined case(s) hold" in _gate(based).stdout
    text = baselines_text(based)
    write_baselines(based, text + "  OK:\n    cpu: {}\n")  # a merge resolved badly: a second OK, empty
    dup_line = len(text.splitlines()) + 1
    r = _gate(based)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and f"baselines.yaml.xz:{dup_line}: baselines.OK: duplicate key" in r.stderr, r.stderr
    assert "keep one" in r.stderr and "Traceback" not in r.stderr
    before = path.read_bytes()
    r = run_cli(["baseline", "accept", "stage-OK", "--n", "16"], cwd=based)
    assert r.returncode == 2 and "duplicate key" in r.stderr and path.read_bytes() == before
    # deeper down too: a case twice under one arch
    lines = text.splitlines(keepends=True)
    case = next(i for i, ln in enumerate(lines) if ln.startswith("      n=16"))
    end = next(i for i in range(case + 1, len(lines)) if lines[i].startswith("      n=") or not lines[i].startswith("       "))
    write_baselines(based, "".join(lines[:end] + lines[case:end] + lines[end:]))
    r = _gate(based)
    assert r.returncode == 2 and f"baselines.yaml.xz:{end + 1}: baselines.OK.cpu.n=16: duplicate key" in r.stderr, r.stderr


def test_a_forged_parsed_copy_of_baselines_is_not_trusted(based, tmp_path):
    assert "2 baselined case(s) hold" in _gate(based).stdout  # the parsed copy is cached now
    copies = list((tmp_path / "cache" / "baselines").glob("*.json"))
    assert copies
    for forged in ("null", "{}", json.dumps({"version": 1, "baselines": {}})):
        for c in copies:
            c.write_text(forged)
        r = _gate(based)
        assert r.returncode == 0 and "2 baselined case(s) hold" in r.stdout, (forged, r.stdout, r.stderr)
    for c in copies:
        c.write_text("null")
    r = run_cli(["baseline", "accept", "stage-OK", "--n", "16"], cwd=based)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(baselines.load(based)) == 2  # not a file of 1


def test_save_never_writes_a_file_that_loses_a_baseline_it_read(based):
    path = baselines.baselines_file(based)
    before = path.read_bytes()
    items = baselines.load(based)
    with pytest.raises(baselines.BaselineError, match="would lose 1 of the 2 baselines"):
        baselines.save(based, items[:1], read=items)
    assert path.read_bytes() == before


# -- no baselines is no pass (item 4)


@pytest.mark.parametrize("content", [None, "", "version: 1\n", "version: 1\nbaselines: {}\n"])
def test_a_lab_that_lost_its_baselines_fails_the_gate(based, content):
    path = baselines.baselines_file(based)
    if content is None:
        path.unlink()
    else:
        write_baselines(based, content)
    r = _gate(based)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "git checkout results/baselines.yaml.xz" in r.stdout and "baseline accept" in r.stdout


def test_a_new_lab_without_records_passes_with_no_baselines_yet(fake_lab):
    r = _gate(fake_lab)
    assert r.returncode == 0 and "no baselines yet" in r.stdout, r.stdout + r.stderr


# -- results/ not what it should be (item 15)


def test_a_folder_for_the_baselines_lock_is_one_line_exit_2(based):
    lock = based / "results" / ".baselines.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    r = run_cli(["baseline", "accept", "stage-OK", "--n", "16"], cwd=based)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and ".baselines.lock: is a folder" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


def test_results_as_a_file_is_one_line_exit_2_never_a_pass(based):
    shutil.rmtree(based / "results")
    (based / "results").write_text("oops\n")
    for args in (["gate", "--no-run"], ["baseline", "accept", "stage-OK"]):
        r = run_cli(args, cwd=based)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stdout, r.stderr)
        assert "results: is not a folder" in r.stderr and "internal error" not in r.stderr, r.stderr


def test_missing_records_folder_is_named_as_such(based):
    shutil.rmtree(based / "results" / "records")
    r = _gate(based)
    assert r.returncode == 1 and "results/records/ is missing" in r.stdout, r.stdout + r.stderr
    assert "source changed" not in r.stdout


# -- unbounded reads under results/ (item 9)


def _limited() -> None:
    """A child reading /dev/zero whole dies at 2 GiB."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _cli(lab: Path, args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=lab, env=full, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_limited)


@pytest.mark.parametrize("name", ["inventories.jsonl.xz", "envs.jsonl.xz", "records/OK.jsonl",
                                  "archive/OK.jsonl.xz", "runs.jsonl"])
def test_a_symlink_to_dev_zero_under_results_is_refused(based, name):
    path = based / "results" / name
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    said = ""
    for args in (["dashboard"], ["show", "r"]):  # dashboard and `show`
        r = _cli(based, args)
        assert "MemoryError" not in r.stderr and "internal error" not in r.stderr and r.returncode in (0, 1, 2), \
            (args, r.returncode, r.stderr[-2000:])
        said += r.stderr
    assert f"{name}: cannot be read (is a symbolic link" in said, said[-2000:]


@pytest.mark.parametrize("name", ["records/OK.jsonl", "envs.jsonl.xz", "runs.jsonl", "notes.jsonl",
                                  "baselines.yaml.xz"])
def test_a_fifo_under_results_hangs_no_reader(based, name):
    path = based / "results" / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    for args in (["dashboard"], ["show", "r"], ["gate", "--no-run"]):
        r = _cli(based, args, timeout=60)  # before: blocked forever opening the FIFO
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (args, r.stderr[-2000:])
        if name == "baselines.yaml.xz" and args[0] == "gate":
            assert r.returncode == 2 and "FIFO" in r.stderr, r.stderr
    r = _cli(based, ["note", "r", "a note"]) if name == "notes.jsonl" else None
    if r is not None:
        assert r.returncode == 2 and "FIFO" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_xz_bomb_as_the_env_store_is_refused_within_the_cap(based):
    store = based / "results" / "envs.jsonl.xz"
    bomb = lzma.compress(b'{"id":"x","env":{}}\n' + b" " * (8 << 20))  # 8 MiB of spaces in 1 KiB
    assert len(bomb) < 4096
    store.write_bytes(store.read_bytes() + bomb)
    r = _cli(based, ["dashboard"], DSV4_LAB_MAX_XZ_MIB="1")
    assert r.returncode in (0, 1) and "envs.jsonl.xz" in r.stderr and "decompresses to more than 1 MiB" in r.stderr, \
        r.stderr[-2000:]
    archive = based / "results" / "archive" / "OK.jsonl.xz"
    archive.parent.mkdir(exist_ok=True)
    archive.write_bytes(bomb)
    r = _cli(based, ["dashboard"], DSV4_LAB_MAX_XZ_MIB="1")
    assert "OK.jsonl.xz: not an xz archive (byte 0: decompresses to more than 1 MiB" in r.stderr, r.stderr[-2000:]
