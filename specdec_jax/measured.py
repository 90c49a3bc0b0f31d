"""This project's own measurements, borrowed where the paper publishes none.

``DEMO_RANK_PROFILE``: the demo pair's rank acceptance rates at T = 0 over its
first-choice rate (``lab.trees.rank_rates``), which ``tree.scaled_rank_rates``
scales to a row's α to price token trees (an assumption elsewhere)."""

from __future__ import annotations

DEMO_RANK_PROFILE: tuple[float, ...] = (1.0, 0.088 / 0.699, 0.028 / 0.699, 0.018 / 0.699)
