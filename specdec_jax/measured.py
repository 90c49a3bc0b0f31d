"""This project's own measurements that models of other settings borrow where
the paper publishes none, transcribed once (as ``paper`` holds the paper's).

``DEMO_RANK_PROFILE``: the demo pair's rank acceptance rates at T = 0 over
its first-choice rate (``lab.trees.rank_rates`` on held-out verses:
0.699, 0.088, 0.028, 0.018), i.e. how fast the runner-up choices fall off
for a small draft of a larger model. ``tree.scaled_rank_rates`` scales it to
a row's α to price token trees (an assumption for pairs not measured).
"""

from __future__ import annotations

DEMO_RANK_PROFILE: tuple[float, ...] = (1.0, 0.088 / 0.699, 0.028 / 0.699, 0.018 / 0.699)
