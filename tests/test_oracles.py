"""Oracles vs independent float64 computations; generators seeded, never zeros, never constant."""

import math

import pytest
import torch

from oracles import attention, qk
from oracles.common import case_seed


def loops_matmul_t(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[math.fsum(x * y for x, y in zip(row, col)) for col in b] for row in a]


@pytest.mark.parametrize("hd", [64, 128, 256, 512])
def test_qk_oracle_matches_plain_python(hd):
    case = {"m": 8, "n": 16, "hd": hd}
    inputs = qk.make_inputs(case, seed=case_seed("A", case))
    ref = qk.reference(inputs, case)["S"]
    want = loops_matmul_t(inputs["Q"].double().tolist(), inputs["K"].double().tolist())
    assert torch.allclose(ref, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert [s.shape for s in qk.tensors(case)] == [(8, hd), (16, hd), (8, 16)]


def test_generators_are_seeded_and_never_degenerate():
    case = {"m": 128, "n": 256, "hd": 64}
    a = qk.make_inputs(case, 7)
    b = qk.make_inputs(case, 7)
    c = qk.make_inputs(case, 8)
    assert torch.equal(a["Q"], b["Q"]) and not torch.equal(a["Q"], c["Q"])
    for t in a.values():
        assert t.abs().min() >= 0 and t.float().std() > 0.5 and (t != 0).float().mean() > 0.99
    assert case_seed("A", case) == case_seed("A", dict(reversed(list(case.items()))))


def softmax_loops(q, k, v, scale):
    out, lse = [], []
    for qi in q:
        s = [math.fsum(a * b for a, b in zip(qi, kj)) * scale for kj in k]
        mx = max(s)
        e = [math.exp(x - mx) for x in s]
        tot = math.fsum(e)
        out.append([math.fsum(e[j] * v[j][d] for j in range(len(v))) / tot for d in range(len(v[0]))])
        lse.append(mx + math.log(tot))
    return out, lse


@pytest.mark.parametrize("scores", ["normal", "wide"])
@pytest.mark.parametrize("hd", [64, 128, 256, 512])
def test_softmax_oracle_matches_plain_python(scores, hd):
    case = {"m": 4, "n": 128, "hd": hd, "scores": scores}
    inputs = attention.softmax_inputs(case, seed=3)
    ref = attention.softmax_reference(inputs, case)
    o, lse = softmax_loops(inputs["Q"].double().tolist(), inputs["K"].double().tolist(),
                           inputs["V"].double().tolist(), 1 / math.sqrt(hd))
    assert torch.allclose(ref["O"], torch.tensor(o, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(ref["LSE"], torch.tensor(lse, dtype=torch.float64), atol=1e-10)


def test_wide_scores_really_are_wide_and_move_the_max_late():
    case = {"m": 128, "n": 1024, "hd": 64, "scores": "wide"}
    inputs = attention.softmax_inputs(case, seed=1)
    s = (inputs["Q"].double() @ inputs["K"].double().T) / 8.0
    assert s.max() - s.min() > 100
    # a missing rescale shows
    assert (s.argmax(dim=1) >= 1024 - 128).float().mean() > 0.3


def test_identity_oracle_rounds_p_to_bf16_and_honours_v_is_k():
    case = {"m": 8, "n": 128, "hd": 64, "v_is_k": True}
    inputs = attention.identity_inputs(case, seed=5)
    assert inputs["V"].data_ptr() == inputs["K"].data_ptr()
    ref = attention.identity_reference(inputs, case)["O"]
    s = loops_matmul_t(inputs["Q"].double().tolist(), inputs["K"].double().tolist())
    p = torch.tensor(s, dtype=torch.float32).to(torch.bfloat16).double()
    assert torch.allclose(ref, p @ inputs["V"].double(), atol=1e-12)
    other = attention.identity_inputs({**case, "v_is_k": False}, seed=5)
    assert not torch.equal(other["V"], other["K"])
