"""The compute-node side of a slurm run: what each array task's job script starts.

`python -m harness.remote.slurm_side KEYFILE RECFILE -- run STAGE ... --shard i/n --emit-jsonl`
reads and deletes the channel key (before any worker exists), opens RECFILE (0600,
close-on-exec) as the channel's descriptor, points stdout at stderr, then runs the command line
as `remote_side` does; what the job prints goes to its Slurm log."""

from __future__ import annotations

import os
import runpy
import sys

from harness.remote.channel import KEY_RE, ChannelError, install_sender

EXIT_SETUP = 2


def read_key(path: str) -> str:
    """The key in `path` (64 hex digits), the file deleted once read."""
    try:
        with open(path, "rb") as fh:
            key = fh.read(256).split(b"\n", 1)[0].decode("ascii", "replace").strip()
    except OSError as exc:
        raise ChannelError(f"cannot read this task's channel key {path} ({exc.strerror or exc}) — a task runs "
                           "once per key: the lab submits a fresh one when it requeues a task") from None
    try:
        os.unlink(path)
    except OSError:
        pass
    if not KEY_RE.fullmatch(key):
        raise ChannelError(f"{path} holds no channel key (64 hex digits)")
    return key


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[2] != "--":
        print("usage: python -m harness.remote.slurm_side KEYFILE RECFILE -- run STAGE ... --emit-jsonl "
              "(the job script of `dsv4-lab run --target SLURM_TARGET` writes this)", file=sys.stderr)
        sys.exit(EXIT_SETUP)
    keyfile, recfile, rest = argv[0], argv[1], argv[3:]
    try:
        key = read_key(keyfile)
        fd = os.open(recfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # nothing reads the job's stdin
        install_sender(key, fd)
    except (ChannelError, OSError) as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        sys.exit(EXIT_SETUP)
    sys.argv = ["cli", *rest]
    runpy.run_module("cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
