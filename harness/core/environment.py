"""What machine a result came from: host, GPUs, driver, CUDA, torch, CuTeDSL.

`cutedsl_version()` reads package metadata (no import). The GPU facts need torch and are
read once per worker process.
"""

from __future__ import annotations

import os
import socket
import subprocess
from functools import lru_cache
from importlib import metadata


@lru_cache(maxsize=1)
def cutedsl_version() -> str:
    for dist in ("nvidia-cutlass-dsl", "nvidia_cutlass_dsl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:  # a copy on PYTHONPATH without its dist-info
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))
    except ImportError:
        return "missing"


def arch_of_capability(major: int, minor: int) -> str | None:
    """The stage arch a device can run: 9.0 -> sm_90a, 10.x -> sm_100a."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return None


@lru_cache(maxsize=1)
def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip().splitlines()
        return out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


@lru_cache(maxsize=1)
def gpu_environment() -> dict:
    """Facts about this process's current GPU (or that there is none). Imports torch."""
    import torch

    env: dict = {"host": socket.gethostname(), "torch": torch.__version__, "cute": cutedsl_version()}
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(i)
        env.update(
            gpu=props.name,
            cc=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    return {k: v for k, v in env.items() if v is not None}


def host_environment() -> dict:
    """Facts that need neither torch nor a GPU (for compile-only records)."""
    return {"host": socket.gethostname(), "cute": cutedsl_version(), "cpus": os.cpu_count()}


def gpu_capabilities() -> dict[int, tuple[str, str | None]]:
    """index -> (name, arch it can run) for every visible GPU, via nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    caps: dict[int, tuple[str, str | None]] = {}
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        idx, name, cc = parts
        try:
            major, minor = (int(x) for x in cc.split("."))
        except ValueError:
            continue
        caps[int(idx)] = (name, arch_of_capability(major, minor))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        order = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        caps = {new: caps[old] for new, old in enumerate(order) if old in caps}
    return caps
