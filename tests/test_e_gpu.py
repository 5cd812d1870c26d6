"""On a GPU: E's planted bugs fail; a grid past the SMs is not merged in-kernel and passes."""

import pytest

from harness.spec.matrix import Case, expand
from harness.spec.spec import load_spec
from tests.conftest import planted, run_cases

pytestmark = pytest.mark.gpu


def _planted(project_root, name: str):
    spec = load_spec(root=project_root)
    return spec, planted(spec, "E", name)


def _run_cases(spec, stage, cases, tmp_path, label: str, want: str) -> None:
    """Run `cases` of `stage` on the GPU; every record `want`, every element written."""
    summary = run_cases(spec, stage, cases, tmp_path)
    assert len(summary.records) == len(cases)
    for rec in summary.records:
        print(label, rec.case, rec.status, rec.metrics.get("O"), rec.error)
        assert rec.status == want, rec.case
        if want == "fail":
            assert all(m["unwritten"] == 0 for m in rec.metrics.values())


def _run_all_fail(project_root, tmp_path, name, keep, count):
    spec, wrong = _planted(project_root, name)
    cases = [c for c in expand(wrong) if keep(c.dict)]
    assert len(cases) == count
    _run_cases(spec, wrong, cases, tmp_path, name, "fail")


def test_lab_catches_a_scale_from_the_wrong_tile(project_root, tmp_path):
    _run_all_fail(project_root, tmp_path, "wrong_e_scale",
                  lambda c: c["kv_format"] == "model1" and c["config"] == "s1h64_m96bs64" and c["splits"] == 1
                  and c["scenario"] in ("plain", "sink", "dup"), 3)


def test_lab_catches_an_nvfp4_scale_from_the_neighbouring_group(project_root, tmp_path):
    """Issue 33: wrong_e_nvfp4_group fails every case, h_q 64 and 128."""
    _run_all_fail(project_root, tmp_path, "wrong_e_nvfp4_group",
                  lambda c: c["kv_format"] == "nvfp4" and c["config"] in ("s1h64_m96bs64", "s2h128_m128bs256_x1024bs64")
                  and c["splits"] == 1 and c["scenario"] in ("plain", "sink", "dup"), 6)


def _all_pass(project_root, tmp_path, select, label: str) -> None:
    """E's cases `select(stage)` picks: every one passes."""
    spec = load_spec(root=project_root)
    _run_cases(spec, spec.stages["E"], select(spec.stages["E"]), tmp_path, label, "pass")


def _nvfp4_cases(stage):
    """The matrix's nvfp4 cases."""
    cases = [c for c in expand(stage) if c.dict["kv_format"] == "nvfp4"]
    assert len(cases) == 108
    return cases


def test_nvfp4_cases_agree_with_the_oracle(project_root, tmp_path):
    """Issue 33.1: every nvfp4 case of the matrix passes."""
    _all_pass(project_root, tmp_path, _nvfp4_cases, "nvfp4")


def test_lab_catches_entries_past_topk_length_honoured(project_root, tmp_path):
    _run_all_fail(project_root, tmp_path, "wrong_e_len",
                  lambda c: c["scenario"] == "topk_len" and c["config"] in ("s1h64_m96bs64", "s2h64_m200bs2_x64bs256")
                  and c["kv_format"] in ("simple", "model1") and c["splits"] == 1, 4)


def test_lab_catches_a_pair_that_fills_the_wrong_slot(project_root, tmp_path):
    """h_q 128: wrong_e_pair (the half sent to the peer's other slot) fails."""
    _run_all_fail(project_root, tmp_path, "wrong_e_pair",
                  lambda c: c["config"] in ("s2h128_m128bs256_x1024bs64", "s1h128_m128bs256_x1024bs2")
                  and c["kv_format"] in ("model1", "v4.1") and c["scenario"] == "plain" and c["splits"] == 1
                  and c["epilogue"] == "bf16", 4)


def test_parts_that_cut_sequences_agree_with_the_oracle(project_root, tmp_path):
    """Parts across sequence boundaries, edge scenarios: all pass."""
    from stages.E_sparse_decode import sm90

    spec = load_spec(root=project_root)
    stage = spec.stages["E"]
    cases = []
    for config, splits in (("s2h128_m128bs256_x1024bs64", 4), ("s2h64_m128bs256_x1024bs64", 4), ("s2h64_m200bs2_x64bs256", 2)):
        k = sm90.Kernel(b=3, config=config, kv_format="model1", splits=splits)
        assert k.partials and any(k.sched.segments(p) > 1 for p in range(k.sched.parts)), config  # it does cross
        for fmt in ("model1", "simple"):
            for scenario in ("sink", "lonely", "topk_len", "extreme"):
                params = dict(b=3, config=config, kv_format=fmt, scenario=scenario, splits=splits, epilogue="bf16")
                cases.append(Case("E", tuple((axis, params[axis]) for axis in stage.matrix)))
    _run_cases(spec, stage, cases, tmp_path, "parts", "pass")


def test_lab_catches_a_rescale_skipped(project_root, tmp_path):
    """wrong_e_rescale fails every `extreme` case."""
    _run_all_fail(project_root, tmp_path, "wrong_e_rescale",
                  lambda c: c["scenario"] == "extreme" and c["splits"] == 1 and c["epilogue"] == "bf16"
                  and c["config"] in ("s2h128_m128bs256_x1024bs64", "s2h64_m200bs2_x64bs256"), 8)


def _merge_cases(stage, sm90):
    """Parts cutting sequences in two (kernel merge and PartCombine), edge scenarios: pass."""
    cases = []
    for config in ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64", "s2h64_m200bs2_x64bs256"):
        k = sm90.Kernel(b=3, config=config, kv_format="model1", splits=2)
        assert k.merges, config  # the kernel merges these itself …
        assert k.combines == (config == "s2h64_m200bs2_x64bs256"), config  # … and launches PartCombine only for more
        for fmt in ("model1", "simple"):
            for scenario in ("sink", "sink_inf", "lonely", "topk_len", "extreme"):
                params = dict(b=3, config=config, kv_format=fmt, scenario=scenario, splits=2, epilogue="bf16")
                cases.append(Case("E", tuple((axis, params[axis]) for axis in stage.matrix)))
    return cases


def test_sequences_cut_in_two_are_merged_by_the_kernel(project_root, tmp_path):
    """Piece 0 merges piece 1's partial after its flag: every case passes."""
    from stages.E_sparse_decode import sm90

    spec = load_spec(root=project_root)
    stage = spec.stages["E"]
    _run_cases(spec, stage, _merge_cases(stage, sm90), tmp_path, "merge", "pass")


def test_lab_catches_a_merge_that_forgets_piece_1(project_root, tmp_path):
    """The same cases with piece 1 dropped (wrong_e_merge) fail."""
    from stages.E_sparse_decode import sm90

    spec, wrong = _planted(project_root, "wrong_e_merge")
    _run_cases(spec, wrong, _merge_cases(wrong, sm90), tmp_path, "wrong_e_merge", "fail")


def _cases(stage, b, configs, scenarios, splits):
    return [Case("E", tuple((axis, dict(b=b, config=config, kv_format=fmt, scenario=scenario, splits=splits, epilogue="bf16")[axis])
                            for axis in stage.matrix))
            for config in configs for fmt in ("model1", "simple") for scenario in scenarios]


def test_a_grid_larger_than_the_resident_set_is_not_merged_and_passes(project_root, tmp_path, monkeypatch):
    """Issue 30.5: b 74 splits 2 pass via PartCombine; $DSV4_SM_COUNT=8: b 3 not merged, pass."""
    from stages.common.device import ENV
    from stages.E_sparse_decode import sm90

    spec = load_spec(root=project_root)
    stage = spec.stages["E"]
    configs = ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64")
    for config in configs:
        k = sm90.Kernel(b=74, config=config, kv_format="model1", splits=2)
        assert k.sched.parts * k.sched.head_blocks > k.sm_count and not k.merges and k.combines, config
    _run_cases(spec, stage, _cases(stage, 74, configs, ("sink", "lonely"), 2), tmp_path / "gpu", "not resident", "pass")

    monkeypatch.setenv(ENV, "8")
    for config in configs:
        whole = sm90.Kernel(b=3, config=config, kv_format="model1", splits=2, sm_count=132)
        k = sm90.Kernel(b=3, config=config, kv_format="model1", splits=2)
        assert whole.merges and k.sm_count == 8 and not k.merges and k.combines, config
    _run_cases(spec, stage, _cases(stage, 3, configs, ("sink", "sink_inf", "lonely", "topk_len"), 2), tmp_path / "small",
               "told of 8 SMs", "pass")


@pytest.mark.parametrize("scenario", ["sink_inf", "topk_len", "lonely", "extreme", "dup", "softmax_scale"])
def test_flashmla_agrees_with_the_oracle_on_model1_bytes(scenario):
    """Issue 14.6: FlashMLA's V4 sparse decode on the stage's bytes agrees with the oracle."""
    import math

    import torch

    from harness.peers import flashmla_sparse, flashmla_sparse_percall, torch_sparse
    from oracles import sparse_decode as sd

    if flashmla_sparse.installed():
        pytest.skip("sgl-flash-mla is not installed (pip install --no-deps sgl-flash-mla)")
    assert "multiples of 64" in flashmla_sparse.unsupported(  # its kernel asserts; the adapter says so first
        "sparse_decode", torch_sparse.sparse_dims(sd.tensors(dict(b=3, config="s2h64_m200bs2_x64bs256", kv_format="model1",
                                                                scenario=scenario, splits=1))), (9, 0))
    for config in ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x512bs64"):
        case = dict(b=3, config=config, kv_format="model1", scenario=scenario, splits=1)
        assert flashmla_sparse.unsupported("sparse_decode", torch_sparse.sparse_dims(sd.tensors(case)), (9, 0)) is None
        inputs = sd.make_inputs(case, seed=21, device="cuda")
        ref = sd.reference(inputs, case)
        out = flashmla_sparse.make("sparse_decode", torch_sparse.sparse_dims(sd.tensors(case)), inputs)()
        # metadata made in the call: the same outputs
        again = flashmla_sparse_percall.make("sparse_decode", torch_sparse.sparse_dims(sd.tensors(case)), inputs)()
        torch.cuda.synchronize()
        assert torch.equal(again["O"], out["O"]) and torch.equal(again["LSE"], out["LSE"]), config
        cos = torch.nn.functional.cosine_similarity(out["O"].double().flatten(), ref["O"].flatten(), dim=0).item()
        lonely_same = torch.equal(out["LSE"] == math.inf, ref["LSE"] == math.inf)
        fin = torch.isfinite(ref["LSE"])
        lse_err = (out["LSE"][fin].double() - ref["LSE"][fin]).abs().max().item() if bool(fin.any()) else 0.0
        print("flashmla", config, scenario, f"cos {cos:.7f}", f"lse err {lse_err:.2e}", "lonely ok", lonely_same)
        assert cos >= 0.9999 and lonely_same and lse_err < 1e-2, (config, scenario)


def test_lab_catches_a_kernel_that_ignores_the_softmax_scale(project_root, tmp_path):
    """Issue 35.1: wrong_e_softmax_scale fails every `softmax_scale` case, passes the `sink` ones."""
    spec, wrong = _planted(project_root, "wrong_e_softmax_scale")
    keep = [c for c in expand(wrong) if c.dict["splits"] == 1 and c.dict["kv_format"] in ("model1", "simple")
            and c.dict["epilogue"] == "bf16"
            and c.dict["config"] in ("s1h64_m96bs64", "s2h128_m128bs256_x1024bs64")]
    scaled = [c for c in keep if c.dict["scenario"] == "softmax_scale"]
    default = [c for c in keep if c.dict["scenario"] == "sink"]
    assert len(scaled) == len(default) == 4
    _run_cases(spec, wrong, scaled, tmp_path / "scaled", "wrong_e_softmax_scale", "fail")
    _run_cases(spec, wrong, default, tmp_path / "default", "wrong_e_softmax_scale", "pass")


def _stream_cases(stage):
    """The matrix's topk 16384 / 32768 cases."""
    from stages.E_sparse_decode import sm90

    cases = [c for c in expand(stage) if c.dict["config"] in
             ("s2h64_m16384bs256", "s1h128_m32768bs256", "s2h64_m1250bs64_x1500bs2", "s2h128_m2048bs256_x1024bs64")]
    streamed = [c for c in cases if sm90.Kernel(b=c.dict["b"], config=c.dict["config"], kv_format=c.dict["kv_format"],
                                                splits=c.dict["splits"]).streams]
    assert (len(cases), len(streamed)) == (25, 20)
    return cases


def test_streamed_idx_windows_agree_with_the_oracle(project_root, tmp_path):
    """Issue 35.1: streamed segments (> 32 tiles): all pass."""
    _all_pass(project_root, tmp_path, _stream_cases, "stream")


def test_lab_catches_a_stream_one_window_behind(project_root, tmp_path):
    """wrong_e_window fails every streamed single-list case."""
    spec, wrong = _planted(project_root, "wrong_e_window")
    cases = [c for c in _stream_cases(wrong) if c.dict["splits"] in (1, 3) and "_x" not in c.dict["config"]]
    assert len(cases) == 8, [c.dict for c in cases]
    _run_cases(spec, wrong, cases, tmp_path, "wrong_e_window", "fail")


def _fp8_cases(stage):
    """The matrix's fp8_rope cases."""
    cases = [c for c in expand(stage) if c.dict.get("epilogue") == "fp8_rope"]
    assert len(cases) == 74, len(cases)
    return cases


def test_fp8_epilogue_agrees_with_the_oracle(project_root, tmp_path):
    """Issue 33.2: every fp8_rope case passes."""
    _all_pass(project_root, tmp_path, _fp8_cases, "fp8_rope")


def test_lab_catches_an_inverse_rotation_with_the_wrong_sign(project_root, tmp_path):
    """wrong_e_rope_sign fails the fp8_rope cases of every path, passes the bf16 ones."""
    spec, wrong = _planted(project_root, "wrong_e_rope_sign")
    # b 2's only row with keys is at position 0
    fp8 = [c for c in _fp8_cases(wrong) if c.dict["scenario"] in ("plain", "sink")
           or (c.dict["splits"] == 3 and c.dict["scenario"] != "lonely")]
    bf16 = [c for c in expand(wrong) if c.dict.get("epilogue") == "bf16" and c.dict["scenario"] == "sink"
            and c.dict["config"] == "s2h64_m128bs256_x512bs64" and c.dict["kv_format"] == "model1"]
    assert len(fp8) == 17 and len(bf16) == 2, (len(fp8), len(bf16))
    _run_cases(spec, wrong, fp8, tmp_path / "fp8", "wrong_e_rope_sign", "fail")
    _run_cases(spec, wrong, bf16, tmp_path / "bf16", "wrong_e_rope_sign", "pass")
