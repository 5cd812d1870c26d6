"""Compile checks with no GPU: each stage's kernels build for both archs through the lab's own
compile path, with the expected tensor-core instructions in the PTX; the cache is reused."""

from __future__ import annotations

import pytest

from harness.compile import Compiler
from harness.spec import load_spec
from tests.conftest import ROOT

EXPECTED = {
    "sm_90a": {"wgmma": 1, "cp.async.bulk.tensor": 1},
    "sm_100a": {"tcgen05.mma": 1, "tcgen05.ld": 1, "cp.async.bulk.tensor": 1},
}
# stage -> (cases to compile, extra instructions per arch)
CASES = {
    "A": ([{"hd": 64, "n": 128, "m": 128}, {"hd": 512, "n": 256, "m": 128}], {}),
    "B": ([{"hd": 64, "n": 256, "v_is_k": True, "m": 128}], {"sm_100a": {"tcgen05.st": 1}}),
    "C": ([{"hd": 64, "n": 1024, "scores": "normal", "m": 128}], {"sm_100a": {"tcgen05.st": 1}}),
    "D1": ([{"hd": 64, "n": 128, "m": 128}, {"hd": 512, "n": 1024, "m": 128}], {"sm_90a": {"stmatrix": 1}}),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile every listed case once (both archs, in parallel) into a throwaway cache."""
    import os

    os.environ["DSV4_LAB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    spec = load_spec(root=ROOT)
    compiler = Compiler(spec.root)
    futs = {}
    for sid, (cases, _) in CASES.items():
        st = spec.stages[sid]
        for arch in st.kernels:
            for case in cases:
                futs[(sid, arch, tuple(case.items()))] = compiler.submit(st, arch, case)
    results = {k: f.result() for k, f in futs.items()}
    compiler.close()
    yield spec, results
    del os.environ["DSV4_LAB_CACHE"]


def test_every_kernel_compiles_with_its_tensor_core_instructions(compiled):
    spec, results = compiled
    for (sid, arch, case), res in results.items():
        assert res.ok, f"{sid} {arch} {dict(case)}: {res.error}"
        want = {**EXPECTED[arch], **CASES[sid][1].get(arch, {})}
        for instr, at_least in want.items():
            assert res.inventory.get(instr, 0) >= at_least, f"{sid} {arch} {dict(case)}: no {instr} in the PTX"
        other = "tcgen05.mma" if arch == "sm_90a" else "wgmma"
        assert res.inventory.get(other, 0) == 0


def test_resources_are_reported_and_hd512_does_not_spill(compiled):
    import shutil

    if not shutil.which("ptxas"):
        pytest.skip("ptxas is not installed: no resource report")
    spec, results = compiled
    for (sid, arch, case), res in results.items():
        assert res.resources.get("regs", 0) > 0 and "spill" in res.resources
        assert res.resources.get("smem", 0) > 0, f"{sid} {arch}: the kernel declares no shared memory"
    d1 = results[("D1", "sm_90a", tuple({"hd": 512, "n": 1024, "m": 128}.items()))]
    assert d1.resources["spill"] == 0


def test_second_compile_is_a_cache_hit(compiled):
    spec, results = compiled
    compiler = Compiler(spec.root)
    res = compiler.submit(spec.stages["A"], "sm_90a", {"hd": 64, "n": 128, "m": 128}).result()
    compiler.close()
    assert res.cached and res.ok


def test_compile_error_is_a_result_with_the_compilers_message(fake_lab, tmp_path):
    """A kernel that fails to build gives compile_error with the message, and the run goes on."""
    from tests.conftest import run_cli

    (fake_lab / "stages" / "fake" / "sm90.py").write_text(
        "class Kernel:\n    def __init__(self, *, n):\n        raise ValueError('n must be a multiple of 64')\n")
    text = (fake_lab / "stages.yaml").read_text().replace(
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}}",
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}, sm90: {module: stages.fake.sm90}}", 1)
    (fake_lab / "stages.yaml").write_text(text)
    r = run_cli(["compile", "stage-OK", "--arch", "sm_90a"], cwd=fake_lab)
    assert r.returncode == 1 and "n must be a multiple of 64" in r.stdout
    r = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 1 and "2 compile_error · 2 pass" in r.stdout


def test_tmem_budget_refuses_an_impossible_configuration():
    """Stage D1 on sm_100a: S and O share TMEM's 512 columns; O over 512 columns in one CTA
    cannot fit beside S and is refused with a clear error, before any compiling."""
    from stages.D1_headdim.sm100 import Kernel, tmem_budget

    with pytest.raises(ValueError, match=r"TMEM budget: S 64 \+ O 512 = 576 columns > 512"):
        Kernel(m=128, n=128, hd=512, hd_per_cta=512)
    ok = tmem_budget(512, 64)
    assert ok["total"] == ok["S"] + ok["O"] <= ok["limit"] == 512 and ok["ctas"] == 2
    Kernel(m=128, n=128, hd=512)  # the default split fits
