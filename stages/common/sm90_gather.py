"""The Hopper gather's copies: cp.async that zero-fills what it does not load (stage E sm90).

`cp.async … [dst], [src], cp_size, src_size` reads src_size bytes and writes cp_size, the rest
zeros.  With src_size = 0 for an invalid key (index −1, or past the list's length) the key's row
in the staging ring becomes zeros without a branch: the copy is issued for every key, the address
of an invalid key is clamped to a real one (never read), and the dequantisers convert every row
unconditionally — a zero e4m3 byte with a zero scale byte is 0 (stages/common/e4m3_bits.py keeps
zeros exact), model1's zero rope bf16 are 0.  Branch-free code lets ptxas interleave the keys of
a warp (a branch per key kept them one after another, each waiting on its shuffle and loads).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def cp_async_or_zero(dst, src, nbytes: int, valid, *, loc=None, ip=None) -> None:
    """cp.async `nbytes` (4, 8 or 16; both addresses aligned to it) from global byte address
    `src` to shared-memory byte address `dst` when `valid`, else `nbytes` zeros to `dst` (nothing
    read).  16 bytes bypass L1 (.cg), as stages/common/fp8_cache.cp_async."""
    mode = "cg" if nbytes == 16 else "ca"
    size = cutlass.select_(valid, Int32(nbytes), Int32(0))
    llvm.inline_asm(
        res=None,
        operands_=[Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip), Int32(size).ir_value(loc=loc, ip=ip)],
        asm_string=f"cp.async.{mode}.shared.global [$0], [$1], {nbytes}, $2;",
        constraints="r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
