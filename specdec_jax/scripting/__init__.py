"""What only the scripts in ``scripts/`` and the notebooks share, above the
runner: ``script_args`` (the demo pair's defaults, flags, path resolution,
logging, the machine's description, markdown tables) and ``sweep`` (γ sweeps:
the baseline and speculative decoding side by side, paper App. A.3). The
installed engine and the runner never import it."""
