"""The installed script: bad invocations one line, exit 2; help and --version exit 0."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, NO_SUCH_STAGE, ROOT, copy_lab

BAD_INVOCATIONS = [
    ["frob"], ["run"], ["run", NO_SUCH_STAGE], ["run", "stage-A", "--hd", "7"], ["run", "stage-A", "--bogus", "1"],
    ["run", "stage-A", "--timeout", "x"], ["run", "stage-A", "--timeout", "inf"], ["run", "stage-A", "--timeout", "-1"],
    ["run", "stage-A", "--workers-per-gpu", "0"], ["run", "stage-A", "--gpus", "a,b"], ["run", "stage-A", "--where", "hd"],
    ["run", "stage-A", "--arch", "sm_80"], ["run", "stage-A", "--shard", "3/2"], ["run", "stage-A", "stray"],
    ["run", "--dry-run"], ["run", "stage-A", "--dry-run"], ["run", "stage-A", "--arhc", "sm_90a"],
    ["run", "stage-A", "--hd", "64", "--where", "hd=128"], ["run", "stage-A", "--gpus", "99"],
    ["compile"], ["compile", "stage-A", "--arch", "sm_80"], ["compile", "stage-Q"], ["compile", "stage-A", "--n", "3"],
    ["history"], ["history", "stage-A", "--n", "x"], ["show"], ["show", "nosuchid"], ["note"],
    ["note", "no-such-run", "text"],
    ["gate", "--nope"], ["baseline", "accept"], ["baseline", "show", "stage-A", "--hd", "x"],
    ["baseline", "drop", "stage-A", "--hd", "x"], ["baseline", "frob"], ["targets", "check"],
    ["targets", "check", "no-such-target"], ["dashboard", "--interval", "x"], ["dashboard", "--watch", "--interval", "-1"],
    ["check", NO_SUCH_STAGE], ["new", "stage"], ["new", "stage", "Z9", "--axes", "n"], ["list", "extra"],
    ["--no-such-flag"],
]

# Nothing asked: help, exit 0.
HELP_INVOCATIONS = [[], ["baseline"], ["new"], ["targets"], ["--help"], ["run", "--help"]]


def _typer_vendors_click() -> bool:
    try:
        import typer._click  # noqa: F401
    except ImportError:
        return False
    return True


def _check(script: str, env: dict[str, str], tmp_path: Path) -> None:
    """On a copy of the lab: never write into the real tree."""
    lab = copy_lab(tmp_path / "lab")
    env = {**env, "DSV4_LAB_ROOT": str(lab)}
    failures = []
    for args in BAD_INVOCATIONS:
        r = subprocess.run([script, *args], cwd=lab, env=env, capture_output=True, text=True, timeout=120)
        text = r.stdout + r.stderr
        if r.returncode != 2 or "Traceback" in text or "Error:" in text.split("\n", 1)[0][:6] or not text.strip():
            failures.append(f"dsv4-lab {' '.join(args)} → exit {r.returncode}: {text[-400:]}")
    for args in HELP_INVOCATIONS:
        r = subprocess.run([script, *args], cwd=lab, env=env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or "Traceback" in r.stdout + r.stderr or "Usage: dsv4-lab" not in r.stdout \
                or "Commands:" not in r.stdout and args[:1] != ["run"] or r.stderr.strip():
            failures.append(f"dsv4-lab {' '.join(args)} → exit {r.returncode}: {(r.stdout + r.stderr)[-400:]}")
    version = subprocess.run([script, "--version"], cwd=lab, env=env, capture_output=True, text=True, timeout=120)
    if version.returncode != 0 or not version.stdout.startswith("dsv4-lab ") or "nvidia-cutlass-dsl" not in version.stdout:
        failures.append(f"dsv4-lab --version → exit {version.returncode}: {version.stdout + version.stderr}")
    assert not failures, "\n".join(failures)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DSV4_LAB_ROOT")}
    env.update(extra)
    return env


@pytest.mark.skipif(not shutil.which("dsv4-lab"), reason="the console script is not installed in this environment")
@pytest.mark.skipif(not _typer_vendors_click(), reason="this typer needs click itself, so click cannot be blocked")
def test_bad_invocations_of_the_installed_script_without_click(tmp_path):
    # This tree's code under the installed script.
    env = _env(PYTHONPATH=os.pathsep.join([str(FIXTURES / "noclick"), str(ROOT)]), DSV4_LAB_CACHE=str(tmp_path / "cache"))
    probe = subprocess.run([shutil.which("python3") or "python3", "-c", "import click"], env=env, capture_output=True)
    assert probe.returncode != 0, "click should be blocked"
    _check(shutil.which("dsv4-lab"), env, tmp_path)


FRESH = os.environ.get("DSV4_FRESH_VENV")


@pytest.mark.skipif(not FRESH, reason="no fresh venv: .ci/run builds one the README's way and sets DSV4_FRESH_VENV")
def test_bad_invocations_of_a_fresh_install(tmp_path):
    script = Path(FRESH) / "bin" / "dsv4-lab"
    assert script.is_file(), f"{script} missing: the fresh venv was not built"
    _check(str(script), _env(DSV4_LAB_CACHE=str(tmp_path / "cache")), tmp_path)
