#!/usr/bin/env bash
# Every stage that has a bench block, beside its peers (`dsv4-lab bench STAGE --peers`), on a
# Hopper machine where the peers are importable. Records go to results/ as usual; with $OUT set,
# results/ (as results.tgz) and the logs are copied there to be committed.
#
# On a copy without .git, say which commit it is:  DSV4_LAB_GIT=<sha>:<0|1> scripts/gpu_bench.sh [STAGE…]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dsv4-gpu-proof}
mkdir -p "$out"
export DSV4_LAB_CACHE=${DSV4_LAB_CACHE:-$(mktemp -d /tmp/dsv4-lab-cache.XXXXXX)}
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  mapfile -t stages < <(python3 - <<'PY'
from harness.spec.spec import load_spec
print("\n".join(s.id for s in load_spec().stages.values() if s.bench_plan is not None))
PY
)
fi
rc=0
for s in "${stages[@]}"; do
  echo "== bench stage-$s --peers"
  python3 -m cli bench "stage-$s" --peers 2>&1 | tee "$out/bench-$s.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
tar -czf "$out/results.tgz" results
exit $rc
