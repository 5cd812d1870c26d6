"""Trace-time asserts of the sm100 decode kernels: TMEM tiles, E's gather bytes, launch smem."""

import json
import textwrap

import pytest

from tests.conftest import traced

_PRELUDE = """
    import json, sys
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from harness.execution.compile import _fake_tensor, launch_smem_bytes

    def compile_case(kernel, specs):
        try:
            c = cute.compile(kernel, *[_fake_tensor(s) for s in specs], make_fake_stream())
        except Exception as exc:
            print("REFUSED", exc)
            sys.exit(0)
        print("COMPILED", json.dumps({"launch_smem": launch_smem_bytes(str(c.ir_module)),
                                      "struct": int(kernel.smem_struct.size_in_bytes()),
                                      "margin": kernel.smem_margin}))
"""


def _traced(script: str, tmp_path) -> str:
    r = traced(textwrap.dedent(_PRELUDE) + textwrap.dedent(script), tmp_path)
    return r.stdout + r.stderr


def test_o_tmem_tiles_other_than_the_pv_mma_tile_are_refused(tmp_path):
    """A 256-column O tile: the second PV tile would land outside O; refused."""
    out = _traced("""
        import stages.common.sm100_decode as house
        import stages.D2_decode.sm100 as m
        from oracles.decode import tensors

        class Wide(house._TmemPlan):
            def __init__(self, qk, pv, s_mn, o_mn, o_sub_mn, s_stages):
                super().__init__(qk, pv, s_mn, o_mn, (o_sub_mn[0], o_sub_mn[1] * 2), s_stages)

        house._TmemPlan = Wide
        case = {"shape": "b1s1h128n256d512", "splits": 1}
        compile_case(m.Kernel(**case), tensors(case))
    """, tmp_path)
    assert "COMPILED" not in out, out[-3000:]
    assert "TMEM plan: an O tile takes 256 columns, its MMA's tile is N = 128 fp32 (128 columns)" in out, out[-3000:]


def test_e_gather_bytes_come_from_the_copy_atom_and_must_add_up(tmp_path):
    """A model1 row gathering 512 of 576 bytes is refused at trace time."""
    out = _traced("""
        import stages.E_sparse_decode.sm100 as m
        from oracles.sparse_decode import tensors
        m.GATHER_ROWS["model1"] = (576, 512)
        case = {"b": 2, "config": "s1h64_m96bs64", "kv_format": "model1", "splits": 1}
        compile_case(m.Kernel(b=2, config=case["config"], kv_format="model1", splits=1), tensors(case))
    """, tmp_path)
    assert "COMPILED" not in out, out[-3000:]
    assert "a gather4 tile deposits 4096 bytes" in out and "add up to 36864" in out and "hold 32768" in out, out[-3000:]


@pytest.mark.parametrize("fmt", ["simple", "v4.1"])
def test_e_launch_smem_is_the_struct_within_the_limit_with_its_margin(fmt, tmp_path):
    """The launch's dynamic smem is the struct: 231,424 of 232,448 bytes."""
    out = _traced(f"""
        import stages.E_sparse_decode.sm100 as m
        from oracles.sparse_decode import tensors
        case = {{"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "{fmt}", "splits": 1}}
        compile_case(m.Kernel(b=2, config=case["config"], kv_format="{fmt}", splits=1), tensors(case))
    """, tmp_path)
    assert "COMPILED" in out, out[-3000:]
    info = json.loads(out.split("COMPILED", 1)[1].strip().splitlines()[0])
    assert info["launch_smem"] == [info["struct"]] == [231424], info
    assert info["margin"] == 232448 - 231424 == 1024, info


def test_launch_smem_bytes_reads_each_launch_and_nothing_else():
    from harness.execution.compile import launch_smem_bytes

    cfg = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
    ir = textwrap.dedent(f"""
        llvm.func @host() {{
          %1 = llvm.mlir.constant(231424 : i64) : i64
          %2 = llvm.mlir.constant(7 : i64) : i64
          %3 = llvm.getelementptr %0[0, 2] : (!llvm.ptr) -> !llvm.ptr, {cfg}
          %4 = llvm.getelementptr %0[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i64, i64, i64)>
          llvm.store %2, %4 : i64, !llvm.ptr
          llvm.store %1, %3 : i64, !llvm.ptr
        }}
        llvm.func @combine() {{
          %1 = llvm.mlir.constant(0 : i64) : i64
          %3 = llvm.getelementptr %9[0, 2] : (!llvm.ptr) -> !llvm.ptr, {cfg}
          llvm.store %1, %3 : i64, !llvm.ptr
        }}
    """)
    assert launch_smem_bytes(ir) == [231424, 0]
