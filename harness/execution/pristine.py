"""Inputs kept pristine across a launch: a kernel must not write its inputs.

Every input is copied before the launch (`keep`), compared with the copy bit for bit after it
(`written`: as integers of the element's width, so a changed NaN payload or -0.0 counts), then
restored (`restore`), so the oracle sees the generated inputs.  A kernel that wrote one fails
with `kernel wrote its input X (N elements changed)`.  The copy is a device clone when the
device has room with HEADROOM to spare, else in host memory (compared in SLICE_BYTES slices)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of the import path of the gate and the dashboard
    import torch

HEADROOM = 1 << 30  # device bytes left free after the clones
SLICE_BYTES = 256 << 20  # at most this much of a host copy on the device at once


def _nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


def keep(inputs: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """A copy of every input tensor (on its device when there is room, else in host memory)."""
    import torch

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    on_device = True
    cuda = [v for v in tensors.values() if v.is_cuda]
    if cuda:
        free, _ = torch.cuda.mem_get_info(cuda[0].device)
        on_device = sum(_nbytes(v) for v in cuda) + HEADROOM <= free
    return {k: (v.clone() if on_device or not v.is_cuda else v.to("cpu", copy=True)) for k, v in tensors.items()}


def _bits(t: "torch.Tensor") -> "torch.Tensor":
    """`t` viewed as integers of its element's width (same shape, same storage)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.is_complex():
        t = torch.view_as_real(t)
    view = t.view(ints[t.element_size()])
    return view.reshape(1) if view.dim() == 0 else view


def changed(now: "torch.Tensor", kept: "torch.Tensor") -> int:
    """How many elements of `now` differ from `kept` bit for bit (a changed shape: all of them)."""
    if now.shape != kept.shape or now.dtype != kept.dtype:
        return max(now.numel(), kept.numel())
    a, b = _bits(now), _bits(kept)
    if a.numel() == 0:
        return 0
    if a.device == b.device:
        return int((a != b).sum())
    rows = max(1, SLICE_BYTES // max(1, _nbytes(a) // max(1, a.shape[0])))
    return sum(int((a[i:i + rows] != b[i:i + rows].to(a.device)).sum()) for i in range(0, a.shape[0], rows))


def written(inputs: dict[str, "torch.Tensor"], kept: dict[str, "torch.Tensor"]) -> dict[str, int]:
    """{input name: elements changed} for every input the launch wrote (empty: none)."""
    out = {}
    for name, copy in kept.items():
        n = changed(inputs[name], copy)
        if n:
            out[name] = n
    return out


def restore(inputs: dict[str, "torch.Tensor"], kept: dict[str, "torch.Tensor"], names) -> None:
    """Give the inputs `names` their kept values again (the dict's entries are replaced: the
    kernel may have changed a tensor's shape as well as its values)."""
    for name in names:
        copy = kept[name]
        inputs[name] = copy if copy.device == inputs[name].device else copy.to(inputs[name].device)


def describe(wrote: dict[str, int]) -> str:
    """`kernel wrote its input a (16 elements changed); kernel wrote its input b (…)`."""
    return "; ".join(f"kernel wrote its input {k} ({n} element{'s' if n != 1 else ''} changed)"
                     for k, n in wrote.items())
