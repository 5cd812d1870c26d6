"""A segment's idx entries streamed through shared memory in windows (stage E sm90, topk up to
32768; docs/STAGE_E.md).

A segment (the tiles of one sequence a CTA walks) is staged whole at its start where it is short
(4 · 64 bytes a tile, `chunk` tiles).  Longer than 2·W tiles (W = WINDOW_TILES) it is streamed
through two buffers of W tiles' entries:

    tile i of the segment (i = tile − tile_begin) is in window w = i // W,
    in buffer w mod 2, its key k at entry  (i mod 2W) · 64 + k      (`entry`),

so 2·W·64·4 = 8 KiB of entries at any topk (`staged_tiles`).

The producer threads' order (each calls key_indices once a tile, in tile order):
    segment start   meet (STAGED); cp.async window 0 → buffer 0, commit; window 1 → buffer 1,
                    commit; wait for all but the last group; meet (STAGED)
    tile i = w·W, w ≥ 1, before its entries are read
                    wait for every group; meet (WINDOW: window w landed in every thread, every
                    thread past window w − 1); cp.async window w + 1 → buffer (w + 1) mod 2, commit
so window w + 1 has W tiles' time to land.  A window's entry j is key j mod 64 of tile
tile_begin + w·W + j // 64, its tile picking its list (`list_position`: a window may cross into
the extra list).  Each entry is one 4-byte `cp.async.ca`, predicated off past the segment's tiles
and the list (never judged valid: key_index takes positions below the list's length).
Plain ints (the CPU tests) or traced Int32s."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

WINDOW_TILES = 16  # W: tiles of idx entries a window holds (4 KiB at 64 keys a tile)
ENTRY_BYTES = 4  # an int32 idx entry


def streams(chunk: int, window: int = WINDOW_TILES) -> bool:
    """Whether segments of up to `chunk` tiles are streamed in windows (longer than 2·W)."""
    return chunk > 2 * window


def staged_tiles(chunk: int, window: int = WINDOW_TILES) -> int:
    """Tiles of idx entries the shared memory holds: the whole segment, or two windows."""
    return 2 * window if streams(chunk, window) else chunk


def staged_bytes(chunk: int, keys: int, window: int = WINDOW_TILES) -> int:
    """The shared-memory bytes of the staged entries (`keys` a tile)."""
    return ENTRY_BYTES * keys * staged_tiles(chunk, window)


def entry(i, key, keys: int, window: int = WINDOW_TILES):
    """The staged entry of key `key` of the segment's tile i (streamed: the module doc)."""
    return (i % (2 * window)) * keys + key


def boundary(i, window: int = WINDOW_TILES):
    """Whether the segment's tile i starts a window after the first (its window must be waited
    for and the next one issued).  Ints or traced."""
    if isinstance(i, int):
        return i > 0 and i % window == 0
    return (i > 0) & (i % window == 0)


def window_tile(w, j, keys: int, window: int = WINDOW_TILES):
    """(tile offset in the segment, key) of entry j of window w."""
    return w * window + j // keys, j % keys


def window_slot(w, j, keys: int, window: int = WINDOW_TILES):
    """The staged entry that entry j of window w fills (buffer w mod 2)."""
    return (w % 2) * window * keys + j


def _asm(args, text: str, constraints: str, loc=None, ip=None) -> None:
    llvm.inline_asm(None, args, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def copy4_async_if(smem_addr, gmem_addr, valid, *, loc=None, ip=None) -> None:
    """cp.async.ca of the 4 bytes at global `gmem_addr` to shared `smem_addr` when `valid`
    (nothing read or written otherwise)."""
    _asm([Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
          Int32(cutlass.select_(valid, Int32(1), Int32(0))).ir_value(loc=loc, ip=ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p cp.async.ca.shared.global [$0], [$1], 4;\n}", "r,l,r", loc, ip)


@dsl_user_op
def commit_copies(*, loc=None, ip=None) -> None:
    """Close this thread's cp.async group (cp.async.commit_group)."""
    _asm([], "cp.async.commit_group;", "", loc, ip)


@dsl_user_op
def wait_copies(pending: int, *, loc=None, ip=None) -> None:
    """This thread's cp.async groups have landed but the newest `pending` (cp.async.wait_group)."""
    _asm([], f"cp.async.wait_group {int(pending)};", "", loc, ip)
