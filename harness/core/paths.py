"""Where the lab lives: its root (the folder holding stages.yaml) and the folders under it."""

from __future__ import annotations

import os
from pathlib import Path

SPEC_NAME = "stages.yaml"


def lab_root() -> Path:
    """The lab's root: $DSV4_LAB_ROOT, else the nearest folder up from the cwd that holds
    stages.yaml, else the folder this package was installed from (editable installs)."""
    env = os.environ.get("DSV4_LAB_ROOT")
    if env:
        return Path(env).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / SPEC_NAME).is_file():
            return folder
    return Path(__file__).resolve().parents[2]  # harness/core/paths.py -> the lab


def results_dir(root: Path) -> Path:
    return root / "results"


def records_dir(root: Path) -> Path:
    return results_dir(root) / "records"


def cache_dir(root: Path) -> Path:
    """Compile cache and other derived state: never committed."""
    return Path(os.environ.get("DSV4_LAB_CACHE", root / ".cache"))
