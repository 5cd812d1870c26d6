"""Every sm100 kernel's rounding plan, emulated on the CPU against its stage's tolerances.

E's key scale follows KEY_SCALE; test_old_e_simple_plan_fails_lse shows the check bites.
"""

import ast
import math

import pytest

torch = pytest.importorskip("torch")

from harness.execution.metrics import compare, judge  # noqa: E402
from harness.spec.spec import load_spec  # noqa: E402
from oracles.common import case_seed  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

SPEC = load_spec(ROOT / "stages.yaml", ROOT)
E_SM100 = ROOT / "stages" / "E_sparse_decode" / "sm100.py"


def _bf16(x):
    """float64 → fp32 → bf16 (nearest even) → float64."""
    return x.float().bfloat16().double()


def _f32(x):
    return x.float().double()


def _stage_case(stage: str, **axes) -> dict:
    """A case of `stage`'s test matrix (values must be in it), other axes at their first value."""
    st = SPEC.stages[stage]
    case = {}
    for axis, values in st.matrix.items():
        v = axes.get(axis, values[0])
        assert v in values, f"{stage}: {axis}={v!r} is not in the matrix {values}"
        case[axis] = v
    return case


def _inputs(stage: str, case: dict) -> dict:
    st = SPEC.stages[stage]
    mod = __import__(st.inputs.module, fromlist=[st.inputs.name])
    return getattr(mod, st.inputs.name)(case, case_seed(stage, case))


def _reference(stage: str, inputs: dict, case: dict) -> dict:
    st = SPEC.stages[stage]
    mod = __import__(st.oracle.module, fromlist=[st.oracle.name])
    return getattr(mod, st.oracle.name)(inputs, case)


def _verdict(stage: str, outs: dict, ref: dict, case: dict) -> tuple[str, str | None, dict]:
    tolerances = SPEC.stages[stage].tolerances_for(case)
    # O_scale not emulated (bf16 here)
    tolerances = {n: t for n, t in tolerances.items() if not (stage == "E" and n == "O_scale")}
    metrics = {name: compare(outs[name], ref[name]).to_json() for name in tolerances}
    verdict, why = judge(tolerances, metrics)
    return verdict, why, metrics


# The kernels' arithmetic


def online_attention(q, k, v, valid, scale: float, tile: int, k_scale=None, sink=None):
    """sm100 attention arithmetic over G groups -> (O [G, R, dv], LSE [G, R]).

    Online softmax per `tile` keys; k_scale on S and on P (after ℓ, before bf16); sink folded in."""
    G, R, _ = q.shape
    N, dv = k.shape[1], v.shape[2]
    m = torch.full((G, R), -math.inf, dtype=torch.float64)
    l = torch.zeros(G, R, dtype=torch.float64)
    o = torch.zeros(G, R, dv, dtype=torch.float64)
    valid = valid.expand(G, R, N)
    for t0 in range(0, N, tile):
        sl = slice(t0, min(N, t0 + tile))
        s = torch.einsum("grd,gnd->grn", q, k[:, sl])
        if k_scale is not None:
            s = _f32(s * k_scale[:, None, sl])
        s = s.masked_fill(~valid[:, :, sl], -math.inf) * scale
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(dim=-1)
        pv = p * k_scale[:, None, sl] if k_scale is not None else p
        o = alpha[..., None] * o + torch.einsum("grn,gnd->grd", _bf16(pv), v[:, sl])
        m = m_new
    lonely = l == 0
    lse = torch.where(lonely, torch.full_like(l, math.inf), m + torch.log(torch.where(lonely, torch.ones_like(l), l)))
    o = torch.where(lonely[..., None], torch.zeros_like(o), o / torch.where(lonely, torch.ones_like(l), l)[..., None])
    if sink is not None:
        factor = 1.0 / (1.0 + torch.exp(sink - torch.where(lonely, torch.zeros_like(lse), lse)))
        o = o * torch.where(lonely, torch.zeros_like(factor), factor)[..., None]
    return o, lse


def _decode_out(o, lse, b: int, s_q: int, h_q: int) -> dict:
    """[b, s_q·h_q] rows → O bf16 [b, s_q, h_q, d], LSE fp32 [b, h_q, s_q]."""
    o = o.reshape(b, s_q, h_q, -1)
    lse = lse.reshape(b, s_q, h_q).permute(0, 2, 1)
    return {"O": _bf16(o).bfloat16(), "LSE": lse.float()}


def emulate_A(inputs, case):
    return {"S": (inputs["Q"].double() @ inputs["K"].double().T).float()}


def emulate_B(inputs, case):
    p = _bf16(inputs["Q"].double() @ inputs["K"].double().T)
    return {"O": (p @ inputs["V"].double()).bfloat16()}


def emulate_C(inputs, case, tile: int = 128):
    q, k, v = (inputs[n].double()[None] for n in ("Q", "K", "V"))
    valid = torch.ones(1, 1, k.shape[1], dtype=torch.bool)
    o, lse = online_attention(q, k, v, valid, 1.0 / math.sqrt(case["hd"]), tile)
    return {"O": _bf16(o[0]).bfloat16(), "LSE": lse[0].float()}


def emulate_D1(inputs, case):
    return emulate_C(inputs, case, tile=128)


def emulate_D2(inputs, case):
    from oracles.decode import parse_shape

    p = parse_shape(case["shape"])
    b, s_q, h_q, n, d = p["b"], p["s_q"], p["h_q"], p["n"], p["d"]
    kv = inputs["KV"][:, :n].double()
    q = inputs["Q"].double().reshape(b, s_q * h_q, d)
    o, lse = online_attention(q, kv, kv, torch.ones(b, 1, n, dtype=torch.bool), 1.0 / math.sqrt(d), 64)
    return _decode_out(o, lse, b, s_q, h_q)


def _masked(inputs, case, kvs, valids, sink):
    from oracles.decode import parse_shape
    from oracles.masked_decode import parse_branch_shape

    shape = case["shape"]
    p = parse_branch_shape(shape) if "m" in shape.split("h")[1] else parse_shape(shape)
    b, s_q, h_q, d = p["b"], p["s_q"], p["h_q"], p["d"]
    # one group per (batch, token)
    q = inputs["Q"].double().reshape(b * s_q, 1, h_q, d).reshape(b * s_q, h_q, d)
    kv = torch.cat([x.double() for x in kvs], dim=1)  # [b, N, d]
    ok = torch.cat(valids, dim=-1).reshape(b * s_q, 1, -1)  # [b·s_q, 1, N]
    kv = torch.where(ok.reshape(b, s_q, -1).any(dim=1)[..., None], kv, torch.zeros_like(kv))  # NaN rows: zeros
    kv = kv.repeat_interleave(s_q, dim=0)
    sk = None if sink is None else sink.double()[None, :]
    o, lse = online_attention(q, kv, kv, ok, 1.0 / math.sqrt(d), 64, sink=sk)
    return _decode_out(o, lse, b, s_q, h_q)


def emulate_D3(inputs, case, causal: bool = False):
    from oracles.decode import parse_shape
    from oracles.masked_decode import valid_keys

    p = parse_shape(case["shape"])
    lens = [int(x) for x in inputs["swa_lens"]]
    return _masked(inputs, case, [inputs["KV"][:, : p["n"]]], [valid_keys(lens, p["n"], p["s_q"], causal)], None)


def emulate_D4(inputs, case):
    return emulate_D3(inputs, case, causal=True)


def emulate_D5(inputs, case):
    from oracles.masked_decode import merge_valids, sink_value

    vm, vs = merge_valids(inputs, case)
    sink = inputs["sink"] if sink_value(case["sink"]) is not None else None
    return _masked(inputs, case, [inputs["KV_main"], inputs["KV_swa"]], [vm, vs], sink)


def e_key_scale_plan() -> dict[str, str]:
    """The E sm100 kernel's KEY_SCALE table, read from its source (no CuTeDSL import)."""
    for node in ast.parse(E_SM100.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KEY_SCALE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{E_SM100}: no KEY_SCALE table (where each format's key scale is applied)")


def _e_branch(inputs, c, fmt: str, extra: bool, plan: str):
    """(K_ring, k_scale or None, valid) of one list, padded to whole 64-key tiles."""
    from oracles import kvcache as kc
    from oracles.sparse_decode import branch_keys

    cache, idx, length, block = ((inputs["KV_extra"], inputs["idx_extra"], inputs["extra_length"], c.extra_block)
                                 if extra else (inputs["KV"], inputs["idx"], inputs["topk_length"], c.block))
    kv, valid = branch_keys(cache, fmt, block, idx, length)  # float64 e4m3 · scale, invalid keys 0
    k_scale = None
    if fmt == "simple":
        safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
        scale = kc.simple_views(cache, block)[1].reshape(-1)[safe].double()  # fp32 per token
        scale = torch.where(valid, scale, torch.zeros_like(scale))
        e4m3 = kv / torch.where(valid, scale, torch.ones_like(scale))[..., None]  # exact
        if plan == "scores":
            kv, k_scale = e4m3, scale
        else:  # the dequantiser's bf16(fp32(e4m3 · scale))
            kv = _bf16(_f32(e4m3 * scale[..., None]))
    else:  # bf16 of the stored values is exact per format
        kv = _bf16(kv)
        assert plan == "keys", f"{fmt}: its e8m0 scale is exact in the key; KEY_SCALE says {plan!r}"
    pad = -idx.shape[-1] % 64
    if pad:
        kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
        if k_scale is not None:
            k_scale = torch.nn.functional.pad(k_scale, (0, pad))
    return kv, k_scale, valid


def emulate_E(inputs, case, plan: dict[str, str] | None = None):
    from oracles.sparse_decode import SparseConfig

    plan = plan or e_key_scale_plan()
    c = SparseConfig.parse(case["config"])
    fmt, b = case["kv_format"], case["b"]
    parts = [_e_branch(inputs, c, fmt, False, plan[fmt])]
    if c.has_extra:
        parts.append(_e_branch(inputs, c, fmt, True, plan[fmt]))
    kv = torch.cat([p[0] for p in parts], dim=2).reshape(b * c.s_q, -1, 512)
    valid = torch.cat([p[2] for p in parts], dim=2).reshape(b * c.s_q, 1, -1)
    k_scale = None
    if parts[0][1] is not None:
        k_scale = torch.cat([p[1] for p in parts], dim=2).reshape(b * c.s_q, -1)
    q = inputs["Q"].double().reshape(b * c.s_q, c.h_q, 512)
    sink = inputs["sink"].double()[None, :]
    o, lse = online_attention(q, kv, kv, valid, 1.0 / math.sqrt(512), 64, k_scale=k_scale, sink=sink)
    return _decode_out(o, lse, b, c.s_q, c.h_q)


def _logits(q, k_e4m3, k_scale, w):
    """fp32(Σ_h w · relu(fp32(q·k))) × k_scale, in fp32: [rows, keys]."""
    s = _f32(torch.einsum("rhd,kd->rhk", q, k_e4m3))
    return _f32(_f32(torch.einsum("rhk,rh->rk", s.clamp(min=0.0), w)) * k_scale[None, :])


def emulate_I1(inputs, case):
    q = inputs["q"].double()
    k = inputs["kv"].double()
    out = _logits(q, k, inputs["kv_scale"].double(), inputs["weights"].double())
    j = torch.arange(k.shape[0])
    valid = (j[None, :] >= inputs["ks"].long()[:, None]) & (j[None, :] < inputs["ke"].long()[:, None])
    return {"logits": torch.where(valid, out, torch.full_like(out, -math.inf)).float()}


def emulate_I2(inputs, case):
    from oracles.indexer import unpack_paged_cache

    q = inputs["q"]
    b, next_n = q.shape[0], q.shape[1]
    table = inputs["block_table"]
    values, scale = unpack_paged_cache(inputs["kv_cache"])
    bk = values.shape[1]
    out = torch.full((b * next_n, table.shape[1] * bk), -math.inf, dtype=torch.float64)
    for i, n in enumerate(inputs["context_lens"].tolist()):
        nblk = math.ceil(n / bk)
        blocks = table[i, :nblk].long()
        k = values[blocks].reshape(nblk * bk, -1)[:n].double()
        ks = scale[blocks].reshape(-1)[:n].double()
        rows = slice(i * next_n, (i + 1) * next_n)
        logit = _logits(q[i].double(), k, ks, inputs["weights"][rows].double())
        j = torch.arange(n)
        pos = torch.arange(n - next_n, n)
        out[rows, :n] = torch.where(j[None, :] <= pos[:, None], logit, torch.full_like(logit, -math.inf))
    return {"logits": out.float()}


EMULATORS = {"A": emulate_A, "B": emulate_B, "C": emulate_C, "D1": emulate_D1, "D2": emulate_D2, "D3": emulate_D3,
             "D4": emulate_D4, "D5": emulate_D5, "E": emulate_E, "I1": emulate_I1, "I2": emulate_I2}

# Small cases of each stage's matrix.
CASES = [
    ("A", {"hd": 512, "n": 128}),
    ("B", {"n": 128, "v_is_k": False}),
    ("C", {"n": 1024, "scores": "wide"}),
    ("D1", {"hd": 512, "n": 256}),
    ("D2", {"shape": "b4s2h128n256d64", "splits": 1}),
    ("D2", {"shape": "b1s1h64n256d512", "splits": 1}),
    ("D3", {"shape": "b4s1h64n256d512", "fill": 65, "splits": 1}),
    ("D4", {"shape": "b4s1h64n256d512", "fill": "at", "splits": 1}),
    ("D5", {"shape": "b4s1h64m128n256d512", "branches": "k+k", "sink": 0, "splits": 1}),
    ("D5", {"shape": "b4s1h64m128n256d512", "branches": "0+k", "sink": 5, "splits": 1}),
    ("I1", {"s": 128, "s_kv": 1024, "ranges": "cp"}),
    ("I2", {"b": 1, "next_n": 2, "ctx": 200}),
]
E_CASES = [
    {"config": "s1h64_m96bs64", "kv_format": fmt, "scenario": sc, "splits": 1, "epilogue": "bf16"}
    for fmt in ("simple", "model1", "v4.1", "nvfp4") for sc in ("plain", "sink", "invalid", "extreme", "lonely")
] + [{"config": "s2h64_m128bs256_x512bs64", "kv_format": fmt, "scenario": sc, "splits": 1, "epilogue": "bf16"}
     for fmt in ("simple",) for sc in ("plain", "sink")]


def _check(stage: str, axes: dict, emulate=None) -> tuple[str, str | None, dict]:
    case = _stage_case(stage, **axes)
    inputs = _inputs(stage, case)
    outs = (emulate or EMULATORS[stage])(inputs, case)
    return _verdict(stage, outs, _reference(stage, inputs, case), case)


def test_every_sm100_kernel_is_emulated():
    """A stage with an sm100 kernel and no emulation here would be unchecked."""
    with_sm100 = {sid for sid, st in SPEC.stages.items() if "sm100" in st.kernels}
    assert with_sm100 <= set(EMULATORS), f"no rounding emulation for {sorted(with_sm100 - set(EMULATORS))}"
    assert with_sm100 <= {s for s, _ in CASES} | {"E"}


@pytest.mark.parametrize("stage,axes", CASES, ids=[f"{s}-{'-'.join(str(v) for v in a.values())}" for s, a in CASES])
def test_sm100_rounding_meets_tolerance(stage, axes):
    verdict, why, metrics = _check(stage, axes)
    assert verdict == "pass", f"{stage} {axes}: the sm100 kernel's arithmetic misses the tolerance: {why} ({metrics})"


@pytest.mark.parametrize("axes", E_CASES, ids=[f"{a['config']}-{a['kv_format']}-{a['scenario']}" for a in E_CASES])
def test_e_sm100_rounding_meets_tolerance(axes):
    verdict, why, metrics = _check("E", {"b": 2, **axes})
    assert verdict == "pass", f"E {axes}: the sm100 kernel's plan {e_key_scale_plan()} misses: {why} ({metrics})"


def test_e_simple_scales_after_the_mma():
    """simple's fp32 key scale is applied in fp32 to S and P, as on sm90."""
    assert e_key_scale_plan() == {"simple": "scores", "model1": "keys", "v4.1": "keys", "nvfp4": "keys"}


@pytest.mark.parametrize("scenario", ["plain", "sink"])
def test_old_e_simple_plan_fails_lse(scenario):
    """The pre-issue-34 plan (bf16(e4m3 × scale) in the ring) misses E's LSE tolerance on `simple`."""
    old = {"simple": "keys", "model1": "keys", "v4.1": "keys"}
    axes = {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "simple", "scenario": scenario, "splits": 1}
    verdict, why, metrics = _check("E", axes, emulate=lambda i, c: emulate_E(i, c, old))
    assert verdict == "fail" and "LSE: rel_l2" in why, (why, metrics)
    assert 1.0e-4 < metrics["LSE"]["rel_l2"] < 1.0e-3, metrics["LSE"]
