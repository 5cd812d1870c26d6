"""No name the installed CuTeDSL deprecates, in sources or at trace time."""

import os
import re
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

LAB_FOLDERS = ("stages", "harness", "oracles", "scripts", "tests")


def _moved_names() -> dict[str, str]:
    """name -> its new home per cutlass.utils."""
    import cutlass.utils as cu

    moved = dict(getattr(cu, "_MOVED_ALIASES", {}) or {})
    moved.setdefault("LayoutEnum", "cutlass.tensor_utils")
    return moved


def test_the_lab_spells_no_moved_cutlass_utils_name_the_old_way():
    moved = _moved_names()
    names = "|".join(map(re.escape, moved))
    old = re.compile(rf"(?<![\w.])(?:cutlass\.)?utils(?:\.layout)?\.({names})\b"
                     rf"|from\s+cutlass\.utils(?:\.layout)?\s+import\s+[^\n]*\b({names})\b")
    found = []
    for folder in LAB_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "test_cutedsl_deprecations.py":
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                m = old.search(line)
                if m:
                    name = m.group(1) or m.group(2)
                    found.append(f"{path.relative_to(ROOT)}:{n}: use {moved[name]}.{name}")
    assert not found, "\n".join(found)


def test_the_shared_sm90_layouts_trace_without_a_deprecation_warning_from_the_lab(tmp_path):
    """The issue's two places trace with deprecations as errors."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import warnings
        warnings.filterwarnings("error", category=DeprecationWarning, module=r"(stages|harness|oracles)(\\.|$)")
        import cutlass
        import cutlass.cute as cute
        from stages.common.sm90_kv_slots import kv_layouts
        from stages.common.sm90_smem_p import vt_slice_layout

        @cute.jit
        def probe():
            vt_slice_layout(cutlass.BFloat16, 512, 64, 2, 256)
            kv_layouts(cutlass.BFloat16, 512, 64, 2, 256)

        probe()
        print("TRACED")
    """))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRACED" in r.stdout, r.stdout + r.stderr[-3000:]
