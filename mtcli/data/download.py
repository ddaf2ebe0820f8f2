"""Public corpora that recipes name, fetched once into a local cache and verified.

A recipe's ``data.source`` may name a corpus mtcli knows (:data:`CORPORA`: ``multi30k``,
``wmt-news-en-de``) instead of a directory. :func:`locate` turns that name into a directory of
``<split>.<lang>`` files:

1. a local copy wins and is never modified: ``../shared/data/<name>`` beside the working
   directory, when it exists (any other directory is passed as ``data.source`` itself);
2. otherwise the download cache, ``$MTCLI_DATA/<name>`` or ``data/raw/<name>``: a file there was
   verified before it was renamed into place, and is verified again before each use (a few
   milliseconds a megabyte), so it is never fetched again unless it changed;
3. otherwise each missing file is downloaded from its pinned URL (gzipped ones unpacked on the
   fly, several parts joined in order) into a temporary name, its size and sha256 checked, and
   only then renamed. A failed or cut transfer, or a wrong checksum, leaves nothing behind and
   raises one :class:`DataError` naming the URL and what to do instead.

Every URL is ``$MTCLI_DATA_URL`` (default :data:`BASE_URL`) plus a pinned path, so a mirror or
a test server can stand in for the public hosts; the official WMT14 subset comes through
sacreBLEU's own downloader. The sha256 and sizes are those of the
unpacked text mtcli's results were computed on.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from mtcli.errors import DataError, one_line
from mtcli.fileio import atomic_write, sha256_file
from mtcli.logs import get_logger

#: Where the pinned paths live; ``$MTCLI_DATA_URL`` replaces it (a mirror, or a test server).
BASE_URL = "https://raw.githubusercontent.com/"
#: Local copies tried before the cache, relative to the working directory.
LOCAL_COPIES = (Path("../shared/data"),)
TIMEOUT_S = 60.0
# a download's temporary file untouched for a day was left by a killed download (a live one
# writes a chunk of it at least every few minutes, even on a slow link)
STALE_S = 86_400.0

_MULTI30K = "multi30k/dataset/master/data/task1/raw/"
_TESTSETS = "Helsinki-NLP/OPUS-MT-testsets/master/testsets/en-de/"


@dataclass(frozen=True)
class PublicFile:
    """One ``<split>.<lang>`` file of a corpus: the URL paths whose (gunzipped) bytes, joined
    in order, make it, and the size and sha256 of the result."""

    name: str
    parts: tuple[str, ...]
    size: int
    sha256: str


def _multi30k(split: str, lang: str, size: int, sha256: str) -> PublicFile:
    return PublicFile(f"{split}.{lang}", (f"{_MULTI30K}{split}.{lang}.gz",), size, sha256)


# WMT news training text: these test sets joined in this order (newstest2013 is val, 2014 test).
_NEWS_TRAIN = ("news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011",
               "newstest2012", "newstest2015-ende", "newstest2016-ende", "newstest2017-ende",
               "newstest2018-ende", "newstest2019-ende")

#: The corpora a recipe may name as ``data.source``, file by file.
CORPORA: dict[str, tuple[PublicFile, ...]] = {
    # Multi30k task 1 (WMT16 multimodal), from the multi30k/dataset repository
    "multi30k": (
        _multi30k("train", "en", 1801238, "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6"),
        _multi30k("train", "de", 2110398, "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72"),
        _multi30k("train", "fr", 2111303, "5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d"),
        _multi30k("train", "cs", 1755283, "2be68b38c8d586ff4f54eb13cc6e1baaaa053695b3f070d3038303a47f2268da"),
        _multi30k("val", "en", 63297, "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227"),
        _multi30k("val", "de", 75981, "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660"),
        _multi30k("val", "fr", 73924, "5304e444d842e962b2dda4d816b70b22a1765b15401642b7ca37a67477e708dc"),
        _multi30k("val", "cs", 60213, "d53827e469b0a1ca8d57e9e26b2b64c4bc4b33f5479c7b03ae87ae5c882c3e33"),
        _multi30k("test_2016_flickr", "en", 62076, "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182"),
        _multi30k("test_2016_flickr", "de", 70649, "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16"),
        _multi30k("test_2016_flickr", "fr", 72261, "cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6"),
        _multi30k("test_2016_flickr", "cs", 62364, "45adb85f688de8407fddcbe1b36dca15d12aab868149b337e2576f2d6d2ff8d8"),
    ),
    # WMT English-German news test sets, from the Helsinki-NLP/OPUS-MT-testsets repository
    "wmt-news-en-de": (
        PublicFile("train.en", tuple(f"{_TESTSETS}{n}.en" for n in _NEWS_TRAIN), 3295690,
                   "75a0ae66446a5cc29e64117a85438453ccc93b719e0b00c0b9f48fd3a14d6e87"),
        PublicFile("train.de", tuple(f"{_TESTSETS}{n}.de" for n in _NEWS_TRAIN), 3738695,
                   "b4bab62b0b1fba135f96263d67aa80e491a86279baa6c415f0a29df6b58847b1"),
        PublicFile("newstest2013.en", (f"{_TESTSETS}newstest2013.en",), 332974,
                   "ace268a1d9724ca76f6d8e5c720ffdc08f01bdce45630ed8b269dc7918e1c16e"),
        PublicFile("newstest2013.de", (f"{_TESTSETS}newstest2013.de",), 385433,
                   "d7ea35ab91ff3709e03ad9cb6bf5b4f2cc775cd2d72efd5254c4aec5e69663ca"),
        PublicFile("newstest2014.en", (f"{_TESTSETS}newstest2014-ende.en",), 359898,
                   "7294bccf2879a97b3706b95c9595f1459617a8ee7130d5d8581c910e69736971"),
        PublicFile("newstest2014.de", (f"{_TESTSETS}newstest2014-ende.de",), 399406,
                   "ae5d110486bc33d7175e9e28c7d0051eb3e5fcd2166dd93371089852c091a20e"),
        # the 2,737-line official subset, which sacreBLEU calls wmt14
        PublicFile("newstest2014-filtered.en", ("sacrebleu:wmt14:en-de:src",), 329121,
                   "aed1e1cb6788f2575f729e0d7a55244a46236d14f902e7481bdbc7597ac85877"),
        PublicFile("newstest2014-filtered.de", ("sacrebleu:wmt14:en-de:ref",), 368143,
                   "695aa9a1aa6e41ef1d5ad79c8dd0b63bcc453f79670279e1a8c9007345d9302b"),
    ),
}


def cache_root() -> Path:
    """Where downloads go: ``$MTCLI_DATA`` when set, else ``data/raw`` (relative to the working directory)."""
    return Path(os.environ.get("MTCLI_DATA") or "data/raw").expanduser()


def base_url() -> str:
    """The URL the pinned paths are appended to (``$MTCLI_DATA_URL``, else :data:`BASE_URL`)."""
    url = os.environ.get("MTCLI_DATA_URL") or BASE_URL
    return url if url.endswith("/") else url + "/"


def _chunks(url: str) -> Iterator[bytes]:
    """The bytes at ``url``, gunzipped when the path ends in ``.gz``; a short read raises."""
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 - http(s) by construction
        expected = response.headers.get("Content-Length")
        stream = gzip.GzipFile(fileobj=response) if url.endswith(".gz") else response
        received = 0
        while chunk := stream.read(1 << 20):
            received += len(chunk)
            yield chunk
        if not url.endswith(".gz") and expected is not None and received != int(expected):
            raise HTTPException(f"transfer cut off after {received} of {expected} bytes")


def _sacrebleu_chunks(test_set: str, langpair: str, side: str) -> Iterator[bytes]:
    """The text of one side of a test set, through sacreBLEU's own downloader (into ``~/.sacrebleu``)."""
    from sacrebleu.dataset import DATASETS

    data = DATASETS[test_set]
    try:
        data.process_to_text(langpair)
        text = data.get_source_file(langpair) if side == "src" else data.get_reference_files(langpair)[0]
    except SystemExit:  # sacreBLEU exits when its download fails
        raise HTTPException("sacreBLEU could not download it") from None
    with open(text, "rb") as handle:
        while chunk := handle.read(1 << 20):
            yield chunk


def _source(part: str) -> tuple[str, Iterator[bytes]]:
    """Where a part comes from (its URL; for ``sacrebleu:TEST_SET:LANGPAIR:src|ref``, the archive
    sacreBLEU reads) and its bytes, fetched lazily."""
    if part.startswith("sacrebleu:"):
        from sacrebleu.dataset import DATASETS

        _, test_set, langpair, side = part.split(":")
        return DATASETS[test_set].data[0], _sacrebleu_chunks(test_set, langpair, side)
    url = base_url() + part
    return url, _chunks(url)


def _remove_stale_parts(path: Path) -> None:
    """Remove what a killed download of ``path`` left (its temporary file): one untouched for
    :data:`STALE_S` is no live download's."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > STALE_S:
                tmp.unlink()


def _fetch(file: PublicFile, path: Path, name: str) -> None:
    """Download ``file`` into ``path``: written under a temporary name, renamed once verified."""
    digest, size, url = hashlib.sha256(), 0, ""
    try:
        with atomic_write(path, "wb", encoding=None) as out:
            for part in file.parts:
                url, chunks = _source(part)
                for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            if (size, digest.hexdigest()) != (file.size, file.sha256):
                raise DataError(
                    f"{url}: the download does not match its pinned checksum ({size} bytes, sha256 "
                    f"{digest.hexdigest()[:12]}..., expected {file.size} bytes, {file.sha256[:12]}...); "
                    f"nothing was kept. {_instead(name)}"
                )
    except (urllib.error.URLError, HTTPException, OSError, EOFError, zlib.error) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise DataError(
            f"cannot download {url}: {one_line(reason) if isinstance(reason, BaseException) else reason}; "
            f"nothing was kept. Without internet, {_instead(name)}"
        ) from None


def unpinned(name: str, files: dict[str, str]) -> list[str]:
    """The names among ``files`` (file name: sha256) that are not corpus ``name``'s pinned text:
    another file, or one that corpus does not have."""
    pinned = {f.name: f.sha256 for f in CORPORA.get(name, ())}
    return [file for file, digest in files.items() if pinned.get(file) != digest]


def _instead(name: str) -> str:
    """What to do when corpus ``name`` cannot be downloaded: its files, and how each command is
    given them (make's ``DATA`` is Multi30k's)."""
    make = "make reproduce DATA=DIR" if name == "multi30k" else "make reproduce-wmt-news REPRODUCE_ARGS='--data DIR'"
    return (f"put its files ({', '.join(f.name for f in CORPORA.get(name, ()))}; those of the recipe's languages "
            f"are enough) in a directory DIR and pass --set data.source=DIR ({make}; mtcli reproduce --data DIR), "
            f"or in ../shared/data/{name}/ beside the checkout, where it is found; or put all those files themselves "
            f"(the same sha256) in DIR/{name}/ and set MTCLI_DATA=DIR")


def _verified(path: Path, file: PublicFile) -> bool:
    """Whether ``path`` holds ``file`` (its size, then its sha256)."""
    return path.is_file() and path.stat().st_size == file.size and sha256_file(path) == file.sha256


def _local_copy(name: str) -> Path | None:
    """The first of :data:`LOCAL_COPIES` holding corpus ``name``, if any."""
    return next((copy / name for copy in LOCAL_COPIES if (copy / name).is_dir()), None)


def located(name: str) -> Path | None:
    """Where :func:`locate` finds corpus ``name`` without downloading anything: a local copy, or
    the cache holding every file (by name); None when it would have to download."""
    root = cache_root() / name
    return _local_copy(name) or (root if all((root / f.name).is_file() for f in CORPORA[name]) else None)


def locate(name: str) -> Path:
    """The directory holding corpus ``name`` (see the module docstring): a local copy, the
    cache, or the cache after downloading what it lacks. Raises :class:`DataError`."""
    copy = _local_copy(name)
    if copy is not None:
        return copy
    root = cache_root() / name
    missing = [f for f in CORPORA[name] if not _verified(root / f.name, f)]
    if missing:
        log = get_logger()
        for file in missing:
            if (root / file.name).exists():  # a copy put there by hand, or one changed since
                log.warning("%s: not the pinned text of %s (its size or sha256 differs): downloading it again",
                            root / file.name, name)
        log.info("data.source %s: downloading %d file(s), %.1f MB of text, into %s", name, len(missing),
                 sum(f.size for f in missing) / 1e6, root)
        root.mkdir(parents=True, exist_ok=True)
        try:
            for file in missing:
                _remove_stale_parts(root / file.name)
                _fetch(file, root / file.name, name)
                log.info("  %s: %d bytes, sha256 verified", file.name, file.size)
        except DataError:
            with contextlib.suppress(OSError):  # a first download that failed: no empty directory left
                root.rmdir()
            raise
    return root


__all__ = ["BASE_URL", "CORPORA", "LOCAL_COPIES", "PublicFile", "base_url", "cache_root", "locate", "located"]
