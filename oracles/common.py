"""Shared, torch-free description of a kernel argument, and seeding helpers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "uint8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class TensorSpec:
    """One kernel argument: name, shape, element type and role — read ("in"), written and compared
        ("out"), or workspace the harness allocates, poisons and never compares ("scratch").
        Row-major, contiguous, 16-byte aligned."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str = "in"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype, self.role]


def case_seed(stage: str, case: dict[str, Any], base: int = 0) -> int:
    """A seed that depends only on the stage, the case and the base seed: the same case
    gets the same inputs on every machine."""
    text = stage + "|" + ",".join(f"{k}={case[k]}" for k in sorted(case)) + f"|{base}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
