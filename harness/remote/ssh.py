"""The SSH transport: the ssh argv for a target, remote shell quoting, and ssh's failures
explained as one line.

Only the system OpenSSH client is used, always as an argv list (never a local shell), with
BatchMode=yes and host-key checking left as the user's ssh has it (the lab never turns it
off). Every remote argument is quoted with shlex.quote; the one unquoted remote text is the
target's own `python` command, written by the user. `DSV4_LAB_SSH_CONFIG` names an ssh config
file to use instead of ~/.ssh/config (`ssh -F`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from harness.remote.targets import Target, TargetError

SSH_CONFIG_ENV = "DSV4_LAB_SSH_CONFIG"
EXIT_LINK = 3  # a target could not be reached, or the link / remote run was lost
DEFAULT_CONNECT_TIMEOUT = 10
SERVER_ALIVE = ("ServerAliveInterval=15", "ServerAliveCountMax=4")  # a dead link shows in ~60 s
MARK = "@@dsv4"  # prefix of the lines our remote probes print (login banners are ignored)


class LinkError(Exception):
    """ssh could not reach or use a target; the text is one line, already explained."""


def ssh_binary() -> str:
    path = shutil.which("ssh")
    if path is None:
        raise TargetError("ssh: the OpenSSH client is not installed here — install openssh-client")
    return path


def ssh_config_args() -> list[str]:
    """`-F FILE` when DSV4_LAB_SSH_CONFIG names an ssh config file, else nothing."""
    cfg = os.path.expanduser(os.environ.get(SSH_CONFIG_ENV, ""))
    if not cfg:
        return []
    if not Path(cfg).is_file():
        raise TargetError(f"{SSH_CONFIG_ENV}={cfg}: no such file — point it at an ssh config file or unset it")
    return ["-F", cfg]


def ssh_base_argv(t: Target) -> list[str]:
    """ssh and its options for target `t` (no destination). The target's own options come
    first: for ssh the first value of an option wins."""
    argv = [ssh_binary(), *ssh_config_args()]
    for k, v in t.ssh_options:
        argv += ["-o", f"{k}={v}"]
    argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_CONNECT_TIMEOUT}"]
    for opt in SERVER_ALIVE:
        argv += ["-o", opt]
    if t.port is not None:
        argv += ["-p", str(t.port)]
    return argv


def ssh_argv(t: Target, remote_command: str) -> list[str]:
    """The full argv that runs `remote_command` (already quoted) on target `t`."""
    return [*ssh_base_argv(t), "--", t.ssh, remote_command]


def remote_path(path: str) -> str:
    """A remote path as shell text: quoted, with a leading ~ kept as "$HOME"."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def explain_ssh_failure(t: Target, stderr: str) -> str:
    """ssh's stderr as one line that says what to do."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("@")]
    last = _printable(lines[-1])[:300] if lines else "no message from ssh"
    where = t.where
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr or "has changed and you have requested strict" in stderr:
        return (f"{t.name}: host key mismatch for {where}: the server's key is not the one in your known_hosts. "
                "Check known_hosts: if the server was really reinstalled, verify its new fingerprint with its "
                "admin, remove the old entry (ssh-keygen -R HOST) and connect once with ssh. "
                "Never disable host-key checking.")
    if re.search(r"No \S+ host key is known for", stderr) or "Host key verification failed" in stderr:
        return (f"{t.name}: host key of {where} is not in your known_hosts (host key verification failed). "
                "Check known_hosts: connect once with ssh, verify the fingerprint, and accept it. "
                "Never disable host-key checking.")
    if "Permission denied" in stderr or "Too many authentication failures" in stderr:
        return (f"{t.name}: authentication failed for {where} ({last}). The lab uses your ssh keys and "
                "ssh-agent, never passwords: ssh-add your key, or install it with ssh-copy-id.")
    unreachable = ("Connection refused", "timed out", "Could not resolve hostname", "No route to host",
                   "Network is unreachable", "Connection closed", "Connection reset", "kex_exchange_identification",
                   "Name or service not known")
    if any(u in stderr for u in unreachable):
        return f"{t.name}: cannot reach {where}: {last}"
    return f"{t.name}: ssh to {where} failed: {last}"


_SSH_OWN = re.compile(
    r"^(ssh: |client_loop: |Connection to \S+ closed|Timeout, server \S+ not responding|packet_write_wait|"
    r"Read from remote host|Write failed|kex_exchange_identification|Host key verification failed|"
    r"\S+: Permission denied \()"
)


def ssh_own_lines(lines: list[str]) -> list[str]:
    """The lines of a session's stderr that ssh itself wrote (not the remote command)."""
    return [ln for ln in lines if _SSH_OWN.match(ln.strip())]


def run_ssh(t: Target, remote_command: str, timeout: float) -> subprocess.CompletedProcess:
    """Run one short remote command; raises LinkError when ssh itself fails (exit 255)."""
    try:
        out = subprocess.run(ssh_argv(t, remote_command), stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LinkError(f"{t.name}: no answer from {t.where} within {timeout:.0f} s") from None
    except OSError as exc:
        raise LinkError(f"{t.name}: cannot start ssh ({exc.strerror or exc})") from None
    if out.returncode == 255:
        raise LinkError(explain_ssh_failure(t, out.stderr.decode("utf-8", "replace")))
    return out


def marked(stdout: bytes) -> list[tuple[str, str]]:
    """(key, rest) of every `@@dsv4 key rest` line a remote probe printed."""
    out = []
    for line in stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(MARK + " "):
            key, _, rest = line[len(MARK) + 1:].partition(" ")
            out.append((key, rest.strip()))
    return out
