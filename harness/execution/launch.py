"""What the worker (harness/execution/worker.py) and bench (harness/execution/bench.py) share to run a case's kernel:
the job's common fields, a function looked up by its (module, name) reference, and a launcher that
loads a compiled kernel once per process and launches it on the current CUDA stream."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(kw_only=True)
class KernelJob:
    """One case's kernel and the stage functions around it (picklable: sent to a worker)."""

    stage: str
    arch: str
    case: dict[str, Any]
    kernel_params: tuple[str, ...]
    kernel_module: str
    kernel_entry: str
    tensors: tuple[str, str]
    inputs: tuple[str, str]
    oracle: tuple[str, str]
    flops: tuple[str, str] | None
    seed: int
    object_path: str = ""  # the compiled kernel (harness/execution/compile.py), for a GPU arch
    prefix: str = ""
    criterion: tuple[str, str] | None = None  # a suite stage's upstream pass rule (oracles/suites/)
    decode: tuple[str, str] | None = None  # the stage's `decode`: the kernel's outputs -> the outputs compared


def attr(ref: tuple[str, str]) -> Any:
    """The attribute `ref[1]` of module `ref[0]` (imported)."""
    return getattr(importlib.import_module(ref[0]), ref[1])


class Launcher:
    """Zero-argument launch callables for jobs; each compiled module is loaded once."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def __call__(self, job: KernelJob, args: list) -> Callable[[], None]:
        if job.arch == "cpu":  # the lab's own tests: a plain-Python kernel
            kernel = attr((job.kernel_module, job.kernel_entry))(**{k: job.case[k] for k in job.kernel_params})
            return lambda: kernel(*args)
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute
        import torch
        from cutlass.cute.runtime import from_dlpack

        fn = self._loaded.get(job.object_path)
        if fn is None:
            fn = self._loaded[job.object_path] = cute.runtime.load_module(job.object_path)[job.prefix]
        cute_args = [from_dlpack(t, assumed_align=16) for t in args]

        def launch() -> None:
            fn(*cute_args, cuda.CUstream(torch.cuda.current_stream().cuda_stream))

        return launch
