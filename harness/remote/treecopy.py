"""Which files travel to a target, where they land, and how: rsync over ssh when both sides
have it, else a tar stream over ssh (this side needs no rsync at all).

The copy is exactly what git would commit (tracked plus untracked-not-ignored files), mirrored
into `<workdir>/<lab-id>/` on the target with stale files removed; the remote compile cache sits
beside it in `<lab-id>.cache`. Nothing is written on the remote outside those two folders.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.remote.ssh import (DEFAULT_CONNECT_TIMEOUT, MARK, LinkError, explain_ssh_failure, marked, remote_path,
                         run_ssh, ssh_argv, ssh_base_argv)
from harness.remote.targets import Target, TargetError

SYNC_TIMEOUT_S = 1800


def lab_id(root: Path) -> str:
    """A stable id of this checkout (user, host and path): the remote folder's name."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    who = f"{user}@{socket.gethostname()}:{Path(root).resolve()}"
    return "dsv4-lab-" + hashlib.sha256(who.encode()).hexdigest()[:12]


def remote_folder(t: Target, root: Path) -> str:
    """`<workdir>/<lab-id>`: where the working tree is copied and the run happens."""
    return f"{t.workdir.rstrip('/')}/{lab_id(root)}"


def remote_cache(t: Target, root: Path) -> str:
    """`<workdir>/<lab-id>.cache`: the remote compile and bytecode cache (kept across syncs)."""
    return remote_folder(t, root) + ".cache"


def tree_files(root: Path) -> list[str]:
    """Exactly what git would commit: tracked plus untracked-not-ignored files that exist."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetError(f"{root}: git ls-files failed ({exc}) — a remote run copies what git would commit") from None
    if out.returncode != 0:
        why = out.stderr.decode("utf-8", "replace").strip().splitlines()
        raise TargetError(f"{root}: not a git working tree ({why[0] if why else 'git failed'}) — "
                          "a remote run copies exactly what git would commit; run git init")
    names = sorted({n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n})
    return [n for n in names if (root / n).is_symlink() or (root / n).is_file()]


def local_rsync() -> str | None:
    """This machine's rsync, or None (then the copy goes by tar)."""
    return shutil.which("rsync")


@dataclass
class SyncResult:
    method: str  # "rsync" or "tar"
    files: int
    folder: str
    why: str = ""  # why tar was used, when it was


def probe_remote(t: Target, root: Path) -> bool:
    """Create the work folder (and its cache) on the remote; True when it has rsync."""
    folder, cache = remote_path(remote_folder(t, root)), remote_path(remote_cache(t, root))
    cmd = (f"mkdir -p {folder} {cache} && test -w {folder} && "
           f"{{ if command -v rsync >/dev/null 2>&1; then echo '{MARK} rsync yes'; "
           f"else echo '{MARK} rsync no'; fi; }}")
    out = run_ssh(t, cmd, timeout=DEFAULT_CONNECT_TIMEOUT + 60)
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace").strip().splitlines()
        raise LinkError(f"{t.name}: cannot create or write the work folder {remote_folder(t, root)} "
                        f"({err[-1][:300] if err else f'exit code {out.returncode}'}) — fix workdir in {t.declared}")
    return ("rsync", "yes") in marked(out.stdout)


class RsyncFailed(LinkError):
    """rsync itself failed (not the ssh link): worth trying tar instead."""


def place_files(root: Path, files: list[str], dest: Path, link: bool = True) -> None:
    """Put `files` (under `root`) into `dest`, symbolic links as links: hard-linked where `link` (copied
        where refused), for rsync --delete; else copied, a file gone since listed skipped (a Slurm
        run's tree must not see a later edit)."""
    for rel in files:
        src, dst = root / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif link:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        else:
            try:
                shutil.copy2(src, dst)
            except FileNotFoundError:
                continue


def sync_rsync(t: Target, root: Path, files: list[str], source: Path | None = None) -> None:
    """Stage `files` in a temporary folder and mirror it with `rsync --delete` over ssh, the remote
        side cd'ing into the quoted work folder first (no path through rsync's argument splitting)."""
    rsync = local_rsync()
    if rsync is None:
        raise RsyncFailed(f"{t.name}: rsync is not installed here")
    with tempfile.TemporaryDirectory(prefix="dsv4-lab-sync-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        place_files(source or root, files, stage)
        shell = " ".join(shlex.quote(a) for a in ssh_base_argv(t))
        argv = [rsync, "-rlpt", "--delete", "-e", shell,
                "--rsync-path", f"cd {remote_path(remote_folder(t, root))} && rsync",
                f"{stage}/", f"{t.ssh}:."]
        try:
            out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=SYNC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LinkError(f"{t.name}: copying the working tree took over 30 minutes — check the link") from None
        except OSError as exc:
            raise RsyncFailed(f"{t.name}: cannot start rsync ({exc.strerror or exc})") from None
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace")
        if out.returncode == 255 or ("ssh" in err.lower() and "connection" in err.lower()):
            raise LinkError(explain_ssh_failure(t, err))
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise RsyncFailed(f"{t.name}: rsync failed (exit {out.returncode}): {lines[0][:300] if lines else 'no message'}")


def sync_tar(t: Target, root: Path, files: list[str], source: Path | None = None) -> None:
    """Stream a tar of `files` (read from `source`, default `root`) into a fresh folder, then
    swap it in place of the old one."""
    folder = remote_folder(t, root)
    new, cur = remote_path(folder + ".incoming"), remote_path(folder)
    cmd = f"rm -rf {new} && mkdir -p {new} && tar -xf - -C {new} && rm -rf {cur} && mv {new} {cur}"

    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(ssh_argv(t, cmd), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        except OSError as exc:
            raise LinkError(f"{t.name}: cannot start ssh ({exc.strerror or exc})") from None
        assert proc.stdin is not None
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for rel in files:
                    try:
                        tf.add((source or root) / rel, arcname=rel, recursive=False, filter=anonymous)
                    except FileNotFoundError:
                        continue  # deleted since git listed it: it would not be committed either
        except (BrokenPipeError, ConnectionResetError):
            pass
        except OSError as exc:
            proc.kill()
            proc.wait()
            raise LinkError(f"{t.name}: cannot read a file to copy ({exc.strerror or exc}: "
                            f"{exc.filename}) — fix its permissions") from None
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            rc = proc.wait(timeout=SYNC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise LinkError(f"{t.name}: copying the working tree took over 30 minutes — check the link") from None
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    if rc == 255:
        raise LinkError(explain_ssh_failure(t, text))
    if rc != 0:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        raise LinkError(f"{t.name}: copying with tar failed (exit {rc}): {lines[-1][:300] if lines else 'no message'}")


def sync_tree(t: Target, root: Path, method: str | None = None,
              snapshot: tuple[Path, list[str]] | None = None) -> SyncResult:
    """Mirror the working tree into `<workdir>/<lab-id>/` on `t` (stale files removed): rsync over ssh
        when both sides have it, else tar; `method` forces one.  `snapshot` (folder, files): those
        files instead (the gate's index export).  Raises LinkError."""
    source, files = snapshot if snapshot is not None else (None, tree_files(root))
    remote_has_rsync = probe_remote(t, root)
    folder = remote_folder(t, root)
    if method == "tar":
        sync_tar(t, root, files, source)
        return SyncResult("tar", len(files), folder, "asked for")
    if method == "rsync":
        if not remote_has_rsync:
            raise LinkError(f"{t.name}: rsync is not installed on {t.where}")
        sync_rsync(t, root, files, source)
        return SyncResult("rsync", len(files), folder)
    if method is not None:
        raise ValueError(f"unknown sync method {method!r}")
    if not remote_has_rsync:
        why = f"no rsync on {t.name}"
    elif local_rsync() is None:
        why = "no rsync here"
    else:
        try:
            sync_rsync(t, root, files, source)
            return SyncResult("rsync", len(files), folder)
        except RsyncFailed as exc:  # e.g. a login shell that prints to stdout breaks rsync's protocol
            why = str(exc).removeprefix(f"{t.name}: ")
    sync_tar(t, root, files, source)
    return SyncResult("tar", len(files), folder, why)
