"""Blackwell (sm_100a) idioms shared by the attention stages: TMEM-P.

TMEM-P: P between two tcgen05 MMAs without leaving the chip
    S = Q·Kᵀ is an fp32 accumulator in TMEM (M = 128, one CTA: lane r row r, column c S[r, c]);
    the second MMA reads P = f(S) (bf16) as its A operand from TMEM ("TS").  A TMEM A operand
    is K-major: lane r holds row r, two bf16 a column (P[r, k] in half of column k / 2).  P
    (128 × 128 bf16, 64 columns) is written inside S's upper half, so S, P and O need S + O.

    `TmemPlan` derives every column offset from the MMAs' fragments
    (`find_tmem_tensor_col_offset`) and checks them against the shapes:
    * S: the QK accumulator, columns [0, s_cols).
    * P: the PV MMA's A-operand fragment (`make_smem_layout_a` of the PV tiler), p_cols =
      K · 16 / 32 columns at s_cols − p_cols; offset in fp32 columns, then recast to bf16.
    * O: the PV accumulator, columns [s_cols, s_cols + o_cols).
    `check_same_fragment_coords` proves the tcgen05.ld fragment of S and the tcgen05.st
    fragment of P hold the same (row, column) at each register index.

SMEM-P (D1, D2 at hd > 64): `check_smem_p` (its docstring).  The checks evaluate coordinates in
plain Python (`fragment_coords`), spot-checked against CuTe's indexing.

Also: the tcgen05 thread-sync fences, the cutlass.pipeline builders, TMEM allocate / free, stage
C's `online_softmax_update`.  The six-warp set-up: sm100_setup.py."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import tcgen05

from stages.common import hang_guard
from stages.common.sm100_coords import NotStatic, identity_coords

TMEM_COL_BITS = 32  # one TMEM column is 32 bits wide in every lane

# Threads whose register fragments are compared at trace time: every lane of
# warp 0 and a few lanes of the other three warps of the softmax warpgroup.
_CHECK_THREADS = tuple(range(32)) + (32, 45, 64, 95, 96, 127)


def tcgen05_fence_before_sync():
    """tcgen05.fence::before_thread_sync: order prior tcgen05 ops before the next sync."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def tcgen05_fence_after_sync():
    """tcgen05.fence::after_thread_sync: order later tcgen05 ops after the last sync."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


def tmem_alloc_cols(used: int) -> int:
    """Columns to pass to tcgen05.alloc for `used` columns: a power of two ≥ 32."""
    alloc = 32
    while alloc < used:
        alloc *= 2
    return alloc


class TmemPlan:
    """Column plan of S (fp32), P (bf16, inside S) and O (fp32) in TMEM, built host-side: every
        attribute a Python int (a compile-time constant)."""

    def __init__(self, qk_mma, pv_mma, qk_tiler, pv_tiler, p_layout, acc_dtype, p_dtype):
        s_frag = qk_mma.make_fragment_C(qk_mma.partition_shape_C(qk_tiler[:2]))
        o_frag = pv_mma.make_fragment_C(pv_mma.partition_shape_C(pv_tiler[:2]))
        # P's view is the PV MMA's A operand (K-major, from TMEM), never a
        # re-interpretation of the QK accumulator.
        p_frag = pv_mma.make_fragment_A(p_layout.outer.shape)[None, None, None, 0]

        self.s_cols = tcgen05.find_tmem_tensor_col_offset(s_frag)
        self.o_cols = tcgen05.find_tmem_tensor_col_offset(o_frag)
        self.p_cols = tcgen05.find_tmem_tensor_col_offset(p_frag)

        # The P column count follows the PV tiler's K extent (the KV tile),
        # not its N extent (hd).  A tagged or otherwise odd offset fails here.
        kv_tile = pv_tiler[2]
        if self.s_cols != qk_tiler[1] * acc_dtype.width // TMEM_COL_BITS:
            raise ValueError(f"TMEM-P: S spans {self.s_cols} columns, expected {qk_tiler[1]}")
        if self.p_cols != kv_tile * p_dtype.width // TMEM_COL_BITS:
            raise ValueError(f"TMEM-P: P spans {self.p_cols} columns, expected {kv_tile} × 16 / 32")
        if self.o_cols != pv_tiler[1] * acc_dtype.width // TMEM_COL_BITS:
            raise ValueError(f"TMEM-P: O spans {self.o_cols} columns, expected {pv_tiler[1]}")
        if self.p_cols > self.s_cols:
            raise ValueError("TMEM-P: P does not fit inside S's columns")

        self.s_col = 0
        self.p_col = self.s_col + self.s_cols - self.p_cols  # upper part of S
        self.o_col = self.s_col + self.s_cols
        used = self.o_col + self.o_cols
        self.alloc_cols = tmem_alloc_cols(used)

        self.s_layout = s_frag.layout
        self.o_layout = o_frag.layout
        self.p_layout = p_frag.layout
        self.p_dtype = p_dtype

    def views(self, tmem_ptr):
        """(tStS, tOrP, tOtO): S, P and O as TMEM tensors, given the fp32 base pointer."""
        tStS = cute.make_tensor(tmem_ptr + self.s_col, self.s_layout)
        tOtO = cute.make_tensor(tmem_ptr + self.o_col, self.o_layout)
        # Offset in fp32 columns first, then recast: the bf16 offset is 2 × columns.
        p_ptr = cute.recast_ptr(tmem_ptr + self.p_col, dtype=self.p_dtype)
        tOrP = cute.make_tensor(p_ptr, self.p_layout)
        return tStS, tOrP, tOtO


def fragment_coords(t, spot_check: bool = True) -> list:
    """[t[i] for i in range(size(t))] of an identity-coordinate partition, evaluated in plain Python
        (sm100_coords.identity_coords), no traced operation per element.  `spot_check`: compared
        with CuTe's indexing at the first, a third, the middle and the last register (raises on a
        disagreement).  A tensor Python does not cover (dynamic, nested) is indexed element by element."""
    n = cute.size(t)
    try:
        coords = identity_coords(t)
    except NotStatic:
        return [t[i] for i in range(n)]
    if len(coords) != n:
        raise ValueError(f"identity_coords gives {len(coords)} coordinates for a tensor of {n}")
    if spot_check:
        for i in sorted({0, n // 3, n // 2, n - 1}):
            if t[i] != coords[i]:
                raise ValueError(f"identity_coords: register {i} evaluates to {coords[i]}, CuTe says {t[i]}")
    return coords


def check_same_fragment_coords(load, load_coords, store, store_coords, what):
    """Trace-time proof that a tiled tcgen05.ld and a tiled tcgen05.st give every thread the same
        (row, column) at the same register index (load_coords / store_coords: identity tensors
        partitioned like each copy's TMEM tensor, e.g. partition_C of QK, partition_A of PV)."""
    for t in _CHECK_THREADS:
        spot = t == _CHECK_THREADS[0]
        ld_list = fragment_coords(load.get_slice(t).partition_D(load_coords), spot)
        st_list = fragment_coords(store.get_slice(t).partition_S(store_coords), spot)
        if ld_list != st_list:
            raise ValueError(
                f"{what}: TMEM load and store register fragments disagree for thread {t}"
            )


def mk_view(t: cute.Tensor) -> cute.Tensor:
    """(M, K) view of an A-operand tensor ((M_atom, K_atom), M_rest, K_rest):
    m = m_atom + M_atom·m_rest, k = k_atom + K_atom·k_rest (same iterator)."""
    s, d = t.layout.shape, t.layout.stride
    layout = cute.make_layout(
        ((s[0][0], s[1]), (s[0][1], s[2])), stride=((d[0][0], d[1]), (d[0][1], d[2]))
    )
    return cute.make_tensor(t.iterator, layout)


def check_smem_p(s_load, cS, p_copy, cA, rows: int, kv_tile: int) -> None:
    """Trace-time proof for SMEM-P: (1) the (M, K) view of the PV MMA's A-operand partition `cA` is
        the identity on (row, key) over the rows × kv_tile tile; (2) for each checked thread,
        register i of its tcgen05.ld fragment of S (`s_load` over `cS`) and of its shared-memory
        copy fragment (`p_copy`) hold the (row, key) of the element it writes."""
    cA_mk = mk_view(cA)
    if tuple(cute.size(cA_mk, mode=[i]) for i in range(2)) != (rows, kv_tile):
        raise ValueError(f"SMEM-P: the A-operand (M, K) view is not {rows} × {kv_tile}")
    mk = fragment_coords(cA_mk)  # index m + rows·k ↔ (m, k): a 2-mode layout's index order
    for k in range(kv_tile):
        for m in range(rows):
            if mk[m + rows * k] != (m, k):
                raise ValueError(f"SMEM-P: A-operand (M, K) view maps {(m, k)} to {mk[m + rows * k]}")
    c_mk = cute.make_identity_tensor((rows, kv_tile))
    for t in _CHECK_THREADS:
        spot = t == _CHECK_THREADS[0]
        reg = fragment_coords(p_copy.get_slice(t).retile(s_load.get_slice(t).partition_D(cS)), spot)
        dst = fragment_coords(p_copy.get_slice(t).partition_D(c_mk), spot)
        if reg != dst:
            raise ValueError(f"SMEM-P: S-load and P-store fragments disagree for thread {t}")


# ---------------------------------------------------------------------------------------
# Pipelines (arrive counts in threads; an elected thread or a tcgen05.commit counts 1)


def tma_umma_pipeline(mbar, stages: int, tx_bytes: int, name: str = ""):
    """PipelineTmaUmma over `mbar` (2 × `stages` Int64): an elected producer whose TMA bytes
        (`tx_bytes` a slot) complete the full barrier → the MMA warp, releasing by tcgen05.commit.
        Returns (producer, consumer)."""
    one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    return pipeline.PipelineTmaUmma.create(
        num_stages=stages, producer_group=one, consumer_group=one,
        tx_count=tx_bytes, barrier_storage=mbar.data_ptr(), name=hang_guard.name(name),
    ).make_participants()


def umma_to_threads_pipeline(mbar, threads: int, stages: int = 1, name: str = ""):
    """PipelineUmmaAsync: MMA commit → `threads` consumer threads, each arriving on release.
        Returns (producer, consumer)."""
    return pipeline.PipelineUmmaAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads),
        barrier_storage=mbar.data_ptr(), name=hang_guard.name(name),
    ).make_participants()


def threads_to_umma_pipeline(mbar, threads: int, stages: int = 1, name: str = ""):
    """PipelineAsyncUmma: `threads` producer threads → the MMA warp, whose release is a
        tcgen05.commit ("slot free" = the MMAs that read it completed).  Returns (producer, consumer)."""
    return pipeline.PipelineAsyncUmma.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        barrier_storage=mbar.data_ptr(), name=hang_guard.name(name),
    ).make_participants()


# ---------------------------------------------------------------------------------------
# TMEM


def tmem_allocate(tmem_alloc, cols: int, dtype=cutlass.Float32):
    """Allocate `cols` TMEM columns: the allocator warp's tcgen05.alloc, every thread waits on the
        retrieve barrier and reads the base pointer (as `dtype`), then the permit is relinquished.
        Call it from every thread of the barrier."""
    tmem_alloc.allocate(cols)
    tmem_alloc.wait_for_alloc()
    tmem_ptr = tmem_alloc.retrieve_ptr(dtype)
    tmem_alloc.relinquish_alloc_permit()
    return tmem_ptr


def tmem_free(tmem_alloc, tmem_ptr, cols: int, done: pipeline.NamedBarrier) -> None:
    """Free TMEM once all its users met on barrier `done` (each fenced before_thread_sync after its
        last access): fence after_thread_sync, the allocator warp's tcgen05.dealloc."""
    done.arrive_and_wait()
    tcgen05_fence_after_sync()
    tmem_alloc.free(tmem_ptr, cols)


def tmem_copy(op, rep, dtype, tmem_tensor: cute.Tensor):
    """A tiled TMEM copy (tcgen05.ld or .st, e.g. op = tcgen05.Ld32x32bOp, rep =
    tcgen05.Repetition.x32) of `dtype` elements over the TMEM tensor it will
    move: thread t of the warpgroup ↔ TMEM lane t."""
    return tcgen05.make_tmem_copy(cute.make_copy_atom(op(rep), dtype), tmem_tensor)


# ---------------------------------------------------------------------------------------
# Online softmax, one thread per row


def online_softmax_update(s, row_max, row_sum, c):
    """One KV tile of the base-2 online softmax for a row this thread owns whole (no shuffles).
        s: raw scores S_j (fp32 TensorSSA); row_max, row_sum: m_{j-1}, l_{j-1}; c = scale · log2 e.
        Returns (p, new_max, alpha, row_sum):

            new_max = max(m_{j-1}, max_k S_j[k])
            alpha   = 2^(m_{j-1} · c − new_max · c)       (0 on the first tile: m_{-1} = −inf)
            p       = 2^(S_j · c − new_max · c)           fp32 TensorSSA
            row_sum = alpha · l_{j-1} + Σ_k p[k]          l_j

        The caller moves row_max to new_max itself (after comparing them)."""
    new_max = cute.arch.fmax(row_max, s.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0))
    new_max_c = new_max * c
    alpha = cute.math.exp2(row_max * c - new_max_c, fastmath=True)  # 0 when j = 0
    p = cute.math.exp2(s * c - new_max_c, fastmath=True)
    row_sum = row_sum * alpha + p.reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
    return p, new_max, alpha, row_sum
