"""The speed gate's two proofs on a Hopper GPU (docs/BENCH.md):

  aa       A/A: `bench stage-E --compare HEAD` on an unchanged tree, RUNS times over SHAPES bench
           shapes (default 5 × 4 = 20 comparisons), one binary on both sides: every verdict must
           be "no detectable change". Exit 0 only with >= 20 comparisons and no false alarm.
  planted  the tree's E kernel replaced by tests/fixtures/slow_e (a busy wait in one producer
           warp per KV tile: about 5 % slower) against HEAD's: every verdict must be "slower".

Each proof works in a scratch copy of this lab (given a git repository and one commit, the REV),
with its own notebook, the compile cache of $DSV4_LAB_CACHE shared. The table also goes to
$OUT/speed_proofs.json (or --out).

    source .device/prelude.sh
    python3 scripts/speed_proofs.py aa [--runs 5]
    python3 scripts/speed_proofs.py planted [--runs 1]"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Four bench shapes of stage E (docs/BENCH.md): h_q 128 and 64, one and two lists, b 64 and 128.
SHAPES = ["--b", "64,128", "--config", "s2h128_m128bs256_x1024bs64,s1h64_m128bs256_x1024bs64"]
REAL = "sm90: {module: stages.E_sparse_decode.sm90}"
PLANTED = "sm90: {module: tests.fixtures.slow_e.sm90}"
IGNORE = (".git", ".cache", "results", ".device", ".peers", "scratch", "__pycache__", ".run", ".pytest_cache")


def _git(lab: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=proof@lab", "-c", "user.name=proof", *args], cwd=lab, check=True,
                   capture_output=True)


def scratch_lab(dest: Path, planted: bool) -> Path:
    """A copy of this lab with a git repository of one commit (the REV); `planted`: the tree's E
    kernel is then the slow fixture (uncommitted: the tree differs from REV by that alone)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*IGNORE))
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "speed proof")
    if planted:
        yaml = dest / "stages.yaml"
        text = yaml.read_text()
        if REAL not in text:
            raise SystemExit(f"stages.yaml no longer names E's kernel as `{REAL}`: update scripts/speed_proofs.py")
        yaml.write_text(text.replace(REAL, PLANTED, 1))
    return dest


def compare_once(lab: Path, rounds: int, shapes: list[str]) -> list[dict]:
    """One `bench stage-E --compare HEAD` in `lab`; the compare blocks of the run's records."""
    from harness.notebook.records import read_records

    env = {k: v for k, v in os.environ.items() if k != "DSV4_LAB_GIT"}  # the scratch commit names the records
    env.update(DSV4_LAB_ROOT=str(lab), DSV4_LAB_CACHE=os.environ.get("DSV4_LAB_CACHE", str(ROOT / ".cache")),
               PYTHONPATH=os.pathsep.join([str(lab), *filter(None, [os.environ.get("PYTHONPATH")])]))
    p = subprocess.run([sys.executable, "-m", "cli", "bench", "stage-E", "--compare", "HEAD", "--rounds", str(rounds),
                        *shapes], cwd=lab, env=env, capture_output=True, text=True)
    print(p.stdout, end="")
    print(p.stderr, end="", file=sys.stderr)
    m = re.search(r"\(run (\S+)\)", p.stdout)
    if not m:
        return [{"error": f"no run (exit {p.returncode})"}]
    recs = [r for r in read_records(lab, ["E"], bench=True) if r.run == m.group(1)]
    return [{"case": r.case, "status": r.status, "error": r.error, **(r.compare or {})} for r in recs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("proof", choices=("aa", "planted"))
    ap.add_argument("--runs", type=int, default=None, help="bench --compare runs (aa: 5, planted: 1)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--resume", metavar="JSON", help="add to the results of an earlier call (its speed_proofs_*.json): "
                                                     "the 20 A/A comparisons may be split over calls of 600 s")
    args = ap.parse_args()
    runs = args.runs or (5 if args.proof == "aa" else 1)
    got: list[dict] = []
    if args.resume:
        earlier = json.loads(Path(args.resume).read_text())
        if earlier.get("proof") != args.proof:
            raise SystemExit(f"--resume {args.resume}: a {earlier.get('proof')} proof, not {args.proof}")
        got += earlier["results"]
    with tempfile.TemporaryDirectory(prefix=f"dsv4-speed-{args.proof}-") as tmp:
        lab = scratch_lab(Path(tmp) / "lab", planted=args.proof == "planted")
        for _ in range(runs):
            got += compare_once(lab, args.rounds, SHAPES)
    verdicts = [g.get("verdict") for g in got]
    want = "no detectable change" if args.proof == "aa" else "slower"
    n = sum(v is not None for v in verdicts)
    summary = {"proof": args.proof, "comparisons": n, "runs": runs, "rounds": args.rounds,
               "verdicts": {v: verdicts.count(v) for v in set(verdicts) if v},
               "not_compared": [g for g in got if g.get("verdict") is None], "results": got}
    out = Path(args.out) / f"speed_proofs_{args.proof}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))
    keep = Path(tempfile.gettempdir()) / f"speed_proofs_{args.proof}.json"  # a warm machine's next call resumes it
    if keep != out:
        keep.write_text(out.read_text())
    for g in got:
        if "ratio" in g:
            print(f"  {g['verdict']:<22} ×{g['ratio']:.4f} [{g['lo']:.4f}, {g['hi']:.4f}]  A {g['a_us']:.2f} µs  "
                  f"B {g['b_us']:.2f} µs  {g['case']}")
    if args.proof == "aa":
        alarms = verdicts.count("slower")
        print(f"A/A: {n} comparisons, {alarms} false alarm(s) (slower), {verdicts.count('faster')} 'faster'; "
              f"rate {alarms / max(n, 1):.1%} → {out}")
        return 0 if n >= 20 and alarms == 0 and not summary["not_compared"] else 1
    print(f"planted slowdown: {verdicts.count(want)} of {len(got)} shape(s) slower → {out}")
    return 0 if got and all(v == want for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
