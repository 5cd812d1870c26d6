"""The peers' own test suites, ported (read, not copied) as case lists, generators and pass
criteria, run against the lab's stages (docs/SUITES.md).

A suite module defines:
    UPSTREAM        "owner/repo@commit path" of every file its cases come from
    STAGE           the stage id its cases run on (stages.yaml names the suite stage)
    upstream()      every upstream case (a frozen dataclass each, upstream's order and count)
    reasons(u)      why upstream case `u` cannot run on the stage today ([] when it can), from
                    the module's LIMITS table (a kernel growing an option edits that table)
    cases()         the supported cases as stage cases (kernel parameters and `id`, the upstream
                    index): what a suite stage's `suite.cases` names
    tensors / make_inputs / reference / criterion
                    the stage contract for a suite case (criterion: upstream's pass rule)
"""

from __future__ import annotations

SUITES = {  # `dsv4-lab suite NAME`: the modules of each suite (one per stage it runs on)
    "flashmla": ("oracles.suites.flashmla_sparse",),
    "deepgemm": ("oracles.suites.deepgemm_mqa", "oracles.suites.deepgemm_paged"),
}
