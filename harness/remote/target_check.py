"""`dsv4-lab targets check NAME`: connect to a target and report what a run there would find —
its Python, torch and CuTeDSL versions, its GPUs, whether the work folder is writable, and how
the tree would be copied. Every fact comes back on a `@@dsv4 key value` line (login banners
and other output are ignored) and is shown with control characters escaped."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.console import make_console, printable
from harness.remote.ssh import DEFAULT_CONNECT_TIMEOUT, EXIT_LINK, MARK, LinkError, marked, remote_path, run_ssh
from harness.remote.targets import Target, TargetError, resolve_targets
from harness.remote.treecopy import local_rsync

PROBE_PY = (
    "import sys\n"
    f"print('{MARK} python', sys.version.split()[0])\n"
    "try:\n"
    "    from importlib import metadata\n"
    "except ImportError:\n"
    "    metadata = None\n"
    "for key, dists in (('torch', ('torch',)), ('cute', ('nvidia-cutlass-dsl', 'nvidia_cutlass_dsl'))):\n"
    "    found = 'missing'\n"
    "    for d in dists:\n"
    "        try:\n"
    "            found = metadata.version(d)\n"
    "            break\n"
    "        except Exception:\n"
    "            pass\n"
    f"    print('{MARK}', key, found)\n"
)


def check_script(t: Target) -> str:
    """The remote shell text of `targets check`: every fact on a `@@dsv4 key value` line."""
    wd = remote_path(t.workdir)
    return "; ".join([
        f"echo \"{MARK} host $(uname -n)\"",
        f"{{ {t.python} -c {shlex.quote(PROBE_PY)} ; }} 2>&1",
        f"echo \"{MARK} python-rc $?\"",
        f"if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=index,name,compute_cap "
        f"--format=csv,noheader 2>&1 | sed 's/^/{MARK} gpu /'; else echo '{MARK} nosmi'; fi",
        f"if mkdir -p {wd} 2>/dev/null && test -w {wd}; then echo '{MARK} writable yes'; "
        f"else echo '{MARK} writable no'; fi",
        f"if command -v rsync >/dev/null 2>&1; then echo '{MARK} rsync yes'; else echo '{MARK} rsync no'; fi",
    ])


@dataclass
class CheckResult:
    host: str = "?"
    python: str | None = None
    python_error: str | None = None
    torch: str = "missing"
    cute: str = "missing"
    gpus: list[str] = field(default_factory=list)
    gpu_note: str | None = None
    writable: bool = False
    rsync: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.python) and self.torch != "missing" and self.cute != "missing" and self.writable


def parse_check(stdout: bytes) -> CheckResult:
    """The facts of a check script's output (each value one printable line, bounded)."""
    res = CheckResult()
    text = stdout.decode("utf-8", "replace").splitlines()
    py_out = [ln for ln in text if not ln.startswith(MARK)]
    for key, rest in marked(stdout):
        rest = printable(rest, 200)
        if key == "host":
            res.host = rest
        elif key == "python":
            res.python = rest
        elif key in ("torch", "cute"):
            setattr(res, key, rest or "missing")
        elif key == "python-rc" and rest != "0":
            res.python = None
            res.python_error = printable(py_out[-1] if py_out else f"exit code {rest}", 200)
        elif key == "gpu":
            parts = [p.strip() for p in rest.split(",")]
            if len(parts) == 3 and parts[0].isdigit():
                res.gpus.append(f"{parts[0]}: {parts[1]} (compute capability {parts[2]})")
            else:
                res.gpu_note = rest
        elif key == "nosmi":
            res.gpu_note = "no nvidia-smi"
        elif key == "writable":
            res.writable = rest == "yes"
        elif key == "rsync":
            res.rsync = rest == "yes"
    return res


def check_cmd(root: Path, name: str) -> int:
    """Connect to `name` and report Python, torch, CuTeDSL, GPUs and the work folder: 0 ready, 1 not
        ready, 3 unreachable; TargetError (exit 2) for a bad name or targets file."""
    if "," in name:
        raise TargetError(f"targets check {name}: check one target at a time")
    t = resolve_targets(root, name, "targets check")[0]
    console = make_console()
    console.print(f"{t.name}: ssh {t.where} (declared at {t.declared})", highlight=False, markup=False)
    t0 = time.monotonic()
    try:
        out = run_ssh(t, check_script(t), timeout=DEFAULT_CONNECT_TIMEOUT + 90)
    except LinkError as exc:
        sys.stdout.flush()
        print(str(exc), file=sys.stderr, flush=True)
        return EXIT_LINK
    res = parse_check(out.stdout)
    here = local_rsync() is not None
    copy_by = ("rsync" if res.rsync and here else
               "tar (no rsync on the remote)" if not res.rsync else "tar (no rsync here)")
    rows = [
        ("connect", f"ok in {time.monotonic() - t0:.1f} s (host {res.host})"),
        ("python", f"{res.python} ({t.python})" if res.python else f"FAILED: {res.python_error or 'no answer'} ({t.python})"),
        ("torch", res.torch),
        ("CuTeDSL", res.cute),
        ("GPUs", "; ".join(res.gpus) if res.gpus else f"none ({res.gpu_note})" if res.gpu_note else "none"),
        ("work folder", f"{t.workdir} — {'writable' if res.writable else 'NOT writable'}"),
        ("copy by", copy_by),
    ]
    for key, value in rows:
        console.print(f"  {key:<12} {value}", highlight=False, markup=False)
    console.print("ready" if res.ready else "not ready: see above", highlight=False, markup=False)
    return 0 if res.ready else 1
