"""The far side of `gate --speed --target NAME` on a Hopper GPU, without ssh (docs/BENCH.md).

The lab's GPU machine has no sshd, so this drives what the target runs exactly as the sending
side would, minus the copy: a scratch lab (scripts/speed_proofs.py: a git repository of one commit,
the REV) gets a speed baseline of one stage-E bench shape at that commit, on this GPU's model, whose
source hash is made to differ (so the gate must re-time it); HEAD's tree is taken with git archive
into `.dsv4-revs/<sha>/`, then `.git` is moved away (the target's copy has none), and
`python -m harness.remote.remote_side gate --speed --emit-jsonl --rev-tree SHA` runs with a fresh
channel key on stdin. Its stdout is read here as the sending side reads it (harness/remote/
channel.py Receiver, remote_run.parse_payload): signed frames only.

    source .device/prelude.sh
    python3 scripts/speed_gate_far.py aa        # unchanged kernel: exit 0 from the far side, verdict not slower
    python3 scripts/speed_gate_far.py planted   # tests/fixtures/slow_e in the tree: exit 1, verdict "slower"

Exit 0 when the far side behaved as expected: one compare record back (signed, planned shape),
the far side's exit code and verdict as above, its gate lines in the end event, and no record
written into the scratch copy's own notebook.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _proof_case(cases: list[dict]) -> dict:
    """The bench shape the proof re-times: b 64, s_q 2, h_q 128, model1 where the bench block has it
    (the planted fixture is ≈ 5 % slower there; at b 1 — the block's first shape — it is ≈ 2 %,
    under the gate's 3 %: the H200 run of 2026-11-27 said "no detectable change"), else the first."""
    for c in cases:
        if c.get("b") == 64 and str(c.get("config", "")).startswith("s2h128") and c.get("kv_format") == "model1":
            return c
    return cases[0]


def main() -> int:
    from harness.core.environment import gpu_capabilities
    from harness.core.labels import case_label
    from harness.execution.abbench import take_tree
    from harness.execution.bench import plan_cases
    from harness.remote.channel import Receiver, new_key
    from harness.remote.remote_run import parse_payload
    from harness.remote.remote_speedgate import REV_DIR
    from harness.spec.spec import load_spec
    from speed_proofs import scratch_lab

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("proof", choices=("aa", "planted"))
    args = ap.parse_args()
    caps = gpu_capabilities()
    case: dict = {}
    gpu_name, arch = caps.get(0, ("NVIDIA H100 80GB HBM3", "sm_90a"))
    if not caps:
        print("no GPU here: the far side must answer 'no GPU on this target' (the plumbing only)")
    with tempfile.TemporaryDirectory(prefix="dsv4-speed-far-") as tmp:
        lab = scratch_lab(Path(tmp) / "lab", planted=args.proof == "planted")
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=lab, capture_output=True, text=True,
                             check=True).stdout.strip()
        st = load_spec(root=lab).stages["E"]
        case = _proof_case(plan_cases(st, []))  # its bench shapes, not its more: case list
        shape = case_label(case)
        (lab / "results").mkdir(exist_ok=True)
        (lab / "results" / "speed_baselines.yaml").write_text(
            f"version: 1\nspeed:\n  E:\n    {arch}:\n      {json.dumps(shape)}: {{record: proof.1, src: made-stale, "
            f"commit: {sha[:12]}, us: 1.0, gpu: {{name: {json.dumps(gpu_name)}}}}}\n")
        take_tree(lab, "HEAD", sha, lab / REV_DIR / sha)
        shutil.move(str(lab / ".git"), str(Path(tmp) / "git-away"))  # the target's copy has no .git
        env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": os.pathsep.join([str(lab), *filter(None, [os.environ.get("PYTHONPATH")])]), "DSV4_LAB_GIT": f"{sha[:12]}:1",
               "DSV4_LAB_CACHE": os.environ.get("DSV4_LAB_CACHE", str(ROOT / ".cache")), "PYTHONUNBUFFERED": "1"}
        key = new_key()
        proc = subprocess.Popen([sys.executable, "-m", "harness.remote.remote_side", "gate", "--speed", "--emit-jsonl",
                                 "--rev-tree", sha], cwd=lab, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(key.encode() + b"\n")
        proc.stdin.flush()
        rx, records, events, rejected = Receiver(key), [], [], []
        for raw in proc.stdout:
            payload, why = rx.open(raw.rstrip(b"\r\n"))
            kind, obj = parse_payload(payload, {"E"}) if payload is not None else ("reject", why)
            (records if kind == "record" else events if kind == "event" else rejected).append(obj)
        rc = proc.wait()
        proc.stdin.close()
        written = list((lab / "results").glob("records/*.jsonl"))
    end = next((e for e in events if e.get("event") == "end"), {})
    for line in end.get("lines", []):
        print(f"far side: {line}")
    verdicts = [(r.get("compare") or {}).get("verdict") for r in records]
    print(f"far side: exit {rc}; {len(records)} record(s) {verdicts}; events {[e.get('event') for e in events]}; "
          f"rejected {len(rejected)} {rejected[:2]}; written in the copy's notebook: {[p.name for p in written]}")
    if not caps:
        ok = rc == 1 and not records and any("no GPU on this target" in ln for ln in end.get("lines", []))
    else:
        want = ("no detectable change", "faster") if args.proof == "aa" else ("slower",)
        ok = (rc == (0 if args.proof == "aa" else 1) and len(records) == 1 and verdicts[0] in want
              and records[0]["case"] == case)
    ok = ok and not rejected and not written and [e.get("event") for e in events] == ["start", "end"]
    print(f"{args.proof}: {'as expected' if ok else 'NOT as expected'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
