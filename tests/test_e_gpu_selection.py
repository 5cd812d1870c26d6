"""On the CPU: every GPU test of tests/test_e_gpu.py selects the cases it counts on.

Those tests assert how many matrix cases they pick before they run them; a new axis value in
stages.yaml (nvfp4, fp8_rope) changed the counts and only a GPU session found out.  Here each test
runs with the GPU part (`_run_cases`) replaced by a recorder, so a stale count fails on CI."""

import inspect

import pytest

import tests.test_e_gpu as gpu_tests
from stages.common.device import ENV

NAMES = sorted(n for n in dir(gpu_tests) if n.startswith("test_") and "flashmla" not in n)


@pytest.mark.parametrize("name", NAMES)
def test_the_gpu_test_selects_its_cases(name, project_root, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "132")  # an H100 / H200's SM count, as the GPU session sees
    calls = []
    monkeypatch.setattr(gpu_tests, "_run_cases", lambda spec, stage, cases, tmp, label, want:
                        calls.append((label, want, len(cases))))
    test = getattr(gpu_tests, name)
    given = {"project_root": project_root, "tmp_path": tmp_path, "monkeypatch": monkeypatch}
    test(**{p: given[p] for p in inspect.signature(test).parameters})
    assert calls and all(n > 0 for _, _, n in calls), calls


def test_every_planted_bug_test_is_covered():
    assert len(NAMES) >= 15 and "test_lab_catches_an_inverse_rotation_with_the_wrong_sign" in NAMES
