"""Keeping the notebook small: a stage's stale lines move into a compressed archive.

A record is stale once the code that decides its verdict changed (harness/identity.py): no
gate, baseline or fresh table reads it again, but the history does. `archive_stale` moves every
stale line of results/records/<stage>.jsonl — a record whose `code.src` is not the stage's
source hash now for its arch — to the end of results/archive/<stage>.jsonl.xz, byte for byte.
Readers (harness/records.py) read the archive as the older part of the records file, so
`history`, `show` and the dashboard see every record they saw before; fresh records, lines that
do not parse and lines of stages or archs the spec no longer has stay where they are.

The archive is written first (a temp file, then a rename), then the records file, the same way:
a crash between the two leaves a line in both places (read twice), never in neither.
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

from harness.records import _read_archive, archive_file, stage_file


def _replace(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def archive_stale(root: Path, stage_id: str, current_src: dict[str, str]) -> tuple[int, int]:
    """Move the stale lines of one stage's records file into its archive. `current_src` maps
    arch -> the stage's source hash now. Returns (lines moved, bytes the records file lost)."""
    path = stage_file(root, stage_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0, 0
    keep: list[bytes] = []
    move: list[bytes] = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        arch = obj.get("arch") if isinstance(obj, dict) else None
        src = (obj.get("code") or {}).get("src") if isinstance(obj, dict) and isinstance(obj.get("code"), dict) else None
        if isinstance(arch, str) and arch in current_src and isinstance(src, str) and src != current_src[arch]:
            move.append(raw)
        else:
            keep.append(raw)
    if not move:
        return 0, 0
    archive = archive_file(path)
    old = _read_archive(archive, None) if archive.exists() else b""
    if old is None:
        raise OSError(f"{archive} is not an xz archive — left as it is; move it away and run again")
    body = old + (b"" if not old or old.endswith(b"\n") else b"\n") + b"\n".join(move) + b"\n"
    _replace(archive, lzma.compress(body, preset=9 | lzma.PRESET_EXTREME))
    text = b"\n".join(keep) + (b"\n" if keep else b"")
    _replace(path, text)
    return len(move), len(data) - len(text)
