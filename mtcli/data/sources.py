"""Parallel-corpus sources: where ``data.source`` points, read as (source, target) pairs.

A source is where ``data.source`` points; :func:`open_source` decides its kind from what is
there:

``text``
    a directory of ``<split>.<lang>`` plain-text files, one sentence a line, optionally gzipped
    (``<split>.<lang>.gz``), e.g. ``data/raw/multi30k``; or of ``<split>.<l1>-<l2>.tsv[.gz]``
    files, both sides of a split in one file, a pair a line, the two languages' sentences in
    the order the name gives, separated by a tab (either direction is read from it); or of
    ``<split>.tmx[.gz]`` translation memories (:mod:`mtcli.data.tmx`);
``dataset``
    a directory written by ``datasets.DatasetDict.save_to_disk`` (``dataset_dict.json`` and one
    sub-directory per split), read with ``datasets.load_from_disk``;
``parquet``
    a directory of parquet files in the hub layout: ``<split>-*.parquet``,
    ``<split>/*.parquet`` or ``data/<split>-*.parquet`` (optionally under ``<hub_config>/``);
``multi30k``, ``wmt-news-en-de``
    a public corpus mtcli knows by name (:mod:`mtcli.data.download`): a local copy, or files
    downloaded once into ``data/raw/<name>/`` and verified, read as a text directory;
``hub``
    a Hugging Face hub id (plus ``data.hub_config``) loaded with ``datasets.load_dataset``.

Hub-layout rows carry a ``translation`` dict ``{src_lang: ..., tgt_lang: ...}`` (or one column
per language). Every source streams ``(source, target)`` string pairs, so a 4.5M-pair corpus is
never held in memory. Text files are read with :mod:`mtcli.data.textio` (strict UTF-8); hub rows
get their inner line breaks replaced by spaces, so a sentence is always one line.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mtcli.data import arrowrows
from mtcli.data.arrowrows import (
    BlockReader,
    ParquetRowGroup,
    check_pair_schema,
    dataset_batches,
    dataset_readers,
    joined_lines,
    naming_arrow_errors,
    pair_columns,
)
from mtcli.data.download import CORPORA, locate
from mtcli.data.filenames import misnamed, read_name
from mtcli.data.sourcebase import MissingSplitError, Pair, Source, mismatch_error, single_line
from mtcli.data.textio import is_gzip, read_lines
from mtcli.data.tmx import tmx_pairs
from mtcli.data.tsv import table_blocks, table_pairs
from mtcli.errors import DataError, one_line
from mtcli.fileio import FileHasher
from mtcli.logs import get_logger, quiet_loggers

#: What ``prepare`` says of a validation or test file that opens with a byte-order mark.
SPLIT_BOM_NOTE = ("opens with a byte-order mark, which mtcli drops from the split's text: sacreBLEU's command line "
                  "on this file keeps it, in the first word, and scores it other than mtcli evaluate does; strip "
                  "it (sed -i '1s/^\\xEF\\xBB\\xBF//')")


class TextDirSource(Source):
    """A directory of ``<split>.<lang>`` (or ``<split>.<lang>.gz``) aligned text files, or of
    ``<split>.<l1>-<l2>.tsv[.gz]`` files holding both sides, or of ``<split>.tmx[.gz]``
    translation memories holding any languages."""

    kind = "text"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root
        self._files: dict[tuple[str, str], list[Path]] = {}
        self._tables: dict[str, list[tuple[Path, tuple[str, str]]]] = {}
        self._memories: dict[str, list[Path]] = {}
        self._misnamed: list[str] = []  # how to name the files that look misnamed
        for entry in sorted(root.iterdir()):
            if not entry.is_file() or entry.name.startswith("."):
                continue
            kind, split, langs = read_name(entry.name, src_lang, tgt_lang)
            if kind == "memory":
                self._memories.setdefault(split, []).append(entry)
            elif kind == "table":
                self._tables.setdefault(split, []).append((entry, (langs[0], langs[1])))
            elif kind == "side":
                self._files.setdefault((split, langs[0]), []).append(entry)
            elif advice := misnamed(entry.name, (src_lang, tgt_lang)):
                self._misnamed.append(advice)

    def _missing_split(self, split: str) -> MissingSplitError:
        swapped = sorted(lang for lang, name in self._files if name == split  # en.train: <lang>.<split>
                         and lang in (self.src_lang, self.tgt_lang))
        if swapped:
            return MissingSplitError(
                f"{self.describe()}: no split '{split}': its files are named <lang>.<split> "
                f"({', '.join(f'{lang}.{split}' for lang in swapped)}), and mtcli reads <split>.<lang>: rename them "
                f"({', '.join(f'{split}.{lang}' for lang in swapped)})")
        return MissingSplitError(f"{super()._missing_split(split)}{self._advice()}")

    def _advice(self) -> str:
        """The misnamed files' advice, to end an error about a file not found."""
        more = f"; and {len(self._misnamed) - 3} more" if len(self._misnamed) > 3 else ""
        return f" ({'; '.join(self._misnamed[:3])}{more})" if self._misnamed else ""

    def describe(self) -> str:
        return f"text directory {self.root}"

    def splits(self) -> list[str]:
        return sorted({split for split, _ in self._files} | set(self._tables) | set(self._memories))

    def languages(self, split: str) -> list[str]:
        """Languages that have a file for ``split``."""
        in_tables = {lang for _, langs in self._tables.get(split, []) for lang in langs}
        return sorted({lang for s, lang in self._files if s == split} | in_tables)

    def table(self, split: str) -> tuple[Path, tuple[str, str]] | None:
        """The ``.tsv`` file of ``split`` that holds both languages, and its columns' languages
        in order (as its name gives them); None when the split's sides are files of their own.
        :class:`DataError` when the split is in both forms."""
        wanted = {self.src_lang, self.tgt_lang}
        found = [(path, langs) for path, langs in self._tables.get(split, []) if set(langs) == wanted]
        if not found:
            return None
        if len(found) > 1 or any((split, lang) in self._files for lang in wanted):
            names = [p.name for p, _ in found]
            names += [p.name for lang in sorted(wanted) for p in self._files.get((split, lang), [])]
            raise DataError(f"{self.describe()}: {' and '.join(names)} all hold split '{split}'; keep one form")
        return found[0]

    def memory(self, split: str) -> Path | None:
        """The ``.tmx`` file of ``split``, or None; :class:`DataError` when the split is in
        another form too."""
        found = self._memories.get(split, [])
        others = [p.name for lang in (self.src_lang, self.tgt_lang) for p in self._files.get((split, lang), [])]
        others += [p.name for p, _ in self._tables.get(split, [])]
        if found and (len(found) > 1 or others):
            raise DataError(f"{self.describe()}: {' and '.join([p.name for p in found] + others)} all hold "
                            f"split '{split}'; keep one form")
        return found[0] if found else None

    def path(self, split: str, lang: str) -> Path:
        """The file of one side of a split; :class:`DataError` if missing or ambiguous."""
        found = self._files.get((split, lang))
        if not found:
            if split not in self.splits():
                raise self._missing_split(split)
            langs = ", ".join(self.languages(split))
            raise DataError(f"{self.describe()}: no file {split}.{lang}[.gz] for language '{lang}' "
                            f"(split '{split}' has languages: {langs}){self._advice()}")
        if len(found) > 1:
            names = " and ".join(p.name for p in found)
            raise DataError(f"{self.describe()}: both {names} exist; keep one")
        return found[0]

    def check(self, splits: Iterable[str]) -> None:
        for split in splits:
            if self.memory(split) is None and self.table(split) is None:
                self._check_table_pair(split)
                self.path(split, self.src_lang)
                self.path(split, self.tgt_lang)

    def _check_table_pair(self, split: str) -> None:
        """A split held in ``.tsv`` files, none of them of this pair: say so (not that a
        language's file is missing)."""
        pair = (self.src_lang, self.tgt_lang)
        if split in self._tables and not all((split, lang) in self._files for lang in pair):
            held = ", ".join(path.name for path, _ in self._tables[split])
            raise DataError(f"{self.describe()}: no {split}.{pair[0]}-{pair[1]}.tsv (or {split}.{pair[0]} and "
                            f"{split}.{pair[1]}) for the pair {pair[0]}-{pair[1]} (split '{split}' is in: {held})")

    def pairs(self, split: str, bom_note: str = "") -> Iterator[Pair]:
        memory = self.memory(split)
        if memory is not None:
            yield from tmx_pairs(memory, self.src_lang, self.tgt_lang)
            return
        table = self.table(split)
        if table is not None:
            yield from table_pairs(*table, self.src_lang)
            return
        src_path, tgt_path = self.path(split, self.src_lang), self.path(split, self.tgt_lang)
        src_it, tgt_it = read_lines(src_path, bom_note), read_lines(tgt_path, bom_note)
        n = 0
        for src in src_it:
            tgt = next(tgt_it, None)
            if tgt is None:
                rest = 1 + sum(1 for _ in src_it)
                raise mismatch_error(src_path, n + rest, tgt_path, n)
            n += 1
            yield src, tgt
        rest = sum(1 for _ in tgt_it)
        if rest:
            raise mismatch_error(src_path, n, tgt_path, n + rest)

    def verbatim_pairs(self, split: str) -> Iterator[Pair]:
        memory, table = self.memory(split), self.table(split)
        if memory is not None:
            return tmx_pairs(memory, self.src_lang, self.tgt_lang, verbatim=True)
        return self.pairs(split, SPLIT_BOM_NOTE) if table is None else table_pairs(*table, self.src_lang, verbatim=True)

    def text_blocks(self, split: str) -> Iterator[tuple[bytes, bytes]]:
        table = self.table(split)
        if table is None:
            raise NotImplementedError("a split of a file a side is read by byte ranges (plain_files)")
        return table_blocks(*table, self.src_lang)

    def block_file_bytes(self, split: str) -> int | None:
        table = self.table(split)
        return table[0].stat().st_size if table is not None else None

    def plain_files(self, split: str) -> tuple[Path, Path] | None:
        if self.memory(split) is not None or self.table(split) is not None:
            return None
        files = self.path(split, self.src_lang), self.path(split, self.tgt_lang)
        return None if any(map(is_gzip, files)) else files

    def _input_files(self, splits: Iterable[str]) -> Iterator[tuple[str, Path]]:
        for split in splits:
            whole = self.memory(split) or (self.table(split) or (None,))[0]
            if whole is not None:
                yield whole.name, whole
                continue
            for lang in (self.src_lang, self.tgt_lang):
                path = self.path(split, lang)
                yield path.name, path


class _ArrowSource(Source):
    """Shared reading of hub-layout rows (``translation`` dicts) from Arrow tables."""

    def _schema(self, split: str) -> Any:
        raise NotImplementedError

    def _batches(self, split: str) -> Iterator[Any]:
        raise NotImplementedError

    def _check_schema(self, split: str, schema: Any) -> None:
        check_pair_schema(schema, self.src_lang, self.tgt_lang, f"{self.describe()}: split '{split}'")

    def check(self, splits: Iterable[str]) -> None:
        available = self.splits()
        for split in splits:
            if split not in available:
                raise self._missing_split(split)
            self._check_schema(split, self._schema(split))

    def _columns(self, split: str) -> Iterator[tuple[Any, Any]]:
        """The source and target columns of ``split``, a batch of rows at a time."""
        for batch in self._batches(split):
            yield pair_columns(batch, self.src_lang, self.tgt_lang)

    def _rows(self, split: str) -> Iterator[tuple[str | None, str | None]]:
        return ((src, tgt) for _, _, src, tgt in self._placed_rows(split))

    def _placed_rows(self, split: str) -> Iterator[tuple[str, int, str | None, str | None]]:
        """``(where, row, src, tgt)`` of each row of ``split``: rows counted from 1 in each place
        :meth:`_placed_batches` names (a file of its own restarts the count)."""
        where, row = "", 0
        for place, batch in self._placed_batches(split):
            if place != where:
                where, row = place, 0
            src_col, tgt_col = pair_columns(batch, self.src_lang, self.tgt_lang)
            for src, tgt in zip(src_col.to_pylist(), tgt_col.to_pylist(), strict=True):
                row += 1
                yield where, row, src, tgt

    def pairs(self, split: str) -> Iterator[Pair]:
        return ((single_line(src or ""), single_line(tgt or "")) for src, tgt in self._rows(split))

    def _placed_batches(self, split: str) -> Iterator[tuple[str, Any]]:
        """The batches of ``split``, each with where its rows are counted from (a file of its own
        restarts the count)."""
        for batch in self._batches(split):
            yield f"{self.describe()}: split '{split}'", batch

    def verbatim_pairs(self, split: str) -> Iterator[Pair]:
        for where, row, src, tgt in self._placed_rows(split):
            if src is None or tgt is None:
                lang = self.src_lang if src is None else self.tgt_lang
                raise DataError(f"{where}, row {row}: no '{lang}' text (a missing value); a validation or test "
                                "split keeps every pair: mend the data")
            yield single_line(src), single_line(tgt)

    def text_blocks(self, split: str) -> Iterator[tuple[bytes, bytes]]:
        for src_col, tgt_col in self._columns(split):
            yield joined_lines(src_col), joined_lines(tgt_col)


def _split_of_parquet(name: str) -> str:
    """Split name of a hub-layout parquet file: ``train-00000-of-00002.parquet`` -> ``train``."""
    stem = name[: -len(".parquet")]
    match = re.match(r"^(.*?)-\d", stem)
    return match.group(1) if match else stem


class ParquetDirSource(_ArrowSource):
    """Parquet files in the hub layout, streamed batch by batch with pyarrow."""

    kind = "parquet"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str, hub_config: str | None) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root / hub_config if hub_config and (root / hub_config).is_dir() else root
        if hub_config and self.root == root:  # (a snapshot of that one configuration, or a misspelt name)
            get_logger().warning("data.hub_config %s: %s has no such sub-directory; its top level is read", hub_config, root)
        self._files: dict[str, list[Path]] = {}
        for base in (self.root, self.root / "data"):
            if not base.is_dir():
                continue
            for path in sorted(base.glob("*.parquet")):
                self._files.setdefault(_split_of_parquet(path.name), []).append(path)
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != "data"):
            files = sorted(sub.glob("*.parquet"))
            if files:
                self._files.setdefault(sub.name, []).extend(files)

    def describe(self) -> str:
        return f"parquet directory {self.root}"

    def _missing_split(self, split: str) -> MissingSplitError:
        """Says which sub-directories hold the split in the hub layout of several configurations
        (``de-en/train-00000-of-00003.parquet``): ``data.hub_config`` picks one."""
        holders = [sub for sub, files in self._files.items() if any(_split_of_parquet(path.name) == split
                                                                     for path in files)]
        hint = f" (in {', '.join(holders)}: set data.hub_config to one)" if holders else ""
        return MissingSplitError(f"{super()._missing_split(split)}{hint}")

    def splits(self) -> list[str]:
        return sorted(self._files)

    def _schema(self, split: str) -> Any:
        import pyarrow.parquet as pq

        schemas = []
        for path in self._files[split]:  # every file's (a footer read each): a damaged one, or a later one of
            with naming_arrow_errors(str(path), "parquet"):  # other columns than the first's, is named now
                schemas.append(pq.read_schema(path))
            if len(schemas) > 1:  # (the first: checked as the split's)
                check_pair_schema(schemas[-1], self.src_lang, self.tgt_lang, f"{path}: split '{split}'")
        return schemas[0]

    def _batches(self, split: str) -> Iterator[Any]:
        return (batch for _, batch in self._placed_batches(split))

    def _placed_batches(self, split: str) -> Iterator[tuple[str, Any]]:
        if split not in self._files:
            raise self._missing_split(split)
        for path in self._files[split]:
            yield from ((str(path), batch) for batch in arrowrows.parquet_batches(path))

    def num_pairs(self, split: str) -> int:
        import pyarrow.parquet as pq

        try:
            return sum(pq.ParquetFile(path).metadata.num_rows for path in self._files[split])
        except OSError as exc:
            raise DataError(f"{self.describe()}: unreadable parquet file ({exc})") from None

    def block_readers(self, split: str) -> list[BlockReader]:
        import pyarrow.parquet as pq

        if split not in self._files:
            raise self._missing_split(split)
        readers: list[BlockReader] = []
        for path in self._files[split]:
            try:
                groups = pq.ParquetFile(path).metadata.num_row_groups
            except OSError as exc:
                raise DataError(f"{path}: unreadable parquet file ({exc})") from None
            readers += [ParquetRowGroup(path, i, self.src_lang, self.tgt_lang) for i in range(groups)]
        return readers

    def _input_files(self, splits: Iterable[str]) -> Iterator[tuple[str, Path]]:
        for split in splits:
            for path in self._files[split]:
                yield str(path.relative_to(self.root)), path


class DatasetDirSource(_ArrowSource):
    """A ``DatasetDict.save_to_disk`` directory (one memory-mapped Arrow dataset per split)."""

    kind = "dataset"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root
        if (root / "state.json").is_file() and not (root / "dataset_dict.json").is_file():
            raise DataError(f"{root}: holds a single dataset without splits; save a DatasetDict "
                            "(DatasetDict({'train': ds, ...}).save_to_disk) so splits have names")
        self._splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        self._loaded: dict[str, Any] = {}

    def describe(self) -> str:
        return f"dataset directory {self.root}"

    def splits(self) -> list[str]:
        return list(self._splits)

    def _dataset(self, split: str) -> Any:
        if split not in self._loaded:
            import datasets

            try:
                self._loaded[split] = datasets.load_from_disk(str(self.root / split))
            except Exception as exc:  # noqa: BLE001 - any failure of the library is bad input
                raise DataError(f"{self.root / split}: cannot load dataset ({one_line(exc)})") from None
        return self._loaded[split]

    def _schema(self, split: str) -> Any:
        return self._dataset(split).data.schema

    def _batches(self, split: str) -> Iterator[Any]:
        return dataset_batches(self._dataset(split))

    def block_readers(self, split: str) -> list[BlockReader] | None:
        return dataset_readers(self._dataset(split), self.src_lang, self.tgt_lang)

    def num_pairs(self, split: str) -> int:
        return self._dataset(split).num_rows

    def _input_files(self, splits: Iterable[str]) -> Iterator[tuple[str, Path]]:
        for split in splits:
            for path in sorted((self.root / split).rglob("*")):
                if path.is_file():
                    yield str(path.relative_to(self.root)), path


def _offline() -> bool:
    flags = (os.environ.get(var, "").strip().lower() for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


class HubSource(_ArrowSource):
    """A Hugging Face hub dataset (``datasets.load_dataset(id, hub_config)``)."""

    kind = "hub"

    def __init__(self, hub_id: str, hub_config: str | None, src_lang: str, tgt_lang: str,
                 key: str = "data.source") -> None:
        super().__init__(hub_id, src_lang, tgt_lang)
        self.hub_id = hub_id
        self.hub_config = hub_config
        self.key = key  # the config key that names it
        self._dict: Any = None

    def describe(self) -> str:
        config = f" (config {self.hub_config})" if self.hub_config else ""
        return f"hub dataset {self.hub_id}{config}"

    def _load(self) -> Any:
        if self._dict is None:
            try:
                import datasets

                with quiet_loggers("huggingface_hub", "datasets"):  # a retry line each few seconds, offline
                    loaded = datasets.load_dataset(self.hub_id, self.hub_config)
            except Exception as exc:  # noqa: BLE001 - network, auth, missing id: all bad input
                why = ("it is not in the local cache and offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
                       if _offline() else "the hub may be unreachable or the id/config wrong")
                if "/" not in self.hub_id:  # as likely a local directory misspelt
                    why += f", and no directory {Path.cwd() / self.hub_id} exists"
                raise DataError(
                    f"{self.key}: cannot load Hugging Face dataset '{self.hub_id}'"
                    f"{f' config {self.hub_config!r}' if self.hub_config else ''}: {why} "
                    f"[{one_line(exc)}]; with no internet, point {self.key} at a local directory "
                    "(<split>.<lang> text files, a save_to_disk directory, or parquet files)"
                ) from None
            if not hasattr(loaded, "keys"):
                loaded = {"train": loaded}
            self._dict = loaded
        return self._dict

    def splits(self) -> list[str]:
        return sorted(self._load().keys())

    def _schema(self, split: str) -> Any:
        return self._load()[split].data.schema

    def _batches(self, split: str) -> Iterator[Any]:
        return dataset_batches(self._load()[split])

    def block_readers(self, split: str) -> list[BlockReader] | None:
        return dataset_readers(self._load()[split], self.src_lang, self.tgt_lang)

    def num_pairs(self, split: str) -> int:
        return self._load()[split].num_rows

    def fingerprint(self, splits: Iterable[str], hasher: FileHasher | None = None) -> dict[str, Any]:
        loaded = self._load()
        prints = {split: getattr(loaded[split], "_fingerprint", None) for split in splits}
        return {"kind": self.kind, "id": self.hub_id, "config": self.hub_config, "fingerprints": prints}


def detect_kind(root: Path) -> str:
    """``dataset``, ``parquet`` or ``text``: the kind of a local source directory."""
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        return "dataset"
    if any(root.glob("*.parquet")) or any(root.glob("*/*.parquet")) or any(root.glob("*/data/*.parquet")):
        return "parquet"
    return "text"


def looks_like_path(source: str) -> bool:
    """Whether ``data.source`` names a path (not a corpus name or a hub id ``org/name``, whose
    organisation is no local directory: ``corpora/en_fr`` is a misspelt ``corpora/en-fr``)."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or (
        "/" in source and Path(source.split("/")[0]).is_dir())


def _near_name(source: str) -> str | None:
    """The corpus mtcli knows, or the directory here, whose name ``source`` misspells (by
    :func:`difflib.get_close_matches`), else None: ``multi30`` for ``multi30k``."""
    names = [*CORPORA, *(entry.name for entry in Path.cwd().iterdir() if entry.is_dir())]
    near = difflib.get_close_matches(source.lower(), names, n=1, cutoff=0.75)
    return near[0] if near else None


def _unused_hub_config(key: str, source: str, kind: str, hub_config: str | None) -> None:
    """Warn of a ``hub_config`` beside a source that has no configurations to pick from."""
    if hub_config:
        get_logger().warning("%s %s: %s has no configurations to pick from; hub_config %s is left out",
                             key, source, kind, hub_config)


def open_source(source: str, src_lang: str, tgt_lang: str, hub_config: str | None = None,
                key: str = "data.source") -> Source:
    """The :class:`Source` ``data.source`` names: a local directory (kind detected), a public
    corpus mtcli knows by name (:mod:`mtcli.data.download`: fetched once, verified), or a hub id
    (``key``: the config key that names it, for errors: ``data.sources[1].source``)."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"{key} {source}: is a file, expected a directory or a hub id")
        kind = detect_kind(path)
        if kind == "dataset":
            _unused_hub_config(key, source, "a saved dataset", hub_config)
            return DatasetDirSource(path, src_lang, tgt_lang)
        text = TextDirSource(path, src_lang, tgt_lang)
        if kind == "parquet":  # unless it holds text of both languages (a stray notes.parquet beside it)
            if not text._memories and not any({src_lang, tgt_lang} <= set(text.languages(split))
                                              for split in text.splits()):  # (a .tmx's languages: read later)
                return ParquetDirSource(path, src_lang, tgt_lang, hub_config)
            get_logger().warning("%s %s: reading its text files; its .parquet files are left out", key, source)
        _unused_hub_config(key, source, "a directory of text files", hub_config)
        if not text.splits():
            entries = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
            raise DataError(f"{key} {source}: no <split>.<lang> text files, <split>.<l1>-<l2>.tsv or "
                            f"<split>.tmx files, parquet files or saved dataset found (it holds: {entries})"
                            f"{text._advice()}")
        return text
    if source in CORPORA:
        _unused_hub_config(key, source, "a corpus mtcli knows", hub_config)
        return TextDirSource(locate(source), src_lang, tgt_lang)
    if looks_like_path(source) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        raise DataError(f"{key} {source}: directory not found (relative paths are from {Path.cwd()})")
    if "/" not in source and (near := _near_name(source)):  # a typo, not a hub id: no wait on the hub
        raise DataError(f"{key} {source}: no such directory or corpus; did you mean {near}? "
                        f"(relative paths are from {Path.cwd()}; a hub id is org/name)")
    get_logger().info("%s %s is not a local directory: loading it from the Hugging Face hub", key, source)
    return HubSource(source, hub_config, src_lang, tgt_lang, key)
