"""`dsv4-lab compile STAGE --diff REV`: what changed in the instruction inventory and the
resources (registers, spills, shared memory, barriers, status) between the working tree and
a commit.

The user's code at REV (stages.yaml, stages/, oracles/) is taken with `git archive` into a
temporary folder and compiled by this lab's own code (so only the kernels and oracles differ),
in a process of its own (its modules never mix with the tree's) and with a compile cache of
its own (`<cache>/rev`, content-keyed, so a second diff against the same commit is quick).
The tree's cases are compiled as `dsv4-lab compile` would (cached). Nothing is recorded: a
diff is a view, not a result. Exit 0 when both sides were compiled (whatever changed), 2 for
a REV git does not know.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from harness.core.paths import cache_dir
from harness.spec.spec import Spec, Stage

USER_CODE = ("stages.yaml", "stages", "oracles")


def counters(ok: bool, resources: dict[str, Any], inv: dict[str, int], sass: dict[str, int],
             error: str | None = None) -> dict[str, Any]:
    """One side of a case, flattened: `status`, resources, `ptx KEY`, `sass KEY`."""
    out: dict[str, Any] = {"status": "compiled" if ok else f"compile_error: {error or '?'}"}
    for k in ("regs", "spill", "stack", "smem", "barriers"):
        if k in resources:
            out[k] = resources[k]
    out.update({f"ptx {k}": v for k, v in inv.items()})
    out.update({f"sass {k}": v for k, v in sass.items()})
    return out


def changed(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """(counter, at REV, in the tree) for every counter that differs (a missing one is 0 for
    an instruction count, absent otherwise)."""
    old, new = old or {}, new or {}
    rows = []
    for key in sorted(set(old) | set(new), key=lambda k: (k.split(" ")[0] not in ("status",), k)):
        a, b = old.get(key), new.get(key)
        if key.startswith(("ptx ", "sass ")):
            a, b = a or 0, b or 0
        if a != b:
            rows.append((key, a, b))
    return rows


def _compile_side(spec: Spec, stage: Stage, archs: list[str], labels: list[str]) -> dict[str, dict[str, Any]]:
    """{"arch label": counters} for the selected cases of `stage` in `spec`'s tree."""
    from harness.execution.compilerun import CompileJob, compile_recorded
    from harness.spec.matrix import expand

    by_label = {c.label: c for c in expand(stage)}
    jobs = [CompileJob(stage, a, by_label[lb]) for a in archs if a in stage.kernels for lb in labels if lb in by_label]
    _, done = compile_recorded(spec, jobs, ["compile", "--diff"], write=False)
    return {f"{d.job.arch} {d.job.case.label}": counters(d.result.ok, d.result.resources, d.result.inventory,
                                                         d.result.sass, d.result.error) for d in done}


def _git(root: Path, *args: str, data: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=not data, timeout=120)


def _extract(root: Path, rev: str, dest: Path) -> Path:
    """The user's code at `rev` under `dest`; returns the lab root there."""
    prefix = _git(root, "rev-parse", "--show-prefix").stdout.strip()
    present = [f"{prefix}{p}" for p in USER_CODE
               if _git(root, "cat-file", "-e", f"{rev}:{prefix}{p}").returncode == 0]
    if not present:
        raise RuntimeError(f"{rev} has none of {', '.join(USER_CODE)}")
    out = _git(root, "archive", "--format=tar", rev, "--", *present, data=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.decode(errors="replace").strip().splitlines()[-1])
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.11.4: git archive of a commit holds plain files only
            tar.extractall(dest)
    return dest / prefix


def diff_main(spec: Spec, stage: Stage, archs: list[str], cases: list, rev: str) -> int:
    from rich.markup import escape
    from rich.table import Table

    from harness.core.console import make_console

    console = make_console()
    root = spec.root
    sha = _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").stdout.strip()
    if not sha:
        print(f"dsv4-lab: --diff {rev}: not a commit git knows here — e.g. HEAD, HEAD~1, main, a sha",
              file=sys.stderr)
        return 2
    labels = [c.label for c in cases]
    with tempfile.TemporaryDirectory(prefix="dsv4-diff-") as tmp:
        try:
            old_root = _extract(root, sha, Path(tmp) / "tree")
        except (RuntimeError, OSError, tarfile.TarError) as exc:
            print(f"dsv4-lab: --diff {rev}: cannot take its tree ({exc})", file=sys.stderr)
            return 2
        result = Path(tmp) / "old.json"
        code_root = Path(__file__).resolve().parents[2]  # harness/execution/compilediff.py -> the code root
        env = {**os.environ, "DSV4_LAB_ROOT": str(old_root), "DSV4_LAB_CACHE": str(cache_dir(root) / "rev"),
               "PYTHONPATH": os.pathsep.join([str(code_root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        console.print(f"compiling {stage.name} ({len(labels)} case(s) × {', '.join(archs)}) at {rev} ({sha[:12]}) "
                      "and in the working tree …", highlight=False)
        old_proc = subprocess.Popen(
            [sys.executable, "-m", "harness.execution.compilediff", str(old_root), stage.id, json.dumps(archs),
             json.dumps(labels), str(result)], cwd=old_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            new = _compile_side(spec, stage, archs, labels)
            _, err = old_proc.communicate()
        except BaseException:
            old_proc.kill()
            old_proc.wait()
            raise
        if old_proc.returncode != 0 or not result.is_file():
            why = (err.strip().splitlines() or ["no result"])[-1]
            print(f"dsv4-lab: --diff {rev}: could not compile {stage.name} at that commit: {why}", file=sys.stderr)
            return 2
        old = json.loads(result.read_text())
    if old.get("missing"):
        console.print(f"{stage.name} does not exist at {rev}: every counter below is new", highlight=False)
    table = Table(title=f"{stage.name}: {rev} ({sha[:12]}) → working tree")
    for col in ("arch", "case", "counter", rev, "tree", "Δ"):
        table.add_column(col, justify="right" if col in (rev, "tree", "Δ") else "left")
    same = []
    for key in new:
        arch, label = key.split(" ", 1)
        rows = changed(old.get("cases", {}).get(key), new[key])
        if not rows:
            same.append(key)
            continue
        for i, (name, a, b) in enumerate(rows):
            delta = f"{b - a:+d}" if isinstance(a, int) and isinstance(b, int) else ""
            table.add_row(arch if i == 0 else "", label if i == 0 else "", escape(name), escape(_s(a)), escape(_s(b)),
                          delta)
    if table.row_count:
        console.print(table)
    console.print(f"{len(new) - len(same)} case(s) changed, {len(same)} unchanged (instruction counts are static "
                  "counts in the code, `(all)` every instruction)", highlight=False)
    return 0


def _s(x: Any) -> str:
    return "—" if x is None else str(x)[:80]


def _emit(root: str, stage_id: str, archs: list[str], labels: list[str], out: str) -> int:
    """The REV side, in its own process: compile and write {"cases": {...}} to `out`."""
    from harness.spec.spec import load_spec

    sys.path.insert(0, root)
    spec = load_spec(root=Path(root))
    if stage_id not in spec.stages:
        Path(out).write_text(json.dumps({"missing": True, "cases": {}}))
        return 0
    cases = _compile_side(spec, spec.stages[stage_id], archs, labels)
    Path(out).write_text(json.dumps({"cases": cases}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_emit(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]))
    except Exception as exc:  # reported by the parent as one line
        print(f"{type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        sys.exit(1)
