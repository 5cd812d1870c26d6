"""Execution: compiling (cache, pool, compile sessions, diffs, kernel inspection), the
workers and their one case executor, launch, timing, metrics, pristine inputs, hang capture, the
prepare-only host path, roofline and calibration, the runner, bench, the run/compile report.
May import: core, peers, spec, notebook."""
