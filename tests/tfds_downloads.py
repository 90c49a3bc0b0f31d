"""TensorFlow Datasets' downloads of WMT EnDe and CNN/DailyMail served from
tiny local files, so that TFDS's real builders (``wmt_t2t_translate/de-en``
1.0.0, ``cnn_dailymail`` 3.4.0: the names and versions the seqio tasks read)
run their own split and generate code on them without the network.

``write_sources(folder)`` writes one tiny file per URL the two builders fetch
(the same archive layout and file formats as the real ones: tar.gz archives
of parallel text and SGML for WMT, story files and URL lists for CNN/DM) and
returns {url: file}. ``serve(files)`` then routes TFDS's downloads of exactly
those URLs to the files, at the only two places TFDS meets the outside:

* the HTTP transport (``requests``' ``HTTPAdapter.send``): a served URL gets
  a 200 response with the file's bytes (a Google Drive URL with the
  ``Content-Disposition`` a real Drive download carries); any other URL is a
  ``ConnectionError`` naming it (nothing reaches the network);
* the checksum registry: TFDS validates every download against the size and
  sha256 registered for its URL; the served files' own are registered in
  their place (``DownloadManager(url_infos=...)``), so validation still runs.

Everything between (the download manager's caching and naming, extraction,
each builder's ``_split_generators`` and ``_generate_examples``, the TFRecord
writer, ``dataset_info.json``) is TFDS's own code. ``install_from_env()``
does the same in a subprocess (tests/tpu_page_env/sitecustomize.py), reading
the files from the JSON file named by ``SERVE_ENV``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import io
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Callable

SERVE_ENV = "SPECDEC_TEST_TFDS_DOWNLOADS"

STATMT = "http://www.statmt.org/wmt13"
WMT_URLS = {
  "commoncrawl": f"{STATMT}/training-parallel-commoncrawl.tgz",
  "europarl": f"{STATMT}/training-parallel-europarl-v7.tgz",
  "news_commentary": "http://data.statmt.org/wmt18/translation-task/training-parallel-nc-v13.tgz",
  "dev": "http://data.statmt.org/wmt19/translation-task/dev.tgz",
}
DRIVE = "https://drive.google.com/uc?export=download&id="
URL_LISTS = "https://raw.githubusercontent.com/abisee/cnn-dailymail/master/url_lists"
CNN_URLS = {
  "cnn_stories": f"{DRIVE}0BwmD_VLjROrfTHk4NFg2SndKcjQ",
  "dm_stories": f"{DRIVE}0BwmD_VLjROrfM1BxdkxVaTY2bWs",
  "train_urls": f"{URL_LISTS}/all_train.txt",
  "val_urls": f"{URL_LISTS}/all_val.txt",
  "test_urls": f"{URL_LISTS}/all_test.txt",
}
# The file name a Google Drive download carries (Content-Disposition).
DRIVE_NAMES = {CNN_URLS["cnn_stories"]: "cnn_stories.tgz",
               CNN_URLS["dm_stories"]: "dailymail_stories.tgz"}

# A tiny parallel language: English words and their "German" counterparts.
EN = ("the a house cat dog is was small big old new on in mat garden we they see go "
      "home today").split()
DE = ("das ein haus katze hund ist war klein gross alt neu auf im matte garten wir sie "
      "sehen gehen heim heute").split()
TO_DE = dict(zip(EN, DE))
# Examples per split (the test split is what the runner reads).
SIZES = {"train": 3, "validation": 2, "test": 12}


def english(i: int, n: int = 6) -> str:
  """The i-th tiny English sentence (deterministic, ``n`` words)."""
  return " ".join(EN[(i * 7 + 3 * k + k * k) % len(EN)] for k in range(n))


def german(text: str) -> str:
  return " ".join(TO_DE[w] for w in text.split())


def wmt_pairs(split: str) -> list[tuple[str, str]]:
  """(en, de) pairs of a WMT split as written into the sources (train: the
  pairs of each of its three corpora, in the order commoncrawl, europarl,
  news commentary)."""
  base = {"train": 0, "validation": 100, "test": 200}[split]
  count = SIZES[split] * (3 if split == "train" else 1)
  return [(english(base + i), german(english(base + i))) for i in range(count)]


def cnn_story(i: int) -> tuple[str, str]:
  """(article, highlights) of the i-th tiny story, as the builder yields them."""
  sentences = [english(i * 5 + k, 5 + k % 3) for k in range(3)]
  return " ".join(s + "." for s in sentences), english(i * 5 + 4, 4) + "."


def _tgz(path: Path, members: dict[str, str]) -> None:
  with tarfile.open(path, "w:gz") as tar:
    for name, text in members.items():
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size, info.mtime = len(data), 0
      tar.addfile(info, io.BytesIO(data))


def _sgm(lang: str, sentences: list[str]) -> str:
  segs = "\n".join(f'<seg id="{i + 1}">{s}</seg>' for i, s in enumerate(sentences))
  return (f'<srcset setid="newstest2014" srclang="any">\n<doc sysid="ref" docid="d1" '
          f'genre="news" origlang="{lang}">\n<p>\n{segs}\n</p>\n</doc>\n</srcset>\n')


def story_url(publisher: str, i: int) -> str:
  return f"http://www.{publisher}.com/story/{i}"


def write_sources(folder: Path) -> dict[str, Path]:
  """One tiny file per URL the two builders download; returns {url: file}."""
  folder.mkdir(parents=True, exist_ok=True)
  files: dict[str, Path] = {}
  train = wmt_pairs("train")
  parts = [train[k * SIZES["train"]:(k + 1) * SIZES["train"]] for k in range(3)]
  lines = lambda pairs, j: "\n".join(p[j] for p in pairs) + "\n"  # noqa: E731
  layouts = {
    "commoncrawl": {"commoncrawl.de-en.de": lines(parts[0], 1),
                    "commoncrawl.de-en.en": lines(parts[0], 0)},
    "europarl": {"training/europarl-v7.de-en.de": lines(parts[1], 1),
                 "training/europarl-v7.de-en.en": lines(parts[1], 0)},
    "news_commentary": {
      "training-parallel-nc-v13/news-commentary-v13.de-en.de": lines(parts[2], 1),
      "training-parallel-nc-v13/news-commentary-v13.de-en.en": lines(parts[2], 0)},
    "dev": {"dev/newstest2013.de": lines(wmt_pairs("validation"), 1),
            "dev/newstest2013.en": lines(wmt_pairs("validation"), 0),
            "dev/newstest2014-deen-src.de.sgm": _sgm("de", [d for _, d in wmt_pairs("test")]),
            "dev/newstest2014-deen-ref.en.sgm": _sgm("en", [e for e, _ in wmt_pairs("test")])},
  }
  for key, members in layouts.items():
    path = folder / WMT_URLS[key].rsplit("/", 1)[1]
    _tgz(path, members)
    files[WMT_URLS[key]] = path

  stories = {"cnn": {}, "dailymail": {}}
  url_lists = {"train": [], "validation": [], "test": []}
  n = 0
  for split, count in SIZES.items():
    for k in range(count):
      publisher = ("cnn", "dailymail")[k % 2]
      url = story_url(publisher, n)
      article, highlights = cnn_story(n)
      name = hashlib.sha1(url.encode()).hexdigest() + ".story"
      body = article.replace(". ", ".\n\n") + f"\n\n@highlight\n\n{highlights}\n"
      stories[publisher][f"{publisher}/stories/{name}"] = body
      url_lists[split].append(url)
      n += 1
  _tgz(folder / "cnn_stories.tgz", stories["cnn"])
  _tgz(folder / "dailymail_stories.tgz", stories["dailymail"])
  files[CNN_URLS["cnn_stories"]] = folder / "cnn_stories.tgz"
  files[CNN_URLS["dm_stories"]] = folder / "dailymail_stories.tgz"
  for key, split in (("train_urls", "train"), ("val_urls", "validation"),
                     ("test_urls", "test")):
    path = folder / CNN_URLS[key].rsplit("/", 1)[1]
    path.write_text("\n".join(url_lists[split]) + "\n")
    files[CNN_URLS[key]] = path
  return files


def cnn_examples(split: str) -> list[tuple[str, str]]:
  """(article, highlights) of a CNN/DM split, in the order they were written."""
  start = {"train": 0, "validation": SIZES["train"],
           "test": SIZES["train"] + SIZES["validation"]}[split]
  return [cnn_story(start + k) for k in range(SIZES[split])]


# --------------------------------------------------------------------------- serving


def _response(request, path: Path):
  import requests  # pylint: disable=g-import-not-at-top
  from requests.structures import CaseInsensitiveDict  # pylint: disable=g-import-not-at-top
  data = path.read_bytes()
  response = requests.Response()
  response.status_code, response.reason = 200, "OK"
  response.url, response.request = request.url, request
  response.raw = io.BytesIO(data)
  headers = {"Content-Length": str(len(data)), "Content-Type": "application/octet-stream"}
  if request.url in DRIVE_NAMES:
    headers["Content-Disposition"] = f'attachment; filename="{DRIVE_NAMES[request.url]}"'
  response.headers = CaseInsensitiveDict(headers)
  return response


def _patch_requests(files: dict[str, Path]) -> Callable[[], None]:
  from requests import adapters, exceptions  # pylint: disable=g-import-not-at-top
  original = adapters.HTTPAdapter.send

  def send(self, request, *args, **kwargs):
    del self, args, kwargs
    if request.url in files:
      return _response(request, files[request.url])
    raise exceptions.ConnectionError(f"{request.url}: not served by the test (no network)")

  adapters.HTTPAdapter.send = send
  return lambda: setattr(adapters.HTTPAdapter, "send", original)


def _patch_checksums(files: dict[str, Path]) -> Callable[[], None]:
  from tensorflow_datasets.core.download import (checksums,  # pylint: disable=g-import-not-at-top
                                                 download_manager)
  infos = {url: checksums.compute_url_info(path) for url, path in files.items()}
  cls = download_manager.DownloadManager
  original = cls.__init__

  def init(self, *args, url_infos=None, **kwargs):
    original(self, *args, url_infos={**(url_infos or {}), **infos}, **kwargs)

  cls.__init__ = init
  return lambda: setattr(cls, "__init__", original)


def serve(files: dict[str, Path]) -> Callable[[], None]:
  """Routes TFDS's downloads of ``files``' URLs to the files (in this
  process); returns the function that undoes it."""
  undo = [_patch_requests(files), _patch_checksums(files)]
  return lambda: [u() for u in reversed(undo)]


class _AfterImport(importlib.abc.MetaPathFinder):
  """Runs ``hooks[name](module)`` right after module ``name`` is first imported."""

  def __init__(self, hooks: dict[str, Callable]):
    self.hooks = hooks

  def find_spec(self, name, path, target=None):
    if name not in self.hooks:
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(name, path, target)
      if spec is not None:
        break
    else:
      return None
    hook, exec_module = self.hooks.pop(name), spec.loader.exec_module

    def exec_then_hook(module):
      exec_module(module)
      hook(module)

    spec.loader.exec_module = exec_then_hook
    return spec


def after_import(hooks: dict[str, Callable]) -> None:
  """Each ``hooks[name](module)`` once module ``name`` is imported (now, if it is)."""
  pending = {}
  for name, hook in hooks.items():
    if name in sys.modules:
      hook(sys.modules[name])
    else:
      pending[name] = hook
  if pending:
    sys.meta_path.insert(0, _AfterImport(pending))


def install_from_env() -> None:
  """In a subprocess: serve the files of the JSON file ``$SERVE_ENV`` names
  ({url: path}) once requests and TFDS's download manager are imported."""
  if not os.environ.get(SERVE_ENV):
    return
  files = {url: Path(p) for url, p in json.loads(Path(os.environ[SERVE_ENV]).read_text()).items()}
  after_import({
    "requests.adapters": lambda _: _patch_requests(files),
    "tensorflow_datasets.core.download.download_manager": lambda _: _patch_checksums(files),
  })
