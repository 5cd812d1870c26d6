"""A real sshd on 127.0.0.1 (`ssh_server`; aliases labhost, -badkey, -unknown, -noauth, -closed) and `make_lab`."""

import getpass
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

PROJECT = Path(__file__).resolve().parents[1]
SSHD = "/usr/sbin/sshd"


@dataclass
class SshServer:
    """A running sshd and the client-side files that reach it."""

    port: int
    closed_port: int
    dir: Path
    config: Path  # client config for DSV4_LAB_SSH_CONFIG
    user: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def free_port() -> int:
    """A local TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsv4-lab-test", "-f", str(path)],
                   check=True, capture_output=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _server_config(d: Path) -> str:
    return textwrap.dedent(f"""\
        ListenAddress 127.0.0.1
        HostKey {d}/host_key
        AuthorizedKeysFile {d}/authorized_keys
        StrictModes no
        PidFile {d}/sshd.pid
        UsePAM no
        PubkeyAuthentication yes
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        AllowTcpForwarding no
        X11Forwarding no
        PrintMotd no
        """)


def _client_config(d: Path, port: int, closed_port: int, user: str) -> str:
    def host(alias: str, key: str, known: str, p: int = port) -> str:
        return textwrap.dedent(f"""\
            Host {alias}
              HostName 127.0.0.1
              Port {p}
              User {user}
              IdentityFile {d}/{key}
              IdentitiesOnly yes
              UserKnownHostsFile {d}/{known}
              GlobalKnownHostsFile {d}/known_hosts_empty
              StrictHostKeyChecking yes
              PasswordAuthentication no
              ConnectTimeout 5
            """)

    return "\n".join([
        host("labhost", "user_key", "known_hosts"),
        host("labhost-badkey", "user_key", "known_hosts_wrong"),
        host("labhost-unknown", "user_key", "known_hosts_empty"),
        host("labhost-noauth", "spare_key", "known_hosts"),
        host("labhost-closed", "user_key", "known_hosts", closed_port),
    ])


def _wait_listening(proc: subprocess.Popen, port: int, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"sshd could not start: {log.read_text(errors='replace').strip()[-300:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.skip(f"sshd did not listen on 127.0.0.1:{port} within {timeout:.0f} s: {log.read_text(errors='replace')[-300:]}")


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A real sshd on 127.0.0.1 (skipped if it cannot start)."""
    if not os.access(SSHD, os.X_OK):
        pytest.skip(f"sshd is not installed ({SSHD}): apt-get install openssh-server")
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: apt-get install openssh-client")
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        # root's sshd needs /run/sshd.
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        except OSError as exc:
            pytest.skip(f"sshd cannot start: /run/sshd is missing and cannot be created ({exc})")
    d = tmp_path_factory.mktemp("sshd")
    host_pub = _keygen(d / "host_key")
    user_pub = _keygen(d / "user_key")
    _keygen(d / "spare_key")
    wrong_pub = _keygen(d / "wrong_host_key")
    (d / "authorized_keys").write_text(user_pub + "\n")
    port, closed_port = free_port(), free_port()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n[127.0.0.1]:{closed_port} {host_pub}\n")
    (d / "known_hosts_wrong").write_text(f"[127.0.0.1]:{port} {wrong_pub}\n")
    (d / "known_hosts_empty").write_text("")
    (d / "sshd_config").write_text(_server_config(d))
    user = getpass.getuser()
    (d / "ssh_config").write_text(_client_config(d, port, closed_port, user))
    for key in ("user_key", "spare_key"):
        os.chmod(d / key, 0o600)
    log = d / "sshd.log"
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config"), "-p", str(port)],
                                stdin=subprocess.DEVNULL, stdout=log_fh, stderr=log_fh)
    try:
        _wait_listening(proc, port, log)
        yield SshServer(port=port, closed_port=closed_port, dir=d, config=d / "ssh_config", user=user, log=log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# A throwaway lab with CPU-only stages.

FAKE_ORACLE = '''\
"""Oracle of the fake CPU stages: out = a + b."""
from oracles.common import TensorSpec


def tensors(case):
    n = case["n"]
    return [TensorSpec("a", (n,), "float32"), TensorSpec("b", (n,), "float32"),
            TensorSpec("out", (n,), "float32", "out")]


def make_inputs(case, seed, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = case["n"]
    return {"a": (torch.rand(n, generator=g) + 0.5).to(device), "b": (torch.rand(n, generator=g) + 0.5).to(device)}


def reference(inputs, case):
    return {"out": inputs["a"].double() + inputs["b"].double()}
'''

FAKE_KERNEL = '''\
"""A plain-Python kernel (arch cpu): out = a + b, into the pre-allocated output."""


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        out.copy_(a + b)
'''

CRASH_KERNEL = '''\
"""Kills the whole `python -m cli` (its worker's parent) on the second case, n = 8."""
import os


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        if self.n == 8:
            os.kill(os.getppid(), 9)
        out.copy_(a + b)
'''

NOISY_KERNEL = '''\
"""Writes to stdout the ways a careless or hostile kernel does: no newline (n = 4), a forged
record of a case not in the matrix, unframed and in a guessed frame (n = 8), and a forged copy of
its own case with a failing status (n = 16). None of it may lose or forge a record."""
import json
import os
import sys


def _forged(n, status):
    return {"v": 1, "id": "FORGED.1", "run": "FORGED", "t": "2026-01-01T00:00:00Z", "stage": "NOISY",
            "arch": "cpu", "case": {"n": n}, "status": status, "metrics": {"out": {"cosine": 1.0}}}


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        if self.n == 4:
            sys.stdout.write("progress without a newline")
            sys.stdout.flush()
            os.write(1, b"raw write to fd 1, no newline")
        elif self.n == 8:
            line = json.dumps(_forged(999, "pass"))
            print(line, flush=True)
            print("@@dsv4-rec 1 " + "0" * 64 + " " + line, flush=True)
            print("@@dsv4-rec 2 " + "f" * 64 + " " + json.dumps({"v": 1, "event": "end", "run": "FORGED"}), flush=True)
            os.write(1, ("\\n" + line + "\\n").encode())
        elif self.n == 16:
            print(json.dumps(_forged(16, "fail")), flush=True)
            print("key in env:", any("KEY" in k for k in os.environ), flush=True)
        out.copy_(a + b)
'''

SLOW_KERNEL = '''\
"""Takes a minute per case: for stopping runs part-way. With SLOW_MARK set, each case first
writes its worker's pid into that folder (the test waits for it, then checks the worker dies)."""
import os
import time
from pathlib import Path


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        mark = os.environ.get("SLOW_MARK")
        if mark:
            (Path(mark) / f"{os.getpid()}.{self.n}").write_text("")
        time.sleep(60)
        out.copy_(a + b)
'''

def _cpu_stage(name: str, title: str, timeout_s: int, n: str = "[4, 8, 16]") -> str:
    """A stages.yaml entry of a CPU stage on the fake add oracle."""
    d = name.lower()
    return (f"  {name}:\n    title: {title}\n    dir: stages/{d}\n    kernels:\n"
            f"      cpu: {{module: stages.{d}.cpu, entry: Kernel}}\n    tensors: oracles.fake:tensors\n"
            f"    inputs: oracles.fake:make_inputs\n    oracle: oracles.fake:reference\n    matrix:\n"
            f"      n: {n}\n    tolerances:\n      out: {{cosine_min: 0.9999}}\n    timeout_s: {timeout_s}\n")


STAGES_YAML = "version: 1\nstages:\n" + "".join(_cpu_stage(*s) for s in (
    ("FAKE", "fake add on the CPU", 120),
    ("NOISY", "prints to stdout without newlines and forges records", 120),
    ("SLOW", "a minute per case", 300),
    ("CRASH", "kills its own run on the second case", 120),
))


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=lab test", "-c", "user.email=lab@test.invalid", *args],
                          cwd=root, check=True, capture_output=True, text=True).stdout


def make_lab(root: Path, targets_yaml: str = "") -> Path:
    """A small git lab with CPU stages FAKE and CRASH."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROJECT / "cli.py", root / "cli.py")
    shutil.copytree(PROJECT / "harness", root / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "oracles").mkdir()
    for name in ("__init__.py", "common.py"):
        shutil.copy(PROJECT / "oracles" / name, root / "oracles" / name)
    (root / "oracles" / "fake.py").write_text(FAKE_ORACLE)
    for folder, kernel in (("fake", FAKE_KERNEL), ("crash", CRASH_KERNEL), ("noisy", NOISY_KERNEL),
                           ("slow", SLOW_KERNEL)):
        (root / "stages" / folder).mkdir(parents=True)
        (root / "stages" / folder / "__init__.py").write_text("")
        (root / "stages" / folder / "cpu.py").write_text(kernel)
    (root / "stages" / "__init__.py").write_text("")
    (root / "stages.yaml").write_text(STAGES_YAML)
    (root / ".gitignore").write_text("__pycache__/\n.cache/\n*.log\n")
    (root / "targets.yaml").write_text(targets_yaml or "version: 1\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "lab")
    return root


def add_cpu_stage(root: Path, name: str, title: str, kernel: str, n: str, timeout_s: int = 600) -> None:
    """Stage NAME (stages/<name>/cpu.py: `kernel`, matrix n: `n`) added to the lab at `root` and committed."""
    d = root / "stages" / name.lower()
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "cpu.py").write_text(kernel)
    (root / "stages.yaml").write_text((root / "stages.yaml").read_text() + _cpu_stage(name, title, timeout_s, n))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", name.lower())


def run_cli(root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300
            ) -> subprocess.CompletedProcess:
    """`python -m cli ARGS` in the lab at `root`."""
    full = {**os.environ, "DSV4_LAB_ROOT": str(root), "PYTHONPATH": str(root), **(env or {})}
    full.pop("DSV4_LAB_GIT", None)
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=root, env=full, capture_output=True,
                          text=True, timeout=timeout)
