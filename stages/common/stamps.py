"""Timestamps from inside a kernel, for a timeline of one CTA's dependent chain
(scripts/e_small_timeline.py reads them).  A diagnostic build only: at named points the thread
passing writes (%globaltimer ns, %clock64 cycles) into 16 bytes of a per-CTA record — no
barrier, one store — and its outputs are then not results.

    record of CTA c: bytes [c · RECORD_BYTES, (c + 1) · RECORD_BYTES) of the buffer, SLOTS
    stamps of 16 bytes; a slot nobody passed keeps whatever the buffer held."""

from __future__ import annotations

from cutlass import Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

SLOTS = 16
RECORD_BYTES = 16 * SLOTS


@dsl_user_op
def stamp(addr, *, loc=None, ip=None) -> None:
    """(%globaltimer, %clock64) of this thread, now, as two 64-bit words at global byte address
    `addr` (16-byte aligned)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)],
                    "{\n.reg .b64 t, c;\nmov.u64 t, %globaltimer;\nmov.u64 c, %clock64;\n"
                    "st.global.v2.b64 [$0], {t, c};\n}", "l", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
