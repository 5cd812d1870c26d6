"""Two CTAs of a cluster that fill each other's KV slots (Hopper, distributed shared memory).

Stage E at h_q = 128: the two 64-head blocks of a token walk the same keys, so each CTA of a
(2, 1, 1) cluster dequantises half of every tile and writes each 16-byte piece into its own slot
(st.shared) and the same offset of the peer's (`st.async`, completing a transaction count on the
peer's mbarrier): the kernel's bound, gather and dequantisation, is halved.

Per KV slot s, in each CTA, beside the slot's own pipeline (`full`: the local producer threads,
`empty`: the local consumer threads):

    remote_full[s]   count 1 and PEER_BYTES transactions: the local producer's thread 0 arms it
                     (arrive.expect_tx) when it takes the slot, the peer's st.async bytes complete
                     it.  The consumers wait on it after the pipeline's full barrier.
    remote_empty[s]  count = the peer's consumer warps, each arriving remotely (lane 0, after its
                     local release).  The producer waits on it beside the empty barrier.

Both run in lockstep with the pipeline's states (parities the pipeline's; a producer state starts
at phase 1).  A phase cannot be confused with the next: the peer writes slot s again only after
this CTA's consumers released it, after remote_full[s] completed; bytes landing before thread 0
armed phase p + 1 drive the transaction count negative, and the phase cannot complete while its
one arrival is pending.

Start: barriers initialised, fenced for the cluster, a cluster barrier passed before any remote
operation.  End: a last cluster barrier, so no CTA exits while its peer may still write to it."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm

from stages.common import hang_guard


class TilePair:
    """The remote half of a KV slot ring shared by a cluster's two CTAs (module doc); `enabled`
        False: every method a no-op (one CTA alone).  Built after the shared-memory allocation."""

    def __init__(self, enabled: bool, remote_full, remote_empty, peer_bytes: int, consumer_warps: int):
        self.enabled = enabled
        self.remote_full = remote_full  # Pointer to `stages` Int64 mbarriers
        self.remote_empty = remote_empty
        self.peer_bytes = peer_bytes
        self.consumer_warps = consumer_warps

    # A traced value: the two barrier pointers travel through the kernel's dynamic loops.
    def __extract_mlir_values__(self):
        a = cutlass.extract_mlir_values(self.remote_full)
        self._split = len(a)
        return a + cutlass.extract_mlir_values(self.remote_empty)

    def __new_from_mlir_values__(self, values):
        k = self._split
        return type(self)(self.enabled, cutlass.new_from_mlir_values(self.remote_full, values[:k]),
                        cutlass.new_from_mlir_values(self.remote_empty, values[k:]),
                        self.peer_bytes, self.consumer_warps)

    @cute.jit
    def init(self, stages: cutlass.Constexpr[int], tidx):
        """Thread 0 initialises both rings (call before mbarrier_init_fence)."""
        if cutlass.const_expr(self.enabled):
            if tidx == 0:
                for s in cutlass.range_constexpr(stages):
                    cute.arch.mbarrier_init(self.remote_full + s, 1)
                    cute.arch.mbarrier_init(self.remote_empty + s, self.consumer_warps)

    @cute.jit
    def rank(self):
        """This CTA's rank in the cluster (0 alone)."""
        r = cutlass.Int32(0)
        if cutlass.const_expr(self.enabled):
            r = cute.arch.block_idx_in_cluster()
        return r

    @cute.jit
    def start(self):
        """The CTA-wide barrier after the barrier inits: cluster-wide for a pair."""
        if cutlass.const_expr(self.enabled):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def finish(self):
        """Every thread of the CTA, at its end: no CTA of a pair exits before its peer is done
        with it."""
        if cutlass.const_expr(self.enabled):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def producer_acquire(self, state, ptid):
        """After the pipeline's producer_acquire: wait until the peer's consumers released slot
        state.index, then (thread 0) arm this CTA's remote_full for the peer's bytes."""
        if cutlass.const_expr(self.enabled):
            hang_guard.mbarrier_wait(self.remote_empty + state.index, state.phase, "pair.remote_empty", state.index)
            if ptid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(self.remote_full + state.index, self.peer_bytes)

    @cute.jit
    def consumer_wait(self, state):
        """After the pipeline's consumer_wait: the peer's half of the slot has landed."""
        if cutlass.const_expr(self.enabled):
            hang_guard.mbarrier_wait(self.remote_full + state.index, state.phase, "pair.remote_full", state.index)

    @cute.jit
    def consumer_release(self, state):
        """Beside consumer_release, one lane of each consumer warp (warp synced) tells the peer's
                producer this CTA is done with the slot."""
        if cutlass.const_expr(self.enabled):
            # relaxed: the warp's reads of the slot (wgmma) are complete and nothing it wrote
            # is published; a release at cluster scope costs a MEMBAR.ALL.GPU per tile (ncu:
            # 15 % of the MMA warps' stall samples)
            cute.arch.mbarrier_arrive(self.remote_empty + state.index, peer_cta_rank_in_cluster=self.rank() ^ 1,
                                      relaxed=True, scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def store16(self, addr, words, state):
        """16 bytes (`words`, 4 Int32) to shared byte address `addr` here and, in a pair, at
                `peer_address` in the peer (st.async, counted on its remote_full of the slot)."""
        dst = cute.make_ptr(cutlass.Int32, addr, cute.AddressSpace.smem, assumed_align=16)
        cute.autovec_copy(words, cute.make_tensor(dst, cute.make_layout(4)))
        if cutlass.const_expr(self.enabled):
            peer = cute.make_ptr(cutlass.Int32, self.peer_address(addr, state), cute.AddressSpace.smem, assumed_align=16)
            cute.arch.store_async_dsmem(peer, (words[0], words[1], words[2], words[3]),
                                        self.remote_full + state.index, self.rank() ^ 1)

    def peer_address(self, addr, state):
        """Where in the peer a piece stored at `addr` here goes: the same offset (the planted
        bug tests/fixtures/wrong_e_pair moves it)."""
        return addr
