"""gs:// everywhere a path goes, against a real Cloud Storage API server on
localhost (``gcp-storage-emulator``, in memory), found through the standard
STORAGE_EMULATOR_HOST: the demo run from gs:// equals the local one token for
token; every checkpoint format loads from gs:// exactly as from disk; a gs://
workdir writes and resumes; a missing object, a missing bucket and an
unreachable endpoint each end in one clear line naming the gs:// path, fast."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gcs_emulator
import jax
import numpy as np
import pytest
from checkpoint_fixtures import write_t5x_legacy, write_t5x_orbax
from gcs_emulator import BUCKET, free_port

from specdec_jax import data, storage
from specdec_jax.checkpoints import load_checkpoint, save_checkpoint
from specdec_jax.checkpoints.common import flatten, unflatten
from specdec_jax.models.t5 import T5Config, param_shapes
from specdec_jax.run import settings
from specdec_jax.run.workdir import Workdir

from lab.hf_export import export_hf

REPO = Path(__file__).resolve().parent.parent
CFG = T5Config(vocab_size=64, d_model=32, num_heads=2, head_dim=8, num_encoder_layers=2,
               num_decoder_layers=2, d_ff=48)
# The environment the storage module derives from STORAGE_EMULATOR_HOST.
DERIVED = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
  """``host:port`` of an in-memory Cloud Storage emulator with the bucket BUCKET."""
  pytest.importorskip("gcp_storage_emulator")
  log = tmp_path_factory.mktemp("gcs") / "emulator.log"
  try:
    with gcs_emulator.running(log) as host:
      yield host
  except RuntimeError as e:
    pytest.fail(str(e))


@pytest.fixture
def gcs(gcs_server, monkeypatch):
  """STORAGE_EMULATOR_HOST set for the test (and nothing else pointing elsewhere)."""
  for name in DERIVED:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
  return f"gs://{BUCKET}"


def upload(local: Path, url: str) -> None:
  """A file, or a directory tree, to ``url`` (object names relative to ``local``)."""
  if local.is_file():
    storage.write_bytes(url, local.read_bytes())
    return
  for f in sorted(p for p in local.rglob("*") if p.is_file()):
    storage.write_bytes(storage.join(url, f.relative_to(local).as_posix()), f.read_bytes())


def error_lines(err: str) -> list[str]:
  return [l for l in err.splitlines() if l.startswith("error:")]


# ------------------------------------------------------------ the demo, end to end


# A few examples; one input width (not the demo's four buckets) compiles each program once.
DEMO = ["--config=configs/demo.gin", "--gin_bindings=Experiment.num_examples = 3",
        "--gin_bindings=Experiment.num_warmup = 1", "--gin_bindings=Experiment.input_buckets = ()"]
# What decoding produced, token for token (timings differ run to run).
SAME = ("index", "id", "output", "baseline_output", "tokens", "baseline_tokens", "accepted",
        "rejected", "accepted_at", "evaluated_at", "target_calls", "draft_calls",
        "matches_baseline", "min_pq_sum", "input_width")


def test_demo_from_gcs_equals_local(gcs, tmp_path, capsys, monkeypatch):
  from specdec_jax import run
  monkeypatch.chdir(REPO)
  demo = REPO / "checkpoints" / "demo"
  root = f"{gcs}/demo"
  for name in ("target", "draft_tiny_feat", "spm.model", "draft_shortlist.json"):
    upload(demo / name, f"{root}/{name}")
  upload(REPO / "data" / "bible" / "test.tsv", f"{root}/test.tsv")
  assert storage.is_file(f"{root}/draft_tiny_feat/feature_bridge.npz")

  assert run.run_args([*DEMO, f"--workdir={tmp_path / 'local'}"]) == 0
  remote = [f"--gin_bindings=Experiment.{k} = '{root}/{v}'" for k, v in (
      ("source", "test.tsv"), ("vocab_path", "spm.model"), ("target_checkpoint", "target"),
      ("draft_checkpoint", "draft_tiny_feat"), ("draft_shortlist", "draft_shortlist.json"))]
  workdir = f"{root}/runs/demo"
  assert run.run_args([*DEMO, *remote, f"--workdir={workdir}"]) == 0, capsys.readouterr().err

  local = [json.loads(l) for l in (tmp_path / "local" / "examples.jsonl").read_text()
           .splitlines()]
  from_gcs = [json.loads(l) for l in storage.read_text(f"{workdir}/examples.jsonl")
              .splitlines()]
  assert len(local) == len(from_gcs) == 3
  for a, b in zip(local, from_gcs):
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
  summary = json.loads(storage.read_bytes(f"{workdir}/summary.json"))
  assert summary["num_examples"] == 3 and summary["mismatches_vs_baseline"] == 0
  assert "Experiment.target_checkpoint = 'gs://" in storage.read_text(f"{workdir}/config.gin")

  # --resume on the finished gs:// run: read back, nothing decoded, the table again.
  capsys.readouterr()
  assert run.run_args([*DEMO, *remote, f"--workdir={workdir}", "--resume"]) == 0
  assert "| bible_modernize |" in capsys.readouterr().out


# ------------------------------------------------------------ every checkpoint format


@pytest.fixture(scope="module")
def params():
  """Random weights of CFG's tree, drawn with numpy (no compilation)."""
  rng = np.random.default_rng(3)
  return unflatten({name: rng.standard_normal(leaf.shape).astype(np.float32)
                    for name, leaf in flatten(param_shapes(CFG)).items()})


def write_format(fmt: str, params, directory: Path) -> Path:
  """A checkpoint of ``params`` in ``fmt`` under ``directory``; the path to load."""
  if fmt == "specdec":
    save_checkpoint(str(directory), params, CFG, dtype="bfloat16")
  elif fmt == "t5x":
    write_t5x_legacy(str(directory / "checkpoint_100"), params)
  elif fmt == "t5x_orbax":
    write_t5x_orbax(str(directory), params)
  else:
    export_hf(params, CFG, str(directory))
  return directory


@pytest.mark.parametrize("fmt", ["specdec", "t5x", "t5x_orbax", "hf"])
def test_checkpoint_formats_from_gcs(gcs, params, tmp_path, fmt):
  local = write_format(fmt, params, tmp_path / fmt)
  url = f"{gcs}/formats/{fmt}"
  upload(local, url)
  config = CFG if fmt.startswith("t5x") else None
  want, want_cfg = load_checkpoint(str(local), config=config)
  got, got_cfg = load_checkpoint(url, config=config)
  assert got_cfg == want_cfg
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    assert g.dtype == w.dtype, path
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))


# ------------------------------------------------------------ files beside the checkpoints


def test_workdir_on_gcs_writes_and_resumes(gcs):
  url = f"{gcs}/runs/unit"
  w = Workdir(url, "Experiment.gamma = 3\n", resume=False)
  assert w.records == []
  w.append({"index": 1, "mode": "speculative", "accepted": 2})
  w.append({"index": 2, "mode": "speculative", "accepted": 3})
  w.write_summary({"num_examples": 2})
  assert storage.read_text(f"{url}/config.gin") == "Experiment.gamma = 3\n"
  with pytest.raises(FileExistsError, match="pass --resume"):
    Workdir(url, "Experiment.gamma = 3\n", resume=False)
  with pytest.raises(ValueError, match="gin config differs"):
    Workdir(url, "Experiment.gamma = 4\n", resume=True)
  # A torn last line (not ours: objects are written whole) is dropped on the next write.
  storage.write_bytes(f"{url}/examples.jsonl",
                      storage.read_bytes(f"{url}/examples.jsonl") + b'{"index": 3, "mo')
  w = Workdir(url, "Experiment.gamma = 3\n", resume=True)
  assert [r["index"] for r in w.records] == [1, 2]
  w.append({"index": 3, "mode": "speculative", "accepted": 1})
  lines = storage.read_text(f"{url}/examples.jsonl").splitlines()
  assert [json.loads(l)["index"] for l in lines] == [1, 2, 3]
  with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket-9 does not exist"):
    Workdir("gs://no-such-bucket-9/runs/x", "", resume=False)


def test_vocab_data_shortlist_and_tfds_dir_from_gcs(gcs, tmp_path):
  from specdec_jax.drafts import shortlist
  demo = REPO / "checkpoints" / "demo"
  upload(demo / "spm.model", f"{gcs}/files/spm.model")
  upload(REPO / "data" / "bible" / "test.tsv", f"{gcs}/files/test.tsv")
  upload(demo / "draft_shortlist.json", f"{gcs}/files/shortlist.json")
  vocab = data.get_vocabulary(f"{gcs}/files/spm.model")
  assert vocab.encode("Thou art") == data.get_vocabulary(str(demo / "spm.model")).encode(
      "Thou art")
  assert data.load_examples(f"{gcs}/files/test.tsv", max_examples=4) == data.load_examples(
      str(REPO / "data" / "bible" / "test.tsv"), max_examples=4)
  np.testing.assert_array_equal(shortlist.load(f"{gcs}/files/shortlist.json", 32128),
                                shortlist.load(str(demo / "draft_shortlist.json"), 32128))
  # A TFDS data directory in Cloud Storage: prepared or not, told without TensorFlow.
  name, version = "wmt_t2t_translate/de-en", "1.0.0"
  with pytest.raises(FileNotFoundError, match="is not prepared"):
    data._check_tfds_prepared(f"{name}:{version}", f"{gcs}/tfds", "the test")
  storage.write_bytes(f"{gcs}/tfds/{name}/{version}/dataset_info.json", b"{}")
  data._check_tfds_prepared(f"{name}:{version}", f"{gcs}/tfds", "the test")


def test_paths_are_kept_and_checked():
  assert settings.resolve_path("gs://b-1/x/spm.model") == "gs://b-1/x/spm.model"
  assert settings.candidates("gs://b-1/x") == ["gs://b-1/x"]
  exp = settings.Experiment(target_checkpoint="gs://b-1/t", draft_checkpoint="gs://b-1/d",
                            vocab_path="gs://b-1/spm.model", source="gs://b-1/test.tsv")
  exp.validate()  # no network: gs:// paths are only checked for form
  with pytest.raises(ValueError, match="Experiment.vocab_path: malformed Cloud Storage path"):
    settings.Experiment(target_checkpoint="gs://b-1/t", draft_checkpoint="gs://b-1/d",
                        vocab_path="gs:///spm.model").validate()


def test_configure_emulator(monkeypatch):
  for name in DERIVED:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
  storage.configure_emulator()
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://localhost:4443"
  assert os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"]
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9000")  # a change follows
  storage.configure_emulator()
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9000"
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://mine:1")  # the user's own wins
  storage.configure_emulator()
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://mine:1"
  monkeypatch.delenv("STORAGE_EMULATOR_HOST")
  storage.configure_emulator()
  assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in os.environ


# ------------------------------------------------------------ bad input: one line, fast


def run_demo_error(capsys, monkeypatch, workdir: Path, *bindings: str) -> tuple[str, float]:
  """The runner's one error line for the demo with ``bindings``, and its seconds."""
  from specdec_jax import run
  monkeypatch.chdir(REPO)
  capsys.readouterr()
  start = time.monotonic()
  code = run.run_args([*DEMO, *[f"--gin_bindings={b}" for b in bindings],
                       f"--workdir={workdir}"])
  elapsed = time.monotonic() - start
  err = capsys.readouterr().err
  assert code == 2, err
  lines = error_lines(err)
  assert len(lines) == 1, err
  assert not workdir.exists()
  return lines[0], elapsed


def test_missing_object(gcs, capsys, monkeypatch, tmp_path):
  line, seconds = run_demo_error(capsys, monkeypatch, tmp_path / "w",
                                 f"Experiment.vocab_path = '{gcs}/nowhere/spm.model'")
  assert line == (f"error: SentencePiece model {gcs}/nowhere/spm.model does not exist "
                  f"(bucket {gcs} has no object 'nowhere/spm.model')")
  assert seconds < 30


def test_missing_bucket(gcs, capsys, monkeypatch, tmp_path):
  line, seconds = run_demo_error(capsys, monkeypatch, tmp_path / "w",
                                 "Experiment.target_checkpoint = 'gs://no-such-bucket-7/target'")
  assert line == ("error: checkpoint directory gs://no-such-bucket-7/target: the bucket "
                  "gs://no-such-bucket-7 does not exist (or cannot be listed)")
  assert seconds < 30


def test_unreachable_endpoint(gcs, capsys, monkeypatch, tmp_path):
  port = free_port()  # closed: nothing listens there
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{port}")
  line, seconds = run_demo_error(capsys, monkeypatch, tmp_path / "w",
                                 f"Experiment.vocab_path = '{gcs}/unreachable/spm.model'")
  assert line.startswith(f"error: {gcs}/unreachable/spm.model: cannot reach the Cloud Storage "
                         f"emulator at http://127.0.0.1:{port} (STORAGE_EMULATOR_HOST="
                         f"127.0.0.1:{port}): is it running?"), line
  assert seconds < 15


def test_refused_access(monkeypatch):
  """A server that answers 401 to everything, as Cloud Storage does to a caller
  without credentials on a private bucket."""
  import http.server
  import threading

  class Refuse(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # pylint: disable=invalid-name
      body = b'{"error": {"code": 401, "message": "Anonymous caller does not have access."}}'
      self.send_response(401)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      del args

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    for name in DERIVED:
      monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{server.server_address[1]}")
    with pytest.raises(storage.StorageAccessError) as e:
      data.get_vocabulary("gs://private-bucket/vocab/spm.model")
    assert str(e.value).startswith("gs://private-bucket/vocab/spm.model: Cloud Storage refused "
                                   "access (PERMISSION_DENIED: Anonymous caller does not have "
                                   "access.;")
    assert "\n" not in str(e.value)
  finally:
    server.shutdown()


def test_distill_script_fails_fast_when_unreachable(tmp_path):
  """The script that once hung for minutes on gs:// paths without a network."""
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k not in DERIVED}
  env.update(STORAGE_EMULATOR_HOST=f"127.0.0.1:{port}", JAX_PLATFORMS="cpu",
             PYTHONPATH=str(REPO))
  url = f"gs://{BUCKET}/distill"
  start = time.monotonic()
  res = subprocess.run(
      [sys.executable, "scripts/distill_draft.py", f"--target_checkpoint={url}/target",
       f"--draft_checkpoint={url}/draft", f"--vocab_path={url}/spm.model",
       f"--source={url}/train.tsv", f"--output_dir={tmp_path / 'out'}",
       f"--workdir={tmp_path / 'work'}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - start
  assert res.returncode != 0
  last = res.stderr.strip().splitlines()[-1]
  # The first gs:// file it reads (whichever that is) names itself and the endpoint.
  assert re.match(rf"distill_draft.py: error: {url}/[\w./]+: cannot reach the Cloud Storage "
                  rf"emulator at http://127.0.0.1:{port} ", last), res.stderr[-2000:]
  assert elapsed < 60
