"""`exokv bench`: the same conversations through five cache strategies, side by side.

- ``scenarios``: deterministic conversations from a seed (linear, switch, branch,
  shared-prefix), sized so the last turn reaches ``--context`` tokens.
- ``strategies``: cold, carried, mlx-lm-lru, exokv and exokv+disk, all decoding
  greedily with the same code path on one loaded model.
- ``runner``: interleaves the strategies turn by turn, repeats, checks that every
  strategy gives the same reply, measures the limit and takes medians.
- ``targets``: grades a run against the issues' targets.
- ``report``: the progress bar, the tables, the JSON document and the plot.
"""

from __future__ import annotations

SCENARIOS = ("linear", "switch", "branch", "shared-prefix", "restart")
STRATEGIES = ("cold", "carried", "mlx-lm-lru", "exokv", "exokv+disk")
# The strategies --kv-bits quantizes: their replies drift from the others' (reported).
QUANTIZED = ("exokv", "exokv+disk")
