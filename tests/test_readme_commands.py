"""Every `dsv4-lab …` command in README.md runs as written (SYNOPSES, SKIPPED)."""

import os
import re

import pytest

from tests.conftest import ROOT, has_gpu, lab_env, run_cli

README = ROOT / "README.md"


def readme_commands(text: str) -> list[str]:
    """Every README command once, in order (inline and code blocks, after `&&` too)."""
    found: list[str] = []
    for m in re.finditer(r"`(dsv4-lab [^`\n]+)`", text):
        found.append(m.group(1))
    in_fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith("    "):
            for m in re.finditer(r"(?:^|&&|;)\s*(dsv4-lab [^&;#]+)", line.strip()):
                found.append(m.group(1))
    out: list[str] = []
    for cmd in (" ".join(c.split()) for c in found):
        cmd = cmd.replace("\\|", "|")  # a `|` escaped in a markdown table
        if cmd not in out:
            out.append(cmd)
    return out


def is_synopsis(cmd: str) -> bool:
    """A placeholder, optional part or alternatives."""
    return bool(re.search(r"\[|\||\b[A-Z]{2,}\b", cmd))


NEW_STAGE = ["new", "stage", "ZX", "--axes", "m=128", "--axes", "hd=64,128", "--axes", "n=128,256",
             "--in", "Q:m,hd:bfloat16", "--out", "S:m,n:float32"]

# synopsis -> concrete commands.
SYNOPSES: dict[str, list[list[str]]] = {
    "dsv4-lab check [STAGE]": [["check", "stage-A"]],
    "dsv4-lab new stage ID --axes m=128 --axes hd=64,128 --axes n=128,256 --in Q:m,hd:bfloat16 --out S:m,n:float32":
        [NEW_STAGE, ["check", "stage-ZX"]],  # the scaffold passes check
    "dsv4-lab baseline accept|show|drop STAGE [filters]":
        [["baseline", "show", "stage-A"], ["baseline", "show", "stage-D1", "--hd", "64"],
         ["baseline", "accept", "stage-A", "--arch", "sm_100a", "--hd", "64"], ["baseline", "drop", "stage-A", "--hd", "64"]],
    "dsv4-lab dashboard [--watch]": [["dashboard"]],  # --watch: test_cli_usage.py
    "dsv4-lab history STAGE [filters]": [["history", "stage-D1", "--hd", "512"]],
    "dsv4-lab show ID": [["show", "{record}"], ["show", "{run}"]],
    "dsv4-lab note RUN \"text\"": [["note", "{run}", "a note from the README test"]],
    "dsv4-lab targets list|check NAME": [["targets", "list"]],  # check NAME: SKIPPED below
    "dsv4-lab targets check NAME": [],
    "dsv4-lab bench stage-D1 [filters] [--peers]": [["bench", "stage-D1", "--hd", "128", "--peers"]],
    "dsv4-lab calibrate [--fp8]": [["calibrate"]],
}

SLOW = "minutes of compiling on a CPU"
# README command -> why not run here.
SKIPPED: dict[str, str] = {
    "dsv4-lab run stage-A": f"{SLOW} (16 kernels); tests/test_cli.py::test_main_job_without_gpu_compiles_and_says_nothing_ran "
                            "runs it on one case",
    "dsv4-lab run stage-D1 --hd 512": f"{SLOW} (4 kernels at hd 512)",
    "dsv4-lab compile stage-E --arch sm_100a": f"{SLOW} (423 cases)",
    "dsv4-lab suite deepgemm": f"{SLOW} (246 cases); tests/test_suites.py",
    "dsv4-lab gate": "judges the whole notebook: stale cases are run or recompiled (minutes); tests/test_gate.py",
    "dsv4-lab gate --install-hook": "needs a git repository; tests/test_gate.py::test_hook_install_is_idempotent_and_"
                                    "refuses_a_foreign_hook",
    "dsv4-lab gate --staged": "judges the git index of the lab's own repository (a copy has none); "
                              "tests/test_gate_target.py runs it in throwaway repositories",
    "dsv4-lab gate --target NAME": "needs an SSH target; tests/test_gate_target.py (a throwaway sshd)",
    "dsv4-lab gate --speed --target NAME": "needs an SSH target; tests/test_speed_gate_target.py (a throwaway sshd)",
    "dsv4-lab targets check NAME": "needs an SSH target; tests/test_targets.py (a throwaway sshd)",
    "dsv4-lab run stage-D1 --target b200": "needs the SSH target b200; tests/test_targets.py",
    "dsv4-lab run stage-D1 --target cluster": "needs a Slurm cluster; tests/test_slurm.py (a throwaway slurmctld)",
    "dsv4-lab run stage-D1 --target cluster --gpus 8 --print-job": "needs the slurm target cluster; "
                                                                    "tests/test_slurm.py::test_print_job_shows_the_gpu_array",
    "dsv4-lab targets check cluster": "needs a Slurm cluster; tests/test_slurm.py::test_targets_check",
    "dsv4-lab bench stage-E --compare REV": "needs a git repository (a copy of the lab has none) and a GPU; "
                                            "tests/test_abbench.py",
    "dsv4-lab profile stage-E [filters] [--compare REV]": "needs a GPU and ncu; tests/test_profile.py",
}

# Documented non-zero exits here.
NO_GPU_EXITS = {"bench": {1}, "calibrate": {1}}  # no GPU: bench exits 1
EXITS = {"baseline accept": {0, 1}}  # 1: nothing fresh to take


def _expected(args: list[str]) -> set[int] | None:
    if args[0] in NO_GPU_EXITS:
        return None if has_gpu() else NO_GPU_EXITS[args[0]]
    return EXITS.get(" ".join(args[:2]), {0})


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))


def test_the_readme_commands_are_found_and_every_list_entry_is_still_in_the_readme():
    assert len(COMMANDS) >= 15 and "dsv4-lab list" in COMMANDS and "dsv4-lab run stage-A" in COMMANDS, COMMANDS
    gone = [c for c in list(SYNOPSES) + list(SKIPPED) if c not in COMMANDS]
    assert not gone, f"no longer in README.md (drop them here): {gone}"


@pytest.fixture(scope="module")
def ids(lab_copy) -> dict[str, str]:
    from harness.notebook.records import read_records

    rec = read_records(lab_copy, ["A"])[-1]
    return {"record": rec.id, "run": rec.run}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_runs_as_written(command, lab_copy, ids, tmp_path_factory):
    slow_ok = os.environ.get("DSV4_README_SLOW") == "1" and SKIPPED.get(command, "").startswith(SLOW)
    if command in SKIPPED and not slow_ok:
        pytest.skip(SKIPPED[command])
    if is_synopsis(command):
        assert command in SYNOPSES, (f"README.md shows the synopsis `{command}`: give the concrete command(s) that "
                                     "stand for it in SYNOPSES (tests/test_readme_commands.py)")
        runs = [[a.format(**ids) for a in args] for args in SYNOPSES[command]]
    else:
        runs = [command.split()[1:]]
    env = lab_env(lab_copy, tmp_path_factory.getbasetemp() / "readme-cache")
    for args in runs:
        expected = _expected(args)
        if expected is None:
            continue  # GPU: test_gpu.py
        r = run_cli(args, cwd=lab_copy, env_extra=env, timeout=900)
        text = r.stdout + r.stderr
        shown = f"dsv4-lab {' '.join(args)} → exit {r.returncode}:\n{text[-2000:]}"
        assert "Traceback" not in text and "internal error" not in text, shown
        assert r.returncode in expected, shown


def test_the_extraction_reads_code_blocks_inline_code_and_chained_commands():
    text = ("Run it:\n\n    pip install x && dsv4-lab run stage-A\n\n| `dsv4-lab list` | `dsv4-lab a\\|b X` |\n"
            "```\ndsv4-lab check stage-E2   # a comment\n```\n")
    assert readme_commands(text) == ["dsv4-lab list", "dsv4-lab a|b X", "dsv4-lab run stage-A",
                                     "dsv4-lab check stage-E2"]
    assert is_synopsis("dsv4-lab show ID") and is_synopsis("dsv4-lab check [STAGE]")
    assert not is_synopsis("dsv4-lab new stage E2 --in Q:m,hd:bfloat16")
