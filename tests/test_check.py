"""`dsv4-lab check`: each way a new stage can be wrong is one file:line, exit 2; the real lab passes."""

import re
import shutil
import time
from pathlib import Path

import pytest

from harness.spec.scaffold import scaffold_stage
from tests.conftest import FIXTURES, ROOT, run_cli

BASE_ORACLE = (FIXTURES / "broken" / "qk_oracle.py").read_text()
AXES = ["hd=64,128", "n=128", "m=64"]


def _line_of(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in text")


def _bare_lab(dest: Path) -> Path:
    """A lab with no stages yet."""
    (dest / "oracles").mkdir(parents=True)
    (dest / "stages").mkdir()
    (dest / "oracles" / "__init__.py").write_text("")
    (dest / "stages" / "__init__.py").write_text("")
    shutil.copy(ROOT / "oracles" / "common.py", dest / "oracles" / "common.py")
    (dest / "stages.yaml").write_text("# broken stages, one per way of going wrong\nversion: 1\n\nstages:\n")
    return dest


def _stage(lab: Path, sid: str) -> tuple[Path, Path, Path]:
    """Scaffold `sid` with the Q·Kᵀ oracle; its oracle, sm90 and sm100 files."""
    scaffold_stage(lab, sid, AXES, ["Q:m,hd", "K:n,hd"], ["S:m,n:float32"])
    oracle = lab / "oracles" / f"{sid.lower()}.py"
    oracle.write_text(BASE_ORACLE)
    folder = lab / "stages" / f"{sid}_new"
    return oracle, folder / "sm90.py", folder / "sm100.py"


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def _yaml_edit(lab: Path, sid: str, old: str, new: str) -> None:
    """Replace `old` inside stage `sid`'s block of stages.yaml."""
    spec = lab / "stages.yaml"
    text = spec.read_text()
    start = text.index(f"\n  {sid}:\n")
    end = text.find("\n\n", start + 1)
    end = len(text) if end < 0 else end
    block = text[start:end]
    assert old in block, (sid, old)
    spec.write_text(text[:start] + block.replace(old, new, 1) + text[end:])


def _yaml_where(lab: Path, sid: str, needle: str) -> str:
    text = (lab / "stages.yaml").read_text()
    start = text.index(f"\n  {sid}:\n") + 1
    return f"stages.yaml:{text[:start].count(chr(10)) + _line_of(text[start:], needle)}"


def _where(path: Path, needle: str, lab: Path) -> str:
    return f"{path.relative_to(lab).as_posix()}:{_line_of(path.read_text(), needle)}"


def _build_broken(lab: Path) -> dict[str, str]:
    """Stage id -> its problem line's `file:line`."""
    want: dict[str, str] = {}

    o, _, _ = _stage(lab, "OK1")  # a correct stage among them: no line
    o, _, _ = _stage(lab, "TSHAPE")  # wrong output shape
    _edit(o, 'TensorSpec("S", (m, n), "float32", "out")', 'TensorSpec("S", (m, n + 1), "float32", "out")')
    want["TSHAPE"] = _where(o, "def reference(", lab)

    for sid, line in [("ISHAPE", "out['K'] = out['K'][:, :-1]"),  # make_inputs returns K with the wrong shape
                      ("IMISSING", "del out['K']"),  # forgets K
                      ("IDTYPE", "out['Q'] = out['Q'].float()"),  # returns Q as float32
                      ("ICONTIG", "out['Q'] = out['Q'].T.contiguous().T"),  # a transposed view: same shape, not row-major
                      ("IALIGN", "out['K'] = out['K'].reshape(-1).clone().repeat(2)[1:out['K'].numel() + 1]"
                                 ".view(out['K'].shape)")]:  # a view 2 bytes into a larger tensor
        o, _, _ = _stage(lab, sid)
        _edit(o, "    return out\n", f"    {line}\n    return out\n")
        want[sid] = _where(o, "def make_inputs(", lab)

    o, _, _ = _stage(lab, "ORAISE")  # the oracle raises
    _edit(o, '    return {"S": s}', '    s = s / 0 if False else s\n    boom = 1 // 0\n    return {"S": s}')
    want["ORAISE"] = _where(o, "boom = 1 // 0", lab)

    for sid, ret in [("OSHAPE", '{"S": s.T}'), ("OKEYS", '{"s": s}')]:  # the oracle returns Sᵀ; names its output wrongly
        o, _, _ = _stage(lab, sid)
        _edit(o, '    return {"S": s}', f"    return {ret}")
        want[sid] = _where(o, "def reference(", lab)

    _stage(lab, "TOLKEY")  # a tolerance key `s` for output `S`
    _yaml_edit(lab, "TOLKEY", "      S: {cosine_min", "      s: {cosine_min")

    _stage(lab, "AXIS")  # a matrix axis Kernel.__init__ does not take
    _yaml_edit(lab, "AXIS", "      m: [64]\n", "      m: [64]\n      extra: [1, 2]\n")

    _, k90, _ = _stage(lab, "INITREQ")  # __init__ requires a parameter that is no axis
    _edit(k90, "def __init__(self, *, hd: int, n: int, m: int):", "def __init__(self, *, hd: int, n: int, m: int, tile: int):")
    want["INITREQ"] = _where(k90, "def __init__(", lab)

    o, k90, k100 = _stage(lab, "EXTRA")  # one more TensorSpec than __call__ takes
    _edit(o, '        TensorSpec("K", (n, hd), "bfloat16"),\n',
          '        TensorSpec("K", (n, hd), "bfloat16"),\n        TensorSpec("V", (n, hd), "bfloat16"),\n')
    want["EXTRA"] = _where(k90, "def __call__(", lab)

    o, _, _ = _stage(lab, "OIMPORT")  # the oracle module raises at import
    _edit(o, "from oracles.common import TensorSpec\n",
          "from oracles.common import TensorSpec\n\nLIMIT = int('sixty-four')\n")
    want["OIMPORT"] = _where(o, "LIMIT = int(", lab)

    _, _, k100 = _stage(lab, "KIMPORT")  # a kernel module raises at import
    _edit(k100, "import cutlass.cute as cute\n", "import cutlass.cute as cute\nfrom cutlass import no_such_name\n")
    want["KIMPORT"] = _where(k100, "no_such_name", lab)

    _, k90, _ = _stage(lab, "NOINIT")  # no __init__
    _edit(k90, "    def __init__(self, *, hd: int, n: int, m: int):", "    def _unused(self, *, hd: int, n: int, m: int):")
    want["NOINIT"] = _where(k90, "class Kernel", lab)

    _, _, k100 = _stage(lab, "NOCALL")  # a kernel class with no __call__
    _edit(k100, "    def __call__(self,", "    def call(self,")
    want["NOCALL"] = _where(k100, "class Kernel", lab)

    o, _, _ = _stage(lab, "FLOPS")  # flops is not a positive number
    _edit(o, '    return 2.0 * case["m"] * case["n"] * case["hd"]', "    return 0")
    want["FLOPS"] = _where(o, "def flops(", lab)
    return want


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    lab = _bare_lab(tmp_path_factory.mktemp("broken") / "lab")
    want = _build_broken(lab)
    want["TOLKEY"] = _yaml_where(lab, "TOLKEY", "s: {cosine_min")
    want["AXIS"] = _yaml_where(lab, "AXIS", "extra: [1, 2]")
    t0 = time.perf_counter()
    r = run_cli(["check"], cwd=lab, env_extra={"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(lab / ".cache")})
    return lab, want, r, time.perf_counter() - t0


def test_check_exits_2_without_traceback(broken):
    _, _, r, _ = broken
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "check: stage-OK1 ok" in r.stdout  # the correct stage passes among the broken ones


@pytest.mark.parametrize("sid", ["TSHAPE", "ISHAPE", "IMISSING", "IDTYPE", "ORAISE", "OSHAPE", "OKEYS", "TOLKEY",
                                 "AXIS", "INITREQ", "EXTRA", "OIMPORT", "KIMPORT", "FLOPS",
                                 "NOINIT", "NOCALL", "ICONTIG", "IALIGN"])
def test_each_breakage_is_one_line_at_the_right_place(broken, sid):
    lab, want, r, _ = broken
    tag = [f"oracles/{sid.lower()}.py", f"stages/{sid}_new/", f"stages.{sid}.", f"stage-{sid},"]
    lines = [ln for ln in r.stderr.splitlines() if any(t in ln for t in tag)]
    assert len(lines) == 1, "\n".join(lines) or r.stderr
    assert lines[0].startswith(want[sid] + ":"), (lines[0], want[sid])
    assert f"check: stage-{sid} ok" not in r.stdout


def test_problem_lines_say_what_is_wrong(broken):
    _, _, r, _ = broken
    err = r.stderr
    assert re.search(r"reference: 'S' has shape \(64, 128\), tensors\(\) declares \(64, 129\)", err)
    assert "make_inputs: 'K' has shape (128, 63), tensors() declares (128, 64)" in err
    assert "make_inputs: missing K" in err
    assert "make_inputs: 'Q' has dtype float32, tensors() declares bfloat16" in err
    assert "in reference: ZeroDivisionError: integer division or modulo by zero" in err
    assert "stages.TOLKEY.tolerances.s: no output 's' (outputs are S) — did you mean 'S'?" in err
    assert "stages.AXIS.matrix.extra: Kernel.__init__ takes no 'extra'" in err
    assert "Kernel.__init__ requires tile" in err
    assert "lists 4 tensors (Q, K, V, S) but __call__ takes 3 (Q, K, S)" in err
    assert "at import: ValueError: invalid literal for int()" in err
    assert "at import: ImportError: cannot import name 'no_such_name'" in err
    assert "flops: returned 0, expected a positive number" in err
    assert "make_inputs: 'Q' is not contiguous (strides (1, 64))" in err
    assert "make_inputs: 'K' is not 16-byte aligned" in err
    assert "Kernel defines no __init__ — it must take the kernel parameters as keywords" in err
    assert "Kernel defines no __call__ — add @cute.jit def __call__(self, Q, K, S, stream)" in err


@pytest.mark.parametrize("where", ["oracle", "kernel"])
def test_syntax_error_is_one_line_naming_file_and_line(tmp_path, where):
    lab = _bare_lab(tmp_path / "lab")
    o, k90, _ = _stage(lab, "SYN")
    path = o if where == "oracle" else k90
    _edit(path, "def __init__(" if where == "kernel" else "def reference(", "def oops(:\n\ndef x(")
    r = run_cli(["check"], cwd=lab, env_extra={"DSV4_LAB_ROOT": str(lab)})
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert _where(path, "def oops(:", lab) in lines[0]


def test_check_passes_on_the_real_lab_fast():
    t0 = time.perf_counter()
    r = run_cli(["check"], cwd=ROOT, env_extra={"DSV4_LAB_ROOT": str(ROOT)})
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    from harness.spec.spec import load_spec

    for sid, st in load_spec(root=ROOT).stages.items():
        assert f"check: stage-{sid} ok ({', '.join(st.kernels)})" in r.stdout, r.stdout
    assert r.stderr.strip() == "" and "Traceback" not in r.stdout
    # no compiling, no GPU
    assert seconds < 60, f"check took {seconds:.1f} s"


def test_check_one_stage_by_name():
    r = run_cli(["check", "stage-A"], cwd=ROOT, env_extra={"DSV4_LAB_ROOT": str(ROOT)})
    assert r.returncode == 0 and "stage-A ok" in r.stdout and "stage-B" not in r.stdout


def test_check_unknown_stage_is_one_line():
    from tests.conftest import NO_SUCH_STAGE  # ZZ could be scaffolded

    r = run_cli(["check", NO_SUCH_STAGE], cwd=ROOT, env_extra={"DSV4_LAB_ROOT": str(ROOT)})
    assert r.returncode == 2 and f"no stage '{NO_SUCH_STAGE}'" in r.stderr and "Traceback" not in r.stderr
