"""What the scripts in ``scripts/`` share, above the runner: ``script_args``
(the demo pair's defaults, flags generated from settings dataclasses, path
resolution, logging, the machine's description, markdown tables), ``tables``
(run summaries as the paper's Tables 2-4), ``figures`` (their PNG figures)
and ``table2`` (every row of a Table 2 family in sequence). The engine and
the runner never import it; studies and sweeps are in ``lab/``, outside the
package."""
