"""`run --first-light`: plan order, stops at the first failure, never green off sm_100."""

import dataclasses

import pytest

from harness.workflows import first_light as fl
from harness.spec.spec import load_spec
from tests.conftest import ROOT, run_cli

ISSUE_ORDER = [
    ("D2", "shape=b1s2h128n1152d512,splits=1"),
    ("E", "b=2,config=s2h64_m128bs256_x512bs64,kv_format=v4.1,scenario=invalid,splits=1,epilogue=bf16"),
    ("E", "b=2,config=s2h64_m128bs256_x512bs64,kv_format=model1,scenario=invalid,splits=1,epilogue=bf16"),
    ("D5", "shape=b4s2h128m128n256d512,branches=k+k,sink=0,splits=many"),
    ("I1", "s=128,s_kv=1024,ranges=cp,heads=64,head_dim=128,logits_dtype=fp32,compressed=false"),
]


def test_plan_is_the_issue_order_of_real_matrix_cases():
    spec = load_spec(root=ROOT)
    steps = fl.plan_cases(spec)
    main = [(st.id, c.label) for s, st, c in steps if s in fl.PLAN]
    assert main == ISSUE_ORDER
    follow = [(st.id, c.label) for s, st, c in steps if s is fl.PLAN[0].if_hang]
    assert follow == [("D2", "shape=b4s2h128n256d64,splits=1")]
    assert all(fl.step_argv(st, c)[-1] == "--debug-hangs" and fl.step_argv(st, c)[3] == "sm_100a"
               for _, st, c in steps)


def test_a_plan_label_the_matrix_lost_is_refused_by_name():
    spec = load_spec(root=ROOT)
    d2 = spec.stages["D2"]
    spec.stages["D2"] = dataclasses.replace(d2, matrix={**d2.matrix, "shape": [s for s in d2.matrix["shape"]
                                                                               if s != "b1s2h128n1152d512"]})
    with pytest.raises(ValueError, match=r"stage-D2 has no case shape=b1s2h128n1152d512,splits=1"):
        fl.plan_cases(spec)


def _script(monkeypatch, statuses):
    """Run the plan, step statuses from `statuses`."""
    ran, lines = [], []
    it = iter(statuses)
    monkeypatch.setattr(fl, "newest_status", lambda root, stage, case, since: (next(it), "run.1", "why"))
    code = fl.run_plan(load_spec(root=ROOT), lambda st, c, argv: ran.append((st.id, c.label)) or 0,
                       say=lines.append)
    return code, ran, "\n".join(lines)


def test_the_plan_stops_at_the_first_failure_and_says_what_next(monkeypatch):
    code, ran, text = _script(monkeypatch, ["pass", "fail"])
    assert code == 1 and ran == ISSUE_ORDER[:2]
    assert "next: it ran and missed its tolerance" in text and "stopped at step 2 of 5" in text


def test_a_hang_of_the_first_step_runs_its_follow_up_then_stops(monkeypatch):
    code, ran, text = _script(monkeypatch, ["hang", "pass"])
    assert code == 1 and ran == [ISSUE_ORDER[0], ("D2", "shape=b4s2h128n256d64,splits=1")]
    assert "localising" in text and "next: the record's error names the role, pipeline" in text


@pytest.mark.parametrize("status", ["compiled", "prepared", "missing", "timeout", "crash"])
def test_a_step_that_did_not_pass_on_sm100_is_never_green(monkeypatch, status):
    code, ran, text = _script(monkeypatch, [status])
    assert code == 1 and len(ran) == 1 and "next:" in text


def test_all_steps_passing_is_the_only_green(monkeypatch):
    code, ran, text = _script(monkeypatch, ["pass"] * 5)
    assert code == 0 and ran == ISSUE_ORDER and "all 5 steps passed" in text


def test_first_light_here_says_there_is_no_sm100_device_and_exits_non_zero(tmp_path):
    r = run_cli(["run", "--first-light"], cwd=tmp_path, env_extra={"DSV4_LAB_ROOT": str(ROOT),
                                                                   "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "--first-light needs an sm_100 (B200) GPU" in r.stderr and "nothing was run" in r.stderr
    assert "pass" not in r.stdout


def test_first_light_takes_no_stage_or_filters(tmp_path):
    r = run_cli(["run", "D2", "--first-light"], cwd=tmp_path, env_extra={"DSV4_LAB_ROOT": str(ROOT)})
    assert r.returncode == 2 and "--first-light runs its own plan" in r.stderr, (r.stdout, r.stderr)
