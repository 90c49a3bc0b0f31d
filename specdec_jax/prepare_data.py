"""Builds the TFDS datasets behind the seqio tasks (WMT EnDe, CNN/DM) into a data
directory, local or ``gs://``, for ``Experiment.tfds_data_dir`` (the runner never
downloads; a version already prepared is kept):

  python -m specdec_jax.prepare_data --dataset=wmt_ende --data_dir=gs://BUCKET/tfds
  python -m specdec_jax.prepare_data --dataset=cnn_dailymail --data_dir=gs://BUCKET/tfds"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from specdec_jax import data

def _local_or_remote(path: str) -> str:
  return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def default_download_dir(data_dir: str) -> str:
  """``<data_dir>/downloads``, or for a gs:// data dir ``~/tensorflow_datasets/downloads``
  (TFDS's WMT builder globs for its extracted files locally)."""
  if "://" in data_dir:
    return os.path.expanduser(os.path.join("~", "tensorflow_datasets", "downloads"))
  return os.path.join(data_dir, "downloads")


def prepare(dataset: str, data_dir: str, download_dir: Optional[str] = None) -> str:
  """Download and prepare ``dataset`` into ``data_dir`` -> the prepared version's directory."""
  if dataset not in data.TFDS_DATASETS:
    raise ValueError(f"unknown dataset {dataset!r}; one of {sorted(data.TFDS_DATASETS)}")
  if not data_dir:
    raise ValueError("data_dir is empty: name the directory to build into (local or gs://)")
  tfds = data.import_optional("tensorflow_datasets", "python -m specdec_jax.prepare_data")
  # builder_cls, not tfds.builder(name): that first lists <data_dir>/<name>/<config>, which
  # fails in a gs:// data dir without it (TensorFlow's NotFoundError is no OSError).
  name, _, version = data.TFDS_DATASETS[dataset].partition(":")
  name, _, config = name.partition("/")
  builder = tfds.builder_cls(name)(config=config or None, version=version,
                                   data_dir=_local_or_remote(data_dir))
  builder.download_and_prepare(download_dir=_local_or_remote(
      download_dir or default_download_dir(data_dir)))
  return str(builder.data_dir)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; a user error is one ``error:`` line and exit status 2."""
  parser = argparse.ArgumentParser(
      prog="python -m specdec_jax.prepare_data",
      description="Build WMT EnDe or CNN/DM for TFDS into a data directory (local or gs://), "
                  "as the seqio tasks specdec_wmt_ende / specdec_cnn_dailymail read them.")
  parser.add_argument("--dataset", required=True, choices=sorted(data.TFDS_DATASETS),
                      help="wmt_ende: " + data.TFDS_DATASETS["wmt_ende"]
                      + "; cnn_dailymail: " + data.TFDS_DATASETS["cnn_dailymail"])
  parser.add_argument("--data_dir", required=True,
                      help="TFDS data directory to build into (local or gs://); bind "
                           "Experiment.tfds_data_dir to it")
  parser.add_argument("--download_dir", default=None,
                      help="where the raw downloads go (default: <data_dir>/downloads; "
                           "for a gs:// data_dir, ~/tensorflow_datasets/downloads here)")
  args = parser.parse_args(argv)
  try:
    path = prepare(args.dataset, args.data_dir, args.download_dir)
  except (ValueError, ImportError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{args.dataset}: prepared in {path}; bind Experiment.tfds_data_dir = "
        f"'{args.data_dir}' (or set TFDS_DATA_DIR)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
