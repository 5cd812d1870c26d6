"""Hopper (sm_90a) KV slots: the shared-memory ring a decode kernel's keys pass through, seen as
K and as Vᵀ, addressed by hand where a producer writes it, and the ring's pipeline state.

One slot holds block_n keys × d bf16 columns: Q·Kᵀ reads it as the K-major B operand K (block_n,
d, slots), P·V THE SAME BYTES as the MN-major Vᵀ (d, block_n, slots): Vᵀ(col, key, slot) =
K(key, col, slot).  Both tile keys first from one swizzle atom:
    swizzled  ONE warpgroup's O slice's atom (D2–D5, TMA-filled): each slice a valid descriptor
    INTER     no swizzle, 8 × 8 atoms (stage E, CUDA-core stores): 8 keys' 16 bytes of the same
              columns are 128 contiguous bytes, one warp store instruction
`kv_layouts` builds both and proves (`check_same_bytes`) they address the same element.

A producer addresses a 16-byte piece by its BYTE offset:
    slot_offset(K, key, col, slot) = swizzle(K.outer(key, col, slot) · 2)   (bf16)
    swizzle_bytes(off, B, M, S) = off ^ ((off & ((2^B − 1) << (M + S))) >> S)
(a pointer swizzle acts on bytes).  `piece_strides` proves the offset is row_offset(key mod 8,
col mod 64) + (key // 8)·key8 + (col // 64)·col64 + slot·block_n·d·2 and returns (key8, col64).

ring_state(stages, count, producer): the PipelineState after `count` tiles — slot count mod
stages, phase the parity of count // stages, flipped for the producer (its first wait passes)."""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from stages.common.sm90_smem_p import vt_slice_layout


def _same_bytes_samples(block_n: int, d: int, slice_n: int, stages: int):
    """(key, col, slot) points where K and Vᵀ are compared: every row of the 8-row swizzle pattern and
        the key mode's boundaries × the column boundaries of atom, slice and tile, first and last slot."""
    keys = sorted({*range(8), 8, 9, block_n // 2, block_n - 1})
    cols = sorted({c for c in (0, 1, 7, 8, 15, 16, 31, 32, 63, 64, slice_n - 1, slice_n, slice_n + 1, d - 1) if c < d})
    slots = sorted({0, stages - 1})
    return [(k, c, s) for s in slots for k in keys for c in cols]


def check_same_bytes(k_layout, vt_layout, block_n: int, d: int, slice_n: int, stages: int) -> None:
    """Trace-time proof (sampled, plain Python ints) that Vᵀ(col, key, slot) and K(key, col, slot) are
        the same element."""
    for key, col, slot in _same_bytes_samples(block_n, d, slice_n, stages):
        a, b = k_layout((key, col, slot)), vt_layout((col, key, slot))
        if a != b:
            raise ValueError(
                f"sm90 decode: the V view of the KV tile is not K's bytes: K(key={key}, col={col}, slot={slot}) "
                f"= {a}, Vᵀ(col, key, slot) = {b}"
            )


def kv_layouts(dtype, d: int, block_n: int, stages: int, slice_n: int, swizzled: bool = True):
    """The KV slots' layouts, the same bytes seen as K (block_n, d, stages), S's K-major B operand, and
        Vᵀ (d, block_n, stages), P·V's MN-major B operand; `swizzled` or INTER atoms (module doc);
        proven one buffer by `check_same_bytes`."""
    if swizzled:
        k_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, slice_n)
        k_layout = cute.tile_to_shape(warpgroup.make_smem_layout_atom(k_kind, dtype), (block_n, d, stages), order=(0, 1, 2))
        vt_layout = vt_slice_layout(dtype, d, block_n, stages, slice_n)
    else:
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_INTER, dtype)
        v_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_INTER, dtype)
        k_layout = cute.tile_to_shape(k_atom, (block_n, d, stages), order=(0, 1, 2))
        vt_layout = cute.tile_to_shape(v_atom, (d, block_n, stages), order=(1, 0, 2))
    check_same_bytes(k_layout, vt_layout, block_n, d, slice_n, stages)
    return k_layout, vt_layout


def swizzle_bytes(off, bits: int, base: int, shift: int):
    """Swizzle S<bits, base, shift> on a BYTE offset (as a pointer's swizzle acts): the `bits` bits above
        base + shift XORed into those above base.  SW128 = S<3,4,3>: a 128-byte row's 16-byte piece
        (bits 4 … 6) permuted by the row mod 8 (bits 7 … 9).  Ints or traced Int32s."""
    return off ^ ((off & (((1 << bits) - 1) << (base + shift))) >> shift)


def slot_offset(k_smem, key, col, slot):
    """Byte offset of K[key, col] of `slot`: the K-major layout's element offset × 2, then swizzled as
        bytes (a ComposedLayout would swizzle the element offset: wrong for a pointer swizzle)."""
    sw = k_smem.inner
    return swizzle_bytes(k_smem.outer((key, col, slot)) * 2, sw.num_bits, sw.num_base, sw.num_shift)


def piece_strides(k_layout, block_n: int, d: int, stages: int) -> tuple[int, int]:
    """(key8, col64): the byte strides of 8 keys and 64 columns, after proving every 16-byte piece's
        offset additive in them and the slot; ValueError where it is not."""
    if k_layout.inner.num_base < 4:  # a producer stores whole 16-byte pieces
        raise ValueError(f"sm90 KV slots: the K swizzle {k_layout.inner} splits 16-byte pieces")
    at = lambda key, col, slot: slot_offset(k_layout, key, col, slot)  # noqa: E731
    key8 = at(8, 0, 0) - at(0, 0, 0)
    col64 = at(0, 64, 0) - at(0, 0, 0)
    for key in range(8):
        for col in (0, 8, 16, 24, 32, 40, 48, 56):
            for slot in range(stages):
                for k8 in range(block_n // 8):
                    for c64 in range(d // 64):
                        if at(key + 8 * k8, col + 64 * c64, slot) != at(key, col, 0) + k8 * key8 + c64 * col64 + slot * block_n * d * 2:
                            raise ValueError(f"sm90 KV slots: K slot offsets are not additive at key {key + 8 * k8}, "
                                             f"col {col + 64 * c64}")
    return key8, col64


def ring_state(stages: int, count, producer: bool):
    """The KV ring's pipeline state after `count` tiles (traced): slot count mod stages, phase
    the parity of count // stages — flipped for the producer, whose first wait passes."""
    return pipeline.PipelineState(stages, count, count % stages, ((count // stages) % 2) ^ (1 if producer else 0))
