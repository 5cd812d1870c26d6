"""Shared fixtures: project root, a throwaway lab of fake CPU stages, the GPU marker."""

import lzma
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


has_gpu = _cuda_available


def traced(script: str, tmp_path: Path, arch: str = "sm_100a", timeout: float = 900,
           **env: str) -> subprocess.CompletedProcess:
    """Run `script` from a file in a fresh process with CUTE_DSL_ARCH=`arch` and `env`."""
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def pytest_runtest_setup(item):
    """.ci/run's second venv: a test not started by DSV4_CI_DEADLINE (epoch s) skips, saying so."""
    deadline = os.environ.get("DSV4_CI_DEADLINE")
    if deadline and time.time() >= float(deadline):
        pytest.skip("not run: CI's time for this venv was up (DSV4_CI_DEADLINE)")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _lab_package(name: str) -> bool:
    return name in ("oracles", "stages") or name.startswith(("oracles.", "stages."))


@pytest.fixture(autouse=True)
def _project_lab_packages_survive():
    """A test importing a fake lab's `oracles`/`stages` leaves the project's modules in place after."""
    before = {k: v for k, v in sys.modules.items() if _lab_package(k)}
    path = list(sys.path)
    yield
    if any(sys.modules.get(k) is not before.get(k) for k in ("oracles", "stages") if k in before or k in sys.modules):
        for k in [k for k in sys.modules if _lab_package(k)]:
            del sys.modules[k]
        sys.modules.update(before)
        sys.path[:] = path


@pytest.fixture
def project_root() -> Path:
    return ROOT


def commit_all(root: Path, msg: str) -> str:
    """Everything in the git repository at `root` committed (`git add -A`); the new HEAD."""
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", msg], cwd=root, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def make_fake_lab(dest: Path) -> Path:
    """A lab of fake CPU stages (tests/fixtures/lab) in `dest`, its own git repository."""
    shutil.copytree(FIXTURES / "lab", dest)
    shutil.copy(ROOT / "oracles" / "common.py", dest / "oracles" / "common.py")
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    commit_all(dest, "fake lab")
    return dest


@pytest.fixture
def fake_lab(tmp_path, monkeypatch) -> Path:
    lab = make_fake_lab(tmp_path / "lab")
    monkeypatch.setenv("DSV4_LAB_ROOT", str(lab))
    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path / "cache"))
    return lab


@pytest.fixture
def lab_path(fake_lab, monkeypatch):
    """fake_lab importable: its oracles and stages, none of this tree's."""
    monkeypatch.syspath_prepend(str(fake_lab))
    for name in [m for m in sys.modules if m == "oracles" or m.startswith(("oracles.", "stages"))]:
        monkeypatch.delitem(sys.modules, name)
    return fake_lab


# A name no stage id can be.
NO_SUCH_STAGE = "stage-no-such"

COPY_IGNORE = (".git", ".cache", ".device", ".peers", "scratch", "__pycache__", ".run", ".pytest_cache")


def copy_lab(dest: Path, results: bool = True) -> Path:
    """A copy of this lab in `dest` (no git, no caches; `results`: its notebook too)."""
    ignore = COPY_IGNORE + (() if results else ("results",))
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*ignore))
    return dest


@pytest.fixture(scope="module")
def lab_copy(tmp_path_factory) -> Path:
    """A copy of this lab (results included) shared by a module's tests; run via `lab_env`."""
    return copy_lab(tmp_path_factory.mktemp("labcopy") / "lab")


def lab_env(lab: Path, cache: Path) -> dict[str, str]:
    return {"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(cache)}


def run_cli(args: list[str], cwd: Path, env_extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`dsv4-lab ARGS` as a user types it, in a fresh process."""
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def planted(spec, stage_id: str, fixture: str):
    """`spec`'s stage with its sm_90a kernel replaced by tests/fixtures/FIXTURE/sm90.py's `Kernel`."""
    import dataclasses

    from harness.spec.spec import KernelRef

    ref = KernelRef("sm_90a", f"tests.fixtures.{fixture}.sm90", "Kernel", FIXTURES / fixture / "sm90.py")
    return dataclasses.replace(spec.stages[stage_id], kernels={"sm_90a": ref}, dir=ref.path.parent)


def run_cases(spec, stage, cases, tmp_path: Path, arch: str = "sm_90a", **opts):
    """A Runner's summary of `cases` of `stage` on `arch`, records under `tmp_path`."""
    from harness.execution.runner import RunOptions, Runner, Task

    tasks = [Task(stage, arch, c) for c in cases]
    return Runner(spec, RunOptions(tasks=tasks, argv=["pytest"], **opts), results_root=tmp_path).run()


def compile_cases(monkeypatch, cache: Path, stage, arch: str, cases, **compiler_kw) -> list:
    """`cases` of `stage` compiled here for `arch`, one after another (cache in `cache`); each must build."""
    from harness.execution.compile import Compiler

    monkeypatch.setenv("DSV4_LAB_CACHE", str(cache))
    compiler = Compiler(ROOT, **compiler_kw)
    try:
        got = [compiler.submit(stage, arch, c).result() for c in cases]
    finally:
        compiler.close()
    assert all(r.ok for r in got), [r.error for r in got]
    return got


def sm100_decode_build(monkeypatch, tmp_path: Path, stage_id: str, case: dict, *families_used: str) -> dict:
    """The inventory of STAGE_ID's sm100 kernel compiled here for `case`: no spill, ≤ 227 KiB of shared memory,
    1-CTA kind::f16 tcgen05 MMAs, no wgmma, each of `families_used` at least once."""
    from harness.notebook.inventory import families
    from harness.spec.spec import load_spec

    st = load_spec(root=ROOT).stages[stage_id]
    if "sm_100a" not in st.kernels:
        pytest.fail(f"stages.yaml: {stage_id} declares no sm100 kernel")
    (res,) = compile_cases(monkeypatch, tmp_path, st, "sm_100a", [case], max_workers=1)
    assert res.resources.get("spill", 0) == 0
    assert res.resources["smem"] <= 227 * 1024
    inv = res.inventory
    assert any(k.startswith("tcgen05.mma.cta_group::1.kind::f16") for k in inv), inv
    fam = families(inv)
    for instr in families_used:
        assert fam.get(instr, 0) >= 1, (instr, inv)
    assert fam.get("wgmma", 0) == 0
    return inv


def e_sm90_builds(tmp_path: Path, monkeypatch, cases, fixture: str = "") -> list[tuple[str, dict]]:
    """(PTX, ptxas resources) of E's sm90 kernel (or FIXTURE's) per case, compiled here at 132 SMs."""
    from harness.execution.compile import ptxas_resources
    from harness.spec.spec import load_spec

    monkeypatch.setenv("DSV4_SM_COUNT", "132")
    spec = load_spec(root=ROOT)
    stage = planted(spec, "E", fixture) if fixture else spec.stages["E"]
    return [(Path(r.ptx_path).read_text(), ptxas_resources(Path(r.ptx_path), "sm_90a"))
            for r in compile_cases(monkeypatch, tmp_path, stage, "sm_90a", cases)]


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode) on the CPU: byte n of the result is byte sel[n] & 7 of b:a, or
    that byte's sign replicated when sel[n] has bit 3 (the bit-move dequantisers' model)."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def bf16_value(bits: int) -> float:
    """The value of the bf16 in the low 16 bits of `bits`."""
    import struct

    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def load_script(name: str):
    """scripts/NAME.py as a module (scripts/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_records(root: Path, records) -> None:
    """`records` appended by one RecordWriter, as a run writes them."""
    from harness.notebook.records import RecordWriter

    w = RecordWriter(root)
    for r in records:
        w.write(r)
    w.close()


def write_baselines(lab: Path, text: str | bytes) -> Path:
    """results/baselines.yaml.xz holding `text` xz-compressed."""
    path = lab / "results" / "baselines.yaml.xz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(text.encode() if isinstance(text, str) else text, format=lzma.FORMAT_XZ))
    return path


def baselines_text(lab: Path) -> str:
    """The text of results/baselines.yaml.xz."""
    return lzma.decompress((lab / "results" / "baselines.yaml.xz").read_bytes()).decode()
