"""scripts/speed_proofs.py on the CPU: the scratch HEAD is the tree, or E swapped for slow_e."""

import subprocess

from tests.conftest import load_script


def test_scratch_labs_for_both_proofs(tmp_path):
    sp = load_script("speed_proofs")
    aa = sp.scratch_lab(tmp_path / "aa", planted=False)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=aa, capture_output=True, text=True).stdout == ""
    assert not (aa / "results").exists()  # its own notebook
    planted = sp.scratch_lab(tmp_path / "planted", planted=True)
    diff = subprocess.run(["git", "diff", "--stat"], cwd=planted, capture_output=True, text=True).stdout
    assert "stages.yaml | 2 +-" in diff and "1 file changed" in diff, diff
    from harness.spec.spec import load_spec

    st = load_spec(root=planted).stages["E"]
    assert st.kernels["sm_90a"].module == "tests.fixtures.slow_e.sm90"
    assert (planted / "tests" / "fixtures" / "slow_e" / "sm90.py").is_file()
