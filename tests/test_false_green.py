"""Green that proved nothing (issue 27, items 3, 5–8)."""

from tests.conftest import run_cli, write_baselines


# Item 7: no case selected: exit 1, one line.


def test_a_shard_past_the_end_is_exit_1_one_line(fake_lab):
    r = run_cli(["run", "stage-OK", "--shard", "99/100"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "selects none of the 2 case(s)" in r.stderr, r.stderr
    assert not (fake_lab / "results" / "records" / "OK.jsonl").exists()


def test_an_arch_no_stage_has_is_exit_1(fake_lab):
    r = run_cli(["run", "stage-OK", "--arch", "sm_90a"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no case to run" in r.stderr, r.stderr


def test_a_shard_that_selects_a_case_still_runs(fake_lab):
    r = run_cli(["run", "stage-OK", "--shard", "1/2"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr


# Item 8: empty tolerances refused.

import io  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from harness.notebook import baselines  # noqa: E402

from harness.workflows import gate
from harness.notebook.baselines import BaselineError  # noqa: E402
from harness.spec.spec import SpecError, load_spec  # noqa: E402

OK_TOL = "tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}"


def _spec_error(lab: Path, tol: str) -> str:
    path = lab / "stages.yaml"
    path.write_text(path.read_text().replace(OK_TOL, f"tolerances: {{out: {tol}}}"))
    with pytest.raises(SpecError) as exc:
        load_spec(root=lab)
    return str(exc.value)


@pytest.mark.parametrize("tol, says", [
    ("{cosine_min: -1}", "out of range — it must be more than 0 and at most 1"),
    ("{cosine_min: 0}", "out of range — it must be more than 0 and at most 1"),
    ("{rel_l2_max: 1.0e+300}", "out of range — it must be at least 0 and at most 1"),
    ("{rel_l2_max: 1.5, cosine_min: 0.9999}", "out of range — it must be at least 0 and at most 1"),
    ("{cosine_min: 0.5}", "bounds that hold nothing — give cosine_min >= 0.9 or rel_l2_max <= 0.5"),
    ("{rel_l2_max: 0.9}", "bounds that hold nothing"),
    ("{max_abs_max: 1.0e+300}", "bounds that hold nothing"),
    ("{cosine_min: 0.5, rel_l2_max: 0.8, max_abs_max: 0.1}", "bounds that hold nothing"),
])
def test_stage_tolerances_that_hold_nothing_are_one_line(fake_lab, tol, says):
    msg = _spec_error(fake_lab, tol)
    assert "\n" not in msg and msg.startswith("stages.yaml:12: stages.OK.tolerances.out") and says in msg, msg


def test_the_loosest_allowed_bounds_still_fail_a_minus_b(fake_lab):
    """`a - b` for `a + b` fails cosine_min 0.9 alone and rel_l2_max 0.5 alone."""
    path = fake_lab / "stages.yaml"
    text = path.read_text()
    for tol in ("{cosine_min: 0.9}", "{rel_l2_max: 0.5}"):
        path.write_text(text.replace("tolerances: {out: {cosine_min: 0.9999}}", f"tolerances: {{out: {tol}}}"))
        r = run_cli(["run", "stage-BAD", "--mode", "wrong"], cwd=fake_lab)
        assert r.returncode == 1 and "1 fail" in r.stdout, (tol, r.stdout + r.stderr)


def test_a_run_with_such_a_tolerance_is_refused_exit_2(fake_lab):
    path = fake_lab / "stages.yaml"
    path.write_text(path.read_text().replace("tolerances: {out: {cosine_min: 0.9999}}",
                                             "tolerances: {out: {cosine_min: -1}}"))
    r = run_cli(["run", "stage-BAD", "--mode", "wrong"], cwd=fake_lab)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stdout + r.stderr
    assert "stages.BAD.tolerances.out.cosine_min" in r.stderr
    assert not (fake_lab / "results" / "records" / "BAD.jsonl").exists()


from tests.test_baselines import GOOD_RUN as BASE  # noqa: E402  (one run baseline of stage OK)


@pytest.mark.parametrize("tol, key", [
    ("{cosine: 2, rel_l2: 1.0e+300}", "tolerance.cosine"),
    ("{rel_l2: 1.0e+300}", "tolerance.rel_l2"),
    ("{max_abs: 5}", "tolerance.max_abs"),
    ("{cosine: 0.5}", "tolerance.cosine"),
])
def test_baseline_tolerances_that_hold_nothing_stop_the_gate(fake_lab, tol, key, capsys):
    write_baselines(fake_lab, BASE + f"        tolerance: {tol}\n")
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(f"results/baselines.yaml.xz:10: baselines.OK.cpu.n=16.{key}: "), text
    assert "holds nothing — give at most" in text
    assert gate.main(fake_lab, allow_run=False, out=io.StringIO()) == 2
    compile_base = BASE.replace("        metrics:\n          out: {cosine: 0.99, rel_l2: 0.001, max_abs: 0.001}\n",
                                "        kind: compile\n        compile: {status: compiled, regs: 90, inv: {}}\n")
    write_baselines(fake_lab, compile_base + "        tolerance: {regs: 1.0e+300}\n")
    with pytest.raises(BaselineError, match="tolerance.regs: 1e\\+300 holds nothing"):
        baselines.load(fake_lab)


def test_a_baseline_tolerance_in_bounds_loads(fake_lab):
    write_baselines(fake_lab, BASE + "        tolerance: {cosine: 1.0e-3, rel_l2: 1.0, max_abs: 0.5}\n")
    (b,) = baselines.load(fake_lab)
    assert b.tolerance == {"cosine": 1e-3, "rel_l2": 1.0, "max_abs": 0.5}


def test_the_committed_stages_and_baselines_keep_to_the_bounds(project_root):
    spec = load_spec(root=project_root)
    assert spec.stages
    assert baselines.load(project_root, must_exist=True)


# Item 3: a kernel writing its inputs fails.

import json  # noqa: E402

INPUT_WRITERS = """\
  IN:
    title: kernels that write their inputs
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.cpu, entry: Misbehave}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix:
      n: [16]
      mode: [zero_inputs, copy_input, touch_input, ok]
    kernel_params: [n, mode]
    tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}
    timeout_s: 20
"""


def test_a_run_fails_a_kernel_that_writes_its_inputs(fake_lab):
    path = fake_lab / "stages.yaml"
    path.write_text(path.read_text() + INPUT_WRITERS)
    r = run_cli(["run", "stage-IN"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    recs = {}
    for line in (fake_lab / "results" / "records" / "IN.jsonl").read_text().splitlines():
        rec = json.loads(line)
        recs[rec["case"]["mode"]] = rec
    zero, copy, touch, ok = recs["zero_inputs"], recs["copy_input"], recs["touch_input"], recs["ok"]
    assert zero["status"] == "fail", zero
    assert zero["error"].startswith("kernel wrote its input a (16 elements changed); kernel wrote its input b "
                                    "(16 elements changed)"), zero["error"]
    assert copy["status"] == "fail" and copy["error"].startswith("kernel wrote its input b ("), copy
    assert "kernel wrote its input a" not in copy["error"]
    # the oracle ran on the generated inputs
    assert touch["status"] == "fail" and touch["error"] == "kernel wrote its input a (1 element changed)", touch
    assert touch["metrics"]["out"]["cosine"] > 0.9999
    assert ok["status"] == "pass" and not ok.get("error")


from tests.test_bench import _job  # noqa: E402  (the bench tests' job; lab_path: a conftest fixture)


def test_bench_check_fails_a_kernel_that_writes_its_inputs(lab_path):
    from harness.execution.bench import check_and_time

    zero = check_and_time(_job("zero_inputs"), lab_path)
    assert zero["status"] == "fail" and "kernel wrote its input a (4096 elements changed)" in zero["error"], zero
    copy = check_and_time(_job("copy_input"), lab_path)
    assert copy["status"] == "fail" and copy["error"].startswith("kernel wrote its input b ("), copy
    touch = check_and_time(_job("touch_input"), lab_path)
    assert touch["status"] == "fail" and touch["error"] == "kernel wrote its input a (1 element changed)", touch
    assert check_and_time(_job("ok"), lab_path)["status"] == "pass"


def test_the_worker_names_the_inputs_written(lab_path):
    from harness.execution.worker import Job, _Executor

    job = Job(stage="IN", arch="cpu", case={"n": 16, "mode": "copy_input"}, kernel_params=("n", "mode"),
              kernel_module="stages.fake.cpu", kernel_entry="Misbehave", tensors=("oracles.add", "tensors"),
              inputs=("oracles.add", "make_inputs"), oracle=("oracles.add", "reference"), flops=None, seed=3)
    out = _Executor(lab_path).run(job)
    assert out["wrote_inputs"] == {"b": 16}
    # out = 2a is far from a + b
    assert out["metrics"]["out"]["cosine"] < 0.99


def test_inputs_are_compared_bit_for_bit():
    import torch

    from harness.execution.pristine import changed, keep, restore, written

    a = torch.tensor([1.0, -0.0, float("nan"), 2.0])
    b = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    inputs = {"a": a, "b": b}
    kept = keep(inputs)
    assert written(inputs, kept) == {}  # a NaN that stayed is no change
    a[1] = 0.0  # -0.0 -> +0.0: equal as values, not as bits
    a.view(torch.int32)[2] = 0x7FC00001  # another NaN payload
    assert changed(a, kept["a"]) == 2
    b.t()[0, 1] = 99  # through a transposed view
    assert written(inputs, kept) == {"a": 2, "b": 1}
    restore(inputs, kept, ["a", "b"])
    assert written(inputs, kept) == {}
    assert changed(torch.zeros(3), torch.zeros(4)) == 4  # a changed shape: every element
    h = torch.tensor([1.0], dtype=torch.bfloat16)
    assert changed(h, h.clone()) == 0 and changed(torch.tensor(3.0), torch.tensor(3.0)) == 0


# Item 5: verdict modules are in the staleness hash.

import ast  # noqa: E402
import shutil  # noqa: E402

from harness.spec import identity  # noqa: E402
from harness.core.statuses import STATUSES  # noqa: E402

# Calls that compare, judge, or fail a case.
VERDICT_CALLS = {"judge", "violations", "compare", "describe_input_writes"}
# statuses' names that decide
DECIDING_NAMES = {"FAILING", "STATUSES"}
# Matching modules that decide nothing, and why.
NOT_HASHED = {
    "workflows/gate.py": "compares records with baselines afresh at every gate call",
    "notebook/baselines.py": "a compile baseline's {status: compiled} is read by the gate afresh",
    "remote/remote_run.py": "FAILING for its exit code only; the lines it writes are checked by channel and records.validate",
}


def _decides_a_verdict(path: Path) -> list[str]:
    """What in `path` decides a verdict or status."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in VERDICT_CALLS:
                found.add(f"calls {name}()")
            if name == "Record" and any(k.arg == "status" for k in node.keywords):
                found.add("builds a Record with a status")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("statuses"):
            found |= {f"imports {a.name}" for a in node.names if a.name in DECIDING_NAMES}
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if (isinstance(k, ast.Constant) and k.value == "status" and isinstance(v, ast.Constant)
                        and v.value in STATUSES + ("error",)):
                    found.add(f"a reply with status {v.value!r}")
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in node.targets):
                found.add("sets .status")
    return sorted(found)


def test_every_module_that_decides_a_verdict_is_hashed():
    hashed = {p.relative_to(identity.HARNESS_DIR).as_posix() for p in identity.verdict_files()}
    deciding = {}
    for path in sorted(identity.HARNESS_DIR.rglob("*.py")):
        why = _decides_a_verdict(path)
        if why:
            deciding[path.relative_to(identity.HARNESS_DIR).as_posix()] = why
    # the scan finds what it must
    assert {"execution/runner.py", "execution/worker.py", "execution/bench.py", "execution/compilerun.py",
            "execution/metrics.py", "notebook/records.py"} <= set(deciding)
    missing = {m: w for m, w in deciding.items() if m not in hashed and m not in NOT_HASHED}
    assert not missing, f"verdict code outside the staleness hash: {missing}"
    assert {"core/statuses.py", "execution/pristine.py", "remote/channel.py"} <= hashed
    assert set(NOT_HASHED) <= set(deciding), "an exemption for a module that decides nothing: drop it"


def _project_copy(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the lab's harness that identity hashes."""
    from tests.conftest import ROOT

    dest = tmp_path / "proj"
    shutil.copytree(ROOT / "harness", dest / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "HARNESS_DIR", dest / "harness")
    return dest / "harness"


@pytest.mark.parametrize("module, old, new", [
    ("execution/runner.py", 'status, why = judge(s.tolerances_for(task.case.dict), out["metrics"])', 'status, why = "pass", None'),
    ("core/statuses.py", 'FAILING: tuple[str, ...] = ("fail", "compile_error", "crash", "timeout", "hang")',
     'FAILING: tuple[str, ...] = ("crash",)'),
    ("execution/compilerun.py", 'status="compiled" if res.ok else "compile_error"', 'status="compiled"'),
    ("execution/executor.py", "status, why = judge(job.tolerances, chk.metrics)", 'status, why = "pass", None'),
    ("notebook/records.py", "from harness.core.statuses import STATUSES", "STATUSES = ('pass',)"),
])
def test_editing_verdict_code_makes_results_stale(fake_lab, tmp_path, monkeypatch, module, old, new):
    harness = _project_copy(tmp_path, monkeypatch)
    spec = load_spec(root=fake_lab)
    before = identity.source_hash(fake_lab, spec.stages["OK"], "cpu")
    path = harness / module
    text = path.read_text()
    assert old in text, f"{module} no longer has {old!r}: update this test"
    path.write_text(text.replace(old, new))
    assert identity.source_hash(fake_lab, spec.stages["OK"], "cpu") != before


# Item 6: dynamically loaded code is hashed; `check` says so.

DYN_STAGE = """\
  DYN:
    title: a kernel that loads code or data dynamically
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.dyn, entry: Dyn}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: ORACLE
    matrix: {n: [16]}
    tolerances: {out: {cosine_min: 0.9999}}
"""

HEAD = "from pathlib import Path\nimport importlib, runpy, sys\nHERE = Path(__file__).parent\n\n"
KERNEL = HEAD + "class Dyn:\n    def __init__(self, *, n):\n        self.n = n\n\n    def __call__(self, a, b, out):\n{body}"

# form -> (__call__ body, file loaded, its text)
DYNAMIC_FORMS = {
    "import_module": ("        importlib.import_module('stages.fake.helper').add(a, b, out)\n",
                      "stages/fake/helper.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "import_module f-string": ("        k = 'helper'\n        importlib.import_module(f'stages.fake.{k}').add(a, b, out)\n",
                               "stages/fake/helper.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "from importlib import import_module": (
        "        from importlib import import_module\n        import_module('stages.common.helper').add(a, b, out)\n",
        "stages/common/helper.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "__import__": ("        __import__('stages.fake.helper', fromlist=['add']).add(a, b, out)\n",
                   "stages/fake/helper.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "exec": ("        exec((HERE / 'code.txt').read_text(), {'a': a, 'b': b, 'out': out})\n",
             "stages/fake/code.txt", "out.copy_(a + b)\n"),
    "eval": ("        out.copy_(eval('a + b'))\n", "stages/fake/notes.txt", "nothing\n"),
    "runpy": ("        runpy.run_path(str(HERE / 'helper.py'))['add'](a, b, out)\n",
              "stages/fake/helper.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "sys.path": ("        sys.path.insert(0, str(HERE / 'lib'))\n        import helperlib\n        helperlib.add(a, b, out)\n",
                 "stages/fake/lib/helperlib.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "sys.path assigned": ("        sys.path = [str(HERE / 'lib')] + sys.path\n        import helperlib\n        helperlib.add(a, b, out)\n",
                          "stages/fake/lib/helperlib.py", "def add(a, b, out):\n    out.copy_(a + b)\n"),
    "data file opened": ("        scale = float(open(HERE / 'scale.txt').read())\n        out.copy_((a + b) * scale)\n",
                         "stages/fake/scale.txt", "1.0\n"),
    "data file read_text": ("        scale = float((HERE / 'scale.txt').read_text())\n        out.copy_((a + b) * scale)\n",
                            "stages/fake/scale.txt", "1.0\n"),
    "torch.load": ("        import torch\n        out.copy_((a + b) * torch.load(HERE / 'scale.pt'))\n",
                   "stages/fake/scale.pt", "binary\n"),
}


def _dyn_lab(lab: Path, body: str, loaded: str, text: str, oracle: str = "oracles.add:reference") -> None:
    (lab / "stages" / "fake" / "dyn.py").write_text(KERNEL.format(body=body))
    target = lab / loaded
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    (lab / "stages.yaml").write_text((lab / "stages.yaml").read_text() + DYN_STAGE.replace("ORACLE", oracle))


@pytest.mark.parametrize("form", list(DYNAMIC_FORMS))
def test_editing_what_is_loaded_dynamically_makes_results_stale(fake_lab, form):
    body, loaded, text = DYNAMIC_FORMS[form]
    _dyn_lab(fake_lab, body, loaded, text)
    spec = load_spec(root=fake_lab)
    before = identity.source_hash(fake_lab, spec.stages["DYN"], "cpu")
    (fake_lab / loaded).write_text(text + "# and more\n" if loaded.endswith(".py") else text + "2\n")
    if loaded.endswith(".py"):  # comments keep results fresh: change code
        (fake_lab / loaded).write_text(text.replace("a + b", "a - b"))
    assert identity.source_hash(fake_lab, spec.stages["DYN"], "cpu") != before, form
    uses = identity.dynamic_uses(fake_lab, spec.stages["DYN"], "cpu")
    assert uses and all(u.path.name == "dyn.py" for u in uses), uses


def test_an_oracle_that_reads_a_data_file_hashes_the_oracles_folder(fake_lab):
    (fake_lab / "oracles" / "dynoracle.py").write_text(
        "from pathlib import Path\n\n\ndef reference(inputs, case):\n"
        "    scale = float((Path(__file__).parent / 'tables' / 'scale.txt').read_text())\n"
        "    return {'out': (inputs['a'].double() + inputs['b'].double()) * scale}\n")
    _dyn_lab(fake_lab, "        out.copy_(a + b)\n", "oracles/tables/scale.txt", "1.0\n", oracle="oracles.dynoracle:reference")
    spec = load_spec(root=fake_lab)
    before = identity.source_hash(fake_lab, spec.stages["DYN"], "cpu")
    (fake_lab / "oracles" / "tables" / "scale.txt").write_text("2.0\n")
    assert identity.source_hash(fake_lab, spec.stages["DYN"], "cpu") != before


def test_a_stage_with_no_dynamic_code_is_hashed_by_its_imports_only(fake_lab):
    spec = load_spec(root=fake_lab)
    before = identity.source_hash(fake_lab, spec.stages["OK"], "cpu")
    assert identity.dynamic_uses(fake_lab, spec.stages["OK"], "cpu") == []
    (fake_lab / "stages" / "fake" / "unrelated.txt").write_text("x\n")
    assert identity.source_hash(fake_lab, spec.stages["OK"], "cpu") == before


def test_check_warns_of_dynamic_loads_in_one_line_each(fake_lab):
    body, loaded, text = DYNAMIC_FORMS["sys.path"]
    _dyn_lab(fake_lab, body, loaded, text)
    r = run_cli(["check", "stage-DYN"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, r.stderr
    assert warnings[0].startswith("stages/fake/dyn.py:10: warning: sys.path.insert() loads code or data the "
                                  "staleness hash cannot follow — stage-DYN's results are hashed over every file of "
                                  "stages/fake/ instead"), warnings[0]
    assert "stage-DYN ok" in r.stdout
    r = run_cli(["run", "stage-DYN"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dyn.py:10: warning: sys.path.insert()" in r.stderr
