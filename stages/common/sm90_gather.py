"""The Hopper gather's loads: read-only global loads into registers that yield a fill value when
they are not to be made (stage E sm90: Hopper's TMA cannot gather rows by index).

An invalid key (index −1, or past the list's length) is never read: the load is predicated off
and its registers hold the fill (zeros for cache bytes, −1 for an idx entry) — no branch, so
ptxas interleaves a thread's loads; zero bytes dequantise to 0, so an invalid key's row is zeros
(its score is masked to −∞).  `ld.global.nc`, by default with a 256-byte L2 prefetch (the rest
of a key's 576 bytes); a key's separate scale bytes are loaded without it."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_VEC = {1: "", 2: ".v2", 4: ".v4"}


@dsl_user_op
def ldg_or(addr, valid, words: int, fill: int = 0, prefetch: bool = True, *, loc=None, ip=None) -> tuple[Int32, ...]:
    """`words` (1, 2 or 4) 32-bit words from the global byte address `addr` (aligned to 4 ·
    words) when `valid`, else `fill` in each, nothing read; `prefetch`: with the L2 prefetch
    of the 256 bytes around them."""
    outs = ", ".join(f"${i}" for i in range(words))
    body = "".join(f"mov.b32 ${i}, {fill};\n" for i in range(words))
    operand = outs if words == 1 else "{" + outs + "}"
    asm = ("{\n.reg .pred p;\n"
           f"setp.ne.b32 p, ${words + 1}, 0;\n"
           + body +
           f"@p ld.global.nc{'.L2::256B' if prefetch else ''}{_VEC[words]}.b32 {operand}, [${words}];\n}}")
    res_type = T.i32() if words == 1 else llvm.StructType.get_literal([T.i32()] * words)
    res = llvm.inline_asm(
        res_type,
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(cutlass.select_(valid, Int32(1), Int32(0))).ir_value(loc=loc, ip=ip)],
        asm,
        ",".join(["=r"] * words + ["l", "r"]),
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    if words == 1:
        return (Int32(res),)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(words))
