"""On an H100/H200: every sm100 kernel's host path runs to the launch, recorded `prepared`."""

import pytest

from harness.core.environment import gpu_capabilities
from harness.spec.matrix import expand
from harness.execution.runner import RunOptions, Runner, Task
from harness.spec.spec import load_spec

pytestmark = pytest.mark.gpu

# One case per sm100 kernel.
WANT = {
    "E": [{"config": "s2h64_m128bs256_x512bs64", "scenario": "invalid", "splits": 1, "kv_format": f}
          for f in ("simple", "model1", "v4.1")] + [{"config": "s2h128_m128bs256_x1024bs64", "kv_format": "model1",
                                                     "scenario": "sink", "splits": "auto"}],
    "D2": [{"shape": "b1s2h128n1152d512", "splits": 1}],
    "D5": [{"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": "0", "splits": "many"}],
    "I1": [{"s": 128, "s_kv": 1024, "ranges": "cp"}],
}


def _cases(stage):
    picks = WANT.get(stage.id)
    cases = expand(stage)
    if picks is None:
        return cases[:1]
    return [c for c in cases if any(all(str(c.dict[k]) == str(v) for k, v in p.items()) for p in picks)][:len(picks)]


def test_every_sm100_kernel_is_prepared_up_to_the_launch(project_root, tmp_path):
    if any(a == "sm_100a" for _, a in gpu_capabilities().values()):
        pytest.skip("an sm_100 GPU is here: its cases run for real (dsv4-lab run … --arch sm_100a)")
    spec = load_spec(root=project_root)
    tasks = [Task(st, "sm_100a", c) for st in spec.stages.values() if "sm_100a" in st.kernels and st.suite is None
             for c in _cases(st)]  # suites run their stage's kernels
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["pytest"], prepare=True), results_root=tmp_path).run()
    assert len(summary.records) == len(tasks)
    for rec in summary.records:
        print(rec.stage, rec.case, rec.status, rec.note or rec.error)
    for rec in summary.records:
        assert rec.status == "prepared", (rec.stage, rec.case, rec.status, rec.error)
        assert rec.note.startswith("prepared, not run: host path up to the launch on ") and "not launched" in rec.note
    assert summary.exit_code == 0 and not any(r.status == "pass" for r in summary.records)
