"""Hopper (sm_90a) kernel set-up: what every sm90 kernel does before its warp roles start, and the
load role's two steps.

A CTA keeps its operands in shared memory, each a staged buffer (the MMA's operand layout with a
trailing "slots" mode and its 128-byte swizzle), fed by TMA through PipelineTmaAsync pipelines
(an elected producer whose TMA bytes complete a slot's FULL barrier, consumer warps arriving
once on its EMPTY one).  The storage holds 2 × slots mbarriers a pipeline, then the buffers,
1024-byte aligned (the swizzle atom's period).  Pieces: TmaPipe, smem_struct,
AttentionOperands (host); smem_tensors, tma_pipelines, tma_tiles, load_once / wait_once,
TileLoader (kernel).  None adds synchronisation of its own."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from stages.common.sm90_idioms import tma_pipeline
from stages.common.tma import tma_partition_tile, tma_produce


class TmaPipe(NamedTuple):
    """One TMA pipeline of a kernel: its mbarriers are the storage field `<name>_mbar`."""

    name: str
    stages: int  # slots
    tx_bytes: int  # what the loads of one slot deposit on its full barrier
    consumer_warps: int  # arrivals per slot on its empty barrier


def smem_struct(pipes, buffers: dict, row_factor_rows: int = 0):
    """The kernel's shared storage (a cute.struct), fields in this order:

        <pipe.name>_mbar  Int64 × 2 · pipe.stages        for each pipe, in order
        row_factor        Float32 × row_factor_rows, 16-byte aligned (only when > 0)
        <buffer name>     dtype × cosize(layout), 1024-byte aligned, for each
                          `buffers[name] = (dtype, staged smem layout)`, in order"""
    fields = {f"{p.name}_mbar": cute.struct.MemRange[cutlass.Int64, 2 * p.stages] for p in pipes}
    if row_factor_rows:
        fields["row_factor"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, row_factor_rows], 16]
    for name, (dtype, layout) in buffers.items():
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
    return cute.struct(type("Smem", (), {"__annotations__": fields}))


def smem_tensors(storage, **layouts):
    """The storage fields named by the keywords, as tensors of their (swizzled, composed)
    layouts, in keyword order: `sQ, sK = smem_tensors(storage, sQ=q_smem, sK=k_smem)`."""
    return tuple(getattr(storage, name).get_tensor(lay.outer, swizzle=lay.inner) for name, lay in layouts.items())


def tma_pipelines(storage, pipes):
    """One PipelineTmaAsync per `TmaPipe` over its `<name>_mbar` field, then the init fence and one
        CTA barrier.  Returns the pipelines in order."""
    made = tuple(
        tma_pipeline(getattr(storage, f"{p.name}_mbar"), p.stages, p.tx_bytes, p.consumer_warps, name=p.name) for p in pipes
    )
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return made


class AttentionOperands(NamedTuple):
    """What an attention kernel's `__call__` builds for its kernel as one argument: the tiled MMAs, the
        TMA atoms and coordinate tensors of Q, K and Vᵀ, their staged layouts."""

    qk_mma: cute.TiledMma
    pv_mma: cute.TiledMma
    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_k: cute.CopyAtom
    mK: cute.Tensor
    tma_v: cute.CopyAtom
    mVt: cute.Tensor
    q_smem: cute.ComposedLayout
    k_smem: cute.ComposedLayout
    v_smem: cute.ComposedLayout


class TmaTiles(NamedTuple):
    """One TMA-loaded operand: the copy atom, the global tiles (tXgX[None, tile…]) and the
    shared-memory slots (tXsX[None, slot]) one copy moves between."""

    atom: cute.CopyAtom
    gmem: cute.Tensor
    smem: cute.Tensor


def tma_tiles(atom, smem: cute.Tensor, gmem: cute.Tensor, tile, coord) -> TmaTiles:
    """`gmem` cut into (rows, cols) `tile`s at `coord` (cute.local_tile; None keeps a mode of
    tiles), partitioned with the staged `smem` so that one copy moves one whole tile."""
    s, g = tma_partition_tile(atom, smem, cute.local_tile(gmem, tile, coord), 2)
    return TmaTiles(atom, g, s)


def load_once(pipe, load: TmaTiles, tile) -> None:
    """Producer of a one-slot pipeline (one thread's warp): global tile `tile` of `load` into
    its only slot, on the slot's full barrier."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    pipe.producer_acquire(state)
    cute.copy(load.atom, load.gmem[(None, tile)], load.smem[(None, 0)], tma_bar_ptr=pipe.producer_get_barrier(state))


def wait_once(pipe) -> None:
    """Consumers of a one-slot pipeline: wait until its one load has landed."""
    pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))


class TileLoader:
    """The producer of a TMA pipeline of `stages` slots: `produce` waits for slot `count mod stages`,
        loads global tile `count` of every operand into it, moves on; `fill(k)` is the prologue.  A
        traced value (its state travels through dynamic loops; call `produce` under the producing
        warp's `if`)."""

    def __init__(self, pipe, loads: tuple, state):
        self.pipe, self.loads, self.state = pipe, loads, state

    @staticmethod
    def create(pipe, stages: int, *loads: TmaTiles) -> "TileLoader":
        return TileLoader(pipe, loads, pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages))

    def produce(self) -> None:
        tma_produce(self.pipe, self.state, *self.loads)
        self.state.advance()

    def fill(self, count: int) -> None:
        for _ in range(count):  # unrolled at trace time
            self.produce()

    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.state)

    def __new_from_mlir_values__(self, values):
        return TileLoader(self.pipe, self.loads, cutlass.new_from_mlir_values(self.state, values))
