"""The FP8 KV cache on the CUDA cores: block sizes of the layouts, byte-level global and
shared-memory loads, and the dequantisation (stage E's kernels).  The layouts (simple, model1,
v4.1, nvfp4) and their bytes per block: oracles/kvcache.py, the reference.

Dequantising: x = e4m3 · scale, e4m3 → f16x2 (exact) → f32, × scale in f32, → bf16 (nearest
even); e8m0 byte e is 2^(e − 127), made by moving e into an fp32's exponent field."""

import cutlass
import cutlass.cute as cute

D = 512
# The layouts' byte sizes, by name (oracles/kvcache.py states the same; tests/test_e_cpu.py checks
# they agree):
D_NOPE = 448  # model1: the e4m3 ("nope") columns of a token, 7 tiles of 64, one e8m0 scale each
D_ROPE = 64  # model1: the bf16 rope columns after them, not quantised
MODEL1_ROW_BYTES = D_NOPE + 2 * D_ROPE  # 576: a model1 token's data in its block
MODEL1_SCALE_BYTES = 8  # a model1 token's scales: 7 e8m0 + 1 pad, after the block's rows
V41_ROW_BYTES = D + D // 32  # 528: 512 e4m3 then 16 e8m0 (one per 32 values)
NVFP4_NOPE_BYTES = D_NOPE // 2  # 224: nvfp4's packed e2m1 nope, two values a byte
NVFP4_ROW_BYTES = NVFP4_NOPE_BYTES + 2 * D_ROPE  # 352: an nvfp4 token's data in its block
NVFP4_SCALE_BYTES = 32  # an nvfp4 token's scales: 28 e4m3 (one per 16 values) + 4 pad, after the block's rows


def cache_block_bytes(fmt: str, block_size: int) -> int:
    """Bytes of one page block (the kernels' own statement of the layouts; their __call__ checks
    the cache tensors agree)."""
    if fmt == "simple":
        return (block_size * (D + 4) + 15) // 16 * 16
    if fmt == "model1":
        row = MODEL1_ROW_BYTES
        return (block_size * (row + MODEL1_SCALE_BYTES) + row - 1) // row * row
    if fmt == "v4.1":
        return block_size * V41_ROW_BYTES
    if fmt == "nvfp4":
        return block_size * (NVFP4_ROW_BYTES + NVFP4_SCALE_BYTES)
    raise ValueError(f"stage E: kv_format must be simple, model1, v4.1 or nvfp4, got {fmt!r}")


@cute.jit
def ldg_u8(addr) -> cutlass.Int32:
    """The byte at global `addr` (CuTeDSL loads a Uint8 sign-extended: mask it, as e8m0_to_f32 does)."""
    t = cute.make_tensor(cute.make_ptr(cutlass.Uint8, addr, cute.AddressSpace.gmem, assumed_align=1), cute.make_layout(1))
    return cutlass.Int32(t[0])


@cute.jit
def ldg_f32(addr) -> cutlass.Float32:
    t = cute.make_tensor(cute.make_ptr(cutlass.Float32, addr, cute.AddressSpace.gmem, assumed_align=4), cute.make_layout(1))
    return t[0]


@cute.jit
def ldg8(addr, raw, at: cutlass.Constexpr[int]):
    """raw[at : at + 2] (Int32) ← the 8 bytes at the 8-byte aligned global `addr` (one 64-bit load)."""
    g = cute.make_tensor(cute.make_ptr(cutlass.Int32, addr, cute.AddressSpace.gmem, assumed_align=8), cute.make_layout(2))
    cute.autovec_copy(g, cute.make_tensor(raw.iterator + at, cute.make_layout(2)))


@cute.jit
def ldg16(addr, raw, at: cutlass.Constexpr[int]):
    """raw[at : at + 4] (Int32) ← the 16 bytes at the 16-byte aligned global `addr` (one 128-bit load)."""
    g = cute.make_tensor(cute.make_ptr(cutlass.Int32, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(4))
    cute.autovec_copy(g, cute.make_tensor(raw.iterator + at, cute.make_layout(4)))






@cute.jit
def e8m0_to_f32(byte) -> cutlass.Float32:
    """2^(byte − 127), the byte moved into an fp32 exponent field (exact for 1 … 254; 0 reads as 0,
        0xFF as +∞ — no quantiser writes either)."""
    bits = cute.make_rmem_tensor(1, cutlass.Int32)
    bits[0] = (byte & 0xFF) << 23  # the mask matters: CuTeDSL loads a Uint8 with ld.global.s8 (sign-extended)
    return cute.recast_tensor(bits, cutlass.Float32)[0]


@cute.jit
def lds16(addr, raw, at: cutlass.Constexpr[int]):
    """raw[at : at + 4] (Int32) ← the 16 bytes at the 16-byte aligned shared-memory `addr`."""
    t = cute.make_tensor(cute.make_ptr(cutlass.Int32, addr, cute.AddressSpace.smem, assumed_align=16), cute.make_layout(4))
    cute.autovec_copy(t, cute.make_tensor(raw.iterator + at, cute.make_layout(4)))


@cute.jit
def convert16(raw, scale, vals):
    """vals (16 bf16) ← the 16 e4m3 in raw[0:4] (e4m3 → f16x2 → f32) × scale → bf16."""
    q = cute.recast_tensor(cute.make_tensor(raw.iterator, cute.make_layout(4)), cutlass.Float8E4M3FN)
    vals.store((q.load().to(cutlass.Float32) * scale).to(cutlass.BFloat16))
