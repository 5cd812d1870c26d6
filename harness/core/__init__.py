"""The core: what every layer needs and nothing of the lab's own — where the lab lives
(paths), the terminal (console), labels, statuses, one-line user faults, stop signals, safe reads
under results/, line-aware YAML, JSON Lines and the notebook lock, the machine's environment, the
command line's option names.  Imports nothing of the lab (docs/ARCHITECTURE.md)."""
