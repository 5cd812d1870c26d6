"""`dsv4-lab bench`: validation, plan, row-sampled check, records, the no-GPU answer (never exit 0)."""

import json
from pathlib import Path

import pytest

from harness.execution.bench import (BenchError, BenchJob, check_and_time, is_bench, plan_cases, row_tensors, sample_rows,
                           shape_support)
from harness.execution.bench import _beside
from harness.spec.matrix import FilterError
from harness.notebook.records import Record, validate
from harness.spec.spec import MAX_BENCH_CASES, SpecError, load_spec
from tests.conftest import has_gpu, run_cli

LAB = """\
version: 1
stages:
  OK:
    title: add
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.cpu, entry: Misbehave}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix:
      n: [16, 32]
      mode: [ok, wrong, unwritten]
    kernel_params: [n, mode]
    tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}
    bench:
      matrix:
        n: [4096, 1000]
      row_axis: n
      check_rows: 64
"""


def load(lab: Path, text: str = LAB):
    (lab / "stages.yaml").write_text(text)
    return load_spec(root=lab)


def error(lab: Path, text: str) -> str:
    (lab / "stages.yaml").write_text(text)
    with pytest.raises(SpecError) as exc:
        load_spec(root=lab)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("stages.yaml:"), msg
    return msg


# The bench block.


def test_bench_block_loads(fake_lab):
    st = load(fake_lab).stages["OK"]
    plan = st.bench_plan
    assert plan is not None
    # omitted axes take the matrix's first value
    assert plan.matrix == {"n": [4096, 1000], "mode": ["ok"]}
    assert plan.row_axis == "n" and plan.check_rows == 64 and plan.peers == () and plan.peak == "bf16"
    # default: largest number / first word per axis
    assert st.bench == {"n": 32, "mode": "ok"}


def test_project_bench_blocks(project_root):
    spec = load_spec(root=project_root)
    d1 = spec.stages["D1"].bench_plan
    assert d1 is not None and d1.matrix == {"hd": [128, 256, 512], "n": [4096], "m": [8192]}
    assert d1.problem == "attention" and {"torch_sdpa", "torch_plain", "fa4"} <= set(d1.peers)
    c = spec.stages["C"].bench_plan
    assert c is not None and c.matrix["n"] == [4096, 16384] and c.matrix["m"] == [128]
    # run --bench still names one test case
    assert spec.stages["D1"].bench == {"hd": 512, "n": 1024}
    # D2 beside FlashMLA's dense decode
    d2 = spec.stages["D2"].bench_plan
    assert d2 is not None and d2.open_axes == ("shape",) and d2.problem == "mla_decode" and "flashmla" in d2.peers
    assert d2.matrix == {"shape": ["b64s2h128n1152d512", "b64s2h128n4096d512"], "splits": ["auto"]}
    assert plan_cases(spec.stages["D2"], []) == [{"shape": s, "splits": "auto"} for s in d2.matrix["shape"]]


def test_old_bench_form_still_names_the_run_case(fake_lab):
    st = load(fake_lab, LAB.split("    bench:\n")[0] + "    bench: {n: 16}\n").stages["OK"]
    assert st.bench == {"n": 16} and st.bench_plan is None


@pytest.mark.parametrize("old, new, line, key, says", [  # key: below stages.OK.bench
    ("        n: [4096, 1000]\n", "        hd: [64]\n", 17, "matrix.hd", "not a matrix axis"),
    ("        n: [4096, 1000]\n", "        n: [4096, -8]\n", 17, "matrix.n", "not a size"),
    ("        n: [4096, 1000]\n", "        n: [4096, 4096]\n", 17, "matrix.n", "repeated"),
    ("        n: [4096, 1000]\n", "        n: [4096.5]\n", 17, "matrix.n", "does not fit"),
    ("        n: [4096, 1000]\n", "        n: [4096]\n        mode: [sideways]\n", 18,
     "matrix.mode", "does not fit"),
    ("        n: [4096, 1000]\n", "        n: [4096, 1000]\n        mode: [ok, wrong, unwritten]\n"
     "      case: {n: 16}\n      colour: red\n", 20, "colour", "unknown key"),
    ("      row_axis: n\n", "      row_axis: q\n", 18, "row_axis", "not a matrix axis"),
    ("      row_axis: n\n", "", 18, "check_rows", "no axis to sample rows"),
    ("      check_rows: 64\n", "      check_rows: 0\n", 19, "check_rows", "out of range"),
    ("      check_rows: 64\n", "      check_rows: many\n", 19, "check_rows", "whole number"),
    ("      check_rows: 64\n", "      check_rows: 64\n      peers: [torch_sdpa]\n", 20, "problem",
     "add problem"),
    ("      check_rows: 64\n", "      check_rows: 64\n      problem: attention\n      peers: [nccl]\n", 21,
     "peers", "unknown peer"),
    ("      check_rows: 64\n", "      check_rows: 64\n      problem: attention\n      peers: [fa4, fa4]\n", 21,
     "peers", "repeated"),
    ("      check_rows: 64\n", "      check_rows: 64\n      problem: gemm\n", 20, "problem",
     "unknown problem"),
    ("      check_rows: 64\n", "      check_rows: 64\n      peak: tf32\n", 20, "peak", "unknown peak"),
    ("      check_rows: 64\n", "      check_rows: 64\n      case: {n: 4096}\n", 20, "case.n",
     "not in the matrix"),
])
def test_bad_bench_block_is_one_line(fake_lab, old, new, line, key, says):
    assert LAB.count(old) == 1, old
    msg = error(fake_lab, LAB.replace(old, new))
    assert msg.startswith(f"stages.yaml:{line}: stages.OK.bench.{key}:") and says in msg, msg


def test_bench_matrix_too_big(fake_lab):
    text = LAB.replace("        n: [4096, 1000]\n", "        n: [" + ", ".join(str(100 + i) for i in range(30)) + "]\n"
                       "        mode: [ok, wrong, unwritten]\n      case: {n: 16}\n")
    msg = error(fake_lab, text)
    assert "90 bench shapes" in msg and "stages.OK.bench.matrix" in msg


# The plan.


def test_plan_and_filters(fake_lab):
    st = load(fake_lab).stages["OK"]
    assert plan_cases(st, []) == [{"n": 4096, "mode": "ok"}, {"n": 1000, "mode": "ok"}]
    assert plan_cases(st, [("n", "1000")]) == [{"n": 1000, "mode": "ok"}]
    with pytest.raises(FilterError, match="not in the matrix"):
        plan_cases(st, [("n", "16")])  # a test value, not a bench shape


MORE = LAB.replace("      row_axis: n\n", "      more: [{n: [512], mode: [wrong]}]\n      beside: {mode: ok}\n      row_axis: n\n")


def test_more_matrices_and_beside(fake_lab):
    """`more` appends shapes; `beside` adds any missing twin, same run."""
    st = load(fake_lab, MORE).stages["OK"]
    assert st.bench_plan.more == ({"n": [512], "mode": ["wrong"]},) and st.bench_plan.beside == (("mode", "ok"),)
    assert plan_cases(st, []) == [{"n": 4096, "mode": "ok"}, {"n": 1000, "mode": "ok"}, {"n": 512, "mode": "ok"},
                                  {"n": 512, "mode": "wrong"}]
    assert plan_cases(st, [("mode", "wrong")]) == [{"n": 512, "mode": "ok"}, {"n": 512, "mode": "wrong"}]
    assert plan_cases(st, [("n", "1000")]) == [{"n": 1000, "mode": "ok"}]


@pytest.mark.parametrize("old, new, key, says", [
    ("      beside: {mode: ok}\n", "      beside: {mode: sideways}\n", "stages.OK.bench.beside.mode", "not a bench value"),
    ("      beside: {mode: ok}\n", "      beside: {}\n", "stages.OK.bench.beside", "name an axis"),
    ("      beside: {mode: ok}\n", "      beside: {mode: ok, n: 16}\n", "stages.OK.bench.beside.n", "not a bench value"),
    ("      more: [{n: [512], mode: [wrong]}]\n", "      more: {n: [512]}\n", "stages.OK.bench.more", "a list of matrices"),
    ("      more: [{n: [512], mode: [wrong]}]\n", "      more: [{n: [-5]}]\n", "stages.OK.bench.more[0].n", "not a size"),
    ("      more: [{n: [512], mode: [wrong]}]\n", "      more: [{n: [" + ", ".join(str(100 + i) for i in range(MAX_BENCH_CASES - 1))
     + "]}]\n", "stages.OK.bench.more", f"{MAX_BENCH_CASES + 1} bench shapes in all"),
])
def test_bad_more_or_beside_is_one_line(fake_lab, old, new, key, says):
    assert MORE.count(old) == 1, old
    msg = error(fake_lab, MORE.replace(old, new))
    assert f" {key}:" in msg and says in msg, msg


def test_beside_gives_each_other_shape_its_twins_time():
    seen: dict = {}
    model1, other = {"us": 100.0}, {"us": 112.0}
    _beside((("kv_format", "model1"),), {"b": 2, "kv_format": "model1"}, model1, seen)
    _beside((("kv_format", "model1"),), {"b": 2, "kv_format": "v4.1"}, other, seen)
    assert other == {"us": 112.0, "beside_model1_us": 100.0, "beside_model1_cost": 1.12} and model1 == {"us": 100.0}
    lone = {"us": 50.0}
    _beside((("kv_format", "model1"),), {"b": 64, "kv_format": "v4.1"}, lone, seen)  # no twin timed: nothing added
    assert lone == {"us": 50.0}


def test_beside_with_two_axes_gives_each_shape_the_twin_of_each():
    """Issue 33.3: `beside` gives nvfp4 and fp8_rope rows their bf16 twins' time; twins planned first."""
    pairs = (("kv_format", "model1"), ("epilogue", "bf16"))
    seen: dict = {}
    base, nv, fp8 = {"us": 100.0}, {"us": 80.0}, {"us": 103.0}
    _beside(pairs, {"b": 2, "kv_format": "model1", "epilogue": "bf16"}, base, seen)
    _beside(pairs, {"b": 2, "kv_format": "nvfp4", "epilogue": "bf16"}, nv, seen)
    _beside(pairs, {"b": 2, "kv_format": "model1", "epilogue": "fp8_rope"}, fp8, seen)
    assert nv == {"us": 80.0, "beside_model1_us": 100.0, "beside_model1_cost": 0.8}
    assert fp8 == {"us": 103.0, "beside_bf16_us": 100.0, "beside_bf16_cost": 1.03} and base == {"us": 100.0}

def test_project_e_bench_covers_latency_and_every_format(project_root):
    """Issue 30.1: model1 at b 1 … 256; v4.1 and simple after their twin, no FlashMLA peer."""
    spec = load_spec(root=project_root)
    stage = spec.stages["E"]
    cases = plan_cases(stage, [])  # E's test matrix has more: (topk up to 32768)
    model1 = [c for c in cases if c["kv_format"] == "model1"]
    assert {c["b"] for c in model1} == {1, 2, 4, 8, 16, 32, 64, 74, 128, 148, 256}
    assert {c["config"][:5] for c in model1} == {"s1h64", "s1h12", "s2h64", "s2h12"}
    others = [c for c in cases if c["kv_format"] not in ("model1", "nvfp4")]
    assert {c["b"] for c in others} == {2, 64, 256} and {c["kv_format"] for c in others} == {"v4.1", "simple"}
    for c in others:
        assert cases.index({**c, "kv_format": "model1"}) < cases.index(c)
        assert "reads model1" in shape_support(stage, c, (9, 0))["flashmla_sparse"]
    assert stage.bench_plan.beside == (("kv_format", "model1"), ("epilogue", "bf16"))
    assert shape_support(stage, model1[0], (9, 0))["flashmla_sparse"] is None
    # topk 2048 and 16384 at b 2 and 64
    long = [c for c in model1 if c["config"] in ("s2h128_m2048bs64", "s2h128_m16384bs64")]
    assert {(c["b"], c["config"]) for c in long} == {(b, cfg) for b in (2, 64)
                                                    for cfg in ("s2h128_m2048bs64", "s2h128_m16384bs64")}
    for c in long:
        assert shape_support(stage, c, (9, 0))["flashmla_sparse"] is None, c
    assert len(cases) == 76 <= MAX_BENCH_CASES  # + issue 33.3's 16 rows


def test_project_e_bench_has_issue_33s_rows(project_root):
    """Issue 33.3: nvfp4 and fp8_rope rows after their bf16 twin; which peers time which rows."""
    stage = load_spec(root=project_root).stages["E"]
    cases = plan_cases(stage, [])
    prod = {(b, cfg) for b in (2, 64, 128, 256) for cfg in ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64")}
    nv = [c for c in cases if c["kv_format"] == "nvfp4"]
    fp8 = [c for c in cases if c["epilogue"] == "fp8_rope"]
    assert {(c["b"], c["config"]) for c in nv} == prod == {(c["b"], c["config"]) for c in fp8}
    assert len(nv) == len(fp8) == 8 and all(c["kv_format"] == "model1" for c in fp8)
    assert "e_unfused_fp8" in stage.bench_plan.peers
    for c in nv + fp8:
        twin = {**c, "kv_format": "model1", "epilogue": "bf16"}
        assert cases.index(twin) < cases.index(c)
        sup = shape_support(stage, c, (9, 0))
        if c in nv:
            assert sup["flashmla_sparse"] is None and sup["flashmla_sparse_percall"] is None and sup["torch_sparse"] is None
            assert "fp8_rope" in sup["e_unfused_fp8"]
        else:
            assert sup["e_unfused_fp8"] is None
            for p in ("flashmla_sparse", "flashmla_sparse_percall", "torch_sparse"):
                assert "epilogue fp8_rope" in sup[p], (p, sup[p])
        assert "fp8_rope" in shape_support(stage, twin, (9, 0))["e_unfused_fp8"]


def test_no_bench_block_is_a_usage_error(fake_lab):
    st = load(fake_lab, LAB.split("    bench:\n")[0]).stages["OK"]
    with pytest.raises(BenchError, match="no bench block"):
        plan_cases(st, [])


def test_shape_support_on_the_project(project_root):
    st = load_spec(root=project_root).stages["D1"]
    sup = shape_support(st, {"hd": 512, "n": 4096, "m": 8192}, (9, 0))
    assert sup["torch_sdpa"] is None and sup["torch_plain"] is None
    assert sup["fa4"] and "unsupported" in sup["fa4"] and "512" in sup["fa4"]
    assert shape_support(st, {"hd": 256, "n": 4096, "m": 8192}, (9, 0))["fa4"] is None


# The row-sampled check.


def test_sample_rows():
    rows = sample_rows(8192, 256, seed=3)
    assert len(rows) == 256 == len(set(rows)) and rows == sorted(rows)
    assert rows[0] == 0 and rows[-1] == 8191
    assert rows == sample_rows(8192, 256, seed=3) and rows != sample_rows(8192, 256, seed=4)
    assert sample_rows(10, 64, seed=0) == list(range(10))
    assert sample_rows(10, 1, seed=0) == [0]


def test_row_tensors_for_attention():
    from oracles.attention import softmax_tensors

    case = {"m": 8192, "n": 8192, "hd": 128}  # n == m: rows found by what changes
    assert row_tensors(softmax_tensors(case), softmax_tensors({**case, "m": 256}), "m", 8192, 256) == {"Q", "O", "LSE"}


def test_row_tensors_leave_scratch_alone():
    from oracles.common import TensorSpec

    def specs(m):  # a split-KV scratch buffer: never compared
        return [TensorSpec("Q", (m, 64), "bfloat16"), TensorSpec("O", (m, 64), "bfloat16", "out"),
                TensorSpec("O_part", (4, m * 2), "float32", "scratch")]

    assert row_tensors(specs(512), specs(32), "m", 512, 32) == {"Q", "O"}


def test_row_tensors_refuses_what_is_not_rows():
    from oracles.attention import softmax_tensors

    case = {"m": 128, "n": 4096, "hd": 64}
    with pytest.raises(ValueError, match="not rows along"):
        row_tensors(softmax_tensors(case), softmax_tensors({**case, "hd": 32}), "hd", 64, 32)


def _job(mode: str, n: int = 4096, rows: int = 64, axis: str | None = "n") -> BenchJob:
    from harness.spec.spec import Tolerance

    return BenchJob(stage="OK", arch="cpu", case={"n": n, "mode": mode}, kernel_params=("n", "mode"),
                    kernel_module="stages.fake.cpu", kernel_entry="Misbehave", tensors=("oracles.add", "tensors"),
                    inputs=("oracles.add", "make_inputs"), oracle=("oracles.add", "reference"), flops=None,
                    tolerances={"out": Tolerance(cosine_min=0.9999, rel_l2_max=1e-6)}, seed=7, check_rows=rows,
                    row_axis=axis)


def test_check_passes_a_right_kernel_on_sampled_rows(lab_path):
    out = check_and_time(_job("ok"), lab_path)
    assert out["status"] == "pass", out
    assert out["checked"] == "64 of 4096 rows along n"
    assert "timing" not in out  # no GPU: checked, never timed


def test_check_fails_a_wrong_kernel_before_timing(lab_path):
    out = check_and_time(_job("wrong"), lab_path)
    assert out["status"] == "fail" and "out:" in out["error"] and "timing" not in out


def test_check_fails_unwritten_rows_outside_the_sample(lab_path):
    # first half written; all scanned for poison
    out = check_and_time(_job("unwritten", rows=2), lab_path)
    assert out["status"] == "fail" and "never written" in out["error"], out


def test_check_every_row_without_a_row_axis(lab_path):
    out = check_and_time(_job("ok", n=64, axis=None), lab_path)
    assert out["status"] == "pass" and out["checked"] == "every row"


# Records, dashboard column, command.


def _bench_record(**timing) -> Record:
    return Record(id="r.1", run="r", t="2026-11-22T05:00:00Z", stage="D1", arch="sm_90a",
                  case={"hd": 128, "n": 4096, "m": 8192}, status="pass", note="bench",
                  metrics={"O": {"cosine": 0.99999}}, code={"src": "abc"},
                  timing={"us": 120.5, "tflops": 228.1, "roofline": 0.31, "bound_by": "compute",
                          "peer_torch_sdpa_us": 150.0, "peer_torch_sdpa_ratio": 1.245,
                          "peer_fa4": "not installed (pip install flash-attn-4)", **timing})


def test_bench_record_is_a_valid_record():
    rec = _bench_record()
    d = json.loads(rec.to_json())
    assert validate(d) is None and is_bench(Record.from_dict(d))
    assert not is_bench(Record(id="r.2", run="r", t="t", stage="D1", arch="sm_90a", case={}, status="pass"))


def test_dashboard_roofline_text():
    from harness.workflows.dashboard import roofline_text

    a = _bench_record()
    b = _bench_record(roofline=0.62)
    b.case = {"hd": 256, "n": 4096, "m": 8192}
    assert roofline_text([a], "abc") == "31%"
    assert roofline_text([a, b], "abc") == "31%–62% (2 shapes)"
    assert roofline_text([a], "changed").endswith("stale")
    c = _bench_record(roofline="not calibrated (run dsv4-lab calibrate on this GPU)")
    assert roofline_text([c], "abc") == "not calibrated"
    failed = _bench_record()
    failed.status, failed.timing = "fail", None
    assert roofline_text([failed], "abc") == "—"


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_bench_without_gpu_times_nothing_and_fails(project_root):
    r = run_cli(["bench", "stage-D1", "--peers", "--hd", "512"], cwd=project_root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no GPU here: nothing was timed" in r.stdout
    assert "fa4: unsupported" in r.stdout and "hd=512,n=4096,m=8192" in r.stdout


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_bench_peer_names_the_peers_timed(project_root):
    """--peer NAME times only the named peers; --peers all."""
    r = run_cli(["bench", "stage-D1", "--peer", "torch_plain", "--hd", "512"], cwd=project_root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "peers: torch_plain\n" in r.stdout and "fa4: unsupported" not in r.stdout, r.stdout
    r = run_cli(["bench", "stage-D1", "--peers", "--hd", "512"], cwd=project_root)
    assert "peers: torch_sdpa, torch_plain, fa4\n" in r.stdout, r.stdout


def test_a_stage_with_more_test_matrices_benches_its_bench_shapes(project_root):
    """I1/I2's `more:` test cases never reach plan_cases' callers: bench shapes only."""
    spec = load_spec(root=project_root)
    for sid, n in (("I1", 12), ("I2", 8), ("E", 76)):
        st = spec.stages[sid]
        assert st.cases is not None  # the listed form that hid the bench shapes
        shapes = plan_cases(st, [])
        assert len(shapes) == n and all(c.get("heads", 64) == 64 and c.get("head_dim", 128) == 128
                                        and c.get("logits_dtype", "fp32") == "fp32" for c in shapes), shapes
    if not has_gpu():
        r = run_cli(["bench", "stage-I2", "--peer", "deepgemm"], cwd=project_root)
        assert r.returncode == 1 and "stage-I2 bench: 8 shape(s); peers: deepgemm" in r.stdout, r.stdout + r.stderr


def test_plan_cases_drops_the_stages_test_more_cases(fake_lab):
    """plan_cases refuses a test-only filter value, naming bench shapes only."""
    text = MORE.replace("    kernel_params: [n, mode]\n", "    more: [{n: [64], mode: [ok]}]\n    kernel_params: [n, mode]\n")
    assert text != MORE
    st = load(fake_lab, text).stages["OK"]
    assert st.cases is not None and ("n", 64) in {p for c in st.cases for p in c}  # the listed form
    assert plan_cases(st, []) == [{"n": 4096, "mode": "ok"}, {"n": 1000, "mode": "ok"}, {"n": 512, "mode": "ok"},
                                  {"n": 512, "mode": "wrong"}]
    assert plan_cases(st, [("n", "1000")]) == [{"n": 1000, "mode": "ok"}]
    with pytest.raises(FilterError, match="not in the matrix"):
        plan_cases(st, [("n", "64")])  # a test-only value, not a bench shape
    with pytest.raises(BenchError) as exc:
        plan_cases(st, [("n", "4096"), ("mode", "wrong")])  # each a bench value, no bench shape both
    msg = str(exc.value)
    assert "bench shapes: " in msg and "4096" in msg and "64" not in msg.replace("4096", ""), msg


def test_chosen_peers_keeps_the_blocks_order():
    from types import SimpleNamespace

    from harness.execution.bench import chosen_peers

    plan = SimpleNamespace(peers=("flashmla_sparse", "flashmla_sparse_percall", "torch_sparse"))
    assert chosen_peers(plan, True) == plan.peers and chosen_peers(plan, False) == ()
    assert chosen_peers(plan, ("torch_sparse", "flashmla_sparse")) == ("flashmla_sparse", "torch_sparse")


def test_bench_usage_errors_are_one_line(project_root):
    r = run_cli(["bench", "stage-B"], cwd=project_root)
    assert r.returncode == 2 and "no bench block" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run_cli(["bench", "stage-D1", "--hd", "64"], cwd=project_root)
    assert r.returncode == 2 and "hd=64 is not in the matrix" in r.stderr, r.stderr
    r = run_cli(["bench", "stage-D1", "--peer", "flashmla", "--hd", "512"], cwd=project_root)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--peer flashmla: not a peer of stage-D1's bench block" in r.stderr, r.stderr
    r = run_cli(["bench", "stage-D1", "--peer", "fa4", "--compare", "HEAD"], cwd=project_root)
    assert r.returncode == 2 and "give one" in r.stderr, r.stderr


@pytest.mark.gpu
def test_bench_times_d1_on_a_gpu(project_root, tmp_path):
    """On a GPU: one D1 bench shape checked, timed and recorded with peers."""
    import shutil

    from harness.notebook.records import read_records

    lab = tmp_path / "lab"  # a copy: records never land in the lab
    shutil.copytree(project_root, lab, ignore=shutil.ignore_patterns(".git", ".cache", ".device", ".peers", "results",
                                                                     "__pycache__"))
    r = run_cli(["bench", "stage-D1", "--hd", "128", "--peers", "--reps", "5"], cwd=lab, timeout=900,
                env_extra={"DSV4_LAB_ROOT": str(lab)})
    assert r.returncode == 0, r.stdout + r.stderr
    recs = [x for x in read_records(lab, ["D1"], bench=True) if is_bench(x) and x.case.get("hd") == 128]
    t = recs[-1].timing or {}
    assert recs[-1].status == "pass" and t["us"] > 0 and t["tflops"] > 0
    assert t["peer_torch_sdpa_us"] > 0 and t["peer_torch_sdpa_ratio"] > 0 and "gpu_name" in t


def test_open_axes_take_new_words_and_tensors_judge_them(lab_path):
    fake_lab = lab_path
    """A word axis listed in open_axes takes bench words the test matrix lacks (shape names); the
    stage's tensors() judge them when bench plans (one line naming the line, the shape and the
    refusal); an axis not listed still refuses a new word."""
    text = LAB.replace("        n: [4096, 1000]\n", "        n: [4096]\n        mode: [ok, sideways]\n") \
              .replace("      row_axis: n\n", "      open_axes: [mode]\n      row_axis: n\n")
    st = load(fake_lab, text).stages["OK"]
    assert st.bench_plan.open_axes == ("mode",)
    oracle = fake_lab / "oracles" / "add.py"
    oracle.write_text(oracle.read_text().replace("def tensors(case", "def _tensors(case") + """

def tensors(case):
    if case["mode"] not in ("ok", "wrong", "unwritten"):
        raise ValueError(f"unknown mode {case['mode']!r}")
    return _tensors(case)
""")
    assert plan_cases(st, [("mode", "ok")]) == [{"n": 4096, "mode": "ok"}]
    with pytest.raises(BenchError) as exc:
        plan_cases(st, [])
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("stages.yaml:16: stage-OK bench shape n=4096,mode=sideways:") and "unknown mode 'sideways'" in msg, msg
    msg = error(fake_lab, text.replace("      open_axes: [mode]\n", "      open_axes: [n]\n"))
    assert "stages.OK.bench.open_axes" in msg and "not a word axis" in msg and "word axes: mode" in msg
    msg = error(fake_lab, text.replace("      open_axes: [mode]\n", ""))
    assert "stages.OK.bench.matrix.mode" in msg and "does not fit" in msg and "open_axes" in msg
