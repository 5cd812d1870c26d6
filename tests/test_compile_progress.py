"""`dsv4-lab compile` as a user meets it: progress, labels, nothing written when nothing is new."""

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.notebook.records import Record
from tests.conftest import ROOT, has_gpu, run_cli

IGNORE = shutil.ignore_patterns(".git", ".cache", ".device", "scratch", "results", "__pycache__", ".run", "*.egg-info")
CASE = ["--arch", "sm_100a", "--hd", "64", "--n", "128"]  # stage A's smallest case: one quick compile
LABEL = "hd=64,n=128,m=128"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One compile cache for this file's labs."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture
def lab(tmp_path, cache):
    """A lab copy with an empty notebook, the shared compile cache and its own TMPDIR."""
    lab = tmp_path / "lab"
    shutil.copytree(ROOT, lab, ignore=IGNORE)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(cache), "TMPDIR": str(tmp)}
    return lab, env, tmp


def _results(lab: Path) -> dict[str, bytes]:
    return {p.relative_to(lab).as_posix(): p.read_bytes() for p in sorted((lab / "results").rglob("*")) if p.is_file()}


def _compile(lab: Path, env: dict, *extra: str) -> str:
    r = run_cli(["compile", "stage-A", *CASE, *extra], cwd=lab, env_extra=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return r.stdout


def _compile_in_a_terminal(lab: Path, env: dict) -> str:
    """The same command on a pseudo-terminal."""
    import pty

    master, slave = pty.openpty()
    full = {**os.environ, **env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "COLUMNS": "200", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "compile", "stage-A", *CASE], cwd=lab, env=full,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(60) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def _leftover_temp(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("dsv4-compile-*"))


def test_looking_again_writes_nothing_and_record_writes_all_the_same(lab):
    lab, env, tmp = lab
    records = lab / "results" / "records" / "A.jsonl"
    runs = lab / "results" / "runs.jsonl"

    # First compile: a record, events, the case's line.
    out = _compile(lab, env)
    lines = [x for x in out.splitlines() if LABEL in x and "sm_100a" in x and "compiled" in x]
    assert len(lines) >= 2, out  # the case's line and table row
    assert len(records.read_text().splitlines()) == 1 and len(runs.read_text().splitlines()) == 2
    assert _leftover_temp(tmp) == []  # scratch folder gone
    before = _results(lab)
    assert {"results/inventories.jsonl.xz", "results/envs.jsonl.xz", "results/runs.jsonl",
            "results/records/A.jsonl"} <= set(before)

    # Again, on a terminal: progress bar; nothing written.
    shown = _compile_in_a_terminal(lab, env)
    assert "compiling" in shown and "1/1" in shown, shown  # the bar: its description and count
    assert LABEL in shown and "unchanged" in shown
    assert _results(lab) == before  # byte for byte: records, both stores, runs.jsonl
    out = _compile(lab, env)
    assert "records: none written" in out and "--record" in out
    assert _results(lab) == before

    # --record writes it again.
    out = _compile(lab, env, "--record")
    assert len(records.read_text().splitlines()) == 2 and len(runs.read_text().splitlines()) == 4
    assert records.read_bytes().startswith(before["results/records/A.jsonl"])

    # Another source's record does not count.
    lines = records.read_text().splitlines()
    old = [json.loads(x) for x in lines]
    for d in old:
        d["code"]["src"] = "0" * len(d["code"]["src"])
    records.write_text("".join(json.dumps(d) + "\n" for d in old))
    _compile(lab, env)
    assert len(records.read_text().splitlines()) == 3
    assert _leftover_temp(tmp) == []


@pytest.mark.skipif(has_gpu(), reason="the path of a machine with no GPU (every case compiled, not run)")
def test_running_again_where_nothing_runs_writes_nothing(lab):
    """`run` again with nothing changed records nothing, exit 0; `--record` records."""
    lab, env, tmp = lab
    args = ["run", "stage-A", "--hd", "64", "--n", "128"]
    r = run_cli(args, cwd=lab, env_extra=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    records = lab / "results" / "records" / "A.jsonl"
    assert len(records.read_text().splitlines()) == 2
    before = _results(lab)
    r = run_cli(args, cwd=lab, env_extra=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("unchanged") == 2 and "records: none written" in r.stdout
    assert "compiled, not run: no GPU on this machine" in r.stdout
    assert _results(lab) == before
    r = run_cli(args + ["--record"], cwd=lab, env_extra=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(records.read_text().splitlines()) == 4
    assert len((lab / "results" / "runs.jsonl").read_text().splitlines()) == 4
    assert _leftover_temp(tmp) == []


def test_every_label_of_stage_E_reads_whole_in_the_lines_and_the_table():
    """E's labels differ only at their end: each row carries the whole label."""
    from rich.console import Console

    from harness.execution.compile import CompileResult
    from harness.execution.compilerun import CompileJob, Compiled
    from harness.spec.matrix import expand
    from harness.execution.report import compile_line, compile_table, print_whole
    from harness.spec.spec import load_spec

    spec = load_spec(root=ROOT)
    st = spec.stages["E"]
    cases = expand(st)
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels) > 200 and max(map(len, labels)) > 80
    inv = {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 24, "cp.async.bulk.tensor.2d": 8}
    rows = []
    line_text = []
    for case in cases:
        res = CompileResult(ok=True, key="k" * 64, arch="sm_90a", cached=True, seconds=12.3, inventory=inv,
                            resources={"regs": 168, "spill": 0, "smem": 180224, "barriers": 6})
        rec = Record(id="r.1", run="r", t="t", stage="E", arch="sm_90a", case=case.dict, status="compiled",
                     compile=res.summary())
        line_text.append(compile_line(Compiled(CompileJob(st, "sm_90a", case), res, rec)))
        rows.append(("sm_90a", case.label, "[green]✓ compiled[/] (cached)", "12.3", "168", "0", "180224", "6", "24",
                     "wgmma 24, cp.async.bulk.tensor 8, stmatrix 4, ldmatrix 2, mbarrier 40"))
    for label, line in zip(labels, line_text):
        assert label in line

    console = Console(width=160, no_color=True, file=io.StringIO())  # what make_console gives a pipe
    print_whole(console, compile_table("stage-E compile", rows))
    text = console.file.getvalue()
    table_rows = [x for x in text.splitlines() if "sm_90a" in x]
    assert len(table_rows) == len(labels)
    assert all(label in row for label, row in zip(labels, table_rows))
    assert "…" not in text  # no cell is cut


def test_same_facts_ignores_only_the_time_and_the_cache_flag():
    from harness.execution.compilerun import same_facts

    def rec(status="compiled", src="abc", **compile):
        c = {"key": "k1", "s": 3.0, "cached": False, "regs": 54, "inv": {"wgmma": 4}, **compile}
        return Record(id="x", run="r", t="t", stage="A", arch="sm_90a", case={"hd": 64}, status=status,
                      compile=c, code={"src": src, "commit": "c1"})

    old = rec()
    assert same_facts(old, rec(s=0.1, cached=True))
    assert same_facts(rec(status="pass"), rec())  # a run's record says what the build gave as well
    assert not same_facts(old, rec(src="def"))
    assert not same_facts(old, rec(regs=56))
    assert not same_facts(old, rec(inv={"wgmma": 8}))
    assert not same_facts(old, rec(sass={"HGMMA": 4}))  # news: the old record has no SASS
    # without CUDA tools it tells less
    assert same_facts(rec(sass={"HGMMA": 4}, static_smem=0), old)
    assert not same_facts(rec(sass={"HGMMA": 4}), rec(sass={"HGMMA": 8}))
    assert not same_facts(rec(status="compile_error"), rec())
    assert not same_facts(old, rec(status="compile_error"))


@pytest.mark.parametrize("cancel", [False, True])
def test_the_compile_workers_temp_folder_goes_with_them(tmp_path, monkeypatch, cancel):
    """Compile workers' scratch folders are removed on close, normal or cancelled."""
    import tempfile

    from harness.execution.compile import Compiler

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's temp folder
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers'
    c = Compiler(ROOT, max_workers=1)
    fut = c._pool("sm_90a").submit(os.getenv, "CUTE_DSL_DUMP_DIR")
    dump = fut.result(timeout=120)  # the worker has started and made its folder
    assert Path(dump).is_dir() and tmp_path in Path(dump).parents
    assert _leftover_temp(tmp_path)
    if cancel:
        c._pool("sm_90a").submit(time.sleep, 120)
    c.close(cancel=cancel)
    assert _leftover_temp(tmp_path) == []
