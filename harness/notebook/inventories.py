"""Content-addressed stores: what many records carry alike is kept once, and a record names it.

Two stores, xz-compressed JSON Lines in results/, the same machinery:

    results/inventories.jsonl.xz  {"id": "<16 hex>", "counts": {"wgmma.mma_async…": 32, …}}
    results/envs.jsonl.xz         {"id": "<16 hex>", "env": {"host": "vm", "gpu": "NVIDIA H100…", …}}
    records/<stage>.jsonl         … "compile": {…, "inv": "#<id>", "sass": "#<id>"}, "env": "#<id>" …

`InventoryStore`: a compiled case's PTX (`compile.inv`) and SASS (`compile.sass`) counters, the
same for every case of one kernel. `EnvStore`: every record's `env`, the same on one machine.
id = the first 16 hex digits of sha256 over the value as canonical JSON (sorted keys, no spaces).

A store is a row of xz streams (`xz -dc` reads it): compaction writes one stream, every later
value is appended as a small stream of its own — one `write` on an O_APPEND file, fsynced,
before the record that names it (`ContentStore.compact`, `StoreAppender`). Two writers may
append a value twice; readers take the first good line of an id.

Reading (`ContentStore.expand`, `Stores.expand`) puts the values back before the record is
checked. A cut-off or corrupt stream costs one warning (file and byte offset) and reading goes
on at the next; a file that is no xz is one warning; a line whose value does not hash to its id
is skipped with one warning; a record naming an id the store lacks loses only that value (one
warning). Records with inline values read as they always did; an older plain
results/inventories.jsonl is read beside the store and folded in by compaction (`rewrite_store`)."""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from harness.core.jsonl import Appender, iter_jsonl, read_bytes, replace_file
from harness.core.safeio import XZ_MAGIC, read_regular, xz_streams as _xz_streams

REF = "#"
ID_LEN = 16

Slot = tuple[str, ...]  # where a record names a stored value: keys from the record down


def content_id(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LEN]


def _counts_ok(counts: Any) -> bool:
    return isinstance(counts, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items())


def _env_ok(env: Any) -> bool:
    """An env block as a record carries it: names to plain values (str, finite number, bool, null)."""
    return isinstance(env, dict) and all(
        isinstance(k, str) and (v is None or isinstance(v, (str, bool, int))
                                or (isinstance(v, float) and math.isfinite(v))) for k, v in env.items())


@dataclass(frozen=True)
class Kind:
    """What one store holds and where a record names it."""

    noun: str  # in warnings: "inventory", "env block"
    plural: str
    file: str  # the store, in results/
    plain: str | None  # an older notebook's plain store, read beside it until compacted; never written
    key: str  # a store line: {"id": …, key: value}
    slots: tuple[Slot, ...]
    ok: Callable[[Any], bool]  # a value this store may hold


PLAIN_NAME = "inventories.jsonl"  # the inventory store before it was compressed; read, never written
INVENTORIES = Kind("inventory", "inventories", "inventories.jsonl.xz", PLAIN_NAME, "counts",
                   (("compile", "inv"), ("compile", "sass")), _counts_ok)
ENVS = Kind("env block", "env blocks", "envs.jsonl.xz", None, "env", (("env",),), _env_ok)


def store_file(results: Path) -> Path:
    return results / INVENTORIES.file


def plain_store_file(results: Path) -> Path:
    return results / PLAIN_NAME


def xz_streams(data: bytes) -> Iterator[tuple[int, bytes | None, str]]:
    """(offset, decoded bytes, "") for every whole xz stream of `data`, (offset, None, why) for a bad
        one (core/safeio.py: bounded)."""
    return _xz_streams(data)


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
_CACHE: dict[Path, tuple[tuple[int, int], dict[str, dict[str, Any]], list[str]]] = {}


def _load_file(path: Path, compressed: bool, kind: Kind) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """id -> value of one store file, and the warnings for what was skipped (parsed once per
    file state; a missing file holds nothing)."""

    try:
        st = path.stat()
    except OSError:
        return {}, []
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit and hit[0] == stamp:
        return hit[1], hit[2]
    known: dict[str, dict[str, Any]] = {}
    warn: list[str] = []
    data = read_bytes(path, warn)
    if data is not None:
        if compressed:
            data = decode_store(path, data, warn)
        for lineno, obj in iter_jsonl(path, warn, data=data):
            ident = obj.get("id") if isinstance(obj, dict) else None
            value = obj.get(kind.key) if isinstance(obj, dict) else None
            if not isinstance(ident, str) or not kind.ok(value) or content_id(value) != ident:
                warn.append(f"{path}:{lineno}: skipped an {kind.noun} (needs id and {kind.key}, and the {kind.key} "
                            f"must hash to the id) — mend the line, or drop it: scripts/compact_results.py --force")
                continue
            known.setdefault(ident, value)
    _CACHE[path] = (stamp, known, warn)
    return known, warn


def store_line(kind: Kind, ident: str, value: dict[str, Any]) -> str:
    return json.dumps({"id": ident, kind.key: value}, separators=(",", ":"))


class _Gone:
    """Marks a slot to leave out (`_with`)."""


def _get(obj: Any, slot: Slot) -> Any:
    """What a parsed record line holds at `slot` (None where the path breaks off)."""
    for key in slot:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _with(obj: dict[str, Any], slot: Slot, value: Any) -> dict[str, Any]:
    """A copy of `obj` with `value` at `slot` (left out for `_Gone`), copying the objects on the way;
        the path must exist."""
    new = dict(obj)
    if len(slot) > 1:
        new[slot[0]] = _with(obj[slot[0]], slot[1:], value)
    elif value is _Gone:
        del new[slot[0]]
    else:
        new[slot[0]] = value
    return new


class StoreAppender(Appender):
    """Appends store lines, each an xz stream of its own: one `write` on an O_APPEND file, then
        fsync, so a crash costs at most the stream it cut off.  `lock`: under the notebook's lock."""

    def write(self, line: str) -> None:
        if "\n" in line or "\r" in line:
            raise ValueError("a store line must be one line")
        data = lzma.compress((line + "\n").encode("utf-8"))
        with self._locked():
            self._append(data, fresh_line=False)


class ContentStore:
    """The content-addressed values of one kind (`kind`, set by a subclass) of one results
    folder: the xz store, and the plain store of an older notebook while it is still there."""

    kind: Kind

    def __init__(self, results: Path):
        self.path = results / self.kind.file
        self.plain = results / self.kind.plain if self.kind.plain else None
        self._read: tuple[dict[str, dict[str, Any]], list[str]] | None = None

    def _load(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """id -> value (both files), and the warnings for what was skipped."""
        known, warn = _load_file(self.path, True, self.kind)
        if self.plain is None or not self.plain.exists():
            return known, warn
        old, old_warn = _load_file(self.plain, False, self.kind)
        return {**old, **known}, warn + old_warn

    def known(self) -> dict[str, dict[str, Any]]:
        return dict(self._load()[0])

    def warnings(self) -> list[str]:
        """What reading the store skipped (from the same loaded state the reads use)."""
        return list(self._snapshot()[1])

    def _snapshot(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """id -> value and its warnings, loaded once per store object (a reader resolves thousands of
                records against one state of the store)."""
        if self._read is None:
            self._read = self._load()
        return self._read

    def _resolve(self, obj: Any, drop_unknown: bool, warn: list[str] | None, where: str) -> Any:
        """`obj` (a parsed line) with the ids the store holds replaced by their values; an unknown id is
                left out (`drop_unknown`, one warning) or kept.  `obj` itself when it names none."""
        named = [(slot, ref) for slot in self.kind.slots if isinstance(ref := _get(obj, slot), str)]
        if not named:
            return obj
        known = self._snapshot()[0]
        for slot, ref in named:
            value = known.get(ref[len(REF):]) if ref.startswith(REF) else None
            if value is not None:
                obj = _with(obj, slot, dict(value))
            elif drop_unknown:
                obj = _with(obj, slot, _Gone)
                if warn is not None:
                    warn.append(f"{where}: {'.'.join(slot)} names {self.kind.noun} {ref[:40]!r}, which "
                                f"{self.path.name} does not hold — left out (restore {self.path.name} from git)")
        return obj

    def expand(self, obj: Any, warn: list[str] | None, where: str) -> Any:
        """`obj` (a parsed record line) with its ids replaced by the values; an id the store
        does not hold costs that value and one warning."""
        return self._resolve(obj, True, warn, where)

    def inline(self, obj: Any) -> Any:
        """`obj` with every id the store holds replaced by the value; an id it does not hold
        stays as it is (nothing is lost). `obj` itself when nothing changes."""
        return self._resolve(obj, False, None, "")

    def compact(self, obj: dict[str, Any], append: Callable[[str], None]) -> dict[str, Any]:
        """`obj` (a record as a dict) with its values stored and named by id; `append(line)`
        writes one line to the store (called before the record is written)."""
        todo = [slot for slot in self.kind.slots if (value := _get(obj, slot)) and self.kind.ok(value)]
        if not todo:
            return obj
        known, _ = self._load()
        for slot in todo:
            value = _get(obj, slot)
            ident = content_id(value)
            if ident not in known:
                append(store_line(self.kind, ident, value))
                known[ident] = dict(value)
            obj = _with(obj, slot, REF + ident)
        return obj

    def refs(self, obj: Any) -> set[str]:
        """The ids of this store that a parsed record line names."""
        return {ref[len(REF):] for slot in self.kind.slots
                if isinstance(ref := _get(obj, slot), str) and ref.startswith(REF)}


class InventoryStore(ContentStore):
    """A record's instruction inventories: results/inventories.jsonl.xz."""

    kind = INVENTORIES


class EnvStore(ContentStore):
    """A record's env block: results/envs.jsonl.xz."""

    kind = ENVS


class Stores:
    """The stores of one results folder used as one (a record names values of each)."""

    def __init__(self, results: Path):
        self.each: tuple[ContentStore, ...] = (InventoryStore(results), EnvStore(results))

    def expand(self, obj: Any, warn: list[str] | None, where: str) -> Any:
        for store in self.each:
            obj = store.expand(obj, warn, where)
        return obj

    def inline(self, obj: Any) -> Any:
        for store in self.each:
            obj = store.inline(obj)
        return obj

    def compact(self, obj: dict[str, Any], append: Callable[[ContentStore, str], None]) -> dict[str, Any]:
        """`obj` with the values of every store named by id; `append(store, line)` writes one
        line to that store (before the record is written)."""
        for store in self.each:
            obj = store.compact(obj, partial(append, store))
        return obj

    def warnings(self) -> list[str]:
        return [w for store in self.each for w in store.warnings()]


def rewrite_store(store: ContentStore, keep: Iterable[str] | None = None) -> tuple[int, int]:
    """Write the store (xz and plain together) as ONE xz stream of the values whose ids are in `keep`
        (all when None), atomically, and remove the plain store.  Returns (kept, dropped).  Hold the
        notebook's lock exclusive (a value appended meanwhile would be lost)."""
    known = store.known()
    wanted = set(known) if keep is None else set(keep)
    kept = {i: v for i, v in known.items() if i in wanted}
    body = "".join(store_line(store.kind, i, kept[i]) + "\n" for i in sorted(kept)).encode()
    replace_file(store.path, lzma.compress(body, preset=9 | lzma.PRESET_EXTREME))
    if store.plain is not None and store.plain.exists():
        store.plain.unlink()
    return len(kept), len(known) - len(kept)


def compact_file(path: Path, store: ContentStore, append: Callable[[str], None]) -> tuple[int, int]:
    """Rewrite a records file with its inline values of `store`'s kind moved into the store,
        atomically; unparsable lines kept byte for byte.  Returns (lines, bytes saved)."""
    data = read_regular(path)
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
