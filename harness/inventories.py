"""Instruction inventories, kept once: results/inventories.jsonl.xz.

A compiled case's record carries two instruction inventories (`compile.inv`, the PTX counters,
and `compile.sass`, the SASS ones): a few hundred bytes to 2 KB each, and the same for every case
that builds the same kernel. The notebook keeps each distinct inventory once, content-addressed,
in an xz-compressed JSON Lines store:

    results/inventories.jsonl.xz  {"id": "<16 hex>", "counts": {"wgmma.mma_async…": 32, …}}
    records/<stage>.jsonl         … "compile": {…, "inv": "#<id>", "sass": "#<id>"} …

id = the first 16 hex digits of sha256 over the counts as canonical JSON (sorted keys, no
spaces), so one inventory always gets the same id, whoever writes it.

The store is a row of xz streams (concatenated streams are one valid xz file, `xz -dc` reads
it): `scripts/compact_results.py` writes the whole store as one stream, and every inventory
written after that is appended as a small stream of its own.

Writing (`InventoryStore.compact`, `StoreAppender`): a record's new tables are appended to the
store, each line one xz stream written with one `write` on an O_APPEND file and fsynced — before
the record itself, so a crash never leaves a record naming an inventory the store lacks — and the
record line holds their ids. Two writers at once may append the same inventory twice; readers
take the first good line of an id.

Reading (`InventoryStore.expand`): ids are replaced by the counts before the record is checked,
so every reader gets the record as it was written. The store is decoded stream by stream: a
stream that is cut off or corrupt (a crash mid-append, a bad copy) costs one warning naming the
file and its byte offset, and reading goes on at the next stream, so every other stream is kept;
a file that is no xz at all is one warning. A store line whose counts do not hash to its id (a
hand edit, a merge gone wrong) is skipped with one warning naming the file and the line of the
decoded text. A record that names an id the store does not hold keeps everything else, loses
that table (the gate then says the case shows no inventory) and costs one warning. Records
written before the store (tables inline) read as they always did.

Older notebooks kept the store as plain results/inventories.jsonl: readers read it beside the
xz store (the union of both), and `compact_results.py` folds it into the xz store and removes it
(`rewrite_store`). That script also drops the inventories no line names any more: a stale line
moved to results/archive/ takes its tables along inline (harness/archive.py), so the store only
serves the live records and the archive lines written before that.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from harness.jsonl import Appender, iter_jsonl, read_bytes, replace_file

TABLES = ("inv", "sass")
REF = "#"
ID_LEN = 16
STORE_NAME = "inventories.jsonl.xz"
PLAIN_NAME = "inventories.jsonl"  # the store before it was compressed; read, never written
XZ_MAGIC = b"\xfd7zXZ\x00"
_CHUNK = 1 << 14  # bytes fed to a decompressor at a time (unused_data copies at most this much)


def inventory_id(counts: dict[str, int]) -> str:
    text = json.dumps(counts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LEN]


def _counts_ok(counts: Any) -> bool:
    return isinstance(counts, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items())


def store_file(results: Path) -> Path:
    return results / STORE_NAME


def plain_store_file(results: Path) -> Path:
    return results / PLAIN_NAME


def xz_streams(data: bytes) -> Iterator[tuple[int, bytes | None, str]]:
    """(byte offset, decoded bytes, "") for every whole xz stream of `data`, in order, and
    (offset, None, why) for a stream that cannot be decoded: reading goes on at the next xz
    header after it, so one bad stream never costs the others. Stream padding (NUL bytes
    between streams) is skipped."""
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] == 0:
            pos += 1
            continue
        start = pos
        dec = lzma.LZMADecompressor(lzma.FORMAT_XZ)
        out: list[bytes] = []
        why = ""
        try:
            while not dec.eof:
                if pos >= end:
                    why = "cut off (a write that did not finish?)"
                    break
                chunk = data[pos:pos + _CHUNK]
                pos += len(chunk)
                out.append(dec.decompress(chunk))
        except lzma.LZMAError as exc:
            why = f"corrupt ({exc})"
        if not why:
            pos -= len(dec.unused_data)
            yield start, b"".join(out), ""
            continue
        yield start, None, why
        nxt = data.find(XZ_MAGIC, start + 1)
        pos = end if nxt < 0 else nxt


def decode_store(path: Path, data: bytes, warn: list[str]) -> bytes:
    """The JSON Lines text of an xz store's bytes: every stream that decodes, one warning
    (file, byte offset, why) for each that does not."""
    parts: list[bytes] = []
    for offset, text, why in xz_streams(data):
        if text is None:
            whole = " (the whole file: not an xz store)" if offset == 0 and not parts and XZ_MAGIC not in data[1:] else ""
            warn.append(f"{path}: byte {offset}: skipped an xz stream, {why}{whole}")
            continue
        parts.append(text if not text or text.endswith(b"\n") else text + b"\n")
    return b"".join(parts)


# The parsed store per file, reused while the file is unchanged: path -> ((mtime_ns, size), ids, warnings).
_CACHE: dict[Path, tuple[tuple[int, int], dict[str, dict[str, int]], list[str]]] = {}


def _load_file(path: Path, compressed: bool) -> tuple[dict[str, dict[str, int]], list[str]]:
    """id -> counts of one store file, and the warnings for what was skipped (parsed once per
    file state; a missing file holds nothing)."""

    try:
        st = path.stat()
    except OSError:
        return {}, []
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit and hit[0] == stamp:
        return hit[1], hit[2]
    known: dict[str, dict[str, int]] = {}
    warn: list[str] = []
    data = read_bytes(path, warn)
    if data is not None:
        if compressed:
            data = decode_store(path, data, warn)
        for lineno, obj in iter_jsonl(path, warn, data=data):
            ident = obj.get("id") if isinstance(obj, dict) else None
            counts = obj.get("counts") if isinstance(obj, dict) else None
            if not isinstance(ident, str) or not _counts_ok(counts) or inventory_id(counts) != ident:
                warn.append(f"{path}:{lineno}: skipped an inventory (needs id and counts, and the counts must hash to the id)")
                continue
            known.setdefault(ident, counts)
    _CACHE[path] = (stamp, known, warn)
    return known, warn


def store_line(ident: str, counts: dict[str, int]) -> str:
    return json.dumps({"id": ident, "counts": counts}, separators=(",", ":"))


class StoreAppender(Appender):
    """Appends inventory lines to an xz store, each as an xz stream of its own: one `write`
    on an O_APPEND file (never interleaved with another writer's), then fsync, so a crash
    keeps every finished line and costs at most the stream it cut off."""

    def write(self, line: str) -> None:
        if "\n" in line or "\r" in line:
            raise ValueError("an inventory must be one line")
        data = lzma.compress((line + "\n").encode("utf-8"))
        done = os.write(self._fd, data)
        while done < len(data):  # a short write (disk full…): finish the stream, or fail
            done += os.write(self._fd, data[done:])
        os.fsync(self._fd)


class InventoryStore:
    """The content-addressed inventories of one results folder: the xz store, and the plain
    store of an older notebook while it is still there."""

    def __init__(self, results: Path):
        self.path = store_file(results)
        self.plain = plain_store_file(results)
        self._read: tuple[dict[str, dict[str, int]], list[str]] | None = None

    def _load(self) -> tuple[dict[str, dict[str, int]], list[str]]:
        """id -> counts (both files), and the warnings for what was skipped."""
        known, warn = _load_file(self.path, compressed=True)
        if not self.plain.exists():
            return known, warn
        old, old_warn = _load_file(self.plain, compressed=False)
        return {**old, **known}, warn + old_warn

    def known(self) -> dict[str, dict[str, int]]:
        return dict(self._load()[0])

    def warnings(self) -> list[str]:
        """What reading the store skipped (from the same loaded state the reads use)."""
        self._snapshot()
        return list(self._read[1])

    def _snapshot(self) -> dict[str, dict[str, int]]:
        """id -> counts for reading, loaded once per store object: a reader resolves thousands
        of records against one state of the store, not one file check per record."""
        if self._read is None:
            self._read = self._load()
        return self._read[0]

    def _resolve(self, obj: Any, drop_unknown: bool, warn: list[str] | None, where: str) -> Any:
        """`obj` (a parsed record line) with the inventory ids the store holds replaced by the
        counts; an id it does not hold is left out (`drop_unknown`, one warning) or kept as it
        is. `obj` itself when it names no id."""
        comp = obj.get("compile") if isinstance(obj, dict) else None
        if not isinstance(comp, dict) or not any(isinstance(comp.get(t), str) for t in TABLES):
            return obj
        known = self._snapshot()
        new = dict(comp)
        for table in TABLES:
            ref = comp.get(table)
            if not isinstance(ref, str):
                continue
            counts = known.get(ref[len(REF):]) if ref.startswith(REF) else None
            if counts is not None:
                new[table] = dict(counts)
            elif drop_unknown:
                del new[table]
                if warn is not None:
                    warn.append(f"{where}: compile.{table} names inventory {ref[:40]!r}, which {self.path.name} does not hold — left out")
        return obj if new == comp else {**obj, "compile": new}

    def expand(self, obj: Any, warn: list[str] | None, where: str) -> Any:
        """`obj` (a parsed record line) with its inventory ids replaced by the counts; an id the
        store does not hold costs that table and one warning."""
        return self._resolve(obj, True, warn, where)

    def inline(self, obj: Any) -> Any:
        """`obj` with every inventory id the store holds replaced by the counts; an id it does
        not hold stays as it is (nothing is lost). `obj` itself when nothing changes."""
        return self._resolve(obj, False, None, "")

    def compact(self, obj: dict[str, Any], append) -> dict[str, Any]:
        """`obj` (a record as a dict) with its inventories stored and named by id; `append(line)`
        writes one line to the store (called before the record is written)."""
        comp = obj.get("compile")
        if not isinstance(comp, dict) or not any(_counts_ok(comp.get(t)) and comp.get(t) for t in TABLES):
            return obj
        known, _ = self._load()
        comp = dict(comp)
        for table in TABLES:
            counts = comp.get(table)
            if not (_counts_ok(counts) and counts):
                continue
            ident = inventory_id(counts)
            if ident not in known:
                append(store_line(ident, counts))
                known[ident] = dict(counts)
            comp[table] = REF + ident
        return {**obj, "compile": comp}


def refs(obj: Any) -> set[str]:
    """The inventory ids a parsed record line names."""
    comp = obj.get("compile") if isinstance(obj, dict) else None
    if not isinstance(comp, dict):
        return set()
    return {comp[t][len(REF):] for t in TABLES if isinstance(comp.get(t), str) and comp[t].startswith(REF)}


def rewrite_store(store: InventoryStore, keep: Iterable[str] | None = None) -> tuple[int, int]:
    """Write the store (the xz one and the plain one together) as ONE xz stream holding the
    inventories whose ids are in `keep` (all of them when None), atomically (a temp file,
    then a rename), and remove the plain store. Returns (inventories kept, dropped). Run it
    while nothing else writes to results/ (an inventory appended meanwhile would be lost)."""
    known = store.known()
    wanted = set(known) if keep is None else set(keep)
    kept = {i: c for i, c in known.items() if i in wanted}
    body = "".join(store_line(i, kept[i]) + "\n" for i in sorted(kept)).encode()
    replace_file(store.path, lzma.compress(body, preset=9 | lzma.PRESET_EXTREME))
    if store.plain.exists():
        store.plain.unlink()
    return len(kept), len(known) - len(kept)


def compact_file(path: Path, store: InventoryStore, append) -> tuple[int, int]:
    """Rewrite one records file with its inline inventories moved into the store (atomically:
    a temp file, then a rename). Lines that do not parse are kept byte for byte. Returns
    (lines, bytes saved)."""
    data = path.read_bytes()
    out: list[bytes] = []
    for raw in data.split(b"\n"):
        try:
            obj = json.loads(raw) if raw.strip() else None
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            new = store.compact(obj, append)
            out.append(raw if new is obj else json.dumps(new, separators=(",", ":"), allow_nan=False).encode())
        else:
            out.append(raw)
    text = b"\n".join(out)
    replace_file(path, text)
    return len(out), len(data) - len(text)
