"""What every parallel-corpus source is (:class:`Source`, read by :mod:`mtcli.data.sources`'
kinds of source) and the errors of reading one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mtcli.data.arrowrows import BlockReader
from mtcli.errors import DataError
from mtcli.fileio import FileHasher

Pair = tuple[str, str]


def single_line(text: str) -> str:
    """Make a sentence safe for one line: inner CR/LF (from hub rows or stray CRs) become spaces."""
    if "\r" in text or "\n" in text:
        text = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return text


class MissingSplitError(DataError):
    """A source has no split of that name (the message lists the splits it has)."""


class Source:
    """A parallel corpus: named splits, each a stream of (source, target) sentence pairs."""

    kind = "?"

    def __init__(self, location: str, src_lang: str, tgt_lang: str) -> None:
        self.location = location
        self.src_lang = src_lang
        self.tgt_lang = tgt_lang

    def describe(self) -> str:
        """Short human description, e.g. ``text directory ../shared/data/multi30k``."""
        return f"{self.kind} source {self.location}"

    def splits(self) -> list[str]:
        """Names of the splits this source holds (sorted)."""
        raise NotImplementedError

    def check(self, splits: Iterable[str]) -> None:
        """Raise :class:`DataError` if a split or a language is missing, listing what exists."""
        raise NotImplementedError

    def pairs(self, split: str) -> Iterator[Pair]:
        """Stream the (source, target) pairs of ``split`` in corpus order."""
        raise NotImplementedError

    def num_pairs(self, split: str) -> int | None:
        """How many pairs ``split`` holds when that is known without reading it; else None."""
        return None

    def verbatim_pairs(self, split: str) -> Iterator[Pair]:
        """The pairs of a validation or test split, which keeps every line: as :meth:`pairs`,
        but a line that cannot be read as a pair raises :class:`DataError` naming it, where
        :meth:`pairs` gives an empty pair (that cleaning drops from a training split)."""
        return self.pairs(split)

    def text_blocks(self, split: str) -> Iterator[tuple[bytes, bytes]]:
        """The pairs of ``split`` in blocks, as the UTF-8 text of the two sides (one line a pair,
        by the rules of :meth:`pairs`), for sources that can make them without a Python loop
        (those whose :meth:`num_pairs` or :meth:`block_file_bytes` is known)."""
        raise NotImplementedError

    def block_file_bytes(self, split: str) -> int | None:
        """The size of the one file :meth:`text_blocks` cuts into blocks itself, the file of
        both sides (a ``.tsv``), so a large one is cleaned by several processes; else None."""
        return None

    def block_readers(self, split: str) -> list[BlockReader] | None:
        """:meth:`text_blocks` cut into parts that another process can read on its own, in
        order, for sources whose files can be read from any place (parquet's row groups, a
        dataset's Arrow files); else None. A worker then reads and converts its part itself, in
        parallel with the others."""
        return None

    def plain_files(self, split: str) -> tuple[Path, Path] | None:
        """The (source, target) files of ``split`` when they are uncompressed text that a
        reader may cut into byte ranges (:func:`mtcli.data.cleaning.clean_text_files`); else None."""
        return None

    def fingerprint(self, splits: Iterable[str], hasher: FileHasher | None = None) -> dict[str, Any]:
        """What identifies the input of ``splits``: the sha256 of each of its files by name
        (a hub source: its id and fingerprints); ``hasher`` may reuse a previous build's digests."""
        hasher = hasher or FileHasher()
        return {"kind": self.kind, "files": hasher.many((path, name) for name, path in self._input_files(splits))}

    def _input_files(self, splits: Iterable[str]) -> Iterator[tuple[str, Path]]:
        """``(name, path)`` of every file ``splits`` are read from."""
        raise NotImplementedError

    def _missing_split(self, split: str) -> MissingSplitError:
        found = ", ".join(self.splits()) or "none"
        return MissingSplitError(f"{self.describe()}: no split '{split}' (found splits: {found})")


def mismatch_error(src_path: Path, src_n: int, tgt_path: Path, tgt_n: int) -> DataError:
    """The one-line error for the two sides of a split having different line counts."""
    return DataError(f"line counts differ: {src_path} has {src_n} lines but {tgt_path} has {tgt_n} lines")


__all__ = ["MissingSplitError", "Pair", "Source", "mismatch_error", "single_line"]
