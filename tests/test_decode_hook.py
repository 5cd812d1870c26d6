"""A stage's `decode`: decode(outputs, case) is what is compared, in a run and in `check`.
Fake lab: the kernel writes 2·(a + b) into `raw`; decode halves it."""

from __future__ import annotations

from harness.notebook.records import read_records
from tests.conftest import commit_all, run_cli

STAGE = """
  DEC:
    title: out = a + b, written doubled into raw
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.dec, entry: Doubled}}
    tensors: oracles.dec:tensors
    inputs: oracles.dec:make_inputs
    oracle: oracles.dec:reference
    decode: oracles.dec:DECODE
    matrix: {n: [16], mode: [ok, wrong]}
    kernel_params: [n, mode]
    tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}
    timeout_s: 20
"""

ORACLE = '''
from oracles.add import make_inputs, reference  # noqa: F401  (the fake lab's a + b)
from oracles.common import TensorSpec


def tensors(case):
    n = case["n"]
    return [TensorSpec("a", (n,), "float32"), TensorSpec("b", (n,), "float32"), TensorSpec("raw", (n,), "float32", "out")]


def decode(outputs, case):
    return {"out": outputs["raw"] / 2}


def misnamed(outputs, case):
    return {"sum": outputs["raw"] / 2}
'''

KERNEL = '''
class Doubled:
    def __init__(self, *, n: int, mode: str):
        self.mode = mode

    def __call__(self, a, b, raw):
        raw.copy_(2 * (a + b) if self.mode == "ok" else a + b)
'''


def _dec_lab(lab, decode: str = "decode"):
    (lab / "stages.yaml").write_text((lab / "stages.yaml").read_text() + STAGE.replace("DECODE", decode))
    (lab / "oracles" / "dec.py").write_text(ORACLE)
    (lab / "stages" / "fake" / "dec.py").write_text(KERNEL)
    commit_all(lab, "dec")


def test_a_run_compares_what_decode_makes_of_the_outputs(fake_lab):
    _dec_lab(fake_lab)
    r = run_cli(["run", "stage-DEC"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr  # the wrong mode fails
    by_mode = {rec.case["mode"]: rec for rec in read_records(fake_lab, ["DEC"])}
    assert by_mode["ok"].status == "pass", by_mode["ok"].error
    assert set(by_mode["ok"].metrics) == {"out"} and by_mode["ok"].metrics["out"]["rel_l2"] < 1e-6
    assert by_mode["wrong"].status == "fail" and by_mode["wrong"].metrics["out"]["rel_l2"] > 0.4


def test_check_takes_the_decoded_outputs(fake_lab):
    _dec_lab(fake_lab)
    r = run_cli(["check", "DEC"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_refuses_a_decode_that_names_other_outputs(fake_lab):
    _dec_lab(fake_lab, "misnamed")
    r = run_cli(["check", "DEC"], cwd=fake_lab)
    assert r.returncode != 0
    line = next(x for x in (r.stdout + r.stderr).splitlines() if "misnamed" in x)
    assert "oracles/dec.py:" in line and "returned out" in line and "makes sum" in line, r.stdout + r.stderr
