"""The name of every option a `dsv4-lab` command takes (core layer: imports nothing of the lab),
shared by spec.py (a matrix axis may not take one of these names: `RESERVED_AXES`) and
commands/base.py (`option()` declares flags by these names only; tests/test_commands.py checks
every flag).  A new option: add its name to COMMAND_OPTIONS (underscores; the flag is
`--name-with-dashes`)."""

from __future__ import annotations

# The options the commands declare (harness/commands/*.py), in underscore form.
COMMAND_OPTIONS: frozenset[str] = frozenset({
    "all", "arch", "bench", "where", "target", "gpus", "workers_per_gpu", "timeout", "seed", "emit_jsonl",
    "shard", "record", "debug_hangs", "prepare", "first_light", "print_job",  # run
    "keep", "diff",  # compile (and arch, where, record)
    "install_hook", "force", "no_run", "staged",  # gate (and target)
    "compile_only",  # baseline accept
    "gone",  # baseline drop
    "speed",  # baseline accept/show, gate, history (issue 29)
    "rev_tree",  # gate --speed --emit-jsonl: the far side of gate --speed --target (issue 29)
    "compare", "rounds",  # bench --compare REV (issue 29)
    "watch", "interval",  # dashboard
    "peers", "peer", "reps", "gpu",  # bench (and where, timeout, seed)
    "fp8",  # calibrate
    "axes", "in", "out", "title", "slug",  # new stage
    "list",  # suite (and arch, where, gpus, timeout, shard)
})

# Options of every command: --help, and --traceback (read by cli.main before any command).
GLOBAL_OPTIONS: frozenset[str] = frozenset({"help", "traceback"})

# No command takes these (yet); they stay reserved so that no stages.yaml names an axis a
# later option would take from it.
KEPT_RESERVED: frozenset[str] = frozenset({"json"})

# Axis names that would be read as the lab's own options (`--arch`, `--where` …), not as filters.
RESERVED_AXES: frozenset[str] = COMMAND_OPTIONS | GLOBAL_OPTIONS | KEPT_RESERVED


def flag(name: str) -> str:
    """The flag of an option or axis name: `workers_per_gpu` -> `--workers-per-gpu`."""
    return "--" + name.replace("_", "-")
