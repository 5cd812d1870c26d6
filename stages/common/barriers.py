"""Named hardware barriers (`bar.sync` / `bar.arrive` ids) of the attention kernels.

Id 0 is the CTA-wide barrier; ids 1 … 15 are named barriers a subset of warps meets at, one id
a meeting (a kernel passes `int(NamedBarrier.X)` and the thread count).  SMEM-P:

    P_FULL   the softmax warpgroup has stored P (and the row factors) and fenced them for the
             async proxy; every consumer warpgroup may run its P·V         (all arrive + wait)
    P_EMPTY  the other consumer warpgroups have finished reading P; the softmax warpgroup may
             overwrite it                                                   (they arrive, it waits)
    EPILOGUE the final row factors (1/ℓ) are published for the epilogue     (all arrive + wait)

On sm100 the tensor-memory allocator's hand-offs (stages/common/sm100_setup.py):

    TMEM_ALLOC the allocating warp has written the TMEM base address to shared memory; the
               warps that use TMEM may read it                              (all arrive + wait)
    TMEM_FREE  every TMEM user is done; the allocating warp may free it     (all arrive + wait)

Stage E on sm90 (met unaligned: stages/common/unaligned_barriers.py):

    STAGED     the producer threads have staged a segment's idx entries in shared memory;
               every producer thread may read them                          (all arrive + wait)
    Q_FREE     warpgroup 0 is past the last S of a segment: Q's shared memory may be loaded
               again                                          (warpgroup 0 arrives + waits)
    FLAG_SEEN  warpgroup 0, piece 0 of a two-piece sequence: its first thread has seen piece
               1's flag; piece 1's LSEs may be read            (warpgroup 0 arrives + waits)
    WINDOW     the producer threads, a streamed segment (idx_windows.py) at a window's first
               tile: every thread's cp.asyncs of the window landed, every thread past the
               window before                                  (all arrive + wait)

This enum is the one registry of the ids.
"""

from __future__ import annotations

import enum


class NamedBarrier(enum.IntEnum):
    SYNC_THREADS = 0  # reserved by the hardware for the CTA-wide barrier
    P_FULL = 1
    P_EMPTY = 2
    EPILOGUE = 3
    TMEM_ALLOC = 4
    TMEM_FREE = 5
    STAGED = 6
    Q_FREE = 7
    FLAG_SEEN = 8
    WINDOW = 10  # (9 was resident_combine's ARRIVED, removed)


MAX_NAMED_BARRIERS = 16
assert max(NamedBarrier) < MAX_NAMED_BARRIERS
