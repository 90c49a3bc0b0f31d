"""What only the scripts in ``scripts/`` and the notebooks share, above the
runner: ``script_args`` (the demo pair's defaults, flags, path resolution,
logging, the machine's description, markdown tables), ``sweep`` (γ sweeps:
the baseline and speculative decoding side by side, paper App. A.3),
``tables`` (run summaries as the paper's Tables 2-4), ``figures`` (their
PNG figures) and ``table2`` (every row of a Table 2 family in sequence). The
installed engine and the runner never import it."""
