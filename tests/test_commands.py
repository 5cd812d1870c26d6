"""The command registry (harness/commands/) and what derives from it; a command is one file."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.commands.registry import registry
from harness.core.optionnames import COMMAND_OPTIONS, GLOBAL_OPTIONS, RESERVED_AXES
from harness.spec.spec import SpecError, load_spec
from tests.conftest import ROOT, run_cli


def _click_commands():
    """(path, click command) of every registered command."""
    import typer

    import cli

    root = typer.main.get_command(cli.build_app(registry()))
    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append((" ".join(path), cmd))

    walk(root, [])
    return out


def _option_names(cmd) -> set[str]:
    return {o[2:].replace("-", "_") for p in cmd.params for o in getattr(p, "opts", []) if o.startswith("--")}


def test_every_flag_of_every_command_is_a_name_stages_yaml_may_not_use_for_an_axis():
    """An axis named like a command's flag is refused."""
    commands = _click_commands()
    assert {"run", "compile", "baseline accept", "targets check", "new stage", "inspect"} <= {p for p, _ in commands}
    missing = {f"{path}: --{name.replace('_', '-')}" for path, cmd in commands for name in _option_names(cmd)
               if name not in RESERVED_AXES}
    assert not missing, f"flags harness/core/optionnames.py does not list (stages.yaml would accept them as axes): {missing}"
    used = {name for _, cmd in commands for name in _option_names(cmd)}
    assert COMMAND_OPTIONS - used == set(), f"option names no command takes: {COMMAND_OPTIONS - used}"
    assert GLOBAL_OPTIONS <= RESERVED_AXES


def test_an_axis_named_like_a_flag_of_any_command_is_refused(fake_lab):
    """An axis `record` is refused (run/compile --record)."""
    path = fake_lab / "stages.yaml"
    path.write_text(path.read_text().replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 32], record: [1, 2]}"))
    with pytest.raises(SpecError, match="--record is one of the lab's own options — rename the axis"):
        load_spec(root=fake_lab)


BENCH_BLOCK = "    bench:\n      matrix:\n        n: [4096, 1000]\n      row_axis: n\n      check_rows: 8\n"


def test_help_lists_axis_filters_where_the_command_takes_them(fake_lab):
    """`show --help` lists no other command's filters; `bench --help` lists its own."""
    path = fake_lab / "stages.yaml"
    text = path.read_text()
    path.write_text(text.replace("    timeout_s: 20\n", "    timeout_s: 20\n" + BENCH_BLOCK, 1))
    matrix_line = "stage-BAD: --n {16}  --mode {abort,raise,wrong,unwritten,ok,hang}"
    shown = run_cli(["show", "--help"], cwd=fake_lab)
    assert shown.returncode == 0 and "Axis filters" not in shown.stdout, shown.stdout
    bench = run_cli(["bench", "--help"], cwd=fake_lab)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "Axis filters on the bench shapes" in bench.stdout and "stage-OK: --n {4096,1000}" in bench.stdout
    assert "stage-BAD" not in bench.stdout  # no bench block: no bench filters
    for cmd in (["run"], ["compile"], ["history"], ["inspect"], ["baseline", "accept"], ["baseline", "show"],
                ["baseline", "drop"]):
        h = run_cli([*cmd, "--help"], cwd=fake_lab)
        assert h.returncode == 0 and matrix_line in h.stdout, (cmd, h.stdout)
    for cmd in (["list"], ["gate"], ["dashboard"], ["note"], ["check"], ["calibrate"], ["targets", "list"],
                ["new", "stage"]):
        h = run_cli([*cmd, "--help"], cwd=fake_lab)
        assert h.returncode == 0 and "Axis filters" not in h.stdout, (cmd, h.stdout)


HELLO = '''\
"""`dsv4-lab hello STAGE [filters]`: a command added as one file."""

import typer

from harness.commands.base import Command, UsageError, cases_of, option, spec_here


class HelloError(Exception):
    """One line of its own."""


def hello(ctx: typer.Context, stage: str = typer.Argument(...), arch: str = option("arch", "all"),
          where: str = option("where", None)) -> None:
    """Say hello to the cases a filter selects."""
    st = spec_here().stage(stage)
    cases = cases_of(st, ctx.args, where)
    if arch == "none":
        raise HelloError("hello: --arch none says hello to nobody — give an arch")
    if not cases:
        raise UsageError("no case matches these filters")
    print("hello", " ".join(str(c.dict["n"]) for c in cases))
    raise typer.Exit(0)


COMMANDS = [Command("hello", hello, axes="matrix", errors=(HelloError,))]
'''


def _code_copy(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(ROOT / "cli.py", code / "cli.py")
    shutil.copytree(ROOT / "harness", code / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    return code


def _dsv4(code: Path, lab: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(lab.parent / "cache"),
           "PYTHONPATH": str(code)}
    return subprocess.run([sys.executable, str(code / "cli.py"), *args], cwd=lab, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_new_command_is_one_file(fake_lab, tmp_path):
    """harness/commands/hello.py is listed; options and errors behave as `run`'s."""
    code = _code_copy(tmp_path)
    (code / "harness" / "commands" / "hello.py").write_text(HELLO)
    top = _dsv4(code, fake_lab, "--help")
    assert top.returncode == 0 and "  hello " in top.stdout, top.stdout + top.stderr
    assert top.stdout.index("  inspect ") < top.stdout.index("  hello ") < top.stdout.index("  baseline ")
    helped = _dsv4(code, fake_lab, "hello", "--help")
    assert "stage-OK: --n {16,32}" in helped.stdout, helped.stdout + helped.stderr
    said = _dsv4(code, fake_lab, "hello", "stage-OK", "--n", "32")
    assert said.returncode == 0 and said.stdout.strip() == "hello 32", said.stdout + said.stderr
    misspelt = _dsv4(code, fake_lab, "hello", "stage-OK", "--arhc", "x")
    assert misspelt.returncode == 2 and misspelt.stderr.strip() == (
        "dsv4-lab: no such option '--arhc' — did you mean --arch? (see dsv4-lab hello --help)"), misspelt.stderr
    own = _dsv4(code, fake_lab, "hello", "stage-OK", "--arch", "none")
    assert own.returncode == 2 and own.stderr.strip() == "dsv4-lab: hello: --arch none says hello to nobody — give an arch"


def test_a_flag_name_the_option_list_lacks_is_named_with_the_fix(fake_lab, tmp_path):
    code = _code_copy(tmp_path)
    (code / "harness" / "commands" / "hello.py").write_text(HELLO.replace('option("arch", "all")',
                                                                          'option("shout", False)'))
    r = _dsv4(code, fake_lab, "list")
    assert r.returncode != 0
    assert "--shout: not an option name of the lab — add 'shout' to COMMAND_OPTIONS in harness/core/optionnames.py" in r.stderr


def test_the_registry_has_one_module_per_command_and_no_hand_kept_lists_in_cli():
    """cli.py names no command and no error class."""
    text = (ROOT / "cli.py").read_text()
    for word in ("@app.command", "AXIS_HELP_COMMANDS", "RunSetupError", "BaselineError", "\"harness.notebook.baselines\""):
        assert word not in text, word

    paths = [c.path for c in registry()]
    assert paths[:3] == ["list", "run", "compile"] and paths[-1] == "new stage", paths
    assert len(paths) == len(set(paths))
