"""The executor behind run/bench: one timing format (old `peer_us` read), one job mapping."""

import pytest

from harness.execution import executor as ex
from harness.notebook.records import Record, peer_times, run_peer_us


def _run_job(mode: str = "ok", **kw) -> ex.Job:
    return ex.Job(stage="OK", arch="cpu", case={"n": 64, "mode": mode}, kernel_params=("n", "mode"),
                  kernel_module="stages.fake.cpu", kernel_entry="Misbehave", tensors=("oracles.add", "tensors"),
                  inputs=("oracles.add", "make_inputs"), oracle=("oracles.add", "reference"), flops=None, seed=3,
                  **kw)


def _bench_job(mode: str = "ok") -> ex.BenchJob:
    from harness.spec.spec import Tolerance

    return ex.BenchJob(stage="OK", arch="cpu", case={"n": 64, "mode": mode}, kernel_params=("n", "mode"),
                       kernel_module="stages.fake.cpu", kernel_entry="Misbehave", tensors=("oracles.add", "tensors"),
                       inputs=("oracles.add", "make_inputs"), oracle=("oracles.add", "reference"), flops=None,
                       seed=3, tolerances={"out": Tolerance(cosine_min=0.9999)}, row_axis=None)


def _fake_bench(calls: list):
    """timing.bench without a GPU: each launch once, fixed times."""
    def bench(launches, reps=30, warmup=3, min_launches=1):
        for f in launches:
            f()
        calls.append(len(launches))
        us = 2.0 if len(calls) == 1 else 5.0
        return {"us": us, "spread": 0.01, "p10_us": us, "p90_us": us, "reps": reps, "rot": len(launches),
                "launches": len(launches), "method": "events"}
    return bench


def test_run_bench_times_its_peer_in_the_flat_peer_keys(lab_path, monkeypatch):
    # `run --bench` writes what `bench` writes
    import harness.execution.timing

    calls: list = []
    monkeypatch.setattr(harness.execution.timing, "bench", _fake_bench(calls))
    job = _run_job(peer=("oracles.add", "reference"), bench=True)
    executor = ex.CaseExecutor(lab_path)
    t = executor._time_case(job, executor.launch(job))
    assert "peer_us" not in t
    assert t["us"] == 2.0 and t["peer_reference_us"] == 5.0 and t["peer_reference_ratio"] == 2.5
    assert t["peer_reference_spread"] == 0.01
    assert peer_times(t) == {"reference": 5.0}


def test_old_and_new_peer_keys_read_alike():
    old = Record(id="r.1", run="r", t="t", stage="A", arch="sm_90a", case={}, status="pass",
                 timing={"us": 2.0, "peer_us": 3.0})
    new = Record(id="r.2", run="r", t="t", stage="A", arch="sm_90a", case={}, status="pass",
                 timing={"us": 2.0, "peer_torch_attention_us": 3.0, "peer_torch_attention_ratio": 1.5})
    bench = Record(id="r.3", run="r", t="t", stage="A", arch="sm_90a", case={}, status="pass", note="bench",
                   timing={"us": 2.0, "peer_torch_sdpa_us": 3.0, "peer_fa4": "not installed"})
    assert run_peer_us(old) == run_peer_us(new) == 3.0
    assert run_peer_us(bench) is None and peer_times(bench.timing) == {"torch_sdpa": 3.0}
    from harness.notebook.recordview import case_line

    assert "(torch 3.00 µs)" in case_line(old) and "(torch 3.00 µs)" in case_line(new)
    assert "torch 3.00" not in case_line(bench)


def test_one_stage_to_job_mapping(project_root):
    from harness.execution.bench import _job
    from harness.spec.spec import load_spec

    spec = load_spec(root=project_root)
    st = next(s for s in spec.stages.values() if s.bench_plan is not None and "sm_90a" in s.kernels)
    case = {a: v[0] for a, v in st.matrix.items()}
    run = ex.job_for(st, "sm_90a", case, 0, ex.Job)
    bench = _job(st, "sm_90a", case, False, 30, 0)
    kernel = [f for f in ex.KernelJob.__dataclass_fields__ if f not in ("object_path", "prefix")]
    assert {f: getattr(run, f) for f in kernel} == {f: getattr(bench, f) for f in kernel}
    assert bench.tolerances == st.tolerances_for(case) and bench.check_rows == st.bench_plan.check_rows
    i1 = spec.stages["I1"]  # bench shapes judged by their case's bounds
    shape = {**{a: v[0] for a, v in i1.bench_plan.matrix.items()}, "logits_dtype": "bf16"}
    assert _job(i1, "sm_90a", shape, False, 30, 0).tolerances["logits"].rel_l2_max == 2.0e-3
    assert _job(i1, "sm_90a", {**shape, "logits_dtype": "fp32"}, False, 30, 0).tolerances["logits"].rel_l2_max == 1.0e-3


def test_bench_shape_runs_in_the_supervised_worker(lab_path):
    from harness.execution.bench import run_job

    out = run_job(lab_path, _bench_job("ok"), 120)
    assert out["status"] == "pass" and out["checked"] == "every row", out
    hung = run_job(lab_path, _bench_job("hang"), 3)
    assert hung["status"] == "timeout" and "bench process killed" in hung["error"]
    died = run_job(lab_path, _bench_job("abort"), 120)
    assert died["status"] == "crash" and "SIGABRT" in died["error"], died  # the worker's classifier names the signal
    raised = run_job(lab_path, _bench_job("raise"), 120)
    assert raised["status"] == "error" and "kernel raised on purpose" in raised["error"]
    assert "cpu.py" in raised["error"]  # the user's file:line, as for a test case


@pytest.mark.gpu
def test_run_bench_on_a_gpu_records_the_flat_peer_keys(project_root, tmp_path):
    """On a GPU: `run --bench` records `peer_torch_attention_us` / `_ratio`, never `peer_us`."""
    import shutil

    from harness.notebook.records import read_records
    from tests.conftest import run_cli

    lab = tmp_path / "lab"  # a copy: records never land in the lab
    shutil.copytree(project_root, lab, ignore=shutil.ignore_patterns(".git", ".cache", ".device", ".peers", "results",
                                                                     "__pycache__"))
    r = run_cli(["run", "stage-D1", "--hd", "512", "--n", "1024", "--arch", "sm_90a", "--bench"], cwd=lab,
                timeout=900, env_extra={"DSV4_LAB_ROOT": str(lab)})
    assert r.returncode == 0, r.stdout + r.stderr
    timed = [x for x in read_records(lab, ["D1"]) if x.timing]
    assert timed, r.stdout
    t = timed[-1].timing
    assert "peer_us" not in t and t["peer_torch_attention_us"] > 0 and t["peer_torch_attention_ratio"] > 0
    assert run_peer_us(timed[-1]) == t["peer_torch_attention_us"]
