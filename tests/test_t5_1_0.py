"""Table 2 with the public T5 1.0 checkpoints (configs/table2_t5_1_0/): the
rows as parsed, the T5 1.0 layout (ReLU MLP, tied embedding, logits scaled
by 1/sqrt(d_model), no logits_dense) read from T5X and Hugging Face files, and
one row run end to end from a local TSV through its task prefix."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_fixtures import write_t5x_legacy

from specdec_jax import data, run
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.checkpoints import load_checkpoint
from specdec_jax.checkpoints.common import flatten, unflatten
from specdec_jax.models import t5
from specdec_jax.models.t5 import T5Config, T5Model, param_shapes

from lab.hf_export import export_hf

REPO = Path(__file__).resolve().parent.parent
ROWS = REPO / "configs" / "table2_t5_1_0"
T5X = "gs://t5-data/pretrained_models/t5x"
# T5X's docs/models.md ("T5 Checkpoints"): the step differs by size.
CHECKPOINTS = {"small": f"{T5X}/t5_small/checkpoint_1000000",
               "base": f"{T5X}/t5_base/checkpoint_999900",
               "large": f"{T5X}/t5_large/checkpoint_1000700"}
TARGET = f"{T5X}/t5_11B/checkpoint_1000000"
GAMMAS = {("ende", "small", 0): 7, ("ende", "base", 0): 7, ("ende", "large", 0): 7,
          ("ende", "small", 1): 7, ("ende", "base", 1): 5, ("ende", "large", 1): 3,
          ("cnndm", "small", 0): 5, ("cnndm", "base", 0): 5, ("cnndm", "large", 0): 3,
          ("cnndm", "small", 1): 5, ("cnndm", "base", 1): 3, ("cnndm", "large", 1): 3}
TASKS = {"ende": ("wmt_ende", "seqio:specdec_wmt_ende"),
         "cnndm": ("cnn_dailymail", "seqio:specdec_cnn_dailymail")}
TINY = T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=48, version="1.0")
TINY_DRAFT = TINY.replace(num_encoder_layers=1, num_decoder_layers=1)
WORDS = ("translate English to German the house is small a cat sat on mat we go home "
         "today it was good and they said yes").split()


def test_rows_parse():
  """All 12 rows: the γ of configs/table2's row, T, presets, prefix, public paths."""
  rows = sorted(p for p in ROWS.glob("*.gin"))
  assert len(rows) == 12
  for (task, size, temp), gamma in GAMMAS.items():
    path = ROWS / f"t5_1_0_{task}_{size}_t{temp}.gin"
    exp = run.parse_config([str(path)], [])
    exp.validate()
    paper_row = run.parse_config([str(REPO / "configs" / "table2" /
                                      f"{task}_{size}_t{temp}.gin")], [])
    assert exp.gamma == paper_row.gamma == gamma, path.name
    assert exp.sampling.temperature == float(temp)
    assert (exp.task, exp.source) == TASKS[task]
    assert exp.prefix == data.PREFIXES[exp.task]
    assert (exp.target_preset, exp.draft_preset) == ("t5_11b", f"t5_{size}")
    assert (exp.target_checkpoint, exp.draft_checkpoint) == (TARGET, CHECKPOINTS[size])
    assert exp.vocab_path == "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"
    assert exp.vocab_extra_ids == 0
    assert exp.labels == ("T5 1.0 11B", f"T5 1.0 {size}")
    assert (exp.max_input_len, exp.num_examples, exp.batch_size) == (
        paper_row.max_input_len, paper_row.num_examples, 1)


@pytest.mark.parametrize("name", ["t5_small", "t5_base", "t5_large", "t5_3b", "t5_11b"])
def test_presets_are_t5_1_0(name):
  """T5X's t5_1_0 gin files: ReLU MLP (mlp/wi), logits via the embedding."""
  c = t5.PRESETS[name]
  assert (c.version, c.gated, c.logits_via_embedding, c.vocab_size) == ("1.0", False, True,
                                                                         32128)
  names = set(flatten(param_shapes(c.replace(num_encoder_layers=1, num_decoder_layers=1))))
  assert "decoder/logits_dense/kernel" not in names
  assert {"encoder/layers_0/mlp/wi/kernel", "decoder/layers_0/mlp/wi/kernel"} <= names
  assert "encoder/layers_0/mlp/wi_0/kernel" not in names


def random_params(config: T5Config, seed: int) -> dict:
  """Random weights of ``config``'s tree, drawn with numpy (no compilation)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, leaf in flatten(param_shapes(config)).items():
    if name.endswith("/scale"):
      out[name] = np.ones(leaf.shape, np.float32)
    else:
      std = 1.0 if name == "token_embedder/embedding" else leaf.shape[0] ** -0.5
      out[name] = (std * rng.standard_normal(leaf.shape)).astype(np.float32)
  return unflatten(out)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """Tiny T5 1.0 target (T5X legacy) and draft (Hugging Face), a vocabulary, a TSV."""
  import sentencepiece as spm
  d = tmp_path_factory.mktemp("t5_1_0")
  rng = np.random.default_rng(0)
  lines = [" ".join(rng.choice(WORDS, size=rng.integers(4, 9))) for _ in range(300)]
  corpus = [f"translate English to German: {l}" for l in lines[:100]] + lines
  (d / "corpus.txt").write_text("\n".join(corpus) + "\n")
  spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "spm"),
                                 vocab_size=40, model_type="unigram", pad_id=0, eos_id=1,
                                 unk_id=2, bos_id=-1, minloglevel=2)
  target, draft = random_params(TINY, 0), random_params(TINY_DRAFT, 1)
  expected = write_t5x_legacy(str(d / "t5x" / "checkpoint_100"), target)
  export_hf(draft, TINY_DRAFT, str(d / "hf"))
  rows = ["id\tinput\treference"] + [f"ex{i}\t{lines[i]}\t{lines[i + 1]}" for i in range(8)]
  (d / "data.tsv").write_text("\n".join(rows) + "\n")
  (d / "row.gin").write_text(f"""
include 'configs/table2_t5_1_0/t5_1_0_ende_small_t0.gin'
TARGET_CHECKPOINT = '{d / "t5x" / "checkpoint_100"}'
DRAFT_SMALL_CHECKPOINT = '{d / "hf"}'
DRAFT_FORMAT = 'hf'
VOCAB_PATH = '{d / "spm.model"}'
Experiment.source = '{d / "data.tsv"}'
Experiment.target_preset = 'tiny_t5_1_0'
Experiment.draft_preset = 'tiny_t5_1_0_draft'
Experiment.max_input_len = 32
Experiment.max_decode_len = 10
Experiment.num_warmup = 1
Experiment.num_examples = 3
Experiment.batch_size = 4
Experiment.dtype = 'float32'
Experiment.param_dtype = 'float32'
""")
  return d, expected


@pytest.fixture
def tiny_presets(monkeypatch):
  monkeypatch.setitem(t5.PRESETS, "tiny_t5_1_0", TINY)
  monkeypatch.setitem(t5.PRESETS, "tiny_t5_1_0_draft", TINY_DRAFT)


def test_t5x_layout_and_logit_scaling(env):
  """The T5X T5 1.0 tree (no logits_dense) loads as written; logits are the
  final hidden states through the embedding, divided by sqrt(d_model)."""
  d, expected = env
  params, config = load_checkpoint(str(d / "t5x" / "checkpoint_100"), fmt="auto", config=TINY)
  got = {k: np.asarray(v) for k, v in flatten(params).items()}
  want = flatten(expected)
  assert set(got) == set(want) and "decoder/logits_dense/kernel" not in got
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  inputs = jnp.array([[5, 6, 7, 1]], jnp.int32)
  forward = jax.jit(lambda p, x, y: T5Model(config)(p, x, y, return_hidden=True))
  logits, hidden = forward(params, inputs, jnp.array([[0, 9, 4]], jnp.int32))
  emb = params["token_embedder"]["embedding"]
  np.testing.assert_allclose(logits, hidden @ emb.T / np.sqrt(TINY.d_model), rtol=1e-5,
                             atol=1e-5)


def test_row_decodes_through_the_prefix(env, tiny_presets):
  """configs/table2_t5_1_0's EnDe row on a local TSV, set up by the runner: the
  inputs are tokenized with 'translate English to German: ' in front; the T5X
  target and the Hugging Face draft load with their presets; at T=0 the
  speculative output is the baseline's, token for token."""
  d, _ = env
  exp = run.parse_config([str(d / "row.gin")], [])
  assert exp.prefix == "translate English to German: " and exp.source.endswith(".tsv")
  run.check_before_loading(exp, False)
  loaded = run.load_data(exp)
  vocab = loaded.vocab
  prefix_ids = vocab.encode("translate English to German:")
  assert vocab.unk_id not in prefix_ids
  assert len(loaded.examples) == 4 and not loaded.truncated
  for ex, row in zip(loaded.examples, loaded.inputs):
    assert not ex.input.startswith("translate")  # the example holds the raw text
    want = vocab.encode("translate English to German: " + ex.input) + [vocab.eos_id]
    assert list(row[:len(want)]) == want and not row[len(want):].any()
    assert list(row[:len(prefix_ids)]) == prefix_ids
    assert vocab.decode(row).startswith("translate English to German: ")

  setup = run.load_models(exp, loaded)
  assert setup.target.config == TINY and setup.draft.model.config == TINY_DRAFT
  kw = dict(max_decode_len=exp.max_decode_len, sampling=exp.sampling, eos_id=1)
  key = jax.random.PRNGKey(0)
  base = temperature_sample(setup.target, setup.target_params, loaded.inputs, key, **kw)
  spec = speculative_decode(setup.target, setup.target_params, setup.draft, loaded.inputs,
                            key, gamma=exp.gamma, **kw)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(base.tokens))
  assert exp.gamma == 7 and np.asarray(base.length).min() > 1
