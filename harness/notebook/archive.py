"""Keeping the notebook small: a stage's stale lines move into a compressed archive (README:
Records).

`archive_stale` moves every line of results/records/<stage>.jsonl (and its segment) whose
`code.src` is not the stage's source hash now — or is the one a suite baseline holds every case
at: the baseline stands for them — to the end of results/archive/<stage>.jsonl.xz,
byte for byte but with the store ids it names replaced by their values (`inline_archive` does
the same to older archive lines; an id a store lacks stays). Fresh records, unparsable lines and
lines of stages or archs the spec no longer has stay. `archive_runs` does the same for the events
of runs no live record names (results/archive/runs.jsonl.xz).

`seal` moves every line of results/records/<stage>.jsonl to the end of its segment
results/records/<stage>.jsonl.xz (one xz stream, preset 9|extreme) and empties the plain file.
It refuses (SealRefused, one line naming file:line and the fix, nothing written) while a line of
either is one readers skip, or the segment is no xz; a line the segment already holds is not
added twice. Archive, then segment, then records file, each a temp file and a rename: a crash
leaves a line in two places (read twice), never in neither.

`retire` bounds the archive: per (arch, case) the newest `keep` lines (default 0: git holds every
committed archive), a bench shape's newest max(keep, KEEP_BENCH), and the last `days` days stay.
Never retired: a line that does not parse or names no id, arch or case; a record a baseline,
speed baseline or note names, or of a run a note or live record names; a line the archive at
HEAD does not hold (`held`). It is named in results/archive/retired.jsonl.xz (retired.py) first,
then the archive is rewritten: never in neither."""

from __future__ import annotations

import json
import lzma
import time
from dataclasses import dataclass
from pathlib import Path

from harness.notebook.inventories import Stores
from harness.notebook.retired import encode_ids, entry_json, old_retired_file, retired_file, retired_lines
from harness.core.jsonl import iter_jsonl, replace_file
from harness.core.safeio import read_regular
from harness.notebook.records import (_read_archive, archive_file, code_src, is_fresh, runs_archive_file, runs_file,
                                      segment_file, stage_file, validate)


class SealRefused(OSError):
    """Why a stage's records were not sealed, as one line (file:line: why — the fix)."""


def _inlined(lines: list[bytes], store: Stores) -> tuple[list[bytes], int]:
    """`lines` with the ids they name replaced by the stores' values (a line that names none,
    or does not parse, stays byte for byte), and how many lines changed."""
    out: list[bytes] = []
    changed = 0
    for raw in lines:
        try:
            obj = json.loads(raw) if b'"#' in raw else None
        except ValueError:
            obj = None
        new = store.inline(obj) if isinstance(obj, dict) else obj
        if new is obj:
            out.append(raw)
            continue
        try:
            out.append(json.dumps(new, separators=(",", ":"), allow_nan=False).encode())
            changed += 1
        except ValueError:
            out.append(raw)
    return out, changed


def _old_lines(archive: Path) -> list[bytes]:
    """The lines of an archive or a segment (none when it does not exist); OSError when it is no xz."""
    old = _read_archive(archive, None) if archive.exists() else b""
    if old is None:
        raise OSError(f"{archive} is not an xz archive — left as it is; move it away and run again")
    return [raw for raw in old.split(b"\n") if raw.strip()]


def _plain_lines(path: Path) -> tuple[bytes, list[bytes]]:
    """A plain records file's bytes and its lines (none when it does not exist)."""
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return b"", []
    return data, [raw for raw in data.split(b"\n") if raw.strip()]


def _write_archive(archive: Path, lines: list[bytes]) -> None:
    replace_file(archive, lzma.compress(b"\n".join(lines) + b"\n", preset=9 | lzma.PRESET_EXTREME))


def inline_archive(root: Path, stage_id: str) -> int:
    """Rewrite a stage's archive with the ids its lines name replaced by the stores' values (no
        rewrite when none is named).  Returns the lines inlined."""
    archive = archive_file(stage_file(root, stage_id))
    if not archive.exists():
        return 0
    lines, changed = _inlined(_old_lines(archive), Stores(archive.parent.parent))
    if changed:
        _write_archive(archive, lines)
    return changed


def _move_lines(path: Path, archive: Path, moves, store: Stores | None = None) -> tuple[int, int]:
    """Move the lines of `path` for which `moves(obj)` holds (obj None: unparsable) to the end of
        `archive`, ids inlined from `store` when given; archive first, then the file.  Returns
        (lines moved, bytes the file lost)."""
    try:
        data = read_regular(path)
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
        (move if moves(obj) else keep).append(raw)
    if not move:
        return 0, 0
    archive.parent.mkdir(parents=True, exist_ok=True)
    lines = _old_lines(archive) + move
    if store is not None:
        lines, _ = _inlined(lines, store)
    _write_archive(archive, lines)
    text = b"\n".join(keep) + (b"\n" if keep else b"")
    replace_file(path, text)
    return len(move), len(data) - len(text)


def _parsed(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def archive_stale(root: Path, stage_id: str, current_src: dict[str, str],
                  summarized: dict[str, str] | None = None) -> tuple[int, int]:
    """Move the stale lines of a stage's segment and records file (segment's first) into its
        archive; `current_src`: arch -> the source hash now; `summarized`: arch -> the source hash a
        suite baseline holds every case at (notebook/baselines.py: suite) — that source's lines move
        too, the baseline standing for them.  Returns (lines moved, bytes lost)."""
    summarized = summarized or {}

    def stale(obj) -> bool:
        arch = obj.get("arch") if isinstance(obj, dict) else None
        if not (isinstance(arch, str) and arch in current_src and code_src(obj) is not None):
            return False
        return not is_fresh(obj, current_src[arch]) or (arch in summarized and is_fresh(obj, summarized[arch]))

    path = stage_file(root, stage_id)
    archive, segment = archive_file(path), segment_file(path)
    sealed = _old_lines(segment)  # OSError when it is no xz: nothing moves
    seg_move = [raw for raw in sealed if stale(_parsed(raw))]
    if not seg_move:
        return _move_lines(path, archive, stale, Stores(archive.parent.parent))
    before = segment.stat().st_size
    data, plain = _plain_lines(path)
    plain_move = [raw for raw in plain if stale(_parsed(raw))]
    lines, _ = _inlined(_old_lines(archive) + seg_move + plain_move, Stores(archive.parent.parent))
    archive.parent.mkdir(parents=True, exist_ok=True)
    _write_archive(archive, lines)
    keep = [raw for raw in sealed if not stale(_parsed(raw))]
    if keep:
        _write_archive(segment, keep)
    else:
        segment.unlink()
    saved = before - (segment.stat().st_size if keep else 0)
    if plain_move:
        text = b"".join(raw + b"\n" for raw in plain if not stale(_parsed(raw)))
        replace_file(path, text)
        saved += len(data) - len(text)
    return len(seg_move) + len(plain_move), saved


def _first_problem(source: Path, text: bytes, store: Stores) -> str | None:
    """`file:line: why` of the first line of `text` readers skip; None when every line reads."""
    warn: list[str] = []
    for lineno, obj in iter_jsonl(source, warn, data=text):
        if warn:
            break
        why = validate(store.expand(obj, None, ""))
        if why:
            return f"{source}:{lineno}: not a record this lab reads ({why})"
    if warn:  # "file:line: skipped a corrupt line (why)"
        where, _, why = warn[0].partition(": skipped ")
        return f"{where}: {why}"
    return None


def seal(root: Path, stage_id: str) -> tuple[int, int]:
    """Move every line of a stage's records file to the end of its segment (module doc).  Returns
        (lines moved, bytes saved).  SealRefused (one line, nothing written) while a line of either
        is one readers skip, or the segment is no xz."""
    path = stage_file(root, stage_id)
    segment = segment_file(path)
    data, plain = _plain_lines(path)
    if not plain:
        return 0, 0
    text = _read_archive(segment, None) if segment.exists() else b""
    if text is None:
        raise SealRefused(f"{segment}: not an xz segment — {path.name} not sealed; restore the segment "
                          f"(git checkout results/records/{segment.name}) and run again")
    store = Stores(path.parent.parent)
    for source, lines, fix in ((segment, text, f"restore it (git checkout results/records/{segment.name})"),
                               (path, data, "mend or delete that line")):
        why = _first_problem(source, lines, store)
        if why:
            raise SealRefused(f"{why} — {path.name} not sealed; {fix} and run again")
    sealed = [raw for raw in text.split(b"\n") if raw.strip()]
    held = set(sealed)
    new = [raw for raw in plain if raw not in held]
    before = len(data) + (segment.stat().st_size if segment.exists() else 0)
    _write_archive(segment, sealed + new)
    replace_file(path, b"")
    return len(new), before - segment.stat().st_size


def archive_runs(root: Path, live: set[str]) -> tuple[int, int]:
    """Move the events of results/runs.jsonl of runs not in `live` to the end of
        results/archive/runs.jsonl.xz (unparsable lines stay).  Returns (lines moved, bytes lost)."""

    def dead(obj) -> bool:
        run = obj.get("run") if isinstance(obj, dict) else None
        return isinstance(run, str) and run not in live

    return _move_lines(runs_file(root), runs_archive_file(root), dead)


KEEP_NEWEST = 0  # stale test-case lines kept per (arch, case), newest first (tree budget: git keeps them)
KEEP_BENCH = 4  # stale bench lines kept per (arch, shape): `history --speed` across the last proofs
KEEP_DAYS = 0.0  # and every stale line of the last KEEP_DAYS days: none beyond those by default (module doc)


@dataclass(frozen=True)
class Held:
    """What the archive at HEAD holds: the commit, the archive's path in it, the ids of its lines."""
    sha: str
    path: str
    ids: frozenset[str]


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def retirable(lines: list[bytes], keep: int, cutoff: str, named_ids: set[str], named_runs: set[str],
              held: frozenset[str], keep_bench: int = KEEP_BENCH) -> list[bool]:
    """For each archive line (oldest first), whether the rule retires it (module doc; `cutoff`: the
        oldest `t` kept whatever its rank; a bench line's rank counts against max(keep, keep_bench))."""
    seen: dict[tuple, int] = {}
    out = [False] * len(lines)
    for i in range(len(lines) - 1, -1, -1):
        obj = _parsed(lines[i])
        if not isinstance(obj, dict):
            continue
        ident, run, arch, case, t = (obj.get(k) for k in ("id", "run", "arch", "case", "t"))
        if not (isinstance(ident, str) and isinstance(arch, str) and isinstance(case, dict) and isinstance(t, str)):
            continue
        key = (arch, json.dumps(case, sort_keys=True), obj.get("note") == "bench")
        rank = seen[key] = seen.get(key, 0) + 1
        limit = max(keep, keep_bench) if key[2] else keep
        out[i] = (rank > limit and len(t) == len(cutoff) and t < cutoff and ident not in named_ids
                  and run not in named_runs and ident in held)
    return out


def retire(root: Path, stage_id: str, held: Held, named_ids: set[str], named_runs: set[str],
           keep: int = KEEP_NEWEST, days: float = KEEP_DAYS, now: float | None = None) -> tuple[int, int]:
    """Retire the lines of a stage's archive the rule retires: one line to retired.jsonl.xz first,
        then the archive rewritten (removed when empty).  Returns (lines, bytes); OSError when no xz."""
    archive = archive_file(stage_file(root, stage_id))
    if not archive.exists():
        return 0, 0
    lines = _old_lines(archive)
    now = time.time() if now is None else now
    gone = retirable(lines, keep, _iso(now - days * 86400), named_ids, named_runs, held.ids)
    retired = [raw for raw, g in zip(lines, gone) if g]
    if not retired:
        return 0, 0
    objs = [_parsed(raw) for raw in retired]
    times = sorted(o["t"] for o in objs)
    entry = {"stage": stage_id, "lines": len(retired), "bytes": sum(len(raw) + 1 for raw in retired),
             "oldest_t": times[0], "newest_t": times[-1], "t": _iso(now), "from": held.sha,
             "how": f"git show {held.sha}:{held.path}", "ids": encode_ids([o["id"] for o in objs])}
    old = retired_lines(root)  # OSError when the .xz is no xz: nothing retired then
    replace_file(retired_file(root), lzma.compress(old + entry_json(entry) + b"\n", format=lzma.FORMAT_XZ))
    if old_retired_file(root).is_file():  # folded into the .xz just written
        old_retired_file(root).unlink()
    before = archive.stat().st_size
    kept = [raw for raw, g in zip(lines, gone) if not g]
    if kept:
        _write_archive(archive, kept)
    else:
        archive.unlink()
    return len(retired), before - (archive.stat().st_size if kept else 0)
