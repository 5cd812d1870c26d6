"""The stage spec: stages.yaml as typed data (spec), the matrix and its filters, the stage
contract proven on the CPU (check), code identity and staleness (identity, codetext), scaffolding
a new stage.  May import: core, peers."""
