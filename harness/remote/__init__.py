"""Remote: targets.yaml (SSH hosts and Slurm clusters), ssh, the tree copy, the signed
record channel, both sides of `run --target`, the Slurm job arrays.  May import: core, peers,
spec, notebook, execution."""
