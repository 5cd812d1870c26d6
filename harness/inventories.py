"""Instruction inventories, kept once: results/inventories.jsonl.

A compiled case's record carries two instruction inventories (`compile.inv`, the PTX counters,
and `compile.sass`, the SASS ones): a few hundred bytes to 2 KB each, and the same for every case
that builds the same kernel. The notebook keeps each distinct inventory once, content-addressed:

    results/inventories.jsonl   {"id": "<16 hex>", "counts": {"wgmma.mma_async…": 32, …}}
    records/<stage>.jsonl       … "compile": {…, "inv": "#<id>", "sass": "#<id>"} …

id = the first 16 hex digits of sha256 over the counts as canonical JSON (sorted keys, no
spaces), so one inventory always gets the same id, whoever writes it.

Writing (`InventoryStore.compact`): a record's tables are appended to the store — before the
record itself, so a crash never leaves a record naming an inventory the store lacks — and the
record line holds their ids. Two writers at once may append the same inventory twice; readers
take the first good line of an id.

Reading (`InventoryStore.expand`): ids are replaced by the counts before the record is checked,
so every reader gets the record as it was written. A store line whose counts do not hash to its
id (a hand edit, a merge gone wrong) is skipped with one warning naming file:line; a record that
names an id the store does not hold keeps everything else, loses that table (the gate then says
the case shows no inventory) and costs one warning. Records written before the store (tables
inline) read as they always did.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

TABLES = ("inv", "sass")
REF = "#"
ID_LEN = 16
STORE_NAME = "inventories.jsonl"


def inventory_id(counts: dict[str, int]) -> str:
    text = json.dumps(counts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LEN]


def _counts_ok(counts: Any) -> bool:
    return isinstance(counts, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items())


def store_file(results: Path) -> Path:
    return results / STORE_NAME


# The parsed store per file, reused while the file is unchanged: (mtime_ns, size) -> ids.
_CACHE: dict[Path, tuple[tuple[int, int], dict[str, dict[str, int]], list[str]]] = {}


class InventoryStore:
    """The content-addressed inventories of one results folder."""

    def __init__(self, results: Path):
        self.path = store_file(results)

    def _load(self) -> tuple[dict[str, dict[str, int]], list[str]]:
        """id -> counts, and the warnings for lines skipped (parsed once per file state)."""
        from harness.records import iter_jsonl

        try:
            st = self.path.stat()
        except OSError:
            return {}, []
        stamp = (st.st_mtime_ns, st.st_size)
        hit = _CACHE.get(self.path)
        if hit and hit[0] == stamp:
            return hit[1], hit[2]
        known: dict[str, dict[str, int]] = {}
        warn: list[str] = []
        for lineno, obj in iter_jsonl(self.path, warn):
            ident = obj.get("id") if isinstance(obj, dict) else None
            counts = obj.get("counts") if isinstance(obj, dict) else None
            if not isinstance(ident, str) or not _counts_ok(counts) or inventory_id(counts) != ident:
                warn.append(f"{self.path}:{lineno}: skipped an inventory (needs id and counts, and the counts must hash to the id)")
                continue
            known.setdefault(ident, counts)
        _CACHE[self.path] = (stamp, known, warn)
        return known, warn

    def warnings(self) -> list[str]:
        return list(self._load()[1])

    def expand(self, obj: Any, warn: list[str] | None, where: str) -> Any:
        """`obj` (a parsed record line) with its inventory ids replaced by the counts."""
        comp = obj.get("compile") if isinstance(obj, dict) else None
        if not isinstance(comp, dict) or not any(isinstance(comp.get(t), str) for t in TABLES):
            return obj
        known, _ = self._load()
        comp = dict(comp)
        for table in TABLES:
            ref = comp.get(table)
            if not isinstance(ref, str):
                continue
            counts = known.get(ref[len(REF):]) if ref.startswith(REF) else None
            if counts is None:
                del comp[table]
                if warn is not None:
                    warn.append(f"{where}: compile.{table} names inventory {ref[:40]!r}, which {self.path.name} does not hold — left out")
            else:
                comp[table] = dict(counts)
        return {**obj, "compile": comp}

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
                append(json.dumps({"id": ident, "counts": counts}, separators=(",", ":")))
                known[ident] = dict(counts)
            comp[table] = REF + ident
        return {**obj, "compile": comp}


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text)
    os.replace(tmp, path)
    return len(out), len(data) - len(text)
