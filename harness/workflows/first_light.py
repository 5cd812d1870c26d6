"""`dsv4-lab run --first-light --target NAME`: the first B200 session's plan.

The sm100 kernels have only been compiled (and prepared on an H100).  The first Blackwell run
goes case by case in an order that localises a problem fastest, with `--debug-hangs` on, and
stops at the first case that does not pass, printing what to look at next.  A step that did not
run on an sm_100 device is a failure too: first light never exits 0 without every step's `pass`.
`plan_cases` resolves PLAN's cases and refuses a label the matrix no longer has."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.core.labels import case_label
from harness.spec.matrix import Case, expand
from harness.spec.spec import Spec, Stage

ARCH = "sm_100a"


@dataclass(frozen=True)
class Step:
    stage: str
    case: dict[str, Any]
    why: str  # what a pass here proves (and so where a failure points)
    if_hang: "Step | None" = None  # run next when this one hangs, to localise it


PLAN: tuple[Step, ...] = (
    Step("D2", {"shape": "b1s2h128n1152d512", "splits": 1},
         "the sm100 decode house (stages/common/sm100_decode.py): TMA Q/KV, tcgen05 QK and PV, S and O in TMEM, "
         "P through SMEM, the 2-CTA O split at d 512 — shared by D2–D5 and E",
         if_hang=Step("D2", {"shape": "b4s2h128n256d64", "splits": 1},
                      "the same house at d 64 (one CTA, one PV tile, no O split): a pass here and a hang at d 512 "
                      "points at the O split / several PV tiles")),
    Step("E", {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "v4.1", "scenario": "invalid", "splits": 1, "epilogue": "bf16"},
         "stage E's producer chain: the index warp, TMA gather4 of 528-byte rows, 4 dequantisation warps; exact "
         "arithmetic (power-of-two scales), so any error is a bug"),
    Step("E", {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "scenario": "invalid", "splits": 1, "epilogue": "bf16"},
         "model1's wide chunk (the 192-byte rope chunk: three gather4 boxes, 12 KiB expect-tx)"),
    Step("D5", {"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": 0, "splits": "many"},
         "two branches under one softmax, masks, the sink, split-KV with empty splits and SplitCombine"),
    Step("I1", {"s": 128, "s_kv": 1024, "ranges": "cp", "heads": 64, "head_dim": 128, "logits_dtype": "fp32",
              "compressed": False},
         "the indexer: tcgen05 kind::f8f6f4, two TMEM buffers, one thread per key, the −inf fill"),
)

# What to look at next, per status of the step that stopped the plan.
NEXT: dict[str, str] = {
    "hang": "the record's error names the role, pipeline, slot and phase that waited: compare that pipeline's "
            "arrive counts and phases with the pipeline simulator (tests/test_pipesim.py) and the barrier-init / "
            "expect-tx constants in the PTX (dsv4-lab inspect); a TMA barrier that never completes is a byte "
            "count (expect-tx) or a tensor map (gather4: run --prepare's record of the launch)",
    "timeout": "no result within the time limit and no hang line: was --debug-hangs in the build (the record's "
               "compile key)? If it was, the wait was not an mbarrier (a named barrier, a spin on a flag, "
               "tcgen05.alloc) — or the kernel is merely slow: rerun with --timeout",
    "crash": "a launch failure or device fault: CUDA_ERROR_LAUNCH_FAILED with PipelineUmmaAsync is a thread/warp "
             "count (DSV4.md lesson 2); an illegal address is a TMA view or a gather row id out of range; "
             "'too many resources' / invalid value at launch is the dynamic shared memory (E simple and v4.1: "
             "231,424 of 232,448 bytes) — rerun under compute-sanitizer, one case",
    "fail": "it ran and missed its tolerance: look at which output (O or LSE) and the pattern — NaN in O is a "
            "missing TMEM fence before P·V (DSV4.md lesson 3) or an invalid key reaching the MMA; cosine near 0 "
            "is a P or O TMEM layout (lessons 4–6); an LSE off by a constant is the scale / log2 e; compare with "
            "tests/test_sm100_rounding.py's emulation of this kernel's rounding",
    "compile_error": "the kernel no longer compiles for sm_100a: dsv4-lab compile STAGE --arch sm_100a here, no GPU "
                     "needed",
    "compiled": "the step did not run on an sm_100 device (the target has none, or --arch was dropped): first light "
                "needs a B200 — check the target with dsv4-lab targets check NAME",
    "prepared": "the step only went up to the launch: first light needs the kernel launched on a B200",
    "missing": "no record came back for the step: see the run's own error above",
}


@dataclass
class Outcome:
    step: Step
    status: str
    record: str | None = None
    error: str | None = None
    extra: list[str] = field(default_factory=list)


def plan_cases(spec: Spec) -> list[tuple[Step, Stage, Case]]:
    """Every step of PLAN (and its hang follow-up) as (step, stage, matrix case), in order.
    Raises ValueError naming a step whose case the matrix no longer has."""
    out = []
    steps = [s for st in PLAN for s in (st, st.if_hang) if s is not None]
    for step in steps:
        if step.stage not in spec.stages:
            raise ValueError(f"first light: stage {step.stage} is not in stages.yaml")
        stage = spec.stages[step.stage]
        if ARCH not in stage.kernels:
            raise ValueError(f"first light: {stage.name} has no {ARCH} kernel")
        label = case_label({k: step.case[k] for k in stage.matrix if k in step.case})
        if set(step.case) != set(stage.matrix):
            raise ValueError(f"first light: {stage.name} case {step.case} must name every axis of its matrix "
                             f"({', '.join(stage.matrix)})")
        match = [c for c in expand(stage, {k: {v} for k, v in step.case.items() if k in stage.matrix})
                 if c.label == label]
        if not match:
            raise ValueError(f"first light: {stage.name} has no case {label} in stages.yaml's matrix — update "
                             "harness/workflows/first_light.py's PLAN")
        out.append((step, stage, match[0]))
    return out


def step_argv(stage: Stage, case: Case, debug_hangs: bool = True) -> list[str]:
    """The `dsv4-lab run` arguments of one step (--debug-hangs forwarded by name)."""
    return ["run", stage.name, "--arch", ARCH, "--where", case.label] + (["--debug-hangs"] if debug_hangs else [])


def has_local_sm100() -> tuple[bool, str]:
    """(whether this machine has an sm_100 GPU, what it has instead)."""
    from harness.core.environment import gpu_capabilities

    caps = gpu_capabilities()
    if any(a == ARCH for _, a in caps.values()):
        return True, ""
    names = sorted({n for n, _ in caps.values()})
    return False, ("no GPU on this machine" if not names else f"this machine has {', '.join(names)}")


def newest_status(root, stage: Stage, case: Case, since: str) -> tuple[str, str | None, str | None]:
    """(status, record id, error) of the newest record of the step's case written since `since`
    (ISO time), or ("missing", None, None)."""
    from harness.notebook.records import read_records

    for rec in reversed(read_records(root, [stage.id])):
        if rec.arch == ARCH and rec.case == case.dict and rec.t >= since:
            return rec.status, rec.id, rec.error or rec.note
    return "missing", None, None


def run_plan(spec: Spec, run_step: Callable[[Stage, Case, list[str]], int], *, say=print) -> int:
    """Run the plan's steps with `run_step(stage, case, argv)`, stopping at the first that does not
        pass (a hang with a follow-up runs the follow-up first).  0 only when every step passed."""
    from harness.notebook.records import now_iso

    steps = plan_cases(spec)
    main = [(s, st, c) for s, st, c in steps if any(s is p for p in PLAN)]
    for i, (step, stage, case) in enumerate(main, 1):
        say(f"first light {i}/{len(main)}: {stage.name} {case.label} — {step.why}")
        since = now_iso()
        run_step(stage, case, step_argv(stage, case))
        status, rid, err = newest_status(spec.root, stage, case, since)
        if status == "pass":
            say(f"  ✓ pass ({rid})")
            continue
        say(f"  ✗ {status}" + (f" ({rid})" if rid else "") + (f": {err.splitlines()[0]}" if err else ""))
        if status == "hang" and step.if_hang is not None:
            follow = next((st, c) for s, st, c in steps if s is step.if_hang)
            say(f"  localising: {follow[0].name} {follow[1].label} — {step.if_hang.why}")
            since = now_iso()
            run_step(follow[0], follow[1], step_argv(follow[0], follow[1]))
            f_status, f_rid, f_err = newest_status(spec.root, follow[0], follow[1], since)
            say(f"  → {f_status}" + (f" ({f_rid})" if f_rid else "") + (f": {f_err.splitlines()[0]}" if f_err else ""))
        say(f"next: {NEXT.get(status, NEXT['missing'])}")
        say(f"first light stopped at step {i} of {len(main)}: nothing after it was run")
        return 1
    say(f"first light: all {len(main)} steps passed on {ARCH}")
    return 0


def first_light(spec: Spec, target: str | None) -> int:
    """The command: on `target` (a targets.yaml name, or local) run the plan; local without an sm_100
        device: say so, exit 1."""
    if not target or target == "local":
        ok, have = has_local_sm100()
        if not ok:
            print(f"dsv4-lab: --first-light needs an sm_100 (B200) GPU: {have} — name a Blackwell machine with "
                  "--target NAME (targets.yaml); nothing was run", file=sys.stderr)
            return 1
    else:
        from harness.remote.remote_run import resolve_targets

        resolve_targets(spec.root, target)  # an unknown target: one line (TargetError) before any step
    plan_cases(spec)  # a label the matrix lost: one line before anything runs

    def run_step(stage: Stage, case: Case, argv: list[str]) -> int:
        if target and target != "local":
            from harness.remote.remote_run import run_remote

            return run_remote(spec, target, argv, [stage], [ARCH], {stage.id: [case]})
        from harness.execution.report import run_local_and_report

        return run_local_and_report(spec, [stage], [ARCH], {stage.id: [case]}, bench=False, gpus=None,
                                    workers_per_gpu=1, timeout=None, seed=0, argv=argv, record=True, debug_hangs=True)

    return run_plan(spec, run_step)
