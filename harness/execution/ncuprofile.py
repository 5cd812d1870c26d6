"""`dsv4-lab profile STAGE [filters]`: Nsight Compute on one bench shape, a small fixed set of
metrics kept with the record.

The first bench shape the filters leave is compiled as `bench` does; a child process
(`python -m harness.execution.ncuprofile JOB OUT`) checks it against the oracle (a wrong kernel
is not profiled) and launches it once more inside the NVTX range `dsv4`, which `ncu --nvtx
--nvtx-include dsv4/ --launch-count 1 --csv --page raw --print-units base` profiles.  `parse_csv`
reads METRICS and STALLS into the record's `profile` block:

    kernel            the profiled kernel's name
    duration_us       gpu__time_duration.sum
    sm_pct            sm__throughput.avg.pct_of_peak_sustained_elapsed
    mem_pct           gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed
    occupancy_pct     sm__warps_active.avg.pct_of_peak_sustained_active (achieved occupancy)
    regs              launch__registers_per_thread
    l2_hit_pct        lts__t_sector_hit_rate.pct
    dram_bytes        dram__bytes_read.sum + dram__bytes_write.sum
    stalls            the top STALL_TOP warp-stall reasons, cycles per issued instruction
                      (smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio)

`profile --compare REV` profiles REV's kernel too (taken as `bench --compare` takes it) into the
record's `compare` block.  The record is a bench record without a timing.  Without ncu, a GPU,
or permission for the performance counters (ERR_NVGPUCTRPERM): one line, exit 1."""

from __future__ import annotations

import csv
import io
import json
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.core.labels import case_label
from harness.spec.spec import Stage

METRICS: dict[str, str] = {
    "duration_us": "gpu__time_duration.sum",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
}
STALL_REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
                 "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction",
                 "not_selected", "short_scoreboard", "sleeping", "tex_throttle", "wait")
# ("selected", a warp issuing, is no stall: not asked for)
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
STALL_TOP = 5
NVTX_RANGE = "dsv4"
PERMISSION = "ERR_NVGPUCTRPERM"
RAW_ENV = "DSV4_NCU_RAW"  # a path: ncu's raw output is written there too
# Units ncu may print (with --print-units base it prints the base ones), as factors to the base.
# Both spellings: the long ones of ncu's CSV (nsecond, Kbyte) and the short ones (ns, KB). A
# duration or byte count in a unit not listed here is an error, never a silent factor 1 (the
# first H200 profiles printed 106,208 "µs" for a ~100 µs kernel: nanoseconds taken as µs).
_TIME = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,  # to µs
         "ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6}
_BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
          "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
_SCALE = {**_TIME, **_BYTES}
_DIMENSION = {"duration_us": _TIME, "dram_read": _BYTES, "dram_write": _BYTES}  # what each must be in


class ProfileError(Exception):
    """Profiling cannot start or gave nothing usable (one line)."""


def metric_names() -> list[str]:
    return [*METRICS.values(), *(STALL.format(r) for r in STALL_REASONS)]


def ncu_command(ncu: str, job_file: Path, out_file: Path, python: str = sys.executable) -> list[str]:
    """The ncu command line that profiles the one NVTX-ranged launch of the child process."""
    return [ncu, "--csv", "--page", "raw", "--print-units", "base", "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/",
            "--launch-count", "1", "--target-processes", "all", "--metrics", ",".join(metric_names()),
            python, "-m", "harness.execution.ncuprofile", str(job_file), str(out_file)]


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def parse_csv(text: str) -> dict[str, Any]:
    """The profile block from ncu's `--csv --page raw` output: the header row ("ID"), a units row,
        one row per kernel (the first taken); earlier lines skipped.  ProfileError without a kernel
        row or with a metric missing."""
    if PERMISSION in text:
        raise ProfileError(f"ncu may not read the GPU's performance counters ({PERMISSION}) — run as root, or "
                           "with the driver's NVreg_RestrictProfilingToAdminUsers=0")
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        last = next((ln for ln in reversed(lines) if ln.strip()), "no output")
        raise ProfileError(f"ncu profiled no kernel ({last.strip()[:200]})")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    units = rows[1] if len(rows) > 1 and rows[1] and rows[1][0] == "" else [""] * len(header)
    data = [r for r in rows[1:] if r and r[0] != "" and len(r) == len(header)]
    if not data:
        raise ProfileError("ncu profiled no kernel (no data row in its CSV)")
    row = dict(zip(header, data[0]))
    unit = dict(zip(header, units))

    def value(metric: str, units: dict[str, float] | None = None) -> float:
        if metric not in row:
            raise ProfileError(f"ncu's CSV has no column {metric}")
        v = _number(row[metric])
        if v is None:
            raise ProfileError(f"ncu's CSV: {metric} is {row[metric]!r}, not a number")
        u = unit.get(metric, "").strip()
        if units is not None:
            if u not in units:
                raise ProfileError(f"ncu's CSV gives {metric} in {u or 'no unit'!r}, not a unit the lab knows "
                                   f"({', '.join(sorted(units))}): add it to harness/execution/ncuprofile.py")
            return v * units[u]
        return v * _SCALE.get(u, 1.0)

    out: dict[str, Any] = {"kernel": row.get("Kernel Name", "?")}
    for key, metric in METRICS.items():
        out[key] = value(metric, _DIMENSION.get(key))
    out["duration_us"] = round(out["duration_us"], 3)
    out["regs"] = int(out["regs"])
    out["dram_bytes"] = int(out.pop("dram_read") + out.pop("dram_write"))
    stalls = {r: value(STALL.format(r)) for r in STALL_REASONS if STALL.format(r) in row}
    top = sorted(((r, v) for r, v in stalls.items() if v > 0), key=lambda rv: -rv[1])[:STALL_TOP]
    out["stalls"] = {r: round(v, 3) for r, v in top}
    return out


def lines(p: dict[str, Any]) -> list[str]:
    """How `show` prints a profile block."""
    stalls = ", ".join(f"{r} {v:.2f}" for r, v in (p.get("stalls") or {}).items())
    return [f"profile (ncu): {p.get('kernel', '?')}",
            f"  {p['duration_us']:.2f} µs  SM {p['sm_pct']:.1f} %  memory {p['mem_pct']:.1f} %  "
            f"occupancy {p['occupancy_pct']:.1f} %  {p['regs']} registers",
            f"  L2 hit {p['l2_hit_pct']:.1f} %  DRAM {p['dram_bytes'] / 1e6:.2f} MB",
            f"  top stalls (cycles per issue): {stalls or '—'}"]


def side_by_side(a: dict[str, Any], b: dict[str, Any], rev: str) -> list[str]:
    """`profile --compare REV`: REV's profile and the tree's, one metric a line, with the change."""
    out = [f"{'metric':<16}{rev:>14}{'tree':>14}{'Δ':>10}"]
    for key, fmt in (("duration_us", ".2f"), ("sm_pct", ".1f"), ("mem_pct", ".1f"), ("occupancy_pct", ".1f"),
                     ("regs", "d"), ("l2_hit_pct", ".1f"), ("dram_bytes", "d")):
        x, y = a.get(key), b.get(key)
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        delta = f"{y / x - 1:+.1%}" if key in ("duration_us", "dram_bytes", "regs") and x else f"{y - x:+.1f}"
        out.append(f"{key:<16}{format(x, fmt):>14}{format(y, fmt):>14}{delta:>10}")
    for name, st in ((rev, a), ("tree", b)):
        stalls = ", ".join(f"{r} {v:.2f}" for r, v in (st.get("stalls") or {}).items())
        out.append(f"stalls {name}: {stalls or '—'}")
    return out


def _run_ncu(root: Path, job: Any, ncu: str, gpu: int, timeout_s: float) -> dict[str, Any]:
    """One ncu run of `job`'s checked launch: {"status", "metrics"?, "error"?, "profile"?};
        ProfileError when ncu gave no usable profile of a passing kernel."""
    import os

    with tempfile.TemporaryDirectory(prefix="dsv4-profile-") as tmp:
        job_file, out_file = Path(tmp) / "job.pkl", Path(tmp) / "out.json"
        job_file.write_bytes(pickle.dumps((str(root), job)))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        try:
            proc = subprocess.run(ncu_command(ncu, job_file, out_file), cwd=root, env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"ncu: no result within {timeout_s:g} s"}
        got = json.loads(out_file.read_text()) if out_file.is_file() else {}
    if not got:
        return {"status": "crash", "error": (proc.stderr.strip().splitlines() or ["ncu gave no result"])[-1][:300]}
    raw = proc.stdout + "\n" + proc.stderr
    if os.environ.get(RAW_ENV):  # ncu's own text, for a unit or column the parser does not know
        Path(os.environ[RAW_ENV]).write_text(raw)
    if got.get("status") == "pass":
        got["profile"] = parse_csv(raw)
    return got


def main(root: Path, stage: Stage, pairs: list[tuple[str, str]], timeout_s: float = 600.0, seed: int = 0,
         gpu: int = 0, argv: list[str] | None = None, compare: str | None = None) -> int:
    """Plan one shape, then (ncu and a GPU here) compile, check, profile and record it; `compare`:
        REV's kernel profiled too, into the record's `compare` block."""
    from harness.core.environment import gpu_capabilities
    from harness.execution.bench import _job, plan_cases

    cases = plan_cases(stage, pairs)
    case = cases[0]
    print(f"{stage.name} profile: {case_label(case)}" + (f" (the first of {len(cases)} shapes)" if len(cases) > 1 else ""))
    with tempfile.TemporaryDirectory(prefix="dsv4-profile-rev-") as tmp:
        sha = old_root = None
        if compare is not None:
            from harness.execution.abbench import rev_commit, take_tree

            sha = rev_commit(root, compare)
            old_root = take_tree(root, compare, sha, Path(tmp) / "tree")
            print(f"{compare} ({sha[:12]}): its stages.yaml, stages/ and oracles/ taken into a temporary tree")
        ncu = shutil.which("ncu")
        if ncu is None:
            print("profile: ncu (Nsight Compute) is not on PATH here — install it or run on the GPU machine",
                  file=sys.stderr)
            return 1
        caps = gpu_capabilities()
        if gpu not in caps:
            print("profile: no GPU here: nothing was profiled", file=sys.stderr)
            return 1
        arch = caps[gpu][1]
        if arch not in stage.kernels:
            print(f"profile: {stage.name} has no kernel for {arch} (GPU {gpu}): nothing was profiled", file=sys.stderr)
            return 1
        from harness.core.paths import cache_dir
        from harness.execution.compile import Compiler
        from harness.notebook.records import BENCH_NOTE, Record, RunLog, now_iso
        from harness.spec.identity import code_identity

        compiler = Compiler(root)
        try:
            res = compiler.submit(stage, arch, case).result()
        finally:
            compiler.close()
        old: dict[str, Any] = {}
        if old_root is not None:
            from harness.execution.abbench import compile_rev

            old = compile_rev(old_root, stage.id, arch, [case], cache_dir(root)).get(case_label(case)) or \
                {"ok": False, "error": f"{stage.name} {case_label(case)} does not exist at {compare}"}
        log = RunLog(root)
        log.plan(target="local", argv=argv or [], cases=1, bench=True)
        log.start()
        common: dict[str, Any] = dict(id=f"{log.run_id}.1", run=log.run_id, t="", stage=stage.id, arch=arch,
                                      case=case, code=code_identity(root, stage, arch), gpu=gpu, note=BENCH_NOTE)
        status = "crash"
        block: dict[str, Any] | None = None if sha is None else {"rev": compare, "commit": sha[:12]}
        try:
            if not res.ok:
                rec = Record(**common, status="compile_error", error=res.error, compile=res.summary(), compare=block)
            elif old and not old["ok"]:  # the tree's kernel built: nothing to compare it with
                rec = Record(**common, status="skipped", error=f"not profiled: at {compare}: {old.get('error')}",
                             compile=res.summary(), compare=block)
            else:
                job = _job(stage, arch, case, False, 1, seed)
                job.object_path, job.prefix = res.object_path, res.prefix
                job.time_it = False
                try:
                    got = _run_ncu(root, job, ncu, gpu, timeout_s)
                    if old and got.get("status") == "pass":
                        rev_job = _job(stage, arch, case, False, 1, seed)
                        rev_job.object_path, rev_job.prefix = old["object_path"], old["prefix"]
                        rev_job.time_it = False
                        got_a = _run_ncu(root, rev_job, ncu, gpu, timeout_s)
                        assert block is not None
                        block["status"] = got_a.get("status", "crash")
                        if got_a.get("profile"):
                            block["profile"] = got_a["profile"]
                        elif got_a.get("error"):
                            block["error"] = got_a["error"]
                except ProfileError as exc:
                    print(f"profile: {exc}", file=sys.stderr)
                    return 1
                rec = Record(**common, status=got.get("status", "crash"), metrics=got.get("metrics") or {},
                             error=got.get("error"), compile=res.summary(), profile=got.get("profile"), compare=block)
            rec.t = now_iso()
            log.write(rec)
            status = rec.status
        finally:
            log.close()
            log.end(False, planned=1, counts={status: 1})
    if rec.profile and block and block.get("profile"):
        print("\n".join(side_by_side(block["profile"], rec.profile, str(compare))))
    elif rec.profile:
        print("\n".join(lines(rec.profile)))
    if not rec.profile:
        print(f"profile: {rec.status}: {rec.error or 'not profiled'}", file=sys.stderr)
    elif block is not None and not block.get("profile"):
        print(f"profile: {compare}'s kernel: {block.get('status')}: {block.get('error') or 'not profiled'}",
              file=sys.stderr)
    print(f"record: {rec.id} (dsv4-lab show {rec.id})")
    return 0 if rec.profile and (block is None or block.get("profile")) else 1


def _child(job_file: str, out_file: str) -> int:
    """In ncu's child: check the shape like bench, then launch it once inside the NVTX range."""
    import torch

    from harness.execution.executor import CaseExecutor

    root, job = pickle.loads(Path(job_file).read_bytes())
    sys.path.insert(0, root)
    ex = CaseExecutor(Path(root))
    got = ex.check_and_time(job)
    if got["status"] == "pass":
        done = ex.launch(job)
        (_, args), = done.arg_sets(1)
        launch = ex.launcher(job, args)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        launch()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    Path(out_file).write_text(json.dumps({k: got[k] for k in ("status", "metrics", "error") if k in got}))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
