"""`dsv4-lab new stage`: passes check, compiles; bad requests: one line, exit 2, nothing written."""

import shutil
from pathlib import Path

import pytest

from harness.spec.scaffold import ScaffoldError, scaffold_stage
from tests.conftest import ROOT, run_cli

IGNORE = shutil.ignore_patterns(".git", ".cache", ".device", "scratch", "results", "__pycache__", ".run", "*.egg-info")
DECL = ["--axes", "hd=64,128", "--axes", "n=128", "--axes", "m=64", "--axes", "causal=true,false",
        "--in", "Q:m,hd", "--in", "K:n,hd:float32", "--in", "I:n//2:int32",
        "--out", "S:m,n", "--out", "L:m:bfloat16"]


@pytest.fixture
def lab_copy(tmp_path) -> Path:
    lab = tmp_path / "lab"
    shutil.copytree(ROOT, lab, ignore=IGNORE)
    return lab


def _env(lab: Path, tmp: Path) -> dict:
    return {"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(tmp / "cache")}


def _snapshot(lab: Path) -> dict[str, str]:
    return {p.relative_to(lab).as_posix(): p.read_text() for p in sorted(lab.rglob("*.py")) + [lab / "stages.yaml"]}


def test_scaffold_passes_check_and_compiles_for_both_archs(lab_copy, tmp_path):
    before = (lab_copy / "stages.yaml").read_text()
    r = run_cli(["new", "stage", "E9", "--title", "Q·Kᵀ placeholder [m, n]", *DECL], cwd=lab_copy,
                env_extra=_env(lab_copy, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    after = (lab_copy / "stages.yaml").read_text()
    assert after.startswith(before)  # text kept, block appended
    folder = lab_copy / "stages" / "E9_q_k_placeholder"
    for name in ("__init__.py", "sm90.py", "sm100.py"):
        assert (folder / name).is_file()
    assert (lab_copy / "oracles" / "e9.py").is_file()
    kernel = (folder / "sm90.py").read_text()
    assert "def __init__(self, *, hd: int, n: int, m: int, causal: bool):" in kernel
    assert ("def __call__(self, Q: cute.Tensor, K: cute.Tensor, I: cute.Tensor, S: cute.Tensor, L: cute.Tensor, "
            "stream: cuda.CUstream):") in kernel

    r = run_cli(["check"], cwd=lab_copy, env_extra=_env(lab_copy, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: stage-E9 ok (sm_90a, sm_100a)" in r.stdout and "check: stage-D1 ok" in r.stdout

    r = run_cli(["compile", "stage-E9", "--arch", "all", "--hd", "128", "--causal", "true"], cwd=lab_copy,
                env_extra=_env(lab_copy, tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("compiled") >= 2 and "sm_90a" in r.stdout and "sm_100a" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_scaffold_oracle_is_seeded_never_zero_and_mirrors_its_shapes(lab_copy):
    scaffold_stage(lab_copy, "E8", ["n=4", "m=3"], ["X:m,n", "Y:n:uint8"], ["O:n*2,m"])
    import importlib
    import sys

    sys.path.insert(0, str(lab_copy))
    try:
        for name in [m for m in sys.modules if m == "oracles" or m.startswith("oracles.")]:
            sys.modules.pop(name)
        mod = importlib.import_module("oracles.e8")
        case = {"n": 4, "m": 3}
        a, b = mod.make_inputs(case, 7), mod.make_inputs(case, 7)
        assert all((a[k] == b[k]).all() for k in a)  # seeded
        assert all((a[k] != 0).any() and a[k].unique().numel() > 1 for k in a)  # never zeros, never constant
        out = mod.reference(a, case)["O"]
        assert tuple(out.shape) == (8, 3)
        # element i = input's i mod size
        x = a["X"].double()
        colex = x.T.reshape(-1)
        for i in range(24):
            r, c = i % 8, i // 8
            assert out[r, c] == colex[i % 12]
        assert mod.flops(case) == 24.0
    finally:
        sys.path.remove(str(lab_copy))
        for name in [m for m in sys.modules if m == "oracles" or m.startswith("oracles.")]:
            sys.modules.pop(name)


@pytest.mark.parametrize("sid, axes, ins, outs, message", [
    ("A", ["n=128"], ["Q:n"], ["S:n"], "stages.A: stage A exists"),
    ("E7", ["n=128"], ["Q:m,n"], ["S:n"], "--in Q:m,n: dimension 'm' names 'm'"),
    ("E7", ["n=128"], ["Q:n:float64"], ["S:n"], "dtype 'float64'"),
    ("E7", ["n=128"], ["Q:n"], ["S:n:int32"], "an output takes one of float32, bfloat16, float16"),
    ("E7", ["n=128"], ["Q:n"], [], "give at least one --in and one --out"),
    ("E7", ["n=128", "n=256"], ["Q:n"], ["S:n"], "axis 'n' given twice"),
    ("E7", ["n"], ["Q:n"], ["S:n"], "expected NAME=V1,V2"),
    ("E7", ["n=128"], ["Q:n-128"], ["S:n"], "dimension 'n - 128' is 0"),
    ("E7", ["n=128"], ["Q:n**2"], ["S:n"], "only + - * // are allowed"),
    ("E7", ["mode=a,b"], ["Q:mode"], ["S:4"], "(not an int axis)"),
    ("E7", ["n=128"], ["Q:n", "Q:n"], ["S:n"], "tensor 'Q' declared twice"),
    ("E7", ["n=128"], ["self:n"], ["S:n"], "'self' cannot be a tensor name"),
    ("7E", ["n=128"], ["Q:n"], ["S:n"], "stage ids are a letter"),
])
def test_bad_requests_are_refused_and_change_nothing(lab_copy, sid, axes, ins, outs, message):
    before = _snapshot(lab_copy)
    with pytest.raises(ScaffoldError) as err:
        scaffold_stage(lab_copy, sid, axes, ins, outs)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert _snapshot(lab_copy) == before


def test_existing_folder_is_refused(lab_copy):
    (lab_copy / "stages" / "E6_new").mkdir()
    with pytest.raises(ScaffoldError, match=r"stages/E6_new: exists"):
        scaffold_stage(lab_copy, "E6", ["n=128"], ["Q:n"], ["S:n"])
    (lab_copy / "oracles" / "e5.py").write_text("")
    with pytest.raises(ScaffoldError, match=r"oracles/e5.py: exists"):
        scaffold_stage(lab_copy, "E5", ["n=128"], ["Q:n"], ["S:n"])


def test_a_block_that_does_not_load_is_rolled_back(lab_copy):
    spec = lab_copy / "stages.yaml"
    text = spec.read_text().replace("version: 1\n", "") + "\nversion: 1\n"  # stages: no longer last
    spec.write_text(text)
    before = _snapshot(lab_copy)
    with pytest.raises(ScaffoldError, match="stages.yaml left as it was"):
        scaffold_stage(lab_copy, "E4", ["n=128"], ["Q:n"], ["S:n"])
    assert _snapshot(lab_copy) == before
    assert not (lab_copy / "stages" / "E4_new").exists() and not (lab_copy / "oracles" / "e4.py").exists()


def test_cli_refusal_is_one_line_exit_2(lab_copy, tmp_path):
    r = run_cli(["new", "stage", "stage-A", "--axes", "n=128", "--in", "Q:n", "--out", "S:n"], cwd=lab_copy,
                env_extra=_env(lab_copy, tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "stage A exists" in r.stderr
    r = run_cli(["new", "stage", "E3", "--axes", "n=128", "--in", "Q:n"], cwd=lab_copy, env_extra=_env(lab_copy, tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr  # typer's own usage message: --out missing
