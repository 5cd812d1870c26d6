"""Upkeep of the notebook's size (the tracked tree must stay small enough to carry to a GPU
machine): move the records' inline instruction inventories into results/inventories.jsonl,
move stale records into results/archive/<stage>.jsonl.xz, and trim compile baselines to what
the gate compares (harness/inventories.py, harness/archive.py, harness/baselines.py). Nothing
is lost: every reader sees the same records afterwards. Idempotent; prints what it saved.

    python3 scripts/compact_results.py [LAB_ROOT]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import baselines  # noqa: E402
from harness.archive import archive_stale  # noqa: E402
from harness.identity import source_hash  # noqa: E402
from harness.spec import load_spec  # noqa: E402
from harness.inventories import InventoryStore, compact_file  # noqa: E402
from harness.paths import records_dir, results_dir  # noqa: E402
from harness.records import Appender  # noqa: E402


def main(root: Path) -> int:
    store = InventoryStore(results_dir(root))
    out = Appender(store.path)
    try:
        for path in sorted(records_dir(root).glob("*.jsonl")):
            lines, saved = compact_file(path, store, out.write)
            print(f"{path.relative_to(root)}: {lines} lines, {saved} bytes saved")
    finally:
        out.close()
    spec = load_spec(root / "stages.yaml")
    for stage in spec.stages.values():
        current = {arch: source_hash(spec.root, stage, arch) for arch in stage.kernels}
        moved, saved = archive_stale(root, stage.id, current)
        if moved:
            print(f"results/records/{stage.id}.jsonl: {moved} stale lines archived, {saved} bytes saved")
    with baselines.locked(root):
        items = baselines.load(root)
        for b in items:
            if b.compile is not None:
                for table in ("inv", "sass"):
                    if isinstance(b.compile.get(table), dict):
                        b.compile[table] = baselines.gated_counts(b.compile[table])
        before = baselines.baselines_file(root).stat().st_size
        baselines.save(root, items)
        print(f"results/baselines.yaml: {before - baselines.baselines_file(root).stat().st_size} bytes saved")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path.cwd()))
