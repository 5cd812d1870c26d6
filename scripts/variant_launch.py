"""Shared by scripts/e_small_timeline.py and scripts/ix_variants.py: a variant's inputs rotated as
`bench` rotates them (L2 cold), and its launches over them."""

from __future__ import annotations

from typing import Callable


def rotated_sets(first: dict) -> list[dict]:
    """`first`, then as many clones of it as `timing.rotations` asks for the GPU's L2."""
    from harness.execution.timing import l2_bytes, rotations

    set_bytes = sum(t.numel() * t.element_size() for t in first.values())
    return [first] + [{k: v.clone() for k, v in first.items()} for _ in range(1, rotations(set_bytes, l2_bytes()))]


def launches(fn, arg_lists: list[list]) -> list[Callable[[], None]]:
    """One launch of exported kernel `fn` per argument list (torch tensors, on the current stream);
    the first one has run, synchronised, when this returns."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    out = []
    for args in arg_lists:
        cargs = [from_dlpack(t, assumed_align=16) for t in args]

        def launch(cargs=cargs) -> None:
            fn(*cargs, cuda.CUstream(torch.cuda.current_stream().cuda_stream))

        out.append(launch)
    out[0]()
    torch.cuda.synchronize()
    return out
