"""Arrow rows (parquet files, ``datasets`` Arrow files) as blocks of text, and the readers of
them that cleaning workers call themselves.

A block is the UTF-8 text of one side of a batch of rows, a line a row, by the rules of
:meth:`mtcli.data.sourcebase.Source.pairs` (a missing value is an empty line, inner line breaks
become spaces), made by Arrow and numpy without a Python loop over the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtcli.errors import DataError

#: Rows in one block of text.
ARROW_BATCH = 10_000


def pair_columns(batch: Any, src_lang: str, tgt_lang: str) -> tuple[Any, Any]:
    """The source and target columns of a batch of hub-layout rows (a ``translation`` struct
    keyed by language, or a column per language)."""
    import pyarrow.compute as pc

    if "translation" in batch.schema.names:
        column = batch.column("translation")
        return pc.struct_field(column, src_lang), pc.struct_field(column, tgt_lang)
    return batch.column(src_lang), batch.column(tgt_lang)


class BlockReader:
    """A part of a split that a worker process reads itself
    (:meth:`mtcli.data.sourcebase.Source.block_readers`)."""

    def blocks(self) -> Iterator[tuple[bytes, bytes]]:
        """The part's pairs as :meth:`mtcli.data.sourcebase.Source.text_blocks` gives them."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ParquetRowGroup(BlockReader):
    """One row group of a parquet file, read a batch at a time (its compressed bytes in memory,
    not the whole group decoded)."""

    path: Path
    index: int
    src_lang: str
    tgt_lang: str

    def blocks(self) -> Iterator[tuple[bytes, bytes]]:
        for batch in parquet_batches(self.path, [self.index]):
            src, tgt = pair_columns(batch, self.src_lang, self.tgt_lang)
            yield joined_lines(src), joined_lines(tgt)


def parquet_batches(path: Path, row_groups: list[int] | None = None) -> Iterator[Any]:
    """The batches of a parquet file (of ``row_groups``, else of all), read a row group at a time:
    Arrow cannot give a nested column whose dictionaries change from one row group to the next
    in one batch (a Hugging Face ``translation`` struct of dictionary-encoded strings, several
    row groups). Each batch is checked whole (a string column of invalid UTF-8), and a failure to
    read is one :class:`DataError` line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        for group in range(handle.metadata.num_row_groups) if row_groups is None else row_groups:
            for batch in handle.iter_batches(batch_size=ARROW_BATCH, row_groups=[group]):
                batch.validate(full=True)
                yield batch
    except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:
        said = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise DataError(f"{path}: unreadable parquet file ({said})") from None


def joined_lines(column: Any) -> bytes:
    """A string column as UTF-8 lines, each ended by ``\n``, by the rules of
    :meth:`mtcli.data.sourcebase.Source.pairs` (a missing value is empty, an inner line break a
    space): Arrow's bytes with the line ends put in by numpy, no Python loop."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if len(column) == 0:
        return b""
    if pa.types.is_dictionary(column.type):  # a pandas category column: its strings, row by row
        column = column.dictionary_decode()
    if column.null_count:
        column = pc.fill_null(column, "")
    offset_type = np.int64 if pa.types.is_large_string(column.type) else np.int32
    _, offsets_buffer, data_buffer = column.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=offset_type)[column.offset:column.offset + len(column) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8)[offsets[0]:offsets[-1]] if data_buffer else np.zeros(0, np.uint8)
    if ((data == 10) | (data == 13)).any():  # an inner line break: single_line's replacements, then again
        for old in ("\r\n", "\n", "\r"):
            column = pc.replace_substring(column, old, " ")
        return joined_lines(column)
    return np.insert(data, (offsets[1:] - offsets[0]).astype(np.int64), 10).tobytes()


#: Rows a worker reads from a dataset's Arrow files at a time (:class:`ArrowStreamSlice`).
SLICE_ROWS = 5 * ARROW_BATCH


@dataclasses.dataclass(frozen=True)
class ArrowStreamSlice(BlockReader):
    """Record batches ``first`` to ``stop`` (not included) of an Arrow stream file (a dataset's
    file, as ``datasets`` writes them), read through a memory map: the batches before ``first``
    are passed over without reading their data, and the map, with the pages read, goes when
    the slice is done."""

    path: str
    first: int
    stop: int
    src_lang: str
    tgt_lang: str

    def blocks(self) -> Iterator[tuple[bytes, bytes]]:
        import pyarrow as pa

        with naming_arrow_errors(self.path), pa.memory_map(self.path) as source:
            pending: list[Any] = []
            rows = 0
            for i, batch in enumerate(pa.ipc.open_stream(source)):
                if i >= self.stop:
                    break
                if i >= self.first:
                    pending.append(batch)
                    rows += batch.num_rows
                if pending and (rows >= ARROW_BATCH or i + 1 == self.stop):
                    src, tgt = pair_columns(pa.Table.from_batches(pending), self.src_lang, self.tgt_lang)
                    yield joined_lines(src), joined_lines(tgt)
                    pending, rows = [], 0
            if pending:
                src, tgt = pair_columns(pa.Table.from_batches(pending), self.src_lang, self.tgt_lang)
                yield joined_lines(src), joined_lines(tgt)


@contextlib.contextmanager
def naming_arrow_errors(path: str, kind: str = "Arrow") -> Iterator[None]:
    """Turn Arrow's failure to read a damaged or cut-short file into a one-line DataError."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{path}: unreadable {kind} file ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def check_pair_schema(schema: Any, src_lang: str, tgt_lang: str, where: str) -> None:
    """Raise :class:`DataError` (naming ``where``) unless ``schema`` holds the two languages as
    text: a ``translation`` struct with a string field for each (the hub's layout), or a string
    column for each."""
    import pyarrow as pa

    names = list(schema.names)
    if "translation" in names:
        field_type = schema.field("translation").type
        if not pa.types.is_struct(field_type):
            raise DataError(f"{where}: its 'translation' column is {field_type}, not a struct of one text per language")
        fields = {f.name: f.type for f in field_type}
        for lang in (src_lang, tgt_lang):
            if lang not in fields:
                raise DataError(f"{where} has no language '{lang}' in its 'translation' column "
                                f"(languages: {', '.join(fields) or 'none'})")
            if not _is_text(fields[lang]):
                raise DataError(f"{where}: translation.{lang} is {fields[lang]}, not text")
        return
    missing = [lang for lang in (src_lang, tgt_lang) if lang not in names]
    if missing:
        raise DataError(f"{where} has neither a 'translation' column nor a column for language '{missing[0]}' "
                        f"(columns: {', '.join(names) or 'none'})")
    for lang in (src_lang, tgt_lang):
        if not _is_text(schema.field(lang).type):
            raise DataError(f"{where}: column '{lang}' is {schema.field(lang).type}, not text")


def _dataset_files(dataset: Any) -> list[str]:
    """The Arrow files a ``datasets.Dataset`` is, in order; [] when it is not just its files (an
    indices mapping, or an unknown version of datasets without ``_indices``)."""
    return [entry["filename"] for entry in dataset.cache_files] if getattr(dataset, "_indices", 1) is None else []


def _check_rows(files: list[str], rows: int, dataset: Any) -> None:
    if rows != dataset.num_rows:
        raise DataError(f"{files[0]}: its dataset's Arrow files hold {rows} rows, the dataset "
                        f"{dataset.num_rows}; save it again with save_to_disk")


def dataset_readers(dataset: Any, src_lang: str, tgt_lang: str) -> list[BlockReader] | None:
    """A dataset's rows as slices of its Arrow files of about :data:`SLICE_ROWS` rows each, for
    workers to read themselves; None when the dataset is not just its files. Only the batches'
    headers are read here (through a memory map), to count their rows."""
    import pyarrow as pa

    files = _dataset_files(dataset)
    if not files:
        return None
    readers: list[BlockReader] = []
    total = 0
    for name in files:
        with naming_arrow_errors(name), pa.memory_map(name) as source:
            first = rows = i = 0
            for i, batch in enumerate(pa.ipc.open_stream(source)):
                rows += batch.num_rows
                if rows >= SLICE_ROWS:
                    readers.append(ArrowStreamSlice(name, first, i + 1, src_lang, tgt_lang))
                    first, total, rows = i + 1, total + rows, 0
            if rows:
                readers.append(ArrowStreamSlice(name, first, i + 1, src_lang, tgt_lang))
                total += rows
    _check_rows(files, total, dataset)
    return readers


def dataset_batches(dataset: Any) -> Iterator[Any]:
    """Arrow tables of a ``datasets.Dataset``, without converting rows to Python dicts.

    ``datasets`` memory-maps its Arrow files, and every page a pass reads would then stay in
    this process's resident memory (1.8 GB at 4.5M pairs, growing with the corpus). A dataset
    that is its files, in order (no indices mapping), is therefore read from them with plain
    reads, a batch at a time, so memory stays flat; any other is iterated by ``datasets``.
    """
    import pyarrow as pa

    files = _dataset_files(dataset)
    if not files:
        yield from dataset.with_format("arrow").iter(batch_size=ARROW_BATCH)
        return
    pending: list[Any] = []
    rows = total = 0
    for name in files:
        with pa.OSFile(name) as handle:
            for batch in pa.ipc.open_stream(handle):
                pending.append(batch)
                rows += batch.num_rows
                if rows >= ARROW_BATCH:
                    yield pa.Table.from_batches(pending)
                    pending, total, rows = [], total + rows, 0
    if pending:
        yield pa.Table.from_batches(pending)
    _check_rows(files, total + rows, dataset)
