"""Blackwell TMA gather4: whole cache rows chosen by index, four per instruction
(cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4; CopyBulkTensor2DGather4G2SOp).

One instruction copies bytes c … c + box − 1 of four rows r0 … r3 of a 2-D tensor map into
shared memory densely (row r_i at i · box).  The cache must be ONE uniform row array (row stride
a multiple of 16; an invalid key's row id is an in-range row never used): a paged cache of
`rows_per_block` rows of `row_bytes` a block is one, token (block, offset) being row block ·
rows_per_block + offset.  The row ids come from a shared-memory ring (`keys` Int32 a slot); copy
k of a tile reads rows 4k … 4k + 3.  A tile deposits keys · box bytes on the caller's mbarrier."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, tcgen05

U8 = cutlass.Uint8


def rows_view(cache: cute.Tensor, block_bytes: int, row_bytes: int, cols: int) -> cute.Tensor:
    """(rows, cols) uint8 view of a paged cache [num_blocks, block_bytes]: row block · (block_bytes /
        row_bytes) + offset, its first `cols` bytes.  ValueError unless it is a uniform row array a
        tensor map can hold (row stride a multiple of 16, blocks whole rows)."""
    if row_bytes % 16 or block_bytes % row_bytes or not 0 < cols <= row_bytes:
        raise ValueError(f"gather4: blocks of {block_bytes} bytes are not rows of {row_bytes} bytes "
                         f"(a multiple of 16) holding {cols} columns")
    rows = cache.shape[0] * (block_bytes // row_bytes)
    return cute.make_tensor(cache.iterator, cute.make_layout((rows, cols), stride=(row_bytes, 1)))


def gather4_atom(data: cute.Tensor, keys: int, box: int, slots: int):
    """(atom, coordinate tensor) of a gather4 load of `keys` rows × `box` bytes of `data`; the
        coordinates are indexed like the row-id ring (keys · slots, cols)."""
    if keys % 4 or box % 16 or box > 256 or cute.size(data, mode=[1]) % box:
        raise ValueError(f"gather4: a tile of {keys} rows × {box} bytes (rows a multiple of 4, "
                         f"16 … 256 bytes dividing the {cute.size(data, mode=[1])} columns)")
    cols = cute.size(data, mode=[1])
    ids = cute.make_tensor(data.iterator, cute.make_layout((keys * slots, cols), stride=(1, 0)))
    one = cute.make_layout((keys, box), stride=(box, 1))
    op = cpasync.CopyBulkTensor2DGather4G2SOp(tcgen05.CtaGroup.ONE)
    return cpasync.make_tiled_tma_atom(op, data, one, (keys, box), gmem_coord_tensor=ids)


def gather4_partition(atom, coords: cute.Tensor, s_raw: cute.Tensor, s_rows: cute.Tensor, keys: int, box: int):
    """(tAsA, tAgA, tAgI) for gather4_tile.  s_raw: the staging ring (keys, box, regions, slots), a
        region one dense tile; s_rows: the row ids, Int32 (keys · slots)."""
    cols = cute.size(coords, mode=[1])
    ids = cute.make_tensor(s_rows.iterator, cute.make_layout((cute.size(s_rows), cols), stride=(1, 0)))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_raw, 0, 2),
                                 [cute.zipped_divide(coords, (keys, box)), cute.zipped_divide(ids, (keys, box))])


def gather4_tile(atom, parts, slot, col_box, region, bar) -> None:
    """Gather box column `col_box` of the rows in row-id slot `slot` into region `region` of staging
        slot `slot` (keys / 4 instructions by one elected thread), completing on mbarrier `bar`."""
    tAsA, tAgA, tAgI = parts
    cute.copy(atom, [tAgA[None, (slot, col_box)], tAgI[None, (slot, col_box)]], tAsA[None, region, slot],
              tma_bar_ptr=bar)
