"""Adversarial inputs that once printed a traceback or exited 0 on nothing."""

import pytest

from tests.conftest import run_cli

_CALL = "    def __call__(self, a, b, out):\n        out.copy_(a + b)\n"


def _kernel(lab, body: str) -> None:
    p = lab / "stages" / "fake" / "cpu.py"
    text = p.read_text()
    assert _CALL in text
    p.write_text(text.replace(_CALL, "    def __call__(self, a, b, out):\n" + body, 1))


@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "SystemExit(0)"])
def test_a_kernel_raising_a_base_exception_is_one_line_error_not_a_traceback(fake_lab, raised):
    """A kernel raising KeyboardInterrupt: the case's error at the kernel's file:line."""
    _kernel(fake_lab, f"        raise {raised}\n")
    r = run_cli(["run", "stage-OK", "--n", "16"], cwd=fake_lab)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "Traceback" not in text, text
    assert f"stages/fake/cpu.py:12: in __call__: {raised.split('(')[0]}" in text, text


def test_an_oracle_that_fails_before_any_user_line_still_names_a_file_and_line(fake_lab):
    """A class as oracle: the error names where the called object is defined."""
    y = fake_lab / "stages.yaml"
    y.write_text(y.read_text().replace("oracle: oracles.add:reference", "oracle: oracles.add:TensorSpec", 1))
    r = run_cli(["check", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    line = [ln for ln in r.stderr.splitlines() if "TypeError" in ln]
    assert line and line[0].startswith("oracles/common.py:"), r.stderr
    assert "in TensorSpec: TypeError" in line[0], r.stderr
