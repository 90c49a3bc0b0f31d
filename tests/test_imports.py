"""The package and the decoding path never import TensorFlow (only the seqio
data path does, lazily)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_no_tensorflow_on_the_decoding_path():
  code = ("import sys, specdec_jax, specdec_jax.decoding, specdec_jax.run, "
          "specdec_jax.checkpoints, specdec_jax.drafts, lab.sweep\n"
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
          "('tensorflow', 'seqio', 'tensorflow_datasets', 'torch'))\n"
          "assert not bad, bad\n")
  res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": ""})
  assert res.returncode == 0, res.stderr[-2000:]
