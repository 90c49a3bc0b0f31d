"""What ``scripts/`` share: ``script_args`` (flags, defaults, paths),
``tables`` and ``figures`` (Tables 2-4) and ``table2`` (a family's rows)."""
