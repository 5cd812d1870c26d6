"""Blackwell (sm_100a) idioms shared by the attention stages: TMEM-P.

TMEM-P: P between two tcgen05 MMAs without leaving the chip
    The first MMA leaves S = Q·Kᵀ as an fp32 accumulator in tensor memory
    (TMEM): with M = 128 and one CTA, TMEM lane r holds row r of S and fp32
    column c holds S[r, c].  The second MMA reads P = f(S) (bf16) as its A
    operand straight from TMEM ("TS" MMA).  An A operand in TMEM is always
    K-major: lane r holds row r of P, two bf16 per 32-bit column, so P[r, k]
    sits in the low/high half of column k / 2.  P (128 × 128 bf16) needs
    64 columns; it is written *inside* S's 128 fp32 columns, in their upper
    half, so S, P and O need only S + O columns.

    `TmemPlan` derives every column offset from the fragments the two tiled
    MMAs build (`find_tmem_tensor_col_offset`), never from hand-written
    numbers, and checks them against the shapes at trace time:

    * S: the QK accumulator, columns [0, s_cols).
    * P: the PV MMA's A-operand fragment, built from the PV MMA's A-operand
      layout (`make_smem_layout_a` of the PV tiler; its K mode is the PV
      tiler's K = the KV tile), `p_cols` = K · 16 / 32 columns, placed at
      fp32 column s_cols − p_cols.  The pointer is offset in fp32 columns and
      only then recast to bf16, so the bf16 element offset is 2 × columns.
    * O: the PV accumulator, columns [s_cols, s_cols + o_cols).

    `check_same_fragment_coords` proves at trace time that the per-thread
    register fragment of a tcgen05.ld of S and the per-thread register
    fragment of a tcgen05.st into P's A-operand view hold the same (row,
    column) at the same register index, so P = bf16(S) is an element-wise
    conversion of the same registers.  If that ever failed, compilation
    stops instead of the kernel computing with a permuted P.  (The same
    check serves any TMEM load/store pair, e.g. the O rescale.)

Cross-thread ordering of tcgen05 operations
    `tcgen05_fence_before_sync` / `tcgen05_fence_after_sync` emit
    tcgen05.fence::before_thread_sync / ::after_thread_sync, the PTX fences
    that order asynchronous tcgen05 operations (ld/st/mma) around an
    execution-ordering synchronisation (mbarrier arrive/wait, bar.sync).
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import tcgen05

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


class TmemPlan:
    """Column plan of S (fp32), P (bf16, inside S) and O (fp32) in TMEM.

    Build it in the host-side (`@cute.jit`) code; every attribute is a Python
    int, so the kernel can use it as a compile-time constant.
    """

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
        alloc = 32
        while alloc < used:  # tcgen05.alloc: a power of two ≥ 32 columns
            alloc *= 2
        self.alloc_cols = alloc

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


def check_same_fragment_coords(load, load_coords, store, store_coords, what):
    """Trace-time proof that a tiled tcgen05.ld and a tiled tcgen05.st give
    every thread the same (row, column) at the same register index.

    load / store: tiled TMEM copies; load_coords / store_coords: identity
    tensors of the tile partitioned like the TMEM tensor each copy was built
    on (e.g. partition_C of the QK MMA for S, partition_A of the PV MMA for P).
    """
    for t in _CHECK_THREADS:
        ld_crd = load.get_slice(t).partition_D(load_coords)
        st_crd = store.get_slice(t).partition_S(store_coords)
        ld_list = [ld_crd[i] for i in range(cute.size(ld_crd))]
        st_list = [st_crd[i] for i in range(cute.size(st_crd))]
        if ld_list != st_list:
            raise ValueError(
                f"{what}: TMEM load and store register fragments disagree for thread {t}"
            )
