"""`dsv4-lab inspect`: the layouts a kernel builds, read at trace time, and the agreement checks
between them (no GPU needed).

A kernel exposes objects with `stages.common.inspection.expose(self, ...)` while traced.  This
module traces one case in a worker whose CUTE_DSL_ARCH is the requested arch, with a recorder
that describes each exposed object on the spot into plain data, and runs the checks:

  mma coverage     each MMA's accumulator fragment owns every (row, col) of its tile exactly
                   once over all threads and registers
  P in registers   (sm90 B and C) the Q·Kᵀ accumulator and the P·V A-operand fragment hold the
                   same (row, key) for every thread and register
  P via SMEM       register i of P's store copy holds the (row, key) it writes; the writes
                   cover the tile once; the write layout equals the PV MMA's read layout; every
                   warpgroup's A operand reads the whole tile
  TMEM             (sm100) every tensor inside the allocation (≤ 512 columns, a power of two
                   ≥ 32); S and O disjoint; P inside S and disjoint from O; TMEM-P load/store
                   fragments agree for all 128 threads

Exit status: 0 when every check holds (and at least one ran), 1 when one fails or the
trace fails (named), 2 for bad usage."""

from __future__ import annotations

import os
import re
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

TMEM_COLUMNS = 512
TMEM_LANES = 128


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Inspection:
    title: str
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)


# ---------------------------------------------------------------------------------------
# Pure-Python layout evaluation (static shapes and strides, nested int tuples)


def _flatten(shape: Any, stride: Any) -> list[tuple[int, int]]:
    if isinstance(shape, tuple):
        out: list[tuple[int, int]] = []
        for s, d in zip(shape, stride):
            out += _flatten(s, d)
        return out
    return [(int(shape), int(stride) if stride is not None else 0)]


def layout_offsets(shape: Any, stride: Any) -> list[int]:
    """Offsets of a layout for linear indices 0 … size − 1 (first mode fastest)."""
    offs = [0]
    for extent, step in _flatten(shape, stride):
        offs = [o + i * step for i in range(extent) for o in offs]
    return offs


_SWIZZLE = re.compile(r"S<(\d+),(\d+),(-?\d+)>")


def swizzle_fn(text: str):
    """The swizzle function of 'S<B,M,S>' (CuTe's Swizzle): o ^ ((o & yyy) >> S)."""
    m = _SWIZZLE.search(text)
    if not m:
        return lambda o: o
    b, base, shift = (int(x) for x in m.groups())
    yyy = ((1 << b) - 1) << (base + max(0, shift))
    return lambda o: o ^ ((o & yyy) >> shift) if shift >= 0 else o ^ ((o & yyy) << -shift)


def swizzle_text(text: str) -> str:
    m = _SWIZZLE.search(text)
    if not m:
        return "none"
    b = int(m.group(1))
    return f"{m.group(0)} ({ {0: 'none', 1: '32-byte', 2: '64-byte', 3: '128-byte'}.get(b, '?') } pattern for 16-bit elements)"


def smem_offsets(layout) -> list[int]:
    """Swizzled element offsets of a (composed) shared-memory layout, index order."""
    outer = getattr(layout, "outer", layout)
    inner = str(getattr(layout, "inner", ""))
    sw = swizzle_fn(inner)
    return [sw(o) for o in layout_offsets(outer.shape, outer.stride)]


def decode_tmem_address(addr: int) -> tuple[int, int, bool]:
    """(lane, column, tagged) of a TMEM address (lane << 16 | column); bit 0x8000 of the column field
        is a tag some A-operand offsets carry (DSV4.md lesson 4), reported and stripped."""
    lane, col = addr >> 16, addr & 0xFFFF
    return lane, col & 0x7FFF, bool(col & 0x8000)


# ---------------------------------------------------------------------------------------
# Describing what a kernel exposes (runs inside the trace)


def _coords(t) -> list[tuple]:
    """The coordinates of an identity-tensor partition in index order, evaluated in Python
        (stages/common/sm100_coords.py, as the kernels' own checks)."""
    from stages.common.sm100_coords import identity_coords

    return identity_coords(t)


def _mma_lines(name: str, mma, tile) -> list[str]:
    op = mma.op
    lines = [
        f"atom        {type(op).__name__}: instruction M×N×K = {tuple(op.shape_mnk)}, "
        f"A {op.a_dtype} {getattr(op.a_major_mode, 'name', op.a_major_mode)}-major "
        f"from {getattr(getattr(op, 'a_src', None), 'name', 'SMEM')}, "
        f"B {op.b_dtype} {getattr(op.b_major_mode, 'name', op.b_major_mode)}-major, acc {op.acc_dtype}",
        f"tile (M,N,K) {tuple(tile)}   threads {mma.size}   atoms (V,M,N,K) {mma.thr_layout_vmnk}",
        f"tiler       {mma.get_tile_size(0)}×{mma.get_tile_size(1)}×{mma.get_tile_size(2)}",
        f"TV layout C {mma.tv_layout_C_tiled}",
        f"TV layout A {mma.tv_layout_A_tiled}",
        f"TV layout B {mma.tv_layout_B_tiled}",
        f"per thread  C {mma.partition_shape_C(tile[:2])}   "
        f"A {mma.partition_shape_A((tile[0], tile[2]))}   B {mma.partition_shape_B((tile[1], tile[2]))}",
    ]
    return lines


def _one_line(obj: Any, limit: int = 220) -> str:
    text = " ".join(str(obj).split())
    return text if len(text) <= limit else text[:limit] + " …"


def _reg_map(frag_layout, coords: list) -> dict[int, tuple]:
    regs = layout_offsets(frag_layout.shape, frag_layout.stride)
    return {r: c for r, c in zip(regs, coords)}


def _thread_maps(mma, tile_mn, operand: str) -> list[dict[int, tuple]]:
    """Per thread: register index → (row, col) of the C or A fragment over `tile_mn`
    (one partition of an identity tensor per thread, evaluated in Python)."""
    import cutlass.cute as cute

    ident = cute.make_identity_tensor(tile_mn)
    thr0 = mma.get_slice(0)
    if operand == "C":
        frag = thr0.make_fragment_C(thr0.partition_shape_C(tile_mn))
    else:
        frag = thr0.make_fragment_A(thr0.partition_shape_A(tile_mn))
    regs = layout_offsets(frag.layout.shape, frag.layout.stride)  # the same for every thread
    out = []
    for t in range(mma.size):
        thr = mma.get_slice(t)
        crd = thr.partition_C(ident) if operand == "C" else thr.partition_A(ident)
        out.append(dict(zip(regs, _coords(crd))))
    return out


def _coverage(maps: list[dict[int, tuple]], tile_mn) -> tuple[bool, str]:
    seen: dict[tuple, int] = {}
    for m in maps:
        for c in m.values():
            seen[c] = seen.get(c, 0) + 1
    want = tile_mn[0] * tile_mn[1]
    dup = sum(1 for v in seen.values() if v > 1)
    ok = len(seen) == want and dup == 0 and all(
        0 <= c[0] < tile_mn[0] and 0 <= c[1] < tile_mn[1] for c in seen)
    return ok, f"{len(seen)} of {want} (row, col) owned, {dup} owned twice"


def _map_lines(maps: list[dict[int, tuple]], label: str) -> list[str]:
    lines = []
    for t in sorted(t for t in {0, 1, 4, 32, len(maps) - 1} if t < len(maps)):
        m = maps[t]
        regs = sorted(m)
        shown = ", ".join(f"r{r}→{m[r]}" for r in regs[:6])
        lines.append(f"{label} thread {t:>3}: {len(regs)} regs  {shown}{' …' if len(regs) > 6 else ''}")
    return lines


class Recorder:
    """Receives what a kernel exposes while it is traced; describes and checks it at once."""

    def __init__(self) -> None:
        self.report = Inspection(title="")
        self.mmas: dict[str, tuple] = {}
        self.p_path: str | None = None
        self.p_write = None
        self.p_read = None
        self._map_cache: dict[tuple, list] = {}

    def add(self, title: str, lines: list[str]) -> None:
        self.report.sections.append((title, lines))

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.report.checks.append(Check(name, bool(ok), detail))

    def __call__(self, kernel, named: dict[str, Any]) -> None:
        if "p_path" in named:
            self.p_path = named["p_path"]
        for key in ("qk_mma", "pv_mma", "mma"):
            if key in named:
                mma, tile = named[key]
                self.mmas[key] = (mma, tuple(tile))
                self._mma(key, mma, tuple(tile))
        if "smem" in named:
            self._smem(named["smem"])
        if "p_write_smem" in named:
            self.p_write = named["p_write_smem"]
        if "p_read_smem" in named:
            self.p_read = named["p_read_smem"]
        if self.p_path == "registers" and "qk_mma" in self.mmas and "pv_mma" in self.mmas and "pv_mma" in named:
            self._registers_p()
        if "p_store" in named:
            self._p_store(*named["p_store"])
        if self.p_write is not None and self.p_read is not None and ("p_write_smem" in named or "p_read_smem" in named):
            self._p_layouts()
        if "pv_a_tile" in named and "pv_mma" in self.mmas:
            self._pv_reads_all(named["pv_a_tile"])
        if "tmem" in named:
            self._tmem(named["tmem"])
        if "tmem_pair" in named:
            self._tmem_pair(*named["tmem_pair"])

    # -- MMAs
    def _maps(self, name: str, operand: str, tile_mn) -> list[dict[int, tuple]]:
        key = (name, operand, tuple(tile_mn))
        if key not in self._map_cache:
            self._map_cache[key] = _thread_maps(self.mmas[name][0], tile_mn, operand)
        return self._map_cache[key]

    def _mma(self, name: str, mma, tile) -> None:
        lines = _mma_lines(name, mma, tile)
        maps_c = self._maps(name, "C", tile[:2])
        lines += _map_lines(maps_c, "C")
        if name == "pv_mma" and self.p_path == "registers":
            lines += _map_lines(self._maps(name, "A", (tile[0], tile[2])), "A")
        self.add(f"MMA {name}", lines)
        ok, detail = _coverage(maps_c, tile[:2])
        self.check(f"{name}: C fragment owns each (row, col) of the {tile[0]}×{tile[1]} tile once", ok, detail)

    def _registers_p(self) -> None:
        qk, qk_tile = self.mmas["qk_mma"]
        pv, pv_tile = self.mmas["pv_mma"]
        tile_mk = (qk_tile[0], qk_tile[1])
        maps_c = self._maps("qk_mma", "C", tile_mk)
        maps_a = self._maps("pv_mma", "A", tile_mk) if pv.size == qk.size else []
        bad = [t for t in range(len(maps_c)) if not maps_a or maps_c[t] != maps_a[t]]
        if not maps_a:
            detail = f"thread counts differ: qk {qk.size}, pv {pv.size}"
        elif bad:
            t = bad[0]
            r = next((r for r in sorted(set(maps_c[t]) | set(maps_a[t])) if maps_c[t].get(r) != maps_a[t].get(r)), None)
            detail = (f"{len(bad)} of {len(maps_c)} threads disagree; first: thread {t} register {r}: "
                      f"S{maps_c[t].get(r)} vs P{maps_a[t].get(r)}")
        else:
            detail = f"all {len(maps_c)} threads, {len(maps_c[0])} registers each"
        self.check("P in registers: Q·Kᵀ accumulator (thread, register) → (row, key) equals the P·V A operand's",
                   not bad, detail)

    # -- shared memory
    def _smem(self, layouts: dict[str, Any]) -> None:
        import cutlass.cute as cute

        lines = []
        for name, lay in layouts.items():
            outer = getattr(lay, "outer", lay)
            lines.append(f"{name:<3} {str(outer)}  cosize {cute.cosize(outer)}  swizzle {swizzle_text(str(getattr(lay, 'inner', '')))}")
        self.add("shared memory", lines)

    def _p_store(self, copy, src, src_coords, dst_coords) -> None:
        import cutlass.cute as cute

        if isinstance(src_coords, tuple):
            src_coords = cute.make_identity_tensor(src_coords)
        if isinstance(dst_coords, tuple):
            dst_coords = cute.make_identity_tensor(dst_coords)
        threads = 128
        bad, seen, dup = [], set(), 0
        for t in range(threads):
            thr_src = src.get_slice(t)
            part = thr_src.partition_C(src_coords) if hasattr(thr_src, "partition_C") else thr_src.partition_D(src_coords)
            thr = copy.get_slice(t)
            # The copy moves tile element c of its source to tile element c of its
            # destination; register j of the retiled source is the tile element at
            # partition_S[j] (for stmatrix not the address this thread supplies: partition_D).
            regs = _coords(thr.retile(part))
            src_tile = _coords(thr.partition_S(dst_coords))
            dst = _coords(thr.partition_D(dst_coords))
            if regs != src_tile:
                bad.append(t)
            for c in dst:
                dup += c in seen
                seen.add(c)
        want = cute.size(dst_coords)
        self.add("P store (registers → SMEM)", [f"copy {_one_line(copy)}", f"threads {threads}, destination {dst_coords.shape}"])
        self.check("P store: register i holds the (row, key) the copy writes it to, every thread", not bad,
                   f"{len(bad)} of {threads} threads disagree" + (f" (first {bad[0]})" if bad else ""))
        self.check("P store: writes cover the P tile exactly once", len(seen) == want and dup == 0,
                   f"{len(seen)} of {want} written, {dup} twice")

    def _p_layouts(self) -> None:
        a, b = smem_offsets(self.p_write), smem_offsets(self.p_read)
        same = a == b
        inj = len(set(a)) == len(a)
        self.add("P in SMEM", [f"written with {self.p_write}", f"read with    {self.p_read}",
                               f"swizzle {swizzle_text(str(getattr(self.p_write, 'inner', '')))}"])
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        self.check("P via SMEM: the layout P is written with equals the PV MMA's A-operand layout", same and len(a) == len(b),
                   f"{len(a)} offsets compared" + (f"; first difference at element {diff}" if diff is not None else ""))
        self.check("P via SMEM: distinct offset per element", inj, f"{len(set(a))} distinct of {len(a)}")

    def _pv_reads_all(self, tile_mk) -> None:
        import cutlass.cute as cute

        pv, _ = self.mmas["pv_mma"]
        ident = cute.make_identity_tensor(tile_mk)
        want = tile_mk[0] * tile_mk[1]
        ok, notes = True, []
        for t in range(0, pv.size, 128):  # one thread per warpgroup (tcgen05: the one MMA "thread")
            got = set(_coords(pv.get_slice(t).partition_A(ident)))
            ok &= len(got) == want
            notes.append(f"thread {t}: {len(got)} of {want}")
        self.check("P via SMEM: the PV A operand of each warpgroup reads the whole P tile", ok, "; ".join(notes))

    # -- TMEM
    def _tmem(self, plan) -> None:
        alloc = int(plan.alloc_cols)
        tensors = []
        for name in ("s", "p", "o"):
            lay = getattr(plan, f"{name}_layout", None)
            if lay is None or not getattr(plan, f"{name}_cols", 0):
                continue
            _, base, base_tag = decode_tmem_address(int(getattr(plan, f"{name}_col")))
            _, ncols, cols_tag = decode_tmem_address(int(getattr(plan, f"{name}_cols")))
            bits = plan.p_dtype.width if name == "p" else 32
            cells, tags = set(), int(base_tag) + int(cols_tag)
            for off in layout_offsets(lay.shape, lay.stride):
                lane, col, tagged = decode_tmem_address(off * bits // 32)  # 32-bit TMEM words
                tags += tagged
                cells.add((lane, base + col))
            cols = sorted({c for _, c in cells})
            lanes = sorted({ln for ln, _ in cells})
            tensors.append((name.upper(), base, ncols, cells, cols, lanes, tags, str(lay)))
        lines = [f"allocation {alloc} columns of {TMEM_COLUMNS} (tcgen05.alloc)"]
        for name, base, ncols, cells, cols, lanes, tags, lay in tensors:
            lines.append(f"{name}  columns [{cols[0]}, {cols[-1] + 1})  ({ncols} from the fragment, base {base})  "
                         f"lanes [{lanes[0]}, {lanes[-1] + 1})  layout {lay}"
                         + (f"  0x8000 tag on {tags} offsets (decoded and stripped)" if tags else "  no 0x8000 tag"))
        used = max((t[4][-1] + 1 for t in tensors), default=0)
        lines.append(f"used {used} columns, {alloc - used} spare in the allocation, {TMEM_COLUMNS - alloc} left on the SM")
        self.add("TMEM (lane, column): address = lane << 16 | column", lines)
        by = {t[0]: t for t in tensors}
        pow2 = alloc >= 32 and alloc & (alloc - 1) == 0
        self.check(f"TMEM: allocation {alloc} ≤ {TMEM_COLUMNS} columns, a power of two ≥ 32, holds every tensor",
                   pow2 and alloc <= TMEM_COLUMNS and used <= alloc
                   and all(t[5][-1] < TMEM_LANES for t in tensors), f"used {used}")
        for name, base, ncols, cells, cols, lanes, tags, lay in tensors:
            self.check(f"TMEM: {name} spans its {ncols} planned columns from {base}",
                       cols == list(range(base, base + ncols)), f"columns {cols[0]}…{cols[-1]}")
        if "S" in by and "O" in by:
            self.check("TMEM: S and O columns disjoint", not (set(by["S"][4]) & set(by["O"][4])),
                       f"S [{by['S'][4][0]}, {by['S'][4][-1] + 1}), O [{by['O'][4][0]}, {by['O'][4][-1] + 1})")
        if "P" in by:
            self.check("TMEM: P inside S (declared alias: P overwrites S once read) and disjoint from O",
                       set(by["P"][4]) <= set(by["S"][4]) and not (set(by["P"][4]) & set(by.get("O", (0,) * 5)[4] or [])),
                       f"P [{by['P'][4][0]}, {by['P'][4][-1] + 1})")

    def _tmem_pair(self, load, load_coords, store, store_coords) -> None:
        bad = []
        for t in range(TMEM_LANES):
            a = _coords(load.get_slice(t).partition_D(load_coords))
            b = _coords(store.get_slice(t).partition_S(store_coords))
            if a != b:
                bad.append(t)
        self.add("TMEM-P copies", [f"load  {_one_line(load)}", f"store {_one_line(store)}"])
        self.check("TMEM-P: tcgen05.ld of S and tcgen05.st of P hold the same (row, key) per register, all 128 threads",
                   not bad, f"{len(bad)} threads disagree" + (f" (first {bad[0]})" if bad else ""))


# ---------------------------------------------------------------------------------------
# The traced case (worker process)


def trace_case(root: str, module: str, entry: str, params: dict[str, Any], specs: list, title: str) -> Inspection:
    """Trace one case with a recorder installed (this process's CUTE_DSL_ARCH is the arch)."""
    import importlib

    from harness.core.userfault import describe
    from stages.common import inspection

    rec = Recorder()
    rec.report.title = title
    inspection.set_recorder(rec)
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from harness.execution.compile import fake_tensor

        kernel = getattr(importlib.import_module(module), entry)(**params)
        cute.compile(kernel, *[fake_tensor(s) for s in specs], make_fake_stream())
    except Exception as exc:  # the kernel's own error (or its own trace-time check) is the report
        rec.report.error = describe(exc, Path(root))
        if os.environ.get("DSV4_LAB_DEBUG"):
            import traceback

            traceback.print_exc()
    finally:
        inspection.set_recorder(None)
    if rec.report.error is None and not rec.report.checks:
        rec.report.error = (f"{module}.{entry} exposes nothing to inspect: call "
                            "stages.common.inspection.expose(self, ...) while it is traced")
    return rec.report


def _init(root: str, arch: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_DRYRUN"] = "1"  # trace to IR only: no PTX, no cubin (read at import)
    if root not in sys.path:
        sys.path.insert(0, root)


def inspect_in_process(root: Path, arch: str, module: str, entry: str, params: dict[str, Any], specs: list,
                       title: str) -> Inspection:
    """Run `trace_case` in a fresh process set up for `arch`."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"),
                             initializer=_init, initargs=(str(root), arch)) as pool:
        return pool.submit(trace_case, str(root), module, entry, params, specs, title).result()


def inspect_case(root: Path, stage, arch: str, case: dict[str, Any]) -> Inspection:
    from harness.execution.compile import tensor_specs
    from harness.core.labels import case_label

    kref = stage.kernels[arch]
    params = {k: case[k] for k in stage.kernel_params}
    title = f"{stage.name} {arch} {case_label(case)}  ({kref.module}.{kref.entry})"
    return inspect_in_process(root, arch, kref.module, kref.entry, params, tensor_specs(stage, case), title)


def render(rep: Inspection) -> str:
    out = [rep.title, "=" * min(len(rep.title), 100)]
    for title, lines in rep.sections:
        out.append(f"\n{title}")
        out += [f"  {ln}" for ln in lines]
    out.append("\nchecks")
    for c in rep.checks:
        out.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.name} — {c.detail}")
    if rep.error:
        out.append(f"  FAIL  trace: {rep.error}")
    failed = [c.name for c in rep.checks if not c.ok] + (["trace"] if rep.error else [])
    out.append(f"\n{len(rep.checks) - len([c for c in rep.checks if not c.ok])} of {len(rep.checks)} checks hold"
               + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return "\n".join(out)


def main(root: Path, stage, arch: str, cases: list) -> int:
    rep = inspect_case(root, stage, arch, cases[0].dict)
    print(render(rep))
    if len(cases) > 1:
        print(f"(inspected the first of {len(cases)} matching cases; narrow with filters for another)")
    return 0 if rep.ok else 1
