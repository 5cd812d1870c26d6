"""Workflows over the whole lab: the regression gate (re-proving baselined cases here or on a
target), the dashboard, history/show/note, the first-light plan.  May import every layer below
(core … remote); the commands (harness/commands) call them."""
