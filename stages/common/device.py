"""What the kernels size themselves by that belongs to the GPU: the shared memory a CTA may have
and the number of SMs a launch spreads over.

SMEM_LIMIT    the largest dynamic shared memory of one CTA: 227 KiB (232 448 bytes) on sm_90a
              and sm_100a (cudaDevAttrMaxSharedMemoryPerBlockOptin).
sm_count      the SMs of the GPU the case runs on (132 on an H100 SXM or H200, 114 on an H100
              PCIe, 78 on an H20, 148 on a B200), from the driver for device 0, else the arch's
              DEFAULT_SM_COUNT: what the split and part choosers fill and the in-kernel merge's
              residency is judged against; part of the compile cache key (`visible_sm_count()`).
DSV4_SM_COUNT an environment variable standing for it (a positive int), to build and run a case
              as on a GPU of fewer SMs (tests/test_e_gpu.py)."""

from __future__ import annotations

import functools
import os

SMEM_LIMIT = 227 * 1024
DEFAULT_SM_COUNT = {"sm_90a": 132, "sm_100a": 148}  # H100 SXM / H200; B200


ENV = "DSV4_SM_COUNT"


def visible_sm_count() -> int | None:
    """The SM count of CUDA device 0 of this process ($DSV4_SM_COUNT where set), or None where
    there is no GPU (no driver, no device, or an error from either)."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{ENV}={forced!r}: must be a positive int (the SM count to build for), or unset")
        return int(forced)
    return _driver_sm_count()


@functools.cache
def _driver_sm_count() -> int | None:
    """The driver's answer for device 0 (asked once a process)."""
    try:
        import cuda.bindings.driver as cu
    except ImportError:
        return None
    try:
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        err, count = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or count < 1:
            return None
        err, dev = cu.cuDeviceGet(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        err, sms = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        return int(sms) if err == cu.CUresult.CUDA_SUCCESS and sms > 0 else None
    except Exception:  # a driver that cannot answer is no GPU here
        return None


def sm_count(arch: str) -> int:
    """The SM count a kernel for `arch` is built for: the GPU's here, else the arch's default."""
    if arch not in DEFAULT_SM_COUNT:
        raise ValueError(f"sm_count: arch must be one of {sorted(DEFAULT_SM_COUNT)}, got {arch!r}")
    return visible_sm_count() or DEFAULT_SM_COUNT[arch]
