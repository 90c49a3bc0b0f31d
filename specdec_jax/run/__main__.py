"""``python -m specdec_jax.run``: the runner's command line (``cli``)."""

from absl import app

from specdec_jax.run import cli

__doc__ = cli.__doc__  # absl prints the main module's docstring for --help

if __name__ == "__main__":
  app.run(cli.app_main)
