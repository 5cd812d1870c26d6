"""The notebook under results/: records (schema, writer, queries, RunLog), the
content-addressed stores (inventories) and the instruction inventory they keep, baselines, the
archive, the git-index snapshot a gate judges.  May import: core, peers, spec."""
