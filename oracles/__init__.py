"""Exact references (PyTorch, fp32/fp64) and seeded input generators, shared by stages.

An oracle never reuses kernel code. Each stage's oracle module provides:
  tensors(case) -> list[TensorSpec]       every kernel argument, inputs first, then outputs
  make_inputs(case, seed, device) -> dict  seeded inputs, never zeros, never constant
  reference(inputs, case) -> dict          the exact outputs, fp32 or fp64
  flops(case) -> float                     (optional) work, for TFLOP/s
"""
