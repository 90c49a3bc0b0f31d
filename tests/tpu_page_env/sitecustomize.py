"""Imported at the start of every Python process that tests/test_tpu_page.py
runs (this folder is first on their PYTHONPATH), to make the page's commands
run on tiny stand-ins, as the test states:

* ``$SPECDEC_TEST_PRESETS`` (a JSON file {name: T5Config fields}): presets
  added to ``specdec_jax.models.t5.PRESETS`` when it is imported, which the
  test's bindings (``Experiment.target_preset = ...``) name;
* ``$SPECDEC_TEST_TFDS_DOWNLOADS``: TensorFlow Datasets' downloads served from
  tiny local files (tests/tfds_downloads.py).

Without either variable it does nothing.
"""

import json
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/

import tfds_downloads  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

PRESETS_ENV = "SPECDEC_TEST_PRESETS"


def _add_presets(module) -> None:
  for name, fields in json.loads(Path(os.environ[PRESETS_ENV]).read_text()).items():
    module.PRESETS[name] = module.T5Config(**fields)


if os.environ.get(PRESETS_ENV):
  tfds_downloads.after_import({"specdec_jax.models.t5": _add_presets})
tfds_downloads.install_from_env()
