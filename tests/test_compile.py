"""Compile checks with no GPU: every stage builds for both archs with its MMAs; cache, records, --diff."""

import os
import subprocess
import sys

import pytest

from harness.execution.compile import Compiler
from harness.notebook.inventory import families, mma_counts, ptx_inventory, ptx_key, sass_inventory
from harness.spec.spec import load_spec
from tests.conftest import ROOT, commit_all, run_cli

EXPECTED = {
    "sm_90a": {"wgmma": 1, "cp.async.bulk.tensor": 1},
    "sm_100a": {"tcgen05.mma": 1, "tcgen05.ld": 1, "cp.async.bulk.tensor": 1},
}
# stage -> (cases, extra instructions per arch)
CASES = {
    "A": ([{"hd": 64, "n": 128, "m": 128}, {"hd": 512, "n": 256, "m": 128}], {}),
    "B": ([{"hd": 64, "n": 256, "v_is_k": True, "m": 128}], {"sm_100a": {"tcgen05.st": 1}}),
    "C": ([{"hd": 64, "n": 1024, "scores": "normal", "m": 128}], {"sm_100a": {"tcgen05.st": 1}}),
    "D1": ([{"hd": 64, "n": 128, "m": 128}, {"hd": 512, "n": 1024, "m": 128}], {"sm_90a": {"stmatrix": 1}}),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile every listed case once (both archs) into a throwaway cache."""
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
        fam = families(res.inventory)
        for instr, at_least in want.items():
            assert fam.get(instr, 0) >= at_least, f"{sid} {arch} {dict(case)}: no {instr} in the PTX"
        other = "tcgen05.mma" if arch == "sm_90a" else "wgmma"
        assert fam.get(other, 0) == 0
        summary = res.summary()  # for compile-only baselines
        assert summary["inv"] == res.inventory and mma_counts(summary["inv"])
        if arch == "sm_100a":
            assert any(k.startswith("tcgen05.mma.cta_group::") and ".kind::" in k for k in summary["inv"])


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
    assert all(res.resources.get("barriers", 0) >= 1 for res in results.values())  # ptxas: "used N barriers"


def test_sass_is_kept_and_counted_when_the_tools_are_installed(compiled):
    from harness.notebook.inventory import sass_tool

    if sass_tool() is None:
        pytest.skip("cuobjdump / nvdisasm not installed (pip install '.[sass]')")
    spec, results = compiled
    for (sid, arch, case), res in results.items():
        assert res.sass_path and res.sass.get("(all)", 0) > 0, f"{sid} {arch}: no SASS"
        mma = mma_counts(res.sass)
        assert mma and all(k.startswith("HGMMA" if arch == "sm_90a" else "UTC") for k in mma), (sid, arch, mma)
        assert res.summary()["sass"] == res.sass


def test_second_compile_is_a_cache_hit(compiled):
    spec, results = compiled
    compiler = Compiler(spec.root)
    res = compiler.submit(spec.stages["A"], "sm_90a", {"hd": 64, "n": 128, "m": 128}).result()
    compiler.close()
    assert res.cached and res.ok


def test_compile_error_is_a_result_with_the_compilers_message(fake_lab, tmp_path):
    """A kernel that fails to build gives compile_error with the message; the run goes on."""
    from tests.conftest import run_cli

    (fake_lab / "stages" / "fake" / "sm90.py").write_text(
        "class Kernel:\n    def __init__(self, *, n):\n        raise ValueError('n must be a multiple of 64')\n\n"
        "    def __call__(self, a, b, out, stream):\n        pass\n")
    text = (fake_lab / "stages.yaml").read_text().replace(
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}}",
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}, sm90: {module: stages.fake.sm90}}", 1)
    (fake_lab / "stages.yaml").write_text(text)
    r = run_cli(["compile", "stage-OK", "--arch", "sm_90a"], cwd=fake_lab)
    assert r.returncode == 1 and "n must be a multiple of 64" in r.stdout
    r = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 1 and "2 compile_error · 2 pass" in r.stdout


def test_tmem_budget_refuses_an_impossible_configuration():
    """D1 on sm_100a: O over 512 TMEM columns is refused before compiling."""
    from stages.D1_headdim.sm100 import Kernel, tmem_budget

    with pytest.raises(ValueError, match=r"TMEM budget: S 64 \+ O 512 = 576 columns > 512"):
        Kernel(m=128, n=128, hd=512, hd_per_cta=512)
    ok = tmem_budget(512, 64)
    assert ok["total"] == ok["S"] + ok["O"] <= ok["limit"] == 512 and ok["ctas"] == 2
    Kernel(m=128, n=128, hd=512)  # the default split fits


# -- the inventory


@pytest.mark.parametrize("opcode, operands, key", [
    ("tcgen05.mma.cta_group::1.kind::f16.collector::a::discard", "[%r1], %rd2, %rd3, %r4, p", "tcgen05.mma.cta_group::1.kind::f16"),
    ("tcgen05.mma.cta_group::2.kind::f8f6f4", "", "tcgen05.mma.cta_group::2.kind::f8f6f4"),
    ("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64", "[%r1]", "tcgen05.commit.cta_group::1"),
    ("tcgen05.wait::ld.sync.aligned", "", "tcgen05.wait::ld"),
    ("tcgen05.fence::before_thread_sync", "", "tcgen05.fence::before_thread_sync"),
    ("tcgen05.dealloc.cta_group::1.sync.aligned.b32", "%r1, 512", "tcgen05.dealloc.cta_group::1"),
    ("tcgen05.ld.sync.aligned.32x32b.x32.b32", "", "tcgen05.ld.32x32b.x32"),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "", "wgmma.mma_async.m64n64k16.f32.bf16.bf16"),
    ("st.global.v4.b32", "[%rd1], {%r1, %r2, %r3, %r4}", "st.global.128b"),
    ("ld.shared.v2.f32", "", "ld.shared.64b"),
    ("ld.global.nc.v4.u32", "", "ld.global.nc.128b"),
    ("ld.param.b64", "", None),
    ("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32", "", "st.async.64b"),
    ("shfl.sync.bfly.b32", "", "shfl.bfly"),
    ("ex2.approx.ftz.f32", "", "ex2.approx.f32"),
    ("bar.sync", "0", "bar.sync"),
    ("bar.sync", "1, 256", "bar.sync.named"),
    ("barrier.sync.aligned", "2, 128", "barrier.sync.named"),
    ("bar.arrive", "3, 256", "bar.arrive.named"),
    ("barrier.cluster.arrive.release", "", "barrier.cluster.arrive.release"),
    ("setmaxnreg.inc.sync.aligned.u32", "240", "setmaxnreg.inc.240"),
    ("cvt.rn.satfinite.e4m3x2.f32", "", "cvt.e4m3x2.f32"),
    ("cvt.rn.f16x2.e5m2x2", "", "cvt.f16x2.e5m2x2"),
    ("cvt.rn.bf16x2.f32", "", None),
    ("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint", "",
     "cp.async.bulk.tensor.2d.shared.global"),
    ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group", "", "cp.async.bulk.tensor.2d.global.shared"),
    ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster", "",
     "cp.async.bulk.tensor.2d.shared.global.multicast::cluster"),
    ("cp.async.bulk.wait_group.read", "0", "cp.async.bulk.wait_group.read"),
    ("mbarrier.try_wait.parity.shared::cta.b64", "", "mbarrier.try_wait.parity"),
    ("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64", "", "mbarrier.arrive.expect_tx"),
    ("stmatrix.sync.aligned.m8n8.x4.shared.b16", "", "stmatrix.m8n8.x4"),
    ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "", "ldmatrix.m8n8.x4.trans"),
    ("add.f32", "", None),
])
def test_ptx_counters_keep_the_qualifiers_that_matter(opcode, operands, key):
    assert ptx_key(opcode, operands) == key


def test_ptx_inventory_reads_statements_labels_predicates_and_blocks():
    ptx = """
    .visible .entry k(.param .u64 p0)
    {
    .reg .b32 %r<10>;
    // a comment: tcgen05.mma.cta_group::1.kind::f16 must not count
    $L__BB0_1:
    @%p1 bra $L__BB0_2;
    { .reg .pred leader; elect.sync _|leader, 0xFFFFFFFF;
    @leader tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, p; }
    @!%p2 cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r5], [%rd17, {%r58, %r58}], [%r72];
    bar.sync 1, 256; bar.sync 0;
    ret;
    }
    """
    inv = ptx_inventory(ptx)
    assert inv["tcgen05.mma.cta_group::1.kind::f16"] == 1
    assert inv["cp.async.bulk.tensor.2d.shared.global"] == 1
    assert inv["bar.sync.named"] == 1 and inv["bar.sync"] == 1
    assert inv["(all)"] == 7  # bra, elect, mma, cp, bar, bar, ret
    assert families(inv)["tcgen05.mma"] == 1 and mma_counts(inv) == {"tcgen05.mma.cta_group::1.kind::f16": 1}


def test_sass_inventory_counts_the_mix_with_widths():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;                 /* 0x0000df00ff017b82 */
                                                                           /* 0x000e220000000800 */
        /*0010*/              @!P0 UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
        /*0020*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0030*/                   STL.64 [R1], R2 ;
        /*0040*/                   LDL.64 R2, [R1] ;
        /*0050*/                   MUFU.EX2 R5, R5 ;
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
    """
    inv = sass_inventory(sass)
    assert inv["(all)"] == 8 and inv["STG.E.128"] == 1 and inv["STL.64"] == 1 and inv["LDL.64"] == 1
    assert inv["MUFU.EX2"] == 1 and inv["BAR.SYNC.DEFER_BLOCKING"] == 1 and "LDC" not in inv
    assert mma_counts(inv) == {"UTCHMMA": 1, "HGMMA.64x64x16.F32.BF16": 1}


def test_the_cuda_tools_are_found_inside_the_nvidia_wheels(tmp_path, monkeypatch):
    """cuobjdump / nvdisasm are found in site-packages/nvidia/<pkg>/bin."""
    import harness.notebook.inventory as inventory

    fake = tmp_path / "site" / "nvidia" / "cu13" / "bin"
    fake.mkdir(parents=True)
    tool = fake / "nvdisasm"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)

    class Spec:
        submodule_search_locations = [str(tmp_path / "site" / "nvidia")]

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(inventory.importlib.util, "find_spec", lambda name: Spec())
    inventory.find_tool.cache_clear()
    try:
        assert inventory.find_tool("nvdisasm") == str(tool)
        assert inventory.find_tool("cuobjdump") is None
        assert inventory.sass_tool() == [str(tool)]
    finally:
        inventory.find_tool.cache_clear()


# -- compile records; one-line errors


CALL = "\n    def __call__(self, a, b, out, stream):\n        pass\n"


def _broken_sm90(lab, body: str) -> None:
    (lab / "stages" / "fake" / "sm90.py").write_text(body)
    text = (lab / "stages.yaml").read_text().replace(
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}}",
        "kernels: {cpu: {module: stages.fake.cpu, entry: Add}, sm90: {module: stages.fake.sm90}}", 1)
    (lab / "stages.yaml").write_text(text)


def test_compile_writes_records_and_run_events_with_a_one_line_error(fake_lab):
    import json

    from harness.notebook.records import read_records

    _broken_sm90(fake_lab, "class Kernel:\n    def __init__(self, *, n):\n        raise ValueError('n must be a multiple of 64')\n\n"
        "    def __call__(self, a, b, out, stream):\n        pass\n")
    r = run_cli(["compile", "stage-OK", "--arch", "sm_90a", "--n", "16"], cwd=fake_lab)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "stages/fake/sm90.py:3: in __init__: ValueError: n must be a multiple of 64" in r.stdout
    (rec,) = read_records(fake_lab, ["OK"])
    assert rec.status == "compile_error" and rec.arch == "sm_90a" and rec.case == {"n": 16}
    assert rec.error == "stages/fake/sm90.py:3: in __init__: ValueError: n must be a multiple of 64"
    assert "Traceback" in rec.trace and rec.code["src"] and rec.env["host"]
    assert f"records: {fake_lab / 'results' / 'records' / 'OK.jsonl'}" in r.stdout
    events = [json.loads(x) for x in (fake_lab / "results" / "runs.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "end"] and events[1]["counts"] == {"compile_error": 1}


def test_an_oracle_that_raises_in_tensors_is_a_compile_error_not_a_crash(fake_lab):
    """An oracle whose tensors(case) raises: a compile error naming its line."""
    add = fake_lab / "oracles" / "add.py"
    add.write_text(add.read_text().replace("def tensors(case):", "def tensors(case):\n    raise KeyError('hd')\n", 1))
    _broken_sm90(fake_lab, "class Kernel:\n    def __init__(self, *, n):\n        pass\n" + CALL)
    script = (
        "import sys\nfrom pathlib import Path\nfrom harness.execution.compile import Compiler\nfrom harness.spec.spec import load_spec\n"
        "def main():\n"
        "    root = Path(sys.argv[1]); spec = load_spec(root=root); c = Compiler(root)\n"
        "    res = c.submit(spec.stages['OK'], 'sm_90a', {'n': 16}).result(); c.close()\n"
        "    print(res.ok); print(res.error); print('Traceback' in (res.trace or ''))\n"
        "if __name__ == '__main__':\n    main()\n")
    env = {**os.environ, "PYTHONPATH": f"{fake_lab}{os.pathsep}{ROOT}"}
    r = subprocess.run([sys.executable, "-c", script, str(fake_lab)], cwd=fake_lab, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ok, error, traced = r.stdout.splitlines()
    assert ok == "False" and traced == "True"
    assert error == "oracles/add.py:5: in tensors: KeyError: 'hd'"


def test_compile_diff_shows_what_changed_since_a_commit(fake_lab):
    """`compile --diff REV` shows the change, exit 0; a bad REV: exit 2."""
    _broken_sm90(fake_lab, "class Kernel:\n    def __init__(self, *, n):\n        raise ValueError('old build')\n" + CALL)
    commit_all(fake_lab, "v1")
    (fake_lab / "stages" / "fake" / "sm90.py").write_text(
        "class Kernel:\n    def __init__(self, *, n):\n        raise ValueError('new build')\n" + CALL)

    script = (
        "import sys\nfrom pathlib import Path\nfrom harness.execution.compilediff import diff_main\n"
        "from harness.spec.matrix import expand\nfrom harness.spec.spec import load_spec\n"
        "def main():\n"
        "    spec = load_spec(root=Path(sys.argv[1])); st = spec.stages['OK']\n"
        "    sys.exit(diff_main(spec, st, ['sm_90a'], expand(st)[:1], sys.argv[2]))\n"
        "if __name__ == '__main__':\n    main()\n")
    env = {**os.environ, "PYTHONPATH": f"{fake_lab}{os.pathsep}{ROOT}", "COLUMNS": "250"}

    def diff(rev: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, str(fake_lab), rev], cwd=fake_lab, env=env,
                              capture_output=True, text=True, timeout=300)

    r = diff("HEAD")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "old build" in r.stdout and "new build" in r.stdout and "1 case(s) changed" in r.stdout
    assert "new build" in (fake_lab / "stages" / "fake" / "sm90.py").read_text()
    assert not (fake_lab / "results" / "records").exists()  # a diff records nothing
    r = diff("no-such-rev")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--diff no-such-rev: not a commit" in r.stderr


def test_counter_changes_are_listed_with_missing_instructions_as_zero():
    from harness.execution.compilediff import changed, counters

    old = counters(True, {"regs": 160, "spill": 0}, {"tcgen05.mma.cta_group::1.kind::f16": 12, "(all)": 900}, {})
    new = counters(True, {"regs": 168, "spill": 0}, {"tcgen05.mma.cta_group::2.kind::f16": 12, "(all)": 900}, {})
    assert changed(old, new) == [("ptx tcgen05.mma.cta_group::1.kind::f16", 12, 0),
                                 ("ptx tcgen05.mma.cta_group::2.kind::f16", 0, 12), ("regs", 160, 168)]
    assert changed(old, old) == []


def test_a_cancelled_compiler_kills_its_running_compiles(project_root):
    """Ctrl-C during a compile: close(cancel=True) returns at once, no process outlives it."""
    import time

    c = Compiler(project_root, max_workers=1)
    fut = c._pool("sm_90a").submit(time.sleep, 120)
    procs = []
    deadline = time.monotonic() + 60
    while not fut.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    procs = list(c._pools["sm_90a"]._processes.values())
    assert fut.running() and procs
    t0 = time.monotonic()
    c.close(cancel=True)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 30  # reaping may take a moment
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in procs if p.is_alive()]  # else it sleeps two minutes
