"""``python -m specdec_jax.run``: the runner's command line (``cli``)."""

import sys

from absl import app

from specdec_jax.run import cli

__doc__ = cli.__doc__

if __name__ == "__main__":
  if cli.wants_help(sys.argv[1:]):
    # absl's own --help lists only this module's flags (none) and exits 1.
    print(cli.help_text())
    sys.exit(0)
  app.run(cli.app_main)
