"""How a text directory's file names are read (:class:`mtcli.data.sources.TextDirSource`).

A file is one of:

- ``<split>.<lang>[.gz]``: one side of a split, a sentence a line;
- ``<split>.<l1>-<l2>.tsv[.gz]``: both sides of a split (:mod:`mtcli.data.tsv`);
- ``<split>.tmx[.gz]``: a translation memory (:mod:`mtcli.data.tmx`).

Other compressions (``.xz``, ``.bz2``, ``.zst``...) are not read, and said so. The extensions
``.gz``, ``.tsv`` and ``.tmx`` are read in any case (``train.TMX``, as some
Windows tools write them; the split and language codes are as written). A name whose last part
is a file format rather than a language (``val.tsv``, ``val.de-en.csv``, ``train.de.txt``) is not
read: :func:`misnamed` says how to name it, so that an error about a missing split or language
can say why the file beside it is not the one looked for.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# ``<split>.<l1>-<l2>.tsv``: both sides of a split in one file
_TABLE_NAME = re.compile(r"(?P<split>.+)\.(?P<first>[^.\-]+)-(?P<second>[^.\-]+)\.tsv")

#: Last parts of a name that are a file format, not a language: such a file is not a side.
FORMATS = frozenset({"tsv", "csv", "txt", "text", "json", "jsonl", "xml", "xlsx", "html", "parquet", "arrow",
                     "tmx", "xliff", "xlf", "sgm", "yaml", "yml", "md", "log"})
#: Compressions a download may come in that are not read (``.gz`` is), and how to undo each.
UNREAD_COMPRESSIONS = {"xz": "xz -dk", "bz2": "bzip2 -dk", "zst": "zstd -d", "lz4": "lz4 -d", "lzma": "xz -dk",
                       "zip": "unzip", "7z": "7z x"}


class FileName(NamedTuple):
    """What a file name means: ``kind`` is ``side`` (``split``, ``langs`` = (lang,)),
    ``table`` (``split``, ``langs`` = the columns' languages in order), ``memory``
    (``split``, no ``langs``), or ``other`` (not a file of the directory's corpus)."""

    kind: str
    split: str
    langs: tuple[str, ...]


def _canonical(name: str) -> str:
    """``name`` without a ``.gz`` (any case), its ``.tsv`` or ``.tmx`` written in lower case."""
    if name.lower().endswith(".gz"):
        name = name[:-3]
    head, dot, ext = name.rpartition(".")
    return f"{head}.{ext.lower()}" if dot and ext.lower() in ("tsv", "tmx") else name


def read_name(name: str, src_lang: str, tgt_lang: str) -> FileName:
    """What the file ``name`` holds for a corpus of ``src_lang`` and ``tgt_lang`` (either
    direction): the configured languages are looked for first in a ``.tsv`` name, so codes with
    a hyphen (``en-zh-Hant``) are read too."""
    name = _canonical(name)
    if name.endswith(".tmx") and len(name) > 4:
        return FileName("memory", name[:-4], ())
    for langs in ((src_lang, tgt_lang), (tgt_lang, src_lang)):
        if name.endswith(suffix := f".{langs[0]}-{langs[1]}.tsv") and len(name) > len(suffix):
            return FileName("table", name[:-len(suffix)], langs)
    if table := _TABLE_NAME.fullmatch(name):
        return FileName("table", table["split"], (table["first"], table["second"]))
    split, dot, lang = name.rpartition(".")
    if not (dot and split and lang) or lang.lower() in FORMATS or lang.lower() in UNREAD_COMPRESSIONS:
        return FileName("other", "", ())
    return FileName("side", split, (lang,))


def misnamed(name: str, langs: tuple[str, str]) -> str | None:
    """How to name ``name`` for mtcli to read it, when it looks like a corpus file of the
    languages ``langs`` named another way (``val.tsv``, ``val.de-en.csv``, ``train.de.txt``);
    else None."""
    stem, _, ext = _canonical(name).rpartition(".")
    ext = ext.lower()
    if stem and ext in UNREAD_COMPRESSIONS:
        return (f"{name} is not read: mtcli reads plain text and .gz, not .{ext}; decompress it first "
                f"({UNREAD_COMPRESSIONS[ext]} {name}), or gzip it")
    head, _, last = stem.rpartition(".")
    split = head if head and re.fullmatch(r"[A-Za-z]{2,3}_?[A-Za-z]{2,3}", last) else stem  # (val.de_en, val.deen)
    table = stem if _TABLE_NAME.fullmatch(f"{stem}.tsv") else f"{split}.{langs[0]}-{langs[1]}"
    if stem and "-" not in stem.rpartition(".")[2] and ext == "tsv":  # (train.en-zh-Hant.tsv: another pair's)
        return f"{name} is not read: a .tsv is named <split>.<l1>-<l2>.tsv (e.g. {table}.tsv)"
    if stem and ext == "csv":
        return (f"{name} is not read: both sides in one file are a tab-separated <split>.<l1>-<l2>.tsv "
                f"(e.g. {table}.tsv)")
    if ext in ("txt", "text") and "." in stem:
        return f"{name} is not read: one side of a split is named <split>.<lang> (e.g. {stem})"
    return None
