"""Hostile stages.yaml / targets.yaml / kernel modules: one `file:line:` error each, nothing else."""

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.spec.spec import SpecError, load_spec
from harness.remote.targets import TargetError, load_targets_file
from harness.core import yamlnodes
from harness.core.yamlnodes import MAX_ALIASES, MAX_DEPTH, MAX_NODES, NodeContext, compose, read_file
from tests.conftest import ROOT, run_cli

# Every key on its own line.
RICH = """\
version: 1
stages:
  OK:
    title: add
    dir: stages/fake
    kernels:
      cpu:
        module: stages.fake.cpu
        entry: Add
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    flops: oracles.add:tensors
    matrix:
      n:
        - 16
        - 32
      mode:
        - a
    kernel_params:
      - n
    tolerances:
      out:
        cosine_min: 0.9999
        rel_l2_max: 1.0e-6
        max_abs_max: 0.5
    timeout_s: 20
    bench:
      n: 32
"""

# Replacement values (some valid for some keys).
RETYPES = [
    "", "[]", "{}", "[1, 2]", "{a: 1}", ".nan", ".inf", "-.inf", "-1", "0", "true", "~", "'x'",
    "1" * 5000, "9" * 400, "!!binary AAAA", "!!python/name:os.system", "2024-13-45", '"\\0"', "..stages.x",
    "*nowhere", "[" * 200,
]

def short_ids(cases: list) -> list:
    """Parameter sets with short ids (long ids reach git's env via PYTEST_CURRENT_TEST)."""
    return [pytest.param(*c, id=f"{i}-{re.sub(r'[^A-Za-z0-9_.]+', '_', str(c[-1]))[:40]}") for i, c in enumerate(cases)]


SPEC_LINE = re.compile(r"^stages\.yaml:\d+: \S")
TARGETS_LINE = re.compile(r"^targets\.yaml:\d+: \S")


def variants(text: str) -> list[tuple[str, str]]:
    """(what, text) for each key line deleted, blanked and retyped."""
    out = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*(?:- )?)([A-Za-z_]\w*):( .*)?$", line.rstrip("\n"))
        if m is None:
            continue
        out.append((f"line {i + 1} deleted", "".join(lines[:i] + lines[i + 1:])))
        for new in RETYPES:
            changed = f"{m.group(1)}{m.group(2)}: {new}\n" if new else f"{m.group(1)}{m.group(2)}:\n"
            out.append((f"line {i + 1} {m.group(2)}: {new[:20]!r}", "".join(lines[:i] + [changed] + lines[i + 1:])))
    return out


def bomb(depth: int = 9, as_key: bool = False) -> str:
    """A billion-laughs fragment: 9 anchors, each 9 aliases of the one before."""
    lines = ["lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, depth):
        lines.append(f"lol{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    lines.append(f"? *l{depth - 1}\n: boom" if as_key else f"boom: *l{depth - 1}")
    return "\n".join(lines) + "\n"


def write_spec(lab: Path, text: str | bytes) -> None:
    p = lab / "stages.yaml"
    p.write_bytes(text if isinstance(text, bytes) else textwrap.dedent(text).encode())


def spec_error(lab: Path, text: str | bytes) -> str:
    write_spec(lab, text)
    with pytest.raises(SpecError) as exc:
        load_spec(root=lab)
    msg = str(exc.value)
    assert SPEC_LINE.match(msg) and "\n" not in msg, msg
    return msg


# stages.yaml


def test_rich_spec_loads(fake_lab):
    write_spec(fake_lab, RICH)
    st = load_spec(root=fake_lab).stages["OK"]
    assert st.matrix == {"n": [16, 32], "mode": ["a"]} and st.bench == {"n": 32} and st.timeout_s == 20


def _refused_in_one_line(cases, load, error, line) -> int:
    """How many variants `load` refuses, each one line; nothing else escapes."""
    refused, problems = 0, []
    for what, text in cases:
        try:
            load(text)
        except error as exc:
            refused += 1
            if not line.match(str(exc)) or "\n" in str(exc):
                problems.append(f"{what}: {exc}")
        except BaseException as exc:  # noqa: BLE001 — the point: nothing else may escape
            problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not problems, "\n".join(problems[:20])
    return refused


def test_every_malformed_spec_is_one_line(fake_lab):
    """Each key deleted, blanked, retyped: one-line SpecError or a spec that loads."""
    cases = variants(RICH)
    assert len(cases) > 300
    refused = _refused_in_one_line(cases, lambda text: (write_spec(fake_lab, text), load_spec(root=fake_lab)),
                                   SpecError, SPEC_LINE)
    assert refused > 0.8 * len(cases), (refused, len(cases) - refused)


@pytest.mark.parametrize("old, new, line, key, says", short_ids([  # key: under stages., but for version
    # tolerances: finite, in range
    ("cosine_min: 0.9999", "cosine_min: .nan", 24, "OK.tolerances.out.cosine_min", "not a finite number"),
    ("cosine_min: 0.9999", "cosine_min: .inf", 24, "OK.tolerances.out.cosine_min", "not a finite number"),
    ("cosine_min: 0.9999", "cosine_min: -.inf", 24, "OK.tolerances.out.cosine_min", "not a finite number"),
    ("cosine_min: 0.9999", "cosine_min: 1.5", 24, "OK.tolerances.out.cosine_min", "at most 1"),
    ("cosine_min: 0.9999", "cosine_min: -2", 24, "OK.tolerances.out.cosine_min", "more than 0"),
    ("rel_l2_max: 1.0e-6", "rel_l2_max: .NaN", 25, "OK.tolerances.out.rel_l2_max", "not a finite number"),
    ("rel_l2_max: 1.0e-6", "rel_l2_max: -1.0e-6", 25, "OK.tolerances.out.rel_l2_max", "at least 0"),
    ("max_abs_max: 0.5", "max_abs_max: .inf", 26, "OK.tolerances.out.max_abs_max", "not a finite number"),
    ("max_abs_max: 0.5", "max_abs_max: 1.0e+400", 26, "OK.tolerances.out.max_abs_max", "not a finite number"),
    ("max_abs_max: 0.5", "max_abs_max: -0.5", 26, "OK.tolerances.out.max_abs_max", "at least 0"),
    # timeout_s: finite, > 0
    ("timeout_s: 20", "timeout_s: .inf", 27, "OK.timeout_s", "not a finite number"),
    ("timeout_s: 20", "timeout_s: .nan", 27, "OK.timeout_s", "not a finite number"),
    ("timeout_s: 20", "timeout_s: 0", 27, "OK.timeout_s", "more than 0"),
    ("timeout_s: 20", "timeout_s: -1", 27, "OK.timeout_s", "more than 0"),
    ("timeout_s: 20", "timeout_s: 1.0e+300", 27, "OK.timeout_s", "at most 86400"),
    ("timeout_s: 20", "timeout_s: " + "9" * 400, 27, "OK.timeout_s", "not a finite number"),
    ("cosine_min: 0.9999", "cosine_min: " + "9" * 400, 24, "OK.tolerances.out.cosine_min", "not a finite"),
    # empty values
    ("    title: add\n", "    title:\n", 4, "OK.title", "nothing"),
    ("    dir: stages/fake\n", "    dir:\n", 5, "OK.dir", "nothing"),
    ("    kernels:\n      cpu:\n        module: stages.fake.cpu\n        entry: Add\n", "    kernels:\n",
     6, "OK.kernels", "nothing"),
    ("      cpu:\n        module: stages.fake.cpu\n        entry: Add\n", "      cpu:\n", 7, "OK.kernels.cpu",
     "nothing"),
    ("        module: stages.fake.cpu\n", "        module:\n", 8, "OK.kernels.cpu.module", "nothing"),
    ("    matrix:\n      n:\n        - 16\n        - 32\n      mode:\n        - a\n", "    matrix:\n",
     14, "OK.matrix", "nothing"),
    ("      n:\n        - 16\n        - 32\n", "      n:\n", 15, "OK.matrix.n", "nothing"),
    ("    tolerances:\n      out:\n", "    tolerances:\n      out:\n      other:\n", 23, "OK.tolerances.out",
     "nothing"),
    ("    bench:\n      n: 32\n", "    bench:\n", 28, "OK.bench", "nothing"),
    ("      n: 32\n", "      n:\n", 29, "OK.bench.n", "nothing"),
    ("    kernel_params:\n      - n\n", "    kernel_params:\n", 20, "OK.kernel_params", "nothing"),
    ("    tensors: oracles.add:tensors\n", "    tensors:\n", 10, "OK.tensors", "nothing"),
    ("version: 1\n", "version:\n", 1, "version", "nothing"),
    ("    title: add\n", "    title: ''\n", 4, "OK.title", "empty"),
    # numbers Python cannot read, tags, dates
    ("        - 16\n", "        - " + "7" * 5000 + "\n", 16, "OK.matrix.n", "5000 digits"),
    ("    title: add\n", "    title: !!python/object/apply:os.system [ls]\n", 4, "OK.title", "not supported"),
    ("    title: add\n", "    title: 2024-13-45\n", 4, "OK.title", "not a valid date"),
    ("    title: add\n", "    title: \"a\\nb\"\n", 4, "OK.title", "one line"),
    # module paths: dotted identifiers only
    ("module: stages.fake.cpu", "module: ..stages.fake.cpu", 8, "OK.kernels.cpu.module", "not a dotted module"),
    ("module: stages.fake.cpu", "module: .cpu", 8, "OK.kernels.cpu.module", "not a dotted module"),
    ("module: stages.fake.cpu", "module: stages..fake.cpu", 8, "OK.kernels.cpu.module", "not a dotted module"),
    ("module: stages.fake.cpu", "module: stages.fake.cpu.", 8, "OK.kernels.cpu.module", "not a dotted module"),
    ("module: stages.fake.cpu", "module: stages/fake/cpu", 8, "OK.kernels.cpu.module", "not a dotted module"),
    ("entry: Add", "entry: Add.x", 9, "OK.kernels.cpu.entry", "not a Python name"),
    ("oracle: oracles.add:reference", "oracle: ..oracles.add:reference", 12, "OK.oracle", "not a dotted"),
    ("oracle: oracles.add:reference", "oracle: oracles.add:ref-erence", 12, "OK.oracle", "not a Python name"),
    # the stage folder stays inside the lab
    ("dir: stages/fake", "dir: /tmp", 5, "OK.dir", "not inside the lab"),
    ("dir: stages/fake", "dir: stages/../..", 5, "OK.dir", "not inside the lab"),
    # one matrix value written twice, however spelled
    ("        - 32\n", "        - '16'\n", 17, "OK.matrix.n", "repeated value"),
    ("        - 32\n", "        - 16.0\n", 17, "OK.matrix.n", "repeated value"),
    ("        - a\n", "        - a\n        - 'a'\n", 20, "OK.matrix.mode", "repeated value"),
    ("        - a\n", "        - true\n        - 'true'\n", 20, "OK.matrix.mode", "repeated value"),
    ("        - a\n", "        - .nan\n", 19, "OK.matrix.mode", "not a finite number"),
    ("        - a\n", "        - 'a,b'\n", 19, "OK.matrix.mode", "cannot be an axis value"),
    ("        - a\n", "        - 'x=1'\n", 19, "OK.matrix.mode", "cannot be an axis value"),
    ("        - a\n", "        - ' a'\n", 19, "OK.matrix.mode", "cannot be an axis value"),
    ("      mode:\n", "      arch:\n", 18, "OK.matrix.arch", "lab's own options"),
    ("      mode:\n", "      class:\n", 18, "OK.matrix.class", "identifiers"),
    # kernel_params and bench
    ("      - n\n", "      - n\n      - n\n", 22, "OK.kernel_params", "repeated"),
    ("      - n\n", "      - hd\n", 21, "OK.kernel_params", "not a matrix axis"),
    ("      n: 32\n", "      n: '32'\n", 29, "OK.bench.n", "not in the matrix"),
    ("      n: 32\n", "      n: 64\n", 29, "OK.bench.n", "not in the matrix"),
    ("      n: 32\n", "      n: 32\n      n: 16\n", 30, "OK.bench.n", "duplicate key"),
    ("      n: 32\n", "      hd: 32\n", 29, "OK.bench.hd", "not a matrix axis"),
    # keys that are not names
    ("    title: add\n", "    title: add\n    ? [a, b]\n    : x\n", 5, "OK", "plain name"),
    ("    title: add\n", "    title: add\n    ~: x\n", 5, "OK", "empty key"),
    ("    bench:\n      n: 32\n", "    bench:\n      <<: {n: 32}\n", 29, "OK.bench", "merge keys"),
]))
def test_bad_values_are_one_line(fake_lab, old, new, line, key, says):
    assert RICH.count(old) == 1, old
    msg = spec_error(fake_lab, RICH.replace(old, new))
    assert msg.startswith(f"stages.yaml:{line}: {'' if key == 'version' else 'stages.'}{key}: "), msg
    assert says in msg and " — " in msg, msg


def test_stage_ids_that_normalise_alike_are_refused(fake_lab):
    block = RICH.split("stages:\n", 1)[1]
    second = block.replace("  OK:\n", "  stage-ok:\n", 1)
    msg = spec_error(fake_lab, "version: 1\nstages:\n" + block + second)
    first_lines = block.count("\n")
    assert msg.startswith(f"stages.yaml:{3 + first_lines}: stages.stage-ok: same stage as 'OK' (line 3) — "), msg
    msg = spec_error(fake_lab, "version: 1\nstages:\n" + block + block.replace("  OK:\n", "  ok:\n", 1))
    assert "stages.ok: same stage as 'OK'" in msg


@pytest.mark.parametrize("sid", ["stage-", "a b", "x" * 40, "stage-a/../b", "é"])
def test_bad_stage_ids(fake_lab, sid):
    msg = spec_error(fake_lab, RICH.replace("  OK:\n", f"  {sid!r}:\n".replace("'", '"')))
    assert msg.startswith("stages.yaml:3: stages.") and "stage ids are short names" in msg, msg


def test_matrix_past_the_case_limit_is_refused_at_validation(fake_lab):
    axes = "".join(f"      a{i}: [{', '.join(str(v) for v in range(10))}]\n" for i in range(6))  # 10**6 cases
    text = RICH.replace("    matrix:\n", "    matrix:\n" + axes).replace("    kernel_params:\n      - n\n", "")
    msg = spec_error(fake_lab, text)
    assert msg.startswith("stages.yaml:15: stages.OK.matrix: 2000000 cases (") and "limit of 100000" in msg, msg


@pytest.mark.parametrize("data, line, says", short_ids([
    (RICH.encode().replace(b"title: add", b"title: a\xffd"), 4, "not UTF-8"),
    (RICH.encode().replace(b"title: add", b"title: a\x00d"), 4, "not allowed"),
    (RICH.encode().replace(b"title: add", b"title: a\x1b[2Jd"), 4, "not allowed"),
    (RICH.encode() + b"deep: " + b"[" * 10000 + b"\n", 30, f"more than {MAX_DEPTH} levels"),
    (RICH.encode() + b"deep: " + b"{a: " * 10000 + b"\n", 30, f"more than {MAX_DEPTH} levels"),
    (RICH.encode() + b"x: &a [*a]\n", 30, "cycle"),
    (RICH.encode() + b"x: *undefined\n", 30, "undefined alias"),
    (RICH.encode() + b"---\nversion: 1\n", 30, "not valid YAML"),
    (RICH.encode() + b"\tx: 1\n", 30, "not valid YAML"),
]))
def test_bad_bytes_and_structures(fake_lab, data, line, says):
    msg = spec_error(fake_lab, data)
    assert msg.startswith(f"stages.yaml:{line}: ") and says in msg, msg


def test_spec_that_is_a_folder(fake_lab):
    (fake_lab / "stages.yaml").unlink()
    (fake_lab / "stages.yaml").mkdir()
    with pytest.raises(SpecError, match=r"^stages\.yaml:1: is a folder"):
        load_spec(root=fake_lab)


@pytest.mark.parametrize("data, says", short_ids([
    (b"\n# \xff\xfe\n", ":6 does not parse: not utf-8 text (byte 0xff)"),
    (b"\nx = '\xff'\n", ":6 does not parse: not utf-8 text"),
    (b"\ndef (:\n", ":6 does not parse: invalid syntax"),
    (b"\nx = 1\x00\n", "does not parse: contains a null byte"),
    (b"\nx = " + b"(" * 5000 + b")" * 5000 + b"\n", "does not parse"),
    (b"\nx = " + b"-" * 200000 + b"1\n", "does not parse: nested too deeply"),
    (b"# -*- coding: nope -*-\n", "does not parse: unknown encoding"),
]))
def test_module_that_does_not_parse(fake_lab, data, says):
    """An unparsable kernel module: one line naming it."""
    mod = fake_lab / "stages" / "fake" / "cpu.py"
    lines = mod.read_bytes().split(b"\n")
    assert lines[4] == b"" and lines[6].startswith(b"class Add")  # line 6 is at module level
    mod.write_bytes(data + b"\n".join(lines) if data.startswith(b"# -*-")
                    else b"\n".join(lines[:5]) + data + b"\n".join(lines[5:]))
    msg = spec_error(fake_lab, RICH)
    assert msg.startswith("stages.yaml:8: stages.OK.kernels.cpu.module: stages/fake/cpu.py"), msg
    assert says in msg, msg


def test_module_reexporting_its_entry_is_accepted(fake_lab):
    (fake_lab / "stages" / "fake" / "alias.py").write_text("from stages.fake.cpu import Add as Kernel\n")
    write_spec(fake_lab, RICH.replace("module: stages.fake.cpu\n        entry: Add", "module: stages.fake.alias"))
    assert load_spec(root=fake_lab).stages["OK"].kernels["cpu"].entry == "Kernel"


# YAML amplification and depth.


class _E(Exception):
    pass


CTX = NodeContext("f.yaml", _E)


@pytest.mark.parametrize("text, says", short_ids([
    (bomb(), "aliases stand for more than"),
    (bomb(as_key=True), "aliases stand for more than"),
    ("a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n", f"more than {MAX_ALIASES} YAML aliases"),
    ("a: &a {b: [*a]}\n", "cycle"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", "levels deep"),
]))
@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
def test_compose_refuses_amplification_fast(text, says, libyaml, monkeypatch):
    if not libyaml:
        monkeypatch.setattr(yamlnodes, "_CParser", None)
    elif yamlnodes._CParser is None:
        pytest.skip("PyYAML here has no libyaml")
    t0 = time.monotonic()
    with pytest.raises(_E) as exc:
        compose(text, CTX)
    assert time.monotonic() - t0 < 1.0
    assert str(exc.value).startswith("f.yaml:") and says in str(exc.value), str(exc.value)


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
@pytest.mark.parametrize("data, line, says", [
    (b"a: 1\nb: x\x00y\n", 2, "character #x0000 is not allowed"),
    (b"a: 1\n\nb: \xe2\x82\xac\x07\n", 3, "character #x0007 is not allowed"),
    (b"a: 1\nb: \xff\n", 2, "not UTF-8"),
    (b"a: 1\nb: [\n", 3, "not valid YAML"),
    (b"\xef\xbb\xbfa: 1\nb: *x\n", 2, "undefined alias"),
])
def test_compose_bad_text_either_parser(data, line, says, libyaml, monkeypatch):
    if not libyaml:
        monkeypatch.setattr(yamlnodes, "_CParser", None)
    with pytest.raises(_E) as exc:
        compose(data, CTX)
    assert str(exc.value).startswith(f"f.yaml:{line}: ") and says in str(exc.value), str(exc.value)


def test_compose_refuses_too_many_values():
    text = "[" + "a, " * 1001 + "]\n"
    with pytest.raises(_E, match=r"^f\.yaml:1: more than 1000 values in one file"):
        compose(text, CTX, max_nodes=1000)
    assert compose(text, CTX, max_nodes=1002) is not None
    assert MAX_NODES >= 100_000


def test_compose_keeps_small_honest_aliases():
    node = compose("t: &t {cosine_min: 0.99}\na: *t\nb: *t\n", CTX)
    assert node is not None and node.value[1][1] is node.value[2][1]
    node = compose("[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n", CTX)
    assert node is not None


_BOMB_CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from pathlib import Path
sys.path.insert(0, sys.argv[1])
kind, path = sys.argv[2], Path(sys.argv[3])
t0 = time.monotonic()
try:
    if kind == "spec":
        from harness.spec.spec import load_spec
        load_spec(root=path.parent)
    else:
        from harness.remote.targets import load_targets_file
        load_targets_file(path, "targets.yaml")
    print("LOADED")
except Exception as exc:
    print(f"{time.monotonic() - t0:.3f} {type(exc).__name__} {exc}")
"""


def _load_in_child(kind: str, path: Path) -> tuple[float, str, str]:
    """Load in a child limited to 2 GiB and 20 s."""
    r = subprocess.run([sys.executable, "-c", _BOMB_CHILD, str(ROOT), kind, str(path)],
                       capture_output=True, text=True, timeout=20)
    out = r.stdout.strip()
    assert r.returncode == 0 and out and out != "LOADED", (r.returncode, out, r.stderr[-500:])
    secs, name, msg = out.split(" ", 2)
    return float(secs), name, msg


@pytest.mark.parametrize("as_key", [False, True])
def test_billion_laughs_in_stages_yaml(fake_lab, as_key):
    write_spec(fake_lab, RICH + bomb(as_key=as_key))
    secs, name, msg = _load_in_child("spec", fake_lab / "stages.yaml")
    assert name == "SpecError" and secs < 1.0, (secs, msg)
    assert re.match(r"^stages\.yaml:\d+: YAML aliases stand for more than", msg), msg


@pytest.mark.parametrize("where", ["value", "key", "inside a target"])
def test_billion_laughs_in_targets_yaml(tmp_path, where):
    if where == "inside a target":
        text = ("version: 1\n" + bomb().split("boom:", 1)[0]
                + "targets:\n  b200:\n    ssh: b200\n    workdir: /w\n    python: python\n    gpus: *l8\n")
    else:
        text = "version: 1\n" + bomb(as_key=where == "key")
    path = tmp_path / "targets.yaml"
    path.write_text(text)
    secs, name, msg = _load_in_child("targets", path)
    assert name == "TargetError" and secs < 1.0, (secs, msg)
    assert re.match(r"^targets\.yaml:\d+: YAML aliases stand for more than", msg), msg


def test_cli_refuses_a_bomb_in_one_line(fake_lab, tmp_path):
    write_spec(fake_lab, RICH + bomb(as_key=True))
    (fake_lab / "targets.yaml").write_text("version: 1\n" + bomb())
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for args, file in ((["list"], "stages.yaml"), (["targets", "list"], "targets.yaml")):
        r = run_cli(args, cwd=fake_lab, env_extra=env, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and f"{file}:" in lines[0] and "aliases" in lines[0], (args, r.stderr)


def test_cli_refuses_deep_nesting_in_the_labs_words(fake_lab, tmp_path):
    """10000 `[`: refused in the lab's own words."""
    write_spec(fake_lab, RICH + "deep: " + "[" * 10000 + "\n")
    (fake_lab / "targets.yaml").write_text("version: 1\ntargets:\n" + "x: " + "{a: " * 10000 + "\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for args, where in ((["list"], "stages.yaml:30: "), (["targets", "list"], "targets.yaml:3: ")):
        r = run_cli(args, cwd=fake_lab, env_extra=env, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"dsv4-lab: {where}"), (args, r.stderr)
        assert f"more than {MAX_DEPTH} levels" in lines[0], (args, r.stderr)


@pytest.mark.parametrize("line", ["[" * 10000, "{a: " * 10000, "[" * 2000 + "]" * 2000],
                         ids=["open-brackets", "open-braces", "closed-brackets"])
@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
def test_compose_refuses_a_deep_line_in_the_labs_words_either_parser(line, libyaml, monkeypatch):
    if not libyaml:
        monkeypatch.setattr(yamlnodes, "_CParser", None)
    elif yamlnodes._CParser is None:
        pytest.skip("PyYAML here has no libyaml")
    with pytest.raises(_E) as exc:
        compose("a: 1\nb: " + line + "\n", CTX)
    assert re.match(rf"^f\.yaml:2: nested more than {MAX_DEPTH} levels deep", str(exc.value)), str(exc.value)


# targets.yaml

TARGETS = """\
version: 1
targets:
  b200:
    ssh: me@b200.example.org
    port: 2222
    workdir: ~/dsv4
    python: python3
    gpus:
      - 0
      - 1
    ssh_options:
      ConnectTimeout: 7
      Compression: true
"""


def test_every_malformed_targets_file_is_one_line(tmp_path):
    path = tmp_path / "targets.yaml"
    path.write_text(TARGETS)
    assert set(load_targets_file(path, "targets.yaml")) == {"b200"}
    cases = variants(TARGETS)
    assert len(cases) > 200
    refused = _refused_in_one_line(cases, lambda text: (path.write_text(text), load_targets_file(path, "targets.yaml")),
                                   TargetError, TARGETS_LINE)
    assert refused > 0.7 * len(cases), refused


@pytest.mark.parametrize("data, line, says", short_ids([
    (TARGETS.encode().replace(b"python3", b"pyth\xc3on3"), 7, "not UTF-8"),
    (TARGETS.encode().replace(b"python3", b"py\x00"), 7, "not allowed"),
    (TARGETS.encode() + b"x: " + b"[" * 10000 + b"\n", 14, "levels deep"),
    (TARGETS.encode().replace(b"port: 2222", b"port: " + b"9" * 5000), 5, "5000 digits"),
    (TARGETS.encode().replace(b"python: python3", b"python: !!python/name:os.system"), 7, "not supported"),
    (b"version: 1\ntargets:\n  b200:\n", 3, "targets.b200: expected a mapping, got nothing"),
    (b"version: 1\ntargets:\n  b200:\n    ssh:\n    workdir: w\n    python: p\n", 4, "targets.b200.ssh: expected"),
    (b"version:\ntargets:\n", 1, "version: unsupported version None"),
    (b"version: 1\ntargets: []\n", 2, "targets: expected a mapping, got a list"),
    (b"version: 1\ntargets:\n  \"b200\\n\":\n    ssh: x\n", 3, "targets.b200\\n: target names"),
]))
def test_bad_targets_files(tmp_path, data, line, says):
    path = tmp_path / "targets.yaml"
    path.write_bytes(data)
    with pytest.raises(TargetError) as exc:
        load_targets_file(path, "targets.yaml")
    msg = str(exc.value)
    assert msg.startswith(f"targets.yaml:{line}: ") and says in msg and "\n" not in msg, msg


def test_empty_targets_key_declares_none_and_a_folder_is_refused(tmp_path):
    path = tmp_path / "targets.yaml"
    path.write_text("version: 1\ntargets:\n")
    assert load_targets_file(path, "targets.yaml") == {}
    path.unlink()
    path.mkdir()
    with pytest.raises(TargetError, match=r"^targets\.yaml:1: is a folder"):
        load_targets_file(path, "targets.yaml")


def test_oversized_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"# " + b"x" * (5 << 20) + b"\n")
    with pytest.raises(_E, match=r"^big\.yaml:1: larger than 4 MiB"):
        read_file(path, NodeContext("big.yaml", _E))
