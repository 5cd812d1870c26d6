"""Resume a run cut short: `dsv4-lab run STAGE --arch ARCH [--gpus …]` on only the cases that have no
verdict (pass, fail, …) for the current source in the notebook — for a list longer than one
device call, such as a peer's suite (docs/SUITES.md).  Recorded as `run` records; exit as `run`
exits, 0 with one line when nothing is missing and every case passed (1 when one did not).

    python3 scripts/run_missing.py STAGE --arch ARCH [--gpus 0,1] [--workers-per-gpu N]

(A script until `run` can take a flag for it: a new option name changes the verdict path.)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after the lab root: workers re-run this line

from harness.core.labels import case_label  # noqa: E402
from harness.notebook.baselines import fresh_verdicts  # noqa: E402
from harness.notebook.records import read_records  # noqa: E402
from harness.spec.identity import source_hash  # noqa: E402
from harness.spec.matrix import expand  # noqa: E402
from harness.spec.spec import SpecError, normalize_stage_name  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="run_missing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage")
    ap.add_argument("--arch", required=True)
    ap.add_argument("--gpus")
    ap.add_argument("--workers-per-gpu", type=int, default=1)
    a = ap.parse_args(argv)
    from harness.commands.base import spec_here  # the lab root importable first, as `dsv4-lab run` has it

    try:
        spec = spec_here()
    except SpecError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    st = spec.stages.get(normalize_stage_name(a.stage))
    if st is None or a.arch not in st.kernels:
        print(f"run_missing: no stage {a.stage} with a kernel for {a.arch} in stages.yaml", file=sys.stderr)
        return 2
    src = source_hash(spec.root, st, a.arch)
    done = fresh_verdicts(read_records(spec.root, [st.id]), a.arch, src)
    every = list(expand(st))
    todo = [c for c in every if case_label(c.dict) not in done]
    failed = sum(1 for r in done.values() if r.status != "pass")
    print(f"run_missing: {st.name} {a.arch}: {len(every) - len(todo)} of {len(every)} cases have a verdict for the "
          f"current source ({failed} not a pass); running the other {len(todo)}", flush=True)
    if not todo:
        return 1 if failed else 0
    from harness.commands.run import gpu_list
    from harness.execution.report import run_local_and_report

    return run_local_and_report(spec, [st], [a.arch], {st.id: todo}, bench=False, gpus=gpu_list(a.gpus),
                                workers_per_gpu=a.workers_per_gpu, timeout=None, seed=0,
                                argv=["run", st.name, "--arch", a.arch, "(run_missing)"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
