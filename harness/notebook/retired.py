"""Where a retired record went: results/archive/retired.jsonl.xz (one xz stream of JSON lines; an
older lab's plain retired.jsonl is read first and folded in at the next retiring).

Compaction drops the archive's oldest stale lines from the tree (archive.py `retire`); git keeps
every committed results/archive/, and each retiring appends one line here first:

  {"stage": "E", "lines": 9199, "bytes": 20123456, "oldest_t": "…", "newest_t": "…",
   "t": "<when>", "from": "<sha of HEAD: the last commit whose tree still holds them>",
   "how": "git show <sha>:results/archive/E.jsonl.xz", "ids": {"<run>": "1-57,60", …}}

`ids` names every retired record: its run, then the numbers of its ids (`<run>.<n>`) as ranges;
an id of another shape is listed whole under "". `where` maps a record or run id to the
retirings that took it (for `show` and `history`)."""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path
from typing import Any

from harness.core.jsonl import iter_jsonl
from harness.core.paths import results_dir

_NUMBERED = re.compile(r"^(.+)\.(\d{1,9})$")


def retired_file(root: Path) -> Path:
    return results_dir(root) / "archive" / "retired.jsonl.xz"


def old_retired_file(root: Path) -> Path:
    """The plain form of the retirings, before they were compressed (read, never written)."""
    return results_dir(root) / "archive" / "retired.jsonl"


def retired_lines(root: Path) -> bytes:
    """Every retiring's line, oldest first: the old plain file's, then the .xz's, decompressed.
    OSError (naming the file) when the .xz is not one."""
    out = b""
    old = old_retired_file(root)
    if old.is_file():
        out = old.read_bytes()
        if out and not out.endswith(b"\n"):
            out += b"\n"
    new = retired_file(root)
    if new.exists():
        try:
            out += lzma.decompress(new.read_bytes())
        except lzma.LZMAError as exc:
            raise OSError(f"{new}: not a readable xz file ({exc}) — restore it: git checkout {new.name}") from None
    return out


def encode_ids(ids: list[str]) -> dict[str, Any]:
    """{run: "1-3,7", …, "": [other ids]} for record ids `<run>.<n>` (module doc)."""
    numbers: dict[str, set[int]] = {}
    other: list[str] = []
    for ident in ids:
        m = _NUMBERED.match(ident)
        if m and str(int(m.group(2))) == m.group(2):
            numbers.setdefault(m.group(1), set()).add(int(m.group(2)))
        else:
            other.append(ident)
    out: dict[str, Any] = {}
    for run in sorted(numbers):
        spans: list[str] = []
        ns = sorted(numbers[run])
        start = prev = ns[0]
        for n in ns[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            if n is not None:
                start = prev = n
        out[run] = ",".join(spans)
    if other:
        out[""] = sorted(set(other))
    return out


def _holds(ids: Any, ident: str) -> bool:
    """Whether an entry's `ids` (encode_ids) names record `ident`."""
    if not isinstance(ids, dict):
        return False
    if isinstance(ids.get(""), list) and ident in ids[""]:
        return True
    m = _NUMBERED.match(ident)
    spans = ids.get(m.group(1)) if m else None
    if not isinstance(spans, str):
        return False
    n = int(m.group(2))
    for span in spans.split(","):
        lo, _, hi = span.partition("-")
        try:
            if int(lo) <= n <= int(hi or lo):
                return True
        except ValueError:
            continue
    return False


def read_retired(root: Path, warn: list[str] | None = None) -> list[dict[str, Any]]:
    """Every retiring recorded, oldest first (a line that is not one is skipped, with a warning)."""
    path = retired_file(root)
    out = []
    try:
        data = retired_lines(root)
    except OSError as exc:
        if warn is not None:
            warn.append(str(exc))
        return out
    for lineno, obj in iter_jsonl(path, warn, data=data):
        if (isinstance(obj, dict) and isinstance(obj.get("stage"), str) and isinstance(obj.get("from"), str)
                and isinstance(obj.get("how"), str)):
            out.append(obj)
        elif warn is not None:
            warn.append(f"{path}:{lineno}: skipped a retiring (needs stage, from and how as strings)")
    return out


def where(root: Path, ident: str, warn: list[str] | None = None) -> tuple[str, dict[str, Any]] | None:
    """("record" or "run", the newest retiring that took record `ident`, or records of run `ident`);
    None when no retiring names it."""
    for entry in reversed(read_retired(root, warn)):
        ids = entry.get("ids")
        if _holds(ids, ident):
            return "record", entry
        if isinstance(ids, dict) and ident and isinstance(ids.get(ident), str):
            return "run", entry
    return None


def of_stage(root: Path, stage: str, warn: list[str] | None = None) -> list[dict[str, Any]]:
    """The retirings of one stage's archive, oldest first."""
    return [e for e in read_retired(root, warn) if e.get("stage") == stage]


def say(kind: str, ident: str, entry: dict[str, Any]) -> str:
    """One line: which record (or run) was retired, and the git command that shows it."""
    what = f"record {ident} was" if kind == "record" else f"records of run {ident} were"
    grep = f' | grep \'"id":"{ident}"\'' if kind == "record" else f" | grep '\"run\":\"{ident}\"'"
    return (f"{what} retired from the notebook's archive (stage {entry.get('stage')}, compaction at "
            f"{entry.get('t', '?')}); git history holds it: {entry['how']} | xz -d{grep}")


def line(entry: dict[str, Any]) -> str:
    """One line about a retiring: how many lines, of which time, and the git command that shows them."""
    return (f"{entry.get('lines', '?')} older record(s) of stage {entry.get('stage')} "
            f"({entry.get('oldest_t', '?')} … {entry.get('newest_t', '?')}) were retired from the archive; "
            f"git history holds them: {entry['how']} | xz -d")


def entry_json(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode()
