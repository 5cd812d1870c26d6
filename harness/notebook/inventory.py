"""The instruction inventory of a compiled kernel: its PTX (always) and SASS (with the CUDA binary
tools), counted per instruction with the qualifiers that matter; static counts, not executions.

PTX keys (one counter per distinct key), e.g.:
  tcgen05.mma.cta_group::1.kind::f16     the MMA with its kind and CTA group (.ws / .sp kept)
  tcgen05.ld.32x32b.x32, tcgen05.st.…    TMEM loads/stores with shape and repeat
  wgmma.mma_async.m64n64k16.f32.bf16.bf16, mma.m16n8k16.…
  ld.global.128b, st.shared.32b, ld.global.nc.128b, st.async.128b   space and width in bits
  bar.sync.named, bar.arrive.named       (named: a barrier id other than a literal 0)
  setmaxnreg.inc.240, cvt.e4m3x2.f32, cp.async.bulk.tensor.2d.shared.global, mbarrier.…
  (all)                                  every instruction
SASS keys: the opcode with its qualifiers for HGMMA, UTC*MMA, HMMA, LDL/STL (spills),
LDG/STG/LDS/STS, LDSM/STSM, BAR, SHFL, MUFU, SYNCS, UTMALDG/UTMASTG/UBLKCP, F2FP; and `(all)`.
`is_mma(key)` names the tensor-core MMA counters (the gate refuses a change in them)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

ALL = "(all)"

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_LABEL = re.compile(r"^[$\w]+:(?!:)\s*")
_PRED = re.compile(r"^@!?%?\w+\s+")
_OPCODE = re.compile(r"^([a-z][a-z0-9_]*(?:\.[A-Za-z0-9_:]+)*)(.*)$", re.S)
_SPACES = {"global", "shared", "shared::cta", "shared::cluster", "local", "param", "const", "tex"}
_TYPE = re.compile(r"^(?:[bfsu]\d+|f16x2|bf16x2|bf16|e4m3x[24]|e5m2x[24]|pred)$")
_LOWP = ("e4m3", "e5m2", "e2m1", "e3m2", "e2m3", "ue8m0")
_APPROX = {"ex2", "lg2", "rcp", "sqrt", "rsqrt", "sin", "cos", "tanh"}


def _space(parts: list[str]) -> str | None:
    for p in parts:
        if p in _SPACES:
            return "shared" if p in ("shared", "shared::cta") else p
    return None


def _bits(parts: list[str]) -> int | None:
    vec = 1
    for p in parts:
        if re.fullmatch(r"v\d+", p):
            vec = int(p[1:])
    for p in reversed(parts):
        m = re.fullmatch(r"[bfsu](\d+)", p)
        if m:
            return vec * int(m.group(1))
    return None


def ptx_key(opcode: str, operands: str = "") -> str | None:
    """The counter an instruction goes to (None: counted in `(all)` only)."""
    parts = opcode.split(".")
    base = parts[0]
    quals = [p for p in parts[1:] if p not in ("sync", "aligned")]
    if base == "tcgen05":
        op = quals[0] if quals else ""
        if op == "mma":
            keep = [q for q in quals[1:] if q.startswith(("cta_group", "kind")) or q in ("ws", "sp", "block_scale")]
            return ".".join(["tcgen05.mma", *keep])
        keep = [q for q in quals[1:] if re.fullmatch(r"\d+x\d+b|x\d+|pack::\w+|unpack::\w+", q)
                or q.startswith("cta_group") or q.startswith("multicast")]
        return ".".join(["tcgen05", op, *keep])
    if base == "wgmma":
        return ".".join(["wgmma", *[q for q in quals if not q.startswith("shared")]])
    if base == "mma":
        return ".".join(["mma", *quals])
    if base in ("ld", "st", "ldu"):
        if quals and quals[0] == "async":
            bits = _bits(quals)
            return f"st.async.{bits}b" if bits else "st.async"
        space = _space(quals) or "generic"
        if space in ("param", "const", "tex"):
            return None
        nc = ".nc" if "nc" in quals else ""
        bits = _bits(quals)
        return f"{base}.{space}{nc}.{bits}b" if bits else f"{base}.{space}{nc}"
    if base in ("atom", "red"):
        return f"{base}.{_space(quals) or 'generic'}"
    if base == "shfl":
        mode = next((q for q in quals if q in ("up", "down", "bfly", "idx")), "")
        return f"shfl.{mode}" if mode else "shfl"
    if base in _APPROX:
        types = [q for q in quals if _TYPE.match(q)]
        approx = ".approx" if "approx" in quals else ""
        return f"{base}{approx}.{types[-1]}" if types else f"{base}{approx}"
    if base in ("bar", "barrier"):
        key = ".".join([base, *[q for q in parts[1:] if q not in ("aligned", "defer_blocking") and not _TYPE.match(q)]])
        if "cluster" not in parts and "warp" not in parts:
            first = operands.strip().split(",")[0].strip()
            if first not in ("", "0"):
                key += ".named"
        return key
    if base == "setmaxnreg":
        n = operands.strip().split(",")[0].strip()
        op = next((q for q in quals if q in ("inc", "dec")), "")
        return f"setmaxnreg.{op}.{n}" if n.isdigit() else f"setmaxnreg.{op}"
    if base == "cvt":
        if not any(lp in q for q in quals for lp in _LOWP):
            return None
        return ".".join(["cvt", *[q for q in quals if _TYPE.match(q) or any(lp in q for lp in _LOWP)]])
    if base == "cp" and quals[:1] == ["async"]:
        rest = quals[1:]
        if rest[:1] == ["bulk"]:
            rest = rest[1:]
            if rest[:1] == ["tensor"]:
                dims = next((q for q in rest if re.fullmatch(r"\d+d", q)), "")
                spaces = [("shared" if q.startswith("shared") else q) for q in rest if q.split("::")[0] in
                          ("shared", "global")]
                extra = [q for q in rest if q.startswith("multicast") or q == "im2col"]
                return ".".join(["cp.async.bulk.tensor", dims, *spaces[:2], *extra])
            if rest[:1] in (["commit_group"], ["wait_group"]):
                return ".".join(["cp.async.bulk", *rest[:2]]) if rest[1:2] == ["read"] else f"cp.async.bulk.{rest[0]}"
            spaces = [("shared" if q.startswith("shared") else q) for q in rest if q.split("::")[0] in ("shared", "global")]
            return ".".join(["cp.async.bulk", *spaces[:2]])
        return ".".join(["cp.async", *rest[:1]])
    if base == "cp" and quals[:1] == ["reduce"]:
        return "cp.reduce.async.bulk" + (".tensor" if "tensor" in quals else "")
    if base == "mbarrier":
        return ".".join(["mbarrier", *[q for q in quals if q not in _SPACES and not _TYPE.match(q)
                                       and q not in ("release", "acquire", "relaxed", "cta", "cluster")]])
    if base in ("stmatrix", "ldmatrix"):
        return ".".join([base, *[q for q in quals if q not in _SPACES and not _TYPE.match(q)]])
    if base == "fence":
        return opcode
    return None


def ptx_inventory(ptx: str) -> dict[str, int]:
    """{counter: count} over the PTX text (see the module's text)."""
    counts: dict[str, int] = {}
    total = 0
    text = _COMMENT.sub("", ptx)
    for stmt in re.split(r"[;{}]", text):
        s = stmt.strip()
        if not s or s[0] in ".)(":
            continue
        s = _LABEL.sub("", s)
        s = _PRED.sub("", s)
        m = _OPCODE.match(s)
        if not m:
            continue
        total += 1
        key = ptx_key(m.group(1), m.group(2))
        if key:
            counts[key] = counts.get(key, 0) + 1
    if total:
        counts[ALL] = total
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------------
# SASS.

_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)",
                        re.M)
_SASS_KEEP = re.compile(r"^(HGMMA|UTC\w*MMA\w*|HMMA|QMMA|IMMA|LDL|STL|LDG|STG|LDS|STS|LDSM|STSM|BAR|SHFL|MUFU|"
                        r"SYNCS|UTMALDG|UTMASTG|UTMAREDG|UBLKCP|F2FP|WARPGROUP|USETMAXREG)$")


def sass_inventory(sass: str) -> dict[str, int]:
    """{counter: count} over disassembled SASS (cuobjdump -sass / nvdisasm output)."""
    counts: dict[str, int] = {}
    total = 0
    for m in _SASS_LINE.finditer(sass):
        op = m.group(1)
        total += 1
        if _SASS_KEEP.match(op.split(".")[0]):
            counts[op] = counts.get(op, 0) + 1
    if total:
        counts[ALL] = total
    return dict(sorted(counts.items()))


_MMA = re.compile(r"^(tcgen05\.mma|wgmma\.mma_async|mma\.|HGMMA|UTC\w*MMA|HMMA|QMMA|IMMA)")


def is_mma(key: str) -> bool:
    return bool(_MMA.match(key))


def mma_counts(inv: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in inv.items() if is_mma(k)}


def family(key: str) -> str:
    """A counter's family, for short displays: `tcgen05.mma.cta_group::1.kind::f16` -> `tcgen05.mma`."""
    for prefix in ("tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.alloc", "tcgen05.commit",
                   "wgmma.mma_async", "cp.async.bulk.tensor", "stmatrix", "ldmatrix", "mbarrier", "mma."):
        if key.startswith(prefix):
            return "wgmma" if prefix == "wgmma.mma_async" else prefix.rstrip(".") if prefix != "mma." else "mma.sync"
    return key


def families(inv: dict[str, int]) -> dict[str, int]:
    """Totals per family (the short form `dsv4-lab compile` shows)."""
    out: dict[str, int] = {}
    for k, v in inv.items():
        if k == ALL:
            continue
        f = family(k)
        out[f] = out.get(f, 0) + v
    return out


# ---------------------------------------------------------------------------------------
# The CUDA binary tools (optional: `pip install "dsv4-lab[sass]"`).


@lru_cache(maxsize=None)
def find_tool(name: str) -> str | None:
    """An executable CUDA tool (ptxas, cuobjdump, nvdisasm): on PATH, else in the NVIDIA wheels
        (site-packages/nvidia/*/bin/), else under $CUDA_HOME/bin."""
    found = shutil.which(name)
    if found:
        return found
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(base).glob(f"*/bin/{name}"))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "bin" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def sass_tool() -> list[str] | None:
    """The command that disassembles a cubin to SASS, or None when neither tool is here."""
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump:
        return [cuobjdump, "-sass"]
    nvdisasm = find_tool("nvdisasm")
    return [nvdisasm] if nvdisasm else None


SASS_MISSING = ("SASS not counted: the CUDA binary tools (cuobjdump / nvdisasm) are not installed — "
                "pip install \"dsv4-lab[sass]\"")


def disassemble(cubin: Path) -> str | None:
    """The SASS of a cubin, or None when no tool is installed or it fails."""
    cmd = sass_tool()
    if cmd is None or not cubin.is_file():
        return None
    try:
        out = subprocess.run([*cmd, str(cubin)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None
