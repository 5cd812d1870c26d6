"""The stage as its bench block reads it.

A stage with `more:` test matrices carries its test cases as a list (`Stage.cases`, harness/spec/
spec.py), and `expand` gives a listed stage its list whatever matrix it is handed — so
`plan_cases` (harness/execution/bench.py), which expands the bench block's own matrices with the
stage, found no bench shape in I1 and I2 once issue 35 gave them `more:` products.  Every caller
of plan_cases hands it `bench_view(stage)`: the same stage without the list (its matrix and
everything a record's code identity reads unchanged: harness/spec/identity.py stage_entry).

To fold into plan_cases itself at the next GPU proof: harness/execution/bench.py is on the
verdict path, and a change there makes every record stale.
"""

from __future__ import annotations

import dataclasses

from harness.spec.spec import Stage


def bench_view(stage: Stage) -> Stage:
    """`stage` with its `more:` case list dropped (a suite stage, whose list is its matrix, as is)."""
    if stage.cases is None or stage.suite is not None:
        return stage
    return dataclasses.replace(stage, cases=None)
