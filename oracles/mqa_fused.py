"""A fused float64 reference for the MQA logits (oracles/indexer.py `mqa_logits`), as a CuTeDSL
SIMT kernel: the same math, never materialising the [rows, h, keys] scores.

    out[r, j] = Σ_h relu(Σ_d q[r, h, d] · k[j, d]) · w[r, h]   where ks[r] ≤ j < ke[r], else −inf

q [rows, h, d], k [keys, d] (dequantised, key scale inside), w [rows, h] float64; ks, ke int32.
Written from the math (no stages/ code): an independent oracle.

Tiling: a CTA (WARPS warps) per block of BR = WARPS · RW rows × BK = 32 · TK keys.  The CTA
stages its K block transposed in shared memory, kt[d][key] (row stride BK + 1: 2 banks, not 32),
keys past `keys` as 0, only if some row of the block has a key of the block in range.  Warp w
takes RW rows, lane l keys l + 32·i (i < TK).  Per row and chunk of TH heads the warp stages
q[r, chunk, :] as qs[w][d][TH]; each lane accumulates TH × TK fp64 dot products over d, then adds
relu(acc) · w[r, h] to its TK logits, heads in order.  Keys outside [ks, ke) get −inf by
selection.  relu is max.f64: a NaN score gives 0 (the suites' q and k are finite).
Cost: 2·h·d fp64 FMAs per (row, key) of a live block, FMA-bound (32 DFMA per 8 shared loads)."""

import functools
import math

import numpy as np

WARPS, RW, TK, TH = 8, 8, 4, 8
BR, BK = WARPS * RW, 32 * TK
MAX_OFFSET = 2**31 - 1  # the kernel's element offsets are 32-bit: the dispatcher launches row chunks under it


def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float64, Int32

    class MqaFused:
        def __init__(self, h: int, d: int):
            if h % TH or TH * d % 32:
                raise ValueError(f"mqa_fused: heads ({h}) must be a multiple of {TH}, head_dim ({d}) of {32 // TH}")
            self.h, self.d = h, d
            self.smem_bytes = 8 * (d * (BK + 1) + WARPS * d * TH) + 64  # + alignment slack

        @cute.jit
        def __call__(self, q: cute.Pointer, k: cute.Pointer, w: cute.Pointer, ks: cute.Pointer, ke: cute.Pointer,
                     out: cute.Pointer, rows: Int32, keys: Int32, stream):
            self.kernel(q, k, w, ks, ke, out, rows, keys).launch(
                grid=((keys + BK - 1) // BK, (rows + BR - 1) // BR, 1), block=(32 * WARPS, 1, 1),
                smem=self.smem_bytes, stream=stream)

        @cute.kernel
        def kernel(self, q_p: cute.Pointer, k_p: cute.Pointer, w_p: cute.Pointer, ks_p: cute.Pointer,
                   ke_p: cute.Pointer, out_p: cute.Pointer, rows: Int32, keys: Int32):
            h, d = self.h, self.d
            tidx, _, _ = cute.arch.thread_idx()
            kb, rb, _ = cute.arch.block_idx()
            warp, lane = tidx // 32, tidx % 32
            j0, r0 = kb * BK, rb * BR
            q = cute.make_tensor(q_p, cute.make_layout(rows * (h * d)))
            k = cute.make_tensor(k_p, cute.make_layout(keys * d))
            w = cute.make_tensor(w_p, cute.make_layout(rows * h))
            ks = cute.make_tensor(ks_p, cute.make_layout(rows))
            ke = cute.make_tensor(ke_p, cute.make_layout(rows))
            out = cute.make_tensor(out_p, cute.make_layout(rows * keys))
            smem = cutlass.utils.SmemAllocator()
            kt = smem.allocate_tensor(Float64, cute.make_layout((d, BK), stride=(BK + 1, 1)), 16)
            qs = smem.allocate_tensor(Float64, cute.make_layout((WARPS, d, TH), stride=(d * TH, TH, 1)), 16)
            j_end = cutlass.min(j0 + BK, keys)
            # the block is live when some row of it has a key of the block in its range
            live = Int32(0)
            for i in cutlass.range(BR):
                r = r0 + i
                if r < rows:
                    if cutlass.max(ks[r], j0) < cutlass.min(ke[r], j_end):
                        live = Int32(1)
            if live != 0:
                for t in cutlass.range(tidx, BK * d, 32 * WARPS):
                    j, c = t // d, t % d
                    v = Float64(0.0)
                    if j0 + j < keys:
                        v = k[(j0 + j) * d + c]
                    kt[c, j] = v
            cute.arch.sync_threads()
            for i in cutlass.range(RW):
                r = r0 + warp * RW + i
                if r < rows:
                    a, b = ks[r], ke[r]
                    row_live = (live != 0) & (cutlass.max(a, j0) < cutlass.min(b, j_end))
                    logit = cute.make_rmem_tensor(TK, Float64)
                    logit.fill(0.0)
                    if row_live:
                        self.row_logits(q, w, kt, qs, warp, lane, r, logit)
                    for x in cutlass.range_constexpr(TK):
                        j = j0 + lane + 32 * x
                        if j < keys:
                            out[r * keys + j] = cutlass.select_(row_live & (a <= j) & (j < b), Float64(logit[x]), Float64(-math.inf))

        @cute.jit
        def row_logits(self, q, w, kt, qs, warp, lane, r, logit):
            """logit[x] = Σ_h relu(q[r, h] · k[j0 + lane + 32x]) · w[r, h], TH heads at a time."""
            h, d = self.h, self.d
            for hc in cutlass.range(h // TH):
                for t in cutlass.range_constexpr(TH * d // 32):
                    e = lane + 32 * t
                    qs[warp, e % d, e // d] = q[(r * h + hc * TH) * d + e]
                cute.arch.sync_warp()
                acc = cute.make_rmem_tensor(TH * TK, Float64)
                acc.fill(0.0)
                kv = cute.make_rmem_tensor(TK, Float64)
                qv = cute.make_rmem_tensor(TH, Float64)
                for c in cutlass.range(d, unroll=4):
                    for x in cutlass.range_constexpr(TK):
                        kv[x] = kt[c, lane + 32 * x]
                    for y in cutlass.range_constexpr(TH):
                        qv[y] = qs[warp, c, y]
                    for y in cutlass.range_constexpr(TH):
                        for x in cutlass.range_constexpr(TK):
                            acc[y * TK + x] = acc[y * TK + x] + qv[y] * kv[x]
                cute.arch.sync_warp()  # qs is rewritten by the next chunk
                for y in cutlass.range_constexpr(TH):
                    wy = w[r * h + hc * TH + y]
                    for x in cutlass.range_constexpr(TK):
                        s = acc[y * TK + x]
                        logit[x] = logit[x] + cutlass.select_(s > Float64(0.0), Float64(s), Float64(0.0)) * wy

    return MqaFused


@functools.lru_cache(maxsize=None)
def compiled(h: int, d: int):
    """The kernel for (h, d), compiled for this process's CUTE_DSL_ARCH (rows and keys are run-time)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    ptr = [make_ptr(t, 0, cute.AddressSpace.gmem, assumed_align=16)
           for t in (cutlass.Float64,) * 3 + (cutlass.Int32,) * 2 + (cutlass.Float64,)]
    return cute.compile(_kernel_class()(h, d), *ptr, cutlass.Int32(1), cutlass.Int32(1), make_fake_stream())


def row_chunks(rows: int, keys: int, h: int, d: int) -> list[tuple[int, int]]:
    """(first row, rows) of each launch: n · max(keys, h · d) ≤ MAX_OFFSET (the 32-bit offsets),
    every first row a multiple of BR (its slices stay 16-byte aligned)."""
    step = MAX_OFFSET // max(keys, h * d) // BR * BR
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def mqa_logits_fused(q, k, w, ks, ke):
    """float64 [rows, keys]: oracles/indexer.py mqa_logits(q, k, w, valid) with valid[r, j] =
    ks[r] ≤ j < ke[r], on the GPU in one fused kernel.  All CUDA tensors."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import make_ptr

    rows, h, d = q.shape
    keys = k.shape[0]
    if max(BR * keys, keys * d, BR * h * d) > MAX_OFFSET:
        raise ValueError(f"mqa_logits_fused: {keys} keys, h {h}, d {d} exceed the kernel's 32-bit offsets")
    out = torch.full((rows, keys), float("nan"), dtype=torch.float64, device=q.device)  # NaN: none left unwritten
    if rows == 0 or keys == 0:
        return out.fill_(float("-inf"))
    args = [t.to(dt).contiguous() for t, dt in zip((q, k, w, ks, ke), [torch.float64] * 3 + [torch.int32] * 2)]
    args = [t if t.data_ptr() % 16 == 0 else t.clone() for t in args] + [out]  # the pointers assume 16 bytes
    fn, stream = compiled(h, d), cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    for r0, n in row_chunks(rows, keys, h, d):
        ptrs = [make_ptr(cutlass.Float64 if t.dtype == torch.float64 else cutlass.Int32,
                         t.data_ptr() if i == 1 else t[r0:].data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
                for i, t in enumerate(args)]
        fn(*ptrs, cutlass.Int32(n), cutlass.Int32(keys), stream)
    return out


def model_logits(q, k, w, ks, ke) -> np.ndarray:
    """The kernel's tiling in numpy (same blocks, loops and index math; the 32 lanes as a vector):
    a CPU check of the index math.  Arguments as `mqa_logits_fused`, numpy."""
    rows, h, d = q.shape
    keys = k.shape[0]
    out = np.full(rows * keys, np.nan)  # every element must be written
    qf, kf, wf, lane = q.reshape(-1), k.reshape(-1), w.reshape(-1), np.arange(32)
    for kb in range(-(-keys // BK)):
        for rb in range(-(-rows // BR)):
            j0, r0 = kb * BK, rb * BR
            j_end = min(j0 + BK, keys)
            live = any(max(ks[r], j0) < min(ke[r], j_end) for r in range(r0, min(r0 + BR, rows)))
            kt = np.zeros((d, BK))
            if live:
                for t in range(BK * d):
                    j, c = t // d, t % d
                    kt[c, j] = kf[(j0 + j) * d + c] if j0 + j < keys else 0.0
            for warp in range(WARPS):
                for i in range(RW):
                    r = r0 + warp * RW + i
                    if r >= rows:
                        continue
                    a, b = ks[r], ke[r]
                    row_live = live and max(a, j0) < min(b, j_end)
                    logit = np.zeros((TK, 32))
                    for hc in range(h // TH if row_live else 0):
                        qs = np.zeros((d, TH))
                        for t in range(TH * d // 32):
                            e = lane + 32 * t
                            qs[e % d, e // d] = qf[(r * h + hc * TH) * d + e]
                        acc = np.zeros((TH, TK, 32))
                        for c in range(d):
                            kv = np.stack([kt[c, lane + 32 * x] for x in range(TK)])
                            acc += qs[c][:, None, None] * kv[None]
                        for y in range(TH):
                            logit += np.maximum(acc[y], 0.0) * wf[r * h + hc * TH + y]
                    for x in range(TK):
                        j = j0 + lane + 32 * x
                        ok = j < keys
                        val = np.where(row_live & (a <= j) & (j < b), logit[x], -np.inf)
                        out[r * keys + j[ok]] = val[ok]
    return out.reshape(rows, keys)
