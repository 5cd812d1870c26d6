#!/usr/bin/env bash
# The lab's GPU proof in one go, on a machine with a Hopper GPU:
#   1. stage A with an empty compile cache (cold), then again (warm: nothing to compile), timed;
#   2. every stage's matrix on both archs (sm_100a: compiled, not run), benched cases timed;
#   3. the GPU tests (every test marked gpu: stage A through the runner; the planted bugs —
#      wrong-B, the D3–D5 masks and sink, the indexer's dropped ReLU, E's — must be reported `fail`);
#   4. the dashboard.
# scripts/gpu_bench.sh then benches the stages with bench blocks beside their peers (a call that
# carries .peers, on the same warm machine: see README "On the GPU machine of this workplace").
# The lab writes its records into results/ as it always does; with $OUT set (the device
# tool), results/ (as results.tgz) and the logs are copied there to be committed.
#
# On a copy without .git, say which commit it is:  DSV4_LAB_GIT=<sha>:<0|1> scripts/gpu_proof.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dsv4-gpu-proof}
mkdir -p "$out"
export DSV4_LAB_CACHE=$(mktemp -d /tmp/dsv4-lab-cache.XXXXXX)  # a cache of its own: a cold start
TIMEFORMAT='wall %R s'
lab() { python3 -m cli "$@"; }

nvidia-smi -L | tee "$out/gpu.txt"
echo "== stage A, cold (empty compile cache)"
{ time lab run stage-A; } 2>&1 | tee "$out/A-cold.log"
echo "== stage A, warm"
{ time lab run stage-A; } 2>&1 | tee "$out/A-warm.log"
echo "== every stage, benched cases timed"
{ time lab run --all --bench; } 2>&1 | tee "$out/all.log"
echo "== GPU tests"
python3 -m pytest -q -s -rs -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu-tests.log"
lab dashboard 2>&1 | tee "$out/dashboard.txt"
tar -czf "$out/results.tgz" results
