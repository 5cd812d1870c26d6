"""baselines.yaml.xz under bad input and races, compile-only baselines, the hook's interpreter."""

import io
import lzma
import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.notebook import baselines

from harness.workflows import gate
from harness.notebook.baselines import Baseline, BaselineError
from harness.spec.identity import source_hash
from harness.core.labels import case_label
from harness.notebook.records import Record
from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import ROOT, baselines_text, run_cli, write_baselines, write_records

GOOD_RUN = """\
version: 1
baselines:
  OK:
    cpu:
      n=16:
        record: r.1
        src: abc
        metrics:
          out: {cosine: 0.99, rel_l2: 0.001, max_abs: 0.001}
"""

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "version: 1\n"

BAD = {
    "stage as a list": GOOD_RUN.replace("  OK:\n    cpu:", "  OK:\n  - cpu:"),
    "metrics as an int": GOOD_RUN.replace("        metrics:\n          out: {cosine: 0.99, rel_l2: 0.001, max_abs: 0.001}",
                                          "        metrics: 3"),
    "metric as a string": GOOD_RUN.replace("cosine: 0.99", "cosine: '0.99'"),
    "metric NaN": GOOD_RUN.replace("cosine: 0.99", "cosine: .nan"),
    "metric inf": GOOD_RUN.replace("rel_l2: 0.001", "rel_l2: .inf"),
    "metric bool": GOOD_RUN.replace("cosine: 0.99", "cosine: true"),
    "tolerance as a string": GOOD_RUN + "        tolerance: {cosine: 'loose'}\n",
    "tolerance NaN": GOOD_RUN + "        tolerance: {cosine: .nan}\n",
    "unknown top-level key": GOOD_RUN.replace("baselines:", "baseline:"),
    "no version": GOOD_RUN.replace("version: 1\n", ""),
    "unknown arch": GOOD_RUN.replace("    cpu:", "    sm_80:"),
    "yaml bomb": BOMB,
    "not yaml": "version: 1\nbaselines:\n  A: [\n",
    "huge int": GOOD_RUN.replace("cosine: 0.99", "cosine: " + "9" * 5000),
    "python tag": GOOD_RUN.replace("cosine: 0.99", "cosine: !!python/object:os.system 1"),
    "compile regs as a string": """\
version: 1
baselines:
  OK:
    cpu:
      n=16:
        kind: compile
        record: r.1
        src: abc
        compile: {status: compiled, regs: many, spill: 0, inv: {}}
""",
}


def _write_bad(lab: Path, name: str) -> Path:
    path = baselines.baselines_file(lab)
    path.parent.mkdir(parents=True, exist_ok=True)
    if name == "a directory":
        path.mkdir()
    elif name == "non-UTF-8":
        write_baselines(lab, GOOD_RUN.encode().replace(b"r.1", b"r.\xff\xfe1"))
    else:
        write_baselines(lab, BAD[name])
    return path


@pytest.mark.parametrize("name", ["a directory", "non-UTF-8", *BAD])
def test_a_bad_baselines_file_stops_the_gate_with_one_line(fake_lab, name, capsys):
    _write_bad(fake_lab, name)
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("results/baselines.yaml.xz:"), text
    out = io.StringIO()
    assert gate.main(fake_lab, allow_run=False, out=out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "baselines.yaml.xz:" in err and "pass" not in out.getvalue()


def test_the_error_names_the_line_and_key(fake_lab):
    _write_bad(fake_lab, "metric as a string")
    with pytest.raises(BaselineError, match=r"^results/baselines\.yaml\.xz:9: baselines\.OK\.cpu\.n=16\.metrics\.out\.cosine: "
                                            r"expected a number, got str"):
        baselines.load(fake_lab)


def test_the_yaml_bomb_is_refused_quickly(fake_lab):
    import time

    _write_bad(fake_lab, "yaml bomb")
    t0 = time.perf_counter()
    with pytest.raises(BaselineError, match="anchors and aliases are not allowed"):
        baselines.load(fake_lab)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("name", ["a directory", "metric NaN", "stage as a list"])
@pytest.mark.parametrize("command", ["accept", "drop"])
def test_accept_and_drop_on_a_bad_file_are_one_line_and_overwrite_nothing(fake_lab, name, command):
    spec = load_spec(root=fake_lab)
    _write_records(fake_lab, [_pass(spec, "OK", {"n": 16})])
    path = _write_bad(fake_lab, name)
    before = path.read_bytes() if path.is_file() else None
    r = run_cli(["baseline", command, "stage-OK", "--n", "16"], cwd=fake_lab)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "baselines.yaml.xz:" in r.stderr and "Traceback" not in r.stderr
    assert (path.read_bytes() if path.is_file() else None) == before and (path.is_dir() or before is not None)


def test_saved_files_never_hold_anchors_even_for_shared_values(fake_lab):
    shared = {"out": {"cosine": 0.9, "rel_l2": 0.1, "max_abs": 0.1}}
    baselines.save(fake_lab, [Baseline("OK", "cpu", "n=16", "r.1", "s", shared),
                              Baseline("OK", "cpu", "n=32", "r.2", "s", shared)])
    text = baselines_text(fake_lab)
    assert "&" not in text and "*" not in text
    assert len(baselines.load(fake_lab)) == 2


# -- records and helpers


def _pass(spec, stage: str, case: dict, arch: str = "cpu", i: int = 1, cos: float = 0.9999) -> Record:
    return Record(id=f"run{i}.{i}", run=f"run{i}", t="2026-11-22T00:00:00Z", stage=stage, arch=arch, case=case,
                  status="pass", metrics={"out": {"cosine": cos, "rel_l2": 1e-3, "max_abs": 1e-3}},
                  code={"commit": "x", "dirty": False, "src": source_hash(spec.root, spec.stages[stage], arch)})


INV = {"(all)": 900, "tcgen05.mma.cta_group::1.kind::f16": 12, "tcgen05.ld.32x32b.x32": 6, "st.global.128b": 8}


def _compiled(spec, stage: str, case: dict, arch: str = "sm_100a", i: int = 1, status: str = "compiled",
              src: str | None = None, **summary) -> Record:
    comp = {"key": "k", "s": 1.0, "cached": False, "regs": 160, "spill": 0, "smem": 80000, "barriers": 3,
            "inv": dict(INV)}
    comp.update(summary)
    comp = {k: v for k, v in comp.items() if v is not None}
    return Record(id=f"c{i}.{i}", run=f"c{i}", t="2026-11-22T00:00:00Z", stage=stage, arch=arch, case=case,
                  status=status, compile=comp, error="stages/x.py:3: in f: ValueError: no" if status != "compiled" else None,
                  code={"commit": "x", "dirty": False,
                        "src": src or source_hash(spec.root, spec.stages[stage], arch)})


_write_records = write_records


def _add_stage(lab: Path, name: str, kernels: str, matrix: str) -> None:
    text = (lab / "stages.yaml").read_text()
    text += f"""
  {name}:
    title: fake {name}
    dir: stages/fake
    kernels: {kernels}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {matrix}
    kernel_params: [n]
    tolerances: {{out: {{cosine_min: 0.99}}}}
"""
    (lab / "stages.yaml").write_text(text)


# -- concurrent accepts


def _accept_many(lab: str, stage: str, n: int, barrier) -> None:
    sys.path.insert(0, lab)

    spec = load_spec(root=Path(lab))
    st = spec.stages[stage]
    cases = expand(st)
    barrier.wait()
    for i in range(n):
        with open(os.devnull, "w") as devnull:
            sys.stdout = devnull
            assert baselines.accept(spec, st, ["cpu"], [cases[i]]) == 0
            sys.stdout = sys.__stdout__


def test_concurrent_accepts_of_two_stages_lose_nothing(fake_lab):
    """Two processes, ten accepts each: all twenty baselines are there at the end."""
    n = 10
    values = ", ".join(str(16 * (i + 1)) for i in range(n))
    _add_stage(fake_lab, "P1", "{cpu: {module: stages.fake.cpu, entry: Add}}", f"{{n: [{values}]}}")
    _add_stage(fake_lab, "P2", "{cpu: {module: stages.fake.cpu, entry: Add}}", f"{{n: [{values}]}}")
    spec = load_spec(root=fake_lab)
    recs = [_pass(spec, s, {"n": 16 * (i + 1)}, i=i + 1) for s in ("P1", "P2") for i in range(n)]
    _write_records(fake_lab, recs)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_accept_many, args=(str(fake_lab), s, n, barrier)) for s in ("P1", "P2")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = {(b.stage, b.case) for b in baselines.load(fake_lab)}
    assert got == {(s, f"n={16 * (i + 1)}") for s in ("P1", "P2") for i in range(n)}


# -- compile-only baselines


@pytest.fixture
def blab(fake_lab):
    """A stage with a run arch (cpu) and a compile-only arch (sm_100a)."""
    _add_stage(fake_lab, "HD", "{cpu: {module: stages.fake.cpu, entry: Add}, sm100: {module: stages.fake.cpu, entry: Add}}",
               "{hd: [64, 512], n: [16]}")
    return fake_lab


C64, C512 = {"hd": 64, "n": 16}, {"hd": 512, "n": 16}


def _accept(lab: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(["baseline", "accept", "stage-HD", *args], cwd=lab)


def test_accept_takes_a_compile_only_baseline_for_an_arch_that_cannot_run_here(blab):
    spec = load_spec(root=blab)
    _write_records(blab, [_compiled(spec, "HD", C64, sass={"(all)": 800, "UTCHMMA": 12}),
                          _pass(spec, "HD", C64)])
    r = _accept(blab, "--hd", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sm_100a hd=64,n=16 ← c1.1 (compile-only)" in r.stdout and "cpu hd=64,n=16 ← run1.1 (run)" in r.stdout
    by = {(b.arch, b.case): b for b in baselines.load(blab)}
    comp = by[("sm_100a", "hd=64,n=16")]
    assert comp.kind == "compile" and comp.compile["regs"] == 160 and comp.compile["inv"] == baselines.gated_counts(INV)
    assert comp.compile["inv"]["tcgen05.mma.cta_group::1.kind::f16"] == 12 and "st.global.128b" not in comp.compile["inv"]
    assert comp.compile["sass"]["UTCHMMA"] == 12 and comp.tolerance == baselines.COMPILE_TOLERANCE
    assert by[("cpu", "hd=64,n=16")].kind == "run"
    text = lzma.decompress(baselines.compile_baselines_file(blab).read_bytes()).decode()
    assert "kind: compile" in text and "tcgen05.mma.cta_group::1.kind::f16': 12" in text
    assert "kind: compile" not in baselines_text(blab)


def test_accept_refuses_a_compile_error_and_asks_to_compile_what_has_no_record(blab):
    spec = load_spec(root=blab)
    _write_records(blab, [_compiled(spec, "HD", C64, status="compile_error", inv=None)])
    r = _accept(blab, "--arch", "sm_100a")
    assert r.returncode == 1
    assert "compile_error" in r.stdout and "dsv4-lab compile stage-HD --arch sm_100a" in r.stdout
    assert baselines.load(blab) == []


def test_accept_keeps_a_run_baseline_where_the_arch_cannot_run(blab):
    """sm_100a with a run baseline and only a compiled record: the run baseline is kept."""
    spec = load_spec(root=blab)
    run_b = Baseline("HD", "sm_100a", "hd=64,n=16", "b200.1", "old", {"out": {"cosine": 0.999}})
    baselines.save(blab, [run_b])
    _write_records(blab, [_compiled(spec, "HD", C64)])
    r = _accept(blab, "--arch", "sm_100a", "--hd", "64")
    assert r.returncode == 1 and "keep their run baseline" in r.stdout
    (b,) = baselines.load(blab)
    assert b.kind == "run" and b.record == "b200.1"


def _gate(lab: Path, allow_run: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    return gate.main(lab, allow_run=allow_run, out=out), out.getvalue()


def _baseline_from(lab: Path, rec: Record) -> None:
    facts = baselines.compile_facts(rec)
    baselines.save(lab, [Baseline(rec.stage, rec.arch, case_label(rec.case), rec.id, rec.code["src"], {},
                                  dict(baselines.COMPILE_TOLERANCE), None, facts)])


def _baselined(lab: Path, **kw):
    """(spec, record): stage HD's compiled hd=64 record, its compile baseline accepted."""
    spec = load_spec(root=lab)
    base = _compiled(spec, "HD", C64, **kw)
    _baseline_from(lab, base)
    return spec, base


@pytest.mark.parametrize("change, verdict, words", [
    ({}, 0, ["1 baselined case(s) hold"]),
    ({"regs": 168}, 0, ["hold"]),  # +8: within the margin
    ({"regs": 169}, 1, ["REGRESSIONS", "compile.regs", "160", "169"]),
    ({"spill": 4}, 1, ["REGRESSIONS", "compile.spill"]),
    ({"regs": 150, "smem": 70000}, 0, ["improvements", "compile.regs", "compile.smem",
                                       "adopt: dsv4-lab baseline accept stage-HD --arch sm_100a --hd 64 --n 16"]),
    ({"smem": 90000}, 0, ["changes (not regressions)", "compile.smem"]),
    ({"inv": {**INV, "tcgen05.mma.cta_group::1.kind::f16": 8}}, 1,
     ["REGRESSIONS", "PTX tcgen05.mma.cta_group::1.kind::f16", "12", "8"]),
    ({"inv": {**{k: v for k, v in INV.items() if "mma" not in k}, "tcgen05.mma.cta_group::2.kind::f16": 12}}, 1,
     ["tcgen05.mma.cta_group::2.kind::f16", "tcgen05.mma.cta_group::1.kind::f16"]),
    ({"regs": None}, 1, ["not reported now", "nothing proven"]),
])
def test_gate_compares_what_compiling_proves(blab, change, verdict, words):
    spec, base = _baselined(blab)
    _write_records(blab, [base, _compiled(spec, "HD", C64, i=2, **change)])
    code, text = _gate(blab)
    assert code == verdict, text
    for w in words:
        assert w in text, text


def test_a_compile_error_is_a_regression_named_with_its_file_line(blab):
    spec, base = _baselined(blab)
    _write_records(blab, [base, _compiled(spec, "HD", C64, i=2, status="compile_error", inv=None)])
    code, text = _gate(blab)
    assert code == 1 and "stage-HD sm_100a hd=64,n=16" in text and "compile_error: stages/x.py:3" in text


def test_sass_mma_counts_are_compared_when_both_sides_have_sass(blab):
    spec, base = _baselined(blab, sass={"(all)": 800, "UTCHMMA": 12})
    _write_records(blab, [base, _compiled(spec, "HD", C64, i=2, sass={"(all)": 700, "UTCHMMA": 6})])
    code, text = _gate(blab)
    assert code == 1 and "SASS UTCHMMA" in text
    _write_records(blab, [_compiled(spec, "HD", C64, i=3)])  # no SASS now (tools missing): PTX still holds
    assert _gate(blab)[0] == 0


def test_a_record_without_the_inventory_proves_nothing(blab):
    """A compiled record without inventory is stale for a compile-only baseline."""
    spec, base = _baselined(blab)
    _write_records(blab, [_compiled(spec, "HD", C64, i=2, inv=None)])
    code, text = _gate(blab)
    assert code == 1 and "stale" in text and "dsv4-lab compile stage-HD --arch sm_100a" in text


def test_stale_compile_only_cases_are_recompiled_by_the_gate(blab):
    """A stale compile-only case is recompiled: the gate names the compile error and writes the record."""
    spec, base = _baselined(blab, src="0ld0ld0ld0ld")
    _write_records(blab, [base])
    code, text = _gate(blab, allow_run=True)
    assert code == 1 and "REGRESSIONS" in text and "stage-HD sm_100a hd=64,n=16" in text and "compile_error" in text
    recs = [r for r in __import__("harness.notebook.records", fromlist=["x"]).read_records(blab, ["HD"])]
    assert recs[-1].status == "compile_error" and recs[-1].code["src"] == source_hash(blab, spec.stages["HD"], "sm_100a")
    runs = (blab / "results" / "runs.jsonl").read_text()
    assert '"event":"start"' in runs and '"event":"end"' in runs


def test_run_and_compile_baselines_hold_side_by_side(blab):
    spec = load_spec(root=blab)
    comp = _compiled(spec, "HD", C64)
    run = _pass(spec, "HD", C64)
    _write_records(blab, [comp, run])
    assert _accept(blab, "--hd", "64").returncode == 0
    assert _gate(blab) == (0, "gate: pass — 2 baselined case(s) hold\n")
    _write_records(blab, [_pass(spec, "HD", C64, i=5, cos=0.5)])
    code, text = _gate(blab)
    assert code == 1 and "stage-HD cpu hd=64,n=16" in text and "sm_100a" not in text.split("REGRESSIONS")[1]


def test_nan_never_passes_a_comparison():
    b = Baseline("HD", "cpu", "hd=64,n=16", "r", "s", {"out": {"cosine": 0.99, "rel_l2": 1e-3}})
    rec = Record(id="r.2", run="r", t="t", stage="HD", arch="cpu", case=C64, status="pass",
                 metrics={"out": {"cosine": math.nan, "rel_l2": math.inf}})
    found = gate.compare(b, rec)
    assert {f.metric for f in found if f.kind == "regression"} == {"cosine", "rel_l2"}


def test_show_filters_by_stage_arch_and_case(blab, capsys):
    spec = load_spec(root=blab)
    _write_records(blab, [_compiled(spec, "HD", C64), _compiled(spec, "HD", C512, i=2), _pass(spec, "HD", C64)])
    assert _accept(blab).returncode == 0

    st = spec.stages["HD"]
    assert baselines.show(blab, st, ["sm_100a"], [c for c in expand(st) if c.dict["hd"] == 512]) == 0
    out = capsys.readouterr().out
    assert "hd=512,n=16" in out and "hd=64,n=16" not in out and "compile-only" in out and "(run)" not in out
    assert baselines.show(blab, "stage-HD", ["cpu"]) == 0
    out = capsys.readouterr().out
    assert "hd=64,n=16" in out and "(run)" in out and "compile-only" not in out
    assert baselines.show(blab, "OK") == 0 and "no baselines match" in capsys.readouterr().out


# -- the git hook


def _commit(lab: Path, env: dict) -> subprocess.CompletedProcess:
    (lab / "x.txt").write_text(str(os.urandom(4)))
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)  # the hook judges what is staged
    return subprocess.run(["/usr/bin/git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"],
                          cwd=lab, env=env, capture_output=True, text=True, timeout=300)


def test_hook_runs_with_the_installing_interpreter_when_nothing_is_on_path(blab, monkeypatch):
    """With PATH=/usr/bin:/bin and no PYTHONPATH the hook still gates."""
    assert gate.install_hook(blab) == 0
    hook = (blab / ".git" / "hooks" / "pre-commit").read_text()
    assert str(Path(sys.executable).absolute()) in hook and str(ROOT) in hook and "exec python3 " not in hook
    spec = load_spec(root=blab)
    _write_records(blab, [_pass(spec, "HD", C64)])
    baselines.save(blab, [Baseline("HD", "cpu", "hd=64,n=16", "run1.1", source_hash(blab, spec.stages["HD"], "cpu"),
                                   {"out": {"cosine": 0.9999}})])
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
           "DSV4_LAB_CACHE": os.environ["DSV4_LAB_CACHE"]}
    r = _commit(blab, env)
    assert r.returncode == 0, r.stdout + r.stderr
    _write_records(blab, [_pass(spec, "HD", C64, i=2, cos=0.5)])
    r = _commit(blab, env)
    out = r.stdout + r.stderr  # git passes the hook's stdout on to its stderr
    assert r.returncode != 0 and "REGRESSIONS" in out and "stage-HD cpu hd=64,n=16" in out


def test_the_gate_reads_records_only_when_nothing_changed(blab):
    """Fresh results: the gate imports no torch or CuTeDSL, compiles nothing."""
    spec = load_spec(root=blab)
    _write_records(blab, [_compiled(spec, "HD", C64), _pass(spec, "HD", C64)])
    assert _accept(blab, "--hd", "64").returncode == 0
    script = ("import sys\nfrom pathlib import Path\nfrom harness.workflows import gate\n"
              "code = gate.main(Path(sys.argv[1]))\n"
              "print(code, any(m.split('.')[0] in ('torch', 'cutlass') for m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script, str(blab)], cwd=blab, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0 False" and "2 baselined case(s) hold" in r.stdout
    assert not (blab / "results" / "runs.jsonl").exists()  # nothing was compiled or run


def test_hook_gates_a_lab_in_a_subfolder_of_the_repository(tmp_path, monkeypatch):
    """The hook cds to the lab; a committer's DSV4_LAB_ROOT does not redirect it."""
    import shutil

    from tests.conftest import FIXTURES

    repo = tmp_path / "repo"
    lab = repo / "my lab"
    shutil.copytree(FIXTURES / "lab", lab)
    shutil.copy(ROOT / "oracles" / "common.py", lab / "oracles" / "common.py")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    monkeypatch.setenv("DSV4_LAB_ROOT", str(lab))
    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path / "cache"))
    _add_stage(lab, "HD", "{cpu: {module: stages.fake.cpu, entry: Add}}", "{hd: [64], n: [16]}")
    spec = load_spec(root=lab)
    _write_records(lab, [_pass(spec, "HD", C64, cos=0.5)])
    baselines.save(lab, [Baseline("HD", "cpu", "hd=64,n=16", "run1.1", source_hash(lab, spec.stages["HD"], "cpu"),
                                  {"out": {"cosine": 0.9999}})])
    assert gate.install_hook(lab) == 0
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "DSV4_LAB_CACHE": str(tmp_path / "cache"),
           "DSV4_LAB_ROOT": str(tmp_path / "elsewhere")}
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)  # the hook judges what is staged
    r = _commit(repo, env)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "REGRESSIONS" in out and "stage-HD cpu hd=64,n=16" in out, out


def test_a_compile_baseline_is_written_in_flow_style_and_reads_back(tmp_path):
    """Compile and run baselines are each one flow mapping on one line, read back the same."""
    inv = {"(all)": 294, "tcgen05.mma.cta_group::1.kind::f16": 8}
    b = Baseline("A", "sm_100a", "hd=128", "r.3", "abc",
                 tolerance=dict(baselines.COMPILE_TOLERANCE),
                 compile={"status": "compiled", "regs": 54, "spill": 0, "smem": 66560, "inv": inv, "sass": {"(all)": 424}})
    shallow = Baseline("A", "sm_90a", "hd=64", "r.4", "abd", tolerance=dict(baselines.COMPILE_TOLERANCE),
                       compile={"status": "compiled", "regs": 40, "inv": {}, "sass": {}})  # empty tables: shallow
    other = Baseline("A", "sm_90a", "hd=128", "r.5", "abd", tolerance=dict(baselines.COMPILE_TOLERANCE),
                     compile={"status": "compiled", "regs": 41, "inv": {}, "sass": {}})
    baselines.save(tmp_path, [b, shallow, other])
    text = lzma.decompress(baselines.compile_baselines_file(tmp_path).read_bytes()).decode()  # the same layout
    lines = text.splitlines()
    assert any(ln.startswith("      hd=128: {") and "compile: {status: compiled, regs: 54" in ln and
               "sass: {(all): 424}" in ln for ln in lines), text
    assert "    sm_90a:" in lines and any(ln.startswith("      hd=64: {kind: compile, record: r.4,") for ln in lines), text
    assert sorted(baselines.load(tmp_path, must_exist=True), key=lambda x: (x.arch, x.case)) == \
        sorted([b, shallow, other], key=lambda x: (x.arch, x.case))


# -- run baselines keep the digits the gate needs


def _rec_with(metrics: dict) -> Record:
    return Record(id="r9.1", run="r9", t="2026-11-23T00:00:00Z", stage="A", arch="sm_90a", case={"n": 1},
                  status="pass", metrics=metrics)


EXACT = {"O": {"cosine": 0.9999984673741793, "rel_l2": 0.001750872232223604, "max_abs": 0.015586805746980126},
         "LSE": {"cosine": 0.9999999999999984, "rel_l2": 1.5550111985537762e-07, "max_abs": 1234.5678901234567}}


def test_run_baseline_metrics_are_rounded_and_their_own_record_still_holds():
    rounded = baselines.gated_metrics(EXACT, baselines.DEFAULT_TOLERANCE)
    for out, m in EXACT.items():
        for name, v in m.items():
            r = rounded[out][name]
            assert r == float(f"{r:.{baselines.SIG_DIGITS}g}")  # at most SIG_DIGITS significant digits
            assert abs(r - v) <= 0.5 * 10.0 ** (1 - baselines.SIG_DIGITS) * abs(v)
    assert rounded["O"]["cosine"] != EXACT["O"]["cosine"]  # it did round
    b = Baseline("A", "sm_90a", "n=1", "r9.1", "x", rounded)
    assert gate.compare(b, _rec_with(EXACT)) == []  # its own record passes it
    # and the gate still sees a real change
    worse = {"O": {**EXACT["O"], "cosine": EXACT["O"]["cosine"] - 2e-6}, "LSE": {**EXACT["LSE"], "max_abs": 1605.0}}
    assert {(f.output, f.metric) for f in gate.compare(b, _rec_with(worse))} == {("O", "cosine"), ("LSE", "max_abs")}


def test_a_zero_tolerance_keeps_the_exact_value():
    tol = {**baselines.DEFAULT_TOLERANCE, "cosine": 0.0}
    got = baselines.gated_metrics(EXACT, tol)
    assert got["O"]["cosine"] == EXACT["O"]["cosine"] and got["LSE"]["cosine"] == EXACT["LSE"]["cosine"]
    assert got["O"]["rel_l2"] != EXACT["O"]["rel_l2"]
    b = Baseline("A", "sm_90a", "n=1", "r9.1", "x", got, tol)
    assert gate.compare(b, _rec_with(EXACT)) == []


def test_accept_takes_rounded_metrics_from_the_record():
    # accept saves metrics_of(record)'s values
    got = baselines.metrics_of(_rec_with({out: {**m, "nonfinite": 0} for out, m in EXACT.items()}))
    assert got == baselines.gated_metrics(EXACT, baselines.DEFAULT_TOLERANCE) != EXACT


# -- compile baselines


COMP = {"status": "compiled", "regs": 160, "spill": 0, "smem": 80000, "inv": {"(all)": 900,
        "tcgen05.mma.cta_group::1.kind::f16": 12}}
RUN_B = Baseline("OK", "cpu", "n=16", "r.1", "s", {"out": {"cosine": 0.99, "rel_l2": 0.001, "max_abs": 0.001}})
COMP_B = Baseline("OK", "sm_100a", "n=16", "c.1", "s", {}, dict(baselines.COMPILE_TOLERANCE), None, dict(COMP))
COMP_YAML = """\
version: 1
baselines:
  OK:
    sm_100a:
      n=16:
        kind: compile
        record: c.1
        src: s
        compile: {status: compiled, regs: 160, spill: 0, inv: {(all): 900}}
"""


def _yaml(lab: Path, text: str) -> None:
    write_baselines(lab, text)  # the run baselines file


def _old_yaml(lab: Path, text: str) -> Path:
    """An older clone's run baselines: plain results/baselines.yaml."""
    path = baselines.old_baselines_file(lab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _xz(lab: Path, text: str | bytes) -> Path:
    path = baselines.compile_baselines_file(lab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(text.encode() if isinstance(text, str) else text, format=lzma.FORMAT_XZ))
    return path


def test_save_keeps_run_baselines_and_compile_ones_in_two_xz_files_and_reads_both_back(fake_lab):
    other = Baseline("A", "sm_100a", "n=1", "c.2", "s", {}, dict(baselines.COMPILE_TOLERANCE), None, dict(COMP))
    baselines.save(fake_lab, [COMP_B, RUN_B, other])
    assert baselines.baselines_file(fake_lab).read_bytes().startswith(b"\xfd7zXZ\x00")
    assert not os.path.lexists(baselines.old_baselines_file(fake_lab))
    plain = baselines_text(fake_lab)
    assert plain.startswith(baselines.HEADER) and "\nversion: 1\nbaselines:\n" in plain
    packed = baselines.compile_baselines_file(fake_lab).read_bytes()
    assert packed.startswith(b"\xfd7zXZ\x00") and "kind: compile" not in plain and "r.1" in plain
    text = lzma.decompress(packed).decode()
    assert "kind: compile" in text and "c.1" in text and "c.2" in text and "r.1" not in text
    assert text.startswith(baselines.HEADER) and "\nversion: 1\nbaselines:\n" in text
    assert baselines.load(fake_lab) == [other, RUN_B, COMP_B]  # the order save writes: stage, arch, case
    baselines.save(fake_lab, [RUN_B])  # the last one dropped: the file is emptied
    assert baselines.load(fake_lab) == [RUN_B]


def test_a_compile_baseline_of_an_old_yaml_is_read_and_moves_to_the_xz_file(fake_lab):
    _yaml(fake_lab, COMP_YAML)
    (old,) = baselines.load(fake_lab, must_exist=True)
    assert old.kind == "compile" and old.compile["regs"] == 160
    baselines.save(fake_lab, [old, RUN_B], read=[old])
    assert "kind: compile" not in baselines_text(fake_lab)
    assert "c.1" in lzma.decompress(baselines.compile_baselines_file(fake_lab).read_bytes()).decode()
    assert baselines.load(fake_lab) == [RUN_B, old]


def test_a_case_in_both_files_is_one_line_naming_both(fake_lab):
    _yaml(fake_lab, COMP_YAML)
    _xz(fake_lab, COMP_YAML.replace("regs: 160", "regs: 170"))
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and "results/compile_baselines.yaml.xz" in text and "results/baselines.yaml.xz" in text
    assert "baselines.OK.sm_100a.n=16" in text
    assert gate.main(fake_lab, allow_run=False, out=io.StringIO()) == 2


def test_a_bad_line_inside_the_xz_file_names_file_line_and_key(fake_lab):
    _xz(fake_lab, COMP_YAML.replace("regs: 160", "regs: many"))
    with pytest.raises(BaselineError, match=r"^results/compile_baselines\.yaml\.xz:9: "
                                            r"baselines\.OK\.sm_100a\.n=16\.compile\.regs: expected a count"):
        baselines.load(fake_lab)


@pytest.mark.parametrize("bad", ["corrupt", "cut off", "not xz", "bomb"])
def test_a_corrupt_xz_file_is_one_line_and_accept_overwrites_nothing(fake_lab, bad, monkeypatch, capsys):
    path = _xz(fake_lab, COMP_YAML)
    data = path.read_bytes()
    if bad == "corrupt":
        data = data[:40] + bytes(b ^ 0x55 for b in data[40:60]) + data[60:]
    elif bad == "cut off":
        data = data[: len(data) // 2]
    elif bad == "not xz":
        data = COMP_YAML.encode()
    else:  # decompresses past the cap on the text
        monkeypatch.setattr(baselines, "MAX_BYTES", 4096)
        data = lzma.compress(COMP_YAML.encode() + b"#" * 8192 + b"\n", format=lzma.FORMAT_XZ)
    path.write_bytes(data)
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("results/compile_baselines.yaml.xz:1: "), text
    if bad != "bomb":
        r = run_cli(["baseline", "accept", "stage-OK", "--n", "16"], cwd=fake_lab)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "compile_baselines.yaml.xz:1:" in r.stderr, r.stderr
        assert path.read_bytes() == data


@pytest.mark.parametrize("arch, kind", [("sm_100a", "compile-only"), ("cpu", "run")])
def test_the_staged_gate_reads_the_baselines_from_the_index(blab, arch, kind):
    """`gate --staged` reads the baselines from the git index, even with the working file gone."""
    spec = load_spec(root=blab)
    _write_records(blab, [_compiled(spec, "HD", C64) if kind == "compile-only" else _pass(spec, "HD", C64)])
    r = _accept(blab, "--arch", arch, "--hd", "64")
    assert r.returncode == 0 and f"({kind})" in r.stdout, r.stdout + r.stderr
    subprocess.run(["git", "add", "stages.yaml", "results/baselines.yaml.xz"]
                   + ["results/compile_baselines.yaml.xz"] * (kind == "compile-only"), cwd=blab, check=True)
    (baselines.compile_baselines_file if kind == "compile-only" else baselines.baselines_file)(blab).unlink()
    r = run_cli(["gate", "--staged", "--no-run"], cwd=blab)  # unstaged: the commit still holds the baseline
    assert r.returncode == 0 and "1 baselined case(s) hold" in r.stdout, r.stdout + r.stderr
    r = run_cli(["gate", "--no-run"], cwd=blab)  # the working tree lost it: never a pass
    assert r.returncode == 1 and "no baselines, but the notebook has records" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("crash_at", [2, 3])
def test_a_case_changing_kind_is_never_lost_when_a_write_is_cut_short(fake_lab, monkeypatch, crash_at):
    """Run → compile-only: dying between writes leaves it in one or both files."""
    run_k = Baseline("OK", "sm_100a", "n=16", "b200.1", "s", {"out": {"cosine": 0.999}})
    baselines.save(fake_lab, [run_k, RUN_B])
    writes = []
    real = baselines.replace_file

    def dying(path, data):
        writes.append(path.name)
        if len(writes) == crash_at:
            raise KeyboardInterrupt  # the process dies here
        real(path, data)

    monkeypatch.setattr(baselines, "replace_file", dying)
    with pytest.raises(KeyboardInterrupt):
        baselines.save(fake_lab, [COMP_B, RUN_B], read=[run_k, RUN_B])
    monkeypatch.setattr(baselines, "replace_file", real)
    if crash_at == 2:  # xz never written: run baseline kept
        assert baselines.load(fake_lab) == [RUN_B, run_k]
    else:  # both written: in both, one line
        with pytest.raises(BaselineError, match="also in results/baselines.yaml.xz"):
            baselines.load(fake_lab)


def test_a_save_whose_text_would_read_back_as_another_baseline_writes_nothing(fake_lab, monkeypatch):
    baselines.save(fake_lab, [RUN_B])
    before = baselines.baselines_file(fake_lab).read_bytes()
    to_yaml = Baseline.to_yaml
    monkeypatch.setattr(Baseline, "to_yaml", lambda b: {**to_yaml(b), "record": "r.0"})  # a bug: every record r.0
    two = [RUN_B, Baseline("OK", "cpu", "n=32", "r.2", "s", RUN_B.metrics)]
    with pytest.raises(BaselineError, match="not written — the new text reads back as 2 baselines that differ"):
        baselines.save(fake_lab, two)
    assert baselines.baselines_file(fake_lab).read_bytes() == before


def test_the_real_baselines_round_trip_one_line_a_case(tmp_path, monkeypatch):
    """The project's own baselines round-trip unchanged, one line a case."""
    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path / "cache"))
    lab = tmp_path / "lab"
    (lab / "results").mkdir(parents=True)
    for name in (baselines.RUN_FILE, baselines.COMPILE_FILE):
        (lab / "results" / name).write_bytes((ROOT / "results" / name).read_bytes())
    real = baselines.load(lab, must_exist=True)
    assert len(real) > 1000 and {b.kind for b in real} == {"run", "compile", "suite"}
    baselines.save(lab, real, read=real)
    assert baselines.load(lab, must_exist=True) == real
    runs = [b for b in real if b.kind != "compile"]  # the run file: run and suite baselines
    cases = [ln for ln in baselines_text(lab).splitlines() if ln.startswith("      ")]
    assert len(cases) == len(runs) and all(ln.endswith("}") and ", src: " in ln for ln in cases)


# -- an older clone's plain baselines.yaml


def test_an_old_plain_baselines_file_is_read_and_the_next_save_compresses_it_and_removes_it(fake_lab):
    old = _old_yaml(fake_lab, GOOD_RUN + COMP_YAML.split("  OK:\n", 1)[1])  # a pre-split compile case too
    items = baselines.load(fake_lab, must_exist=True)
    assert [(b.arch, b.kind, b.record) for b in items] == [("cpu", "run", "r.1"), ("sm_100a", "compile", "c.1")]
    assert not baselines.baselines_file(fake_lab).exists()  # reading writes nothing
    baselines.save(fake_lab, items, read=items)
    assert not os.path.lexists(old) and baselines.baselines_file(fake_lab).read_bytes().startswith(b"\xfd7zXZ\x00")
    assert "r.1" in baselines_text(fake_lab) and "kind: compile" not in baselines_text(fake_lab)
    assert baselines.load(fake_lab) == items  # nothing lost on the way


def test_an_old_plain_baselines_file_is_moved_by_the_next_baseline_command(fake_lab):
    spec = load_spec(root=fake_lab)
    _write_records(fake_lab, [_pass(spec, "OK", {"n": 16})])
    old = _old_yaml(fake_lab, GOOD_RUN.replace("n=16", "n=8"))  # a case the command leaves alone
    r = run_cli(["baseline", "accept", "stage-OK", "--n", "16"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not os.path.lexists(old) and {b.case for b in baselines.load(fake_lab)} == {"n=8", "n=16"}


def test_a_bad_old_plain_baselines_file_is_one_line_naming_it(fake_lab):
    _old_yaml(fake_lab, BAD["metric as a string"])
    with pytest.raises(BaselineError, match=r"^results/baselines\.yaml:9: baselines\.OK\.cpu\.n=16\.metrics\.out\."
                                            r"cosine: expected a number, got str"):
        baselines.load(fake_lab)


@pytest.mark.parametrize("same", [True, False])
def test_the_xz_file_and_an_old_plain_one_at_once_are_one_line_naming_both_and_nothing_is_written(fake_lab, same):
    _yaml(fake_lab, GOOD_RUN)
    old = _old_yaml(fake_lab, GOOD_RUN if same else GOOD_RUN.replace("n=16", "n=8"))
    before = (baselines.baselines_file(fake_lab).read_bytes(), old.read_bytes())
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("results/baselines.yaml.xz and results/baselines.yaml: both present"), text
    if same:
        assert text.endswith("both hold the same 1 baselines (a write cut short?): remove the plain one "
                             "(git rm results/baselines.yaml)"), text
    else:
        assert "they differ (1 and 1 baselines)" in text and "`git rm results/baselines.yaml` keeps" in text, text
    with pytest.raises(BaselineError, match="both present"):
        baselines.save(fake_lab, [RUN_B])
    r = run_cli(["gate", "--no-run"], cwd=fake_lab)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "both present" in r.stderr, r.stdout + r.stderr
    assert (baselines.baselines_file(fake_lab).read_bytes(), old.read_bytes()) == before


def test_a_move_cut_short_after_the_xz_is_written_loses_nothing(fake_lab, monkeypatch):
    old = _old_yaml(fake_lab, GOOD_RUN)
    items = baselines.load(fake_lab)

    def dying(self, *a, **k):
        raise KeyboardInterrupt  # the process dies before the plain file goes

    monkeypatch.setattr(Path, "unlink", dying)
    with pytest.raises(KeyboardInterrupt):
        baselines.save(fake_lab, items, read=items)
    monkeypatch.undo()
    assert old.is_file() and baselines.baselines_file(fake_lab).is_file()
    with pytest.raises(BaselineError, match="both hold the same 1 baselines"):
        baselines.load(fake_lab)
    old.unlink()  # the fix the line names
    assert baselines.load(fake_lab) == items


def test_drop_all_removes_the_baselines_of_cases_the_matrix_no_longer_has(fake_lab):
    """A renamed axis orphans baselines: the gate says to use --all; `drop --all` removes them."""
    from tests.conftest import baselines_text, write_baselines

    gone = GOOD_RUN.replace("      n=16:\n", "      n=16,width=3:\n")
    write_baselines(fake_lab, gone + GOOD_RUN.split("    cpu:\n", 1)[1])
    assert "n=16,width=3" in baselines_text(fake_lab) and "\n      n=16:" in baselines_text(fake_lab)
    (fake_lab / "results" / "records").mkdir(parents=True, exist_ok=True)
    r = run_cli(["gate", "--no-run"], cwd=fake_lab)
    assert "is no longer in stage-OK's matrix — drop it: dsv4-lab baseline drop stage-OK --gone" in r.stdout, r.stdout
    r = run_cli(["baseline", "drop", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 0 and "n=16,width=3" in baselines_text(fake_lab), r.stdout + r.stderr  # not named by it
    r = run_cli(["baseline", "drop", "stage-OK", "--all", "--n", "16"], cwd=fake_lab)
    assert r.returncode == 2 and "give no axis filters" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run_cli(["baseline", "drop", "stage-OK", "--all"], cwd=fake_lab)
    assert r.returncode == 0 and "dropped 1 baseline(s) of stage-OK" in r.stdout, r.stdout + r.stderr
    assert "n=16" not in baselines_text(fake_lab)
    r = run_cli(["baseline", "drop", "stage-OK", "--all"], cwd=fake_lab)
    assert r.returncode == 1 and "nothing dropped" in r.stderr, r.stderr


def test_drop_gone_removes_only_the_baselines_of_cases_the_matrix_no_longer_has(fake_lab):
    """`drop STAGE --gone`: only cases gone from the matrix; again: "nothing gone"; filters: usage."""
    gone = GOOD_RUN.replace("      n=16:\n", "      n=16,width=3:\n")
    also = GOOD_RUN.split("    cpu:\n", 1)[1]
    write_baselines(fake_lab, gone + also + also.replace("n=16:", "n=32:").replace("r.1", "r.2")
                    + also.replace("n=16:", "n=8:").replace("r.1", "r.3"))
    assert [b.case for b in baselines.load(fake_lab)] == ["n=16,width=3", "n=16", "n=32", "n=8"]
    for bad, says in ((["--all"], "give one"), (["--n", "16"], "give none with it")):
        r = run_cli(["baseline", "drop", "stage-OK", "--gone", *bad], cwd=fake_lab)
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run_cli(["baseline", "drop", "stage-OK", "--gone"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("dropped 2 baseline(s) of stage-OK whose case its matrix no longer has: cpu n=16,width=3, cpu n=8; kept 2"
            in r.stdout), r.stdout
    assert [b.case for b in baselines.load(fake_lab)] == ["n=16", "n=32"]
    r = run_cli(["baseline", "drop", "stage-OK", "--gone"], cwd=fake_lab)
    assert r.returncode == 0 and "nothing gone: 2 baseline(s) of stage-OK, each names a case of its matrix" in r.stdout, \
        r.stdout + r.stderr
    assert [b.case for b in baselines.load(fake_lab)] == ["n=16", "n=32"]
