"""One case, executed — the single executor behind `run`, `run --bench`, `bench` and the remote
side, in a worker process (worker.py):

  1. the contract: `tensors(case)` checked, the generated inputs checked against it
     (spec.check: a wrong name, shape or dtype is a one-line ContractError before any launch);
  2. outputs and scratch allocated and poisoned;
  3. the kernel launched once, synchronized (a CUDA error raises here), and every input compared
     bit for bit with its copy from before the launch (pristine);
  4. the oracle on every row or on `check_rows` rows along `row_axis` (bench shapes), checked
     against the contract, each output compared (metrics); a suite stage's case also by the
     peer's pass rule (`criterion`);
  5. optionally the kernel timed (timing.py) beside its peers (`run --bench`: the stage's PyTorch
     peer; `bench`: the named peers), in one flat format — `peer_<name>_us`, `_spread`,
     `_tflops`, `_ratio` (peer µs / kernel µs), `_cos`, or `peer_<name>`: why it did not run.

`job_for` maps a stage to its job (the runner and bench use it)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from harness.execution.launch import KernelJob, Launcher, attr
from harness.spec.spec import Tolerance

if TYPE_CHECKING:
    from harness.spec.spec import Stage

MIN_LAUNCHES = 20  # launches per timed repetition of a bench shape (one graph)


@dataclass(kw_only=True)
class Job(KernelJob):
    """A test case (`run`): the kernel's job, the stage's peer (run --bench), and whether to time.
    The worker returns the metrics; the runner judges them."""

    peer: tuple[str, str] | None = None
    bench: bool = False
    debug_hangs: bool = False  # a --debug-hangs build: the launch's printed output is read (harness/execution/hangs.py)
    prepare: bool = False  # a kernel of another arch: its host path up to the launch only (harness/execution/prepare.py)


@dataclass(kw_only=True)
class BenchJob(KernelJob):
    """A bench shape (`bench`): the kernel's job, the stage's tolerances (judged here), the peers
    and the row check."""

    tolerances: dict[str, Tolerance]
    peers: tuple[str, ...] = ()
    problem: str | None = None
    check_rows: int = 256
    row_axis: str | None = None
    reps: int = 30
    min_launches: int = MIN_LAUNCHES
    time_it: bool = True
    env: dict[str, Any] = field(default_factory=dict)


def job_for(stage: "Stage", arch: str, case: dict[str, Any], base_seed: int, cls: type = Job,
            **extra: Any) -> Any:
    """The job (`cls`: Job or BenchJob) that runs `case` of `stage` on `arch`: the one mapping from a
        stage's spec to a worker's job.  `extra`: `cls`'s fields beyond the kernel's."""
    from oracles.common import case_seed

    k = stage.kernels[arch]
    return cls(
        stage=stage.id, arch=arch, case=case, kernel_params=stage.kernel_params, kernel_module=k.module,
        kernel_entry=k.entry, tensors=(stage.tensors.module, stage.tensors.name),
        inputs=(stage.inputs.module, stage.inputs.name), oracle=(stage.oracle.module, stage.oracle.name),
        flops=(stage.flops.module, stage.flops.name) if stage.flops else None,
        seed=case_seed(stage.id, case, base_seed),
        criterion=(stage.suite.criterion.module, stage.suite.criterion.name) if stage.suite else None,
        decode=(stage.decode.module, stage.decode.name) if stage.decode else None, **extra,
    )


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


# ---------------------------------------------------------------------------------------
# Rows (bench shapes: the oracle on a sample).


def sample_rows(total: int, want: int, seed: int) -> list[int]:
    """`want` distinct row indices of `total`, sorted: the first and last rows, the rest drawn
    (seeded). All rows when `want >= total`."""
    if want >= total:
        return list(range(total))
    if want == 1:
        return [0]
    rest = random.Random(seed).sample(range(1, total - 1), want - 2)
    return sorted([0, total - 1, *rest])


def row_tensors(specs: list, specs_rows: list, axis: str, total: int, rows: int) -> set[str]:
    """The tensors sliced by rows: those whose first dimension follows `axis` (`total` → `rows`);
        ValueError when a tensor changes any other way (not row-separable)."""
    if [s.name for s in specs] != [s.name for s in specs_rows]:
        raise ValueError(f"tensors() names different tensors when {axis} changes")
    sliced = set()
    for s, r in zip(specs, specs_rows):
        if s.role == "scratch" or tuple(s.shape) == tuple(r.shape):  # scratch: the kernel's own, never compared
            continue
        if len(s.shape) and s.shape[0] == total and r.shape[0] == rows and tuple(s.shape[1:]) == tuple(r.shape[1:]):
            sliced.add(s.name)
            continue
        raise ValueError(f"{s.name} {list(s.shape)} becomes {list(r.shape)} when {axis} is {rows}: not rows along "
                         f"its first dimension — name another row_axis in the bench block")
    if not any(s.role == "out" and s.name in sliced for s in specs):
        raise ValueError(f"no output has {axis} rows — name another row_axis in the bench block")
    return sliced


@dataclass(kw_only=True)
class ABJob:
    """`bench --compare REV`: one bench shape, two compiled kernels, `a` (REV's) and `b` (the tree's),
        each checked, then timed interleaved on the same rotated inputs (`rounds` rounds of `reps`)."""

    a: BenchJob
    b: BenchJob
    rounds: int = 40
    reps: int = 5
    threshold: float = 0.03


# ---------------------------------------------------------------------------------------
# The steps.


@dataclass
class Launched:
    """A case after its one checked launch: its tensors, and which inputs the kernel wrote."""

    specs: list
    inputs: dict
    buffers: dict  # outputs and scratch, as the kernel left them
    wrote: dict[str, int]
    device: str
    fresh_outputs: Callable[[], dict]

    @property
    def outputs(self) -> dict:
        return {s.name: self.buffers[s.name] for s in self.specs if s.role == "out"}

    def arg_sets(self, n: int) -> list[tuple[dict, list]]:
        """`n` argument lists for timing (the first on the case's own inputs, the rest on clones),
        each with fresh poisoned outputs: (inputs, args)."""
        sets = []
        for i in range(n):
            ins = self.inputs if i == 0 else {k: v.clone() for k, v in self.inputs.items()}
            outs = self.fresh_outputs()
            sets.append((ins, [ins[s.name] if s.role == "in" else outs[s.name] for s in self.specs]))
        return sets


@dataclass
class Checked:
    """The oracle's verdict material: metrics per output, the reference, and the rows compared."""

    metrics: dict[str, dict]
    ref: dict
    idx: list[int] | None = None
    sliced: set[str] = field(default_factory=set)
    checked: str = "every row"
    suite_why: dict[str, str] = field(default_factory=dict)  # a suite stage: why its rule failed, per output


class CaseExecutor:
    """Executes jobs in this process; compiled kernels are loaded once (one per worker)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.launcher = Launcher()

    def run(self, job: KernelJob) -> dict:
        """A worker's reply for `job` (exceptions propagate: the worker turns them into one line)."""
        if isinstance(job, ABJob):
            return self.compare(job)
        if isinstance(job, BenchJob):
            return self.check_and_time(job)
        assert isinstance(job, Job)
        return self.run_case(job)

    # -- the common steps ------------------------------------------------------------------

    def launch(self, job: KernelJob) -> Launched:
        """Steps 1–3: contract, inputs, poisoned outputs, one launch, sync, the pristine-input check."""
        import torch

        from harness.spec.check import ContractError, inputs_problems, specs_problems
        from harness.execution.metrics import poison_
        from harness.execution.pristine import keep, restore, written

        device = "cpu" if job.arch == "cpu" else "cuda"
        tensors_fn, inputs_fn = attr(job.tensors), attr(job.inputs)
        specs = tensors_fn(job.case)
        bad = specs_problems(specs, tensors_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        inputs = inputs_fn(job.case, job.seed, device)
        bad = inputs_problems(specs, inputs, inputs_fn, self.root)
        if bad:  # before the launch: a kernel fed the wrong shapes may fault the device
            raise ContractError(bad[0])

        def fresh_outputs() -> dict:
            """Outputs and scratch, poisoned: the kernel must write what it reads back."""
            return {s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device))
                    for s in specs if s.role in ("out", "scratch")}

        buffers = fresh_outputs()
        args = [inputs[s.name] if s.role == "in" else buffers[s.name] for s in specs]
        launch = self.launcher(job, args)
        kept = keep(inputs)  # the inputs as generated: the kernel must not write them
        if getattr(job, "debug_hangs", False) and device == "cuda":
            launch_watching_hangs(launch, torch)
        else:
            launch()
            if device == "cuda":
                torch.cuda.synchronize()  # raises on a launch failure or illegal address
        wrote = written(inputs, kept)  # bit for bit; the case fails when any changed
        restore(inputs, kept, wrote)  # the oracle (and the timing) see the inputs as generated
        del kept
        return Launched(specs, inputs, buffers, wrote, device, fresh_outputs)

    def check(self, job: KernelJob, done: Launched, check_rows: int | None = None,
              row_axis: str | None = None) -> Checked:
        """Step 4: the oracle on every row, or on `check_rows` rows sampled along `row_axis`."""
        import torch

        from harness.spec.check import ContractError, compared_problems, outputs_problems
        from harness.execution.metrics import compare

        tensors_fn, oracle_fn = attr(job.tensors), attr(job.oracle)
        outputs = done.outputs
        total = job.case.get(row_axis) if row_axis else None
        if row_axis and check_rows is not None and isinstance(total, int) and check_rows < total:
            idx: list[int] | None = sample_rows(total, check_rows, job.seed)
            assert idx is not None
            rcase = {**job.case, row_axis: len(idx)}
            specs = tensors_fn(rcase)
            sliced = row_tensors(done.specs, specs, row_axis, total, len(idx))
            index = torch.tensor(idx, device=done.device)
            pick = (lambda name, t: t.index_select(0, index) if name in sliced else t)
            check_inputs = {k: pick(k, v) for k, v in done.inputs.items()}
            outputs = {k: pick(k, v) for k, v in outputs.items()}
            checked = f"{len(idx)} of {total} rows along {row_axis}"
        else:
            idx, rcase, sliced, specs = None, job.case, set(), done.specs
            check_inputs, checked = done.inputs, "every row"
        ref = oracle_fn(check_inputs, rcase)
        if job.decode:  # the kernel writes another form of the outputs: compare what decode makes of them
            decode_fn = attr(job.decode)
            outputs = decode_fn(outputs, rcase)
            bad = compared_problems(outputs, ref, decode_fn, oracle_fn, self.root)
        else:
            bad = outputs_problems(specs, ref, oracle_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        metrics = {name: compare(outputs[name], ref[name]).to_json() for name in outputs}
        if job.criterion:  # a suite stage: the upstream pass rule's verdict joins each output's metrics
            verdicts = attr(job.criterion)(outputs, ref, rcase)
            if not isinstance(verdicts, dict):
                raise ContractError(f"{job.criterion[0]}:{job.criterion[1]} returned {type(verdicts).__name__}, "
                                    "expected {output: {suite_ok, suite_why, …}}")
            suite_why = {}
            for name, verdict in verdicts.items():
                if name in metrics and isinstance(verdict, dict):
                    # the record keeps numbers only: suite_ok 1/0 and the rule's values; its words go apart
                    metrics[name].update({k: v for k, v in verdict.items() if k not in ("suite_ok", "suite_why")})
                    metrics[name]["suite_ok"] = 1 if verdict.get("suite_ok") is True else 0
                    if verdict.get("suite_why"):
                        suite_why[name] = str(verdict["suite_why"])[:300]
            return Checked(metrics, ref, idx, sliced, checked, suite_why)
        return Checked(metrics, ref, idx, sliced, checked)

    # -- `run` and `run --bench` -----------------------------------------------------------

    def run_case(self, job: Job) -> dict:
        """A test case: {"metrics", "wrote_inputs"?, "timing"?} (the runner judges); a `prepare`
        job: {"prepared", "note"} (nothing launched)."""
        if job.prepare:
            return self.prepare(job)
        done = self.launch(job)
        chk = self.check(job, done)
        result: dict[str, Any] = {"metrics": chk.metrics}
        if chk.suite_why:
            result["suite_why"] = chk.suite_why
        if done.wrote:
            result["wrote_inputs"] = done.wrote
        if job.bench and done.device == "cuda":
            result["timing"] = self._time_case(job, done)
        return result

    def prepare(self, job: Job) -> dict:
        """A kernel built for another arch: inputs on this GPU, outputs allocated, its host path run up
                to the launch (prepare.py), the recorded launch checked against the device's limits.
                {"prepared", "note"}; raises when the host path failed or the launch could not start."""
        import torch

        from harness.spec.check import ContractError, inputs_problems, specs_problems
        from harness.execution.metrics import poison_
        from harness.execution.prepare import check_launch, describe, device_limits, run_host_path

        tensors_fn, inputs_fn = attr(job.tensors), attr(job.inputs)
        specs = tensors_fn(job.case)
        bad = specs_problems(specs, tensors_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        inputs = inputs_fn(job.case, job.seed, "cuda")
        bad = inputs_problems(specs, inputs, inputs_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        outputs = {s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="cuda"))
                   for s in specs if s.role in ("out", "scratch")}
        args = [inputs[s.name] if s.role == "in" else outputs[s.name] for s in specs]
        got = run_host_path(self.launcher(job, args))
        torch.cuda.synchronize()  # nothing was launched: a sticky error would be the host path's
        why = check_launch(got, device_limits())
        if why:
            raise RuntimeError(f"prepare: the launch would not start: {'; '.join(why)}")
        return {"prepared": got, "note": describe(got, torch.cuda.get_device_name(), job.arch.removesuffix("a"))}

    def _time_case(self, job: Job, done: Launched) -> dict:
        from harness.execution.timing import bench, rotations

        total_bytes = sum(s.nbytes for s in done.specs)
        sets = done.arg_sets(rotations(total_bytes))
        t = bench([self.launcher(job, a) for _, a in sets])
        flops = attr(job.flops)(job.case) if job.flops else None
        _rates(t, flops, total_bytes)
        if job.peer:  # the same computation written plainly in PyTorch, timed the same way
            peer = attr(job.peer)
            ins_sets = [{s.name: a[i] for i, s in enumerate(done.specs) if s.role == "in"} for _, a in sets]
            p = bench([(lambda ins=ins: peer(ins, job.case)) for ins in ins_sets])
            peer_fields(t, job.peer[1], p, flops)
        return _rounded(t)

    # -- `bench` ---------------------------------------------------------------------------

    def check_and_time(self, job: BenchJob) -> dict:
        """A bench shape checked on sampled rows and judged, and when it passes on a GPU, timed with its
                peers.  {"status", "metrics", "checked", "error"?, "timing"?}."""
        from harness.execution.metrics import judge, unwritten_mask
        from harness.execution.pristine import describe

        done = self.launch(job)
        chk = self.check(job, done, job.check_rows, job.row_axis)
        status, why = judge(job.tolerances, chk.metrics)
        if done.wrote:  # a kernel that writes its inputs fails, whatever its outputs
            status, why = "fail", "; ".join(filter(None, [describe(done.wrote), why]))
        unwritten = {name: int(unwritten_mask(t).sum()) for name, t in done.outputs.items()}
        if any(unwritten.values()):
            status = "fail"
            lost = ", ".join(f"{k}: {v} elements" for k, v in unwritten.items() if v)
            why = "; ".join(filter(None, [why, f"never written ({lost})"]))
        result: dict[str, Any] = {"status": status, "metrics": chk.metrics, "checked": chk.checked}
        if why:
            result["error"] = why
        if status != "pass" or done.device != "cuda" or not job.time_it:
            return result
        result["timing"] = self._time_shape(job, done, chk)
        return result

    def compare(self, job: ABJob) -> dict:
        """Both kernels checked (each must pass), then timed interleaved on B's rotated inputs.
                {"status", "metrics" (B's), "checked", "a", "rounds": {"A", "B"}, "timing"?, "error"?}."""
        a = job.a
        a.time_it = False
        got_a = self.check_and_time(a)
        b = job.b
        b.time_it = False
        done = self.launch(b)
        got_b = self.check_and_time(b)
        result: dict[str, Any] = {**got_b, "a": {k: got_a[k] for k in ("status", "error") if k in got_a}}
        if got_a["status"] != "pass" or got_b["status"] != "pass":
            result["status"] = "fail"
            result["error"] = "; ".join(f"{side}: {g.get('error') or g['status']}" for side, g in
                                        (("REV", got_a), ("tree", got_b)) if g["status"] != "pass")
            return result
        if done.device != "cuda":
            return result
        from harness.execution import abtest
        from harness.execution.timing import Timer, gpu_clocks, l2_bytes, rotations, summarize

        sets = done.arg_sets(rotations(sum(s.nbytes for s in done.specs), l2_bytes()))
        timers = {side: Timer([self.launcher(j, args) for _, args in sets], min_launches=j.min_launches)
                  for side, j in (("A", a), ("B", b))}
        rounds = abtest.interleaved({side: (lambda t=t: summarize(t.sample(job.reps))["us"])
                                     for side, t in timers.items()}, job.rounds)
        result["rounds"] = rounds
        t = {**summarize(rounds["B"]), "reps": job.reps * job.rounds, "rot": len(sets),
             "launches": timers["B"].launches, "method": timers["B"].method + " ab"}
        total_bytes = sum(s.nbytes for s in done.specs if s.role != "scratch")
        flops = attr(b.flops)(b.case) if b.flops else None
        _rates(t, flops, total_bytes)
        t["flops"] = float(flops or 0.0)
        t["bytes"] = total_bytes
        t.update(gpu_clocks())
        result["timing"] = _rounded(t)
        return result

    def _time_shape(self, job: BenchJob, done: Launched, chk: Checked) -> dict:
        import torch

        from harness.peers import adapter, why_not
        from harness.peers.problems import problem_dims
        from harness.execution.timing import bench, gpu_clocks, l2_bytes, rotations

        specs = done.specs
        total_bytes = sum(s.nbytes for s in specs if s.role != "scratch")  # the fewest bytes: inputs once, outputs once
        sets = done.arg_sets(rotations(sum(s.nbytes for s in specs), l2_bytes()))
        t = bench([self.launcher(job, a) for _, a in sets], reps=job.reps, min_launches=job.min_launches)
        flops = attr(job.flops)(job.case) if job.flops else None
        _rates(t, flops, total_bytes)
        t["flops"] = float(flops or 0.0)
        t["bytes"] = total_bytes
        cap = torch.cuda.get_device_capability()
        dims = problem_dims(job.problem, specs) if job.problem else "no problem named"
        index = torch.tensor(chk.idx, device="cuda") if chk.idx is not None else None
        for name in job.peers:
            key = f"peer_{name}"
            why = why_not(name, job.problem, dims, cap)
            if why:
                t[key] = why
                continue
            try:
                mod = adapter(name)
                runs = [mod.make(job.problem, dims, ins) for ins, _ in sets]
                got = runs[0]()
                torch.cuda.synchronize()
                pm, verdict, pwhy = peer_verdict(job, mod, dims, specs, chk, got, index)
                cos = [m["cosine"] for m in pm.values() if m.get("cosine") is not None]
                if cos:
                    t[f"{key}_cos"] = min(cos)
                if verdict != "pass":
                    t[key] = f"wrong result: {pwhy}"[:300]
                    continue
                p = bench(runs, reps=job.reps, min_launches=job.min_launches)
            except Exception as exc:  # a peer that breaks is that peer's line, not the kernel's record
                t[key] = f"error: {one_line(exc)}"
                if "CUDA" in str(exc) or "illegal" in str(exc):
                    break  # the context may be unusable: no further peer on it
                continue
            peer_fields(t, name, p, mod.flops(job.problem, dims) if hasattr(mod, "flops") else flops)
        t.update(gpu_clocks())
        return _rounded(t)


def peer_verdict(job: BenchJob, mod: Any, dims: Any, specs: list, chk: Checked, got: dict,
                 index: Any = None) -> tuple[dict, str, str]:
    """A peer's first outputs `got` judged against the kernel's checked rows: (metrics a compared
    output, verdict, why).  A peer is held to the stage's cosine bound only: its precision choices
    (a bf16 score matrix in plain PyTorch) are its own business, a wrong answer is not; a peer that
    computes on other bytes than the kernel's (FlashMLA on the model1 re-encoding of an nvfp4
    case's tokens) names its own bound (`check_cosine(problem, dims)`).  A peer that returns the
    kernel's own output form (every `out` tensor, some the oracle's rows lack: e_unfused_fp8's
    O_fp8 / O_scale words) is judged through the stage's decode, as the kernel is."""
    from harness.execution.metrics import compare, judge

    outs = {s.name for s in specs if s.role == "out"}
    if job.decode and set(got) >= outs and not set(got) <= set(chk.ref):
        got = attr(job.decode)(got, job.case)
    pm = {}
    for out, value in got.items():
        if out in chk.ref:
            v = value.index_select(0, index) if (index is not None and out in chk.sliced) else value
            pm[out] = compare(v, chk.ref[out]).to_json()
    own = mod.check_cosine(job.problem, dims) if hasattr(mod, "check_cosine") else None
    tols = {k: Tolerance(cosine_min=own if own is not None else v.cosine_min if v.cosine_min is not None else 0.999)
            for k, v in job.tolerances.items() if k in pm}
    verdict, why = judge(tols, pm) if tols else ("fail", "returned none of the checked outputs")
    return pm, verdict, why


# ---------------------------------------------------------------------------------------
# The timing record.


def _rates(t: dict, flops: float | None, total_bytes: int) -> None:
    secs = t["us"] * 1e-6
    if flops:
        t["tflops"] = flops / secs / 1e12
    t["gbps"] = total_bytes / secs / 1e9


def peer_fields(t: dict, name: str, p: dict, flops: float | None) -> None:
    """A timed peer's flat keys in timing record `t`: `peer_<name>_us`, `_spread`, `_tflops` (from the
        peer's `flops`, when known), `_ratio` (peer µs / kernel µs)."""
    key = f"peer_{name}"
    t[f"{key}_us"] = p["us"]
    t[f"{key}_spread"] = p["spread"]
    if flops:
        t[f"{key}_tflops"] = flops / (p["us"] * 1e-6) / 1e12
    t[f"{key}_ratio"] = p["us"] / t["us"]


def _rounded(t: dict) -> dict:
    """Cosines keep every digit (1 - 1e-6 is not 1.0); times and rates keep four decimals."""
    return {k: (round(v, 4) if isinstance(v, float) and not k.endswith("_cos") else v) for k, v in t.items()}


def launch_watching_hangs(launch: Callable[[], None], torch: Any) -> None:
    """Launch and synchronize with stdout captured: an expired bounded wait printed its hang line
        there before trapping (hangs.py), which makes the CUDA error a KernelHang."""
    from harness.execution.hangs import DeviceOutput, KernelHang, describe, hang_lines

    failure: BaseException | None = None
    out = DeviceOutput()
    with out:
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as exc:  # the trap's CUDA error (or any other: re-raised below)
            failure = exc
    lines = hang_lines(out.text)
    if lines:
        raise KernelHang(describe(lines[0], len(lines) - 1, failure)) from failure
    if failure is not None:
        raise failure
