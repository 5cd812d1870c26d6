"""The remote side of a remote run: what `run --target NAME` starts on the target.

`python -m harness.remote.remote_side run STAGE ... --emit-jsonl` opens the record channel first
(channel.py), then runs the lab's command line as usual; nothing it or a kernel prints can reach
the channel.  `run_emitting` sends a start event, every record as its case ends, and an end
event.  `gate --speed --emit-jsonl` sends its compare records through a `ChannelLog`, its end
event carrying the gate's verdict lines."""

from __future__ import annotations

import json
import runpy
import sys

from harness.remote.channel import FRAME_OVERHEAD, ChannelError, open_sender
from harness.core.jsonl import MAX_LINE_BYTES
from harness.spec.matrix import Case
from harness.spec.spec import Spec, Stage


def run_emitting(spec: Spec, stages: list[Stage], archs: list[str] | None, cases: dict[str, list[Case]], *,
                 bench: bool, gpus: list[int] | None, workers_per_gpu: int, timeout: float | None, seed: int,
                 argv: list[str], shard: tuple[int, int] | None = None, debug_hangs: bool = False,
                 prepare: bool = False) -> int:
    """Run the planned cases here, sending records on the channel (progress on stderr)."""
    try:
        sender = open_sender()  # before the runner starts any process
    except ChannelError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    from harness.execution.runner import RunOptions, Runner, tasks_for

    tasks = tasks_for(stages, archs, lambda st: cases[st.id])
    if shard is not None:
        tasks = tasks[shard[0]::shard[1]]
    opts = RunOptions(tasks=tasks, bench=bench, gpus=gpus, workers_per_gpu=workers_per_gpu,
                      timeout_s=timeout, seed=seed, argv=argv, debug_hangs=debug_hangs, prepare=prepare)

    def progress(rec) -> None:
        print(f"{rec.status} {rec.stage} {rec.arch} {rec.case}", file=sys.stderr, flush=True)

    runner = Runner(spec, opts, emit=lambda line: sender.send(fit_line(line)), on_record=progress)
    sender.send(json.dumps({"v": 1, "event": "start", "run": runner.run_id, "cases": len(tasks)}))
    summary = runner.run()
    try:
        sender.send(json.dumps({"v": 1, "event": "end", "run": runner.run_id, "interrupted": summary.interrupted,
                                "counts": summary.counts, "errors": summary.errors[:5]}))
    except OSError:  # the local side is gone (it marks the run interrupted itself)
        pass
    return summary.exit_code


class ChannelLog:
    """A session whose records go on the channel, never into this copy's notebook (`gate --speed
        --emit-jsonl` hands it to `bench --compare` in place of a RunLog); its events are the caller's."""

    def __init__(self, sender, run_id: str):
        self.sender = sender
        self.run_id = run_id

    def event(self, kind: str, **fields) -> None:
        self.sender.send(json.dumps({"v": 1, "event": kind, "run": self.run_id, **fields}))

    def write(self, rec) -> None:
        self.sender.send(fit_line(rec.to_json()))


def fit_line(line: str, limit: int = MAX_LINE_BYTES - FRAME_OVERHEAD) -> str:
    """A record's JSON line cut to fit the channel (the local side refuses longer lines): the
    free texts (trace, error, note) are shortened, the rest kept."""
    if len(line.encode("utf-8")) <= limit:
        return line
    rec = json.loads(line)
    for key, keep in (("trace", 8000), ("error", 4000), ("note", 2000), ("trace", 0)):
        text = rec.get(key)
        if isinstance(text, str) and len(text) > keep:
            rec[key] = text[:keep] + f"\n… ({len(text) - keep} characters cut to fit the record channel)"
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False)
        if len(line.encode("utf-8")) <= limit:
            return line
    return line  # still too long: the local side rejects it, and says so


def main() -> None:
    """Open the channel, then run the lab's command line (cli) with this process's arguments."""
    try:
        open_sender()
    except ChannelError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        sys.exit(2)
    runpy.run_module("cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
