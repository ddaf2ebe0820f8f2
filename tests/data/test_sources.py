"""Tests of mtcli.data.textio, .sources and .cleaning: strict UTF-8 reading, every source kind,
and cleaning counts."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from mtcli.data.cleaning import CleanCounts, PairCleaner
from mtcli.data.sources import (
    DatasetDirSource,
    HubSource,
    ParquetDirSource,
    TextDirSource,
    detect_kind,
    open_source,
)
from mtcli.data.textio import count_lines, decode_block, read_lines
from mtcli.errors import DataError

PAIRS = [("ein hund", "a dog"), ("", "empty source"), ("zwei katzen", "two cats"), ("drei", "three")]


def write_text_dir(root: Path, splits: dict[str, list[tuple[str, str]]], langs=("de", "en"), gz=False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for side, lang in enumerate(langs):
            data = "".join(p[side] + "\n" for p in pairs).encode()
            path = root / f"{split}.{lang}{'.gz' if gz else ''}"
            path.write_bytes(gzip.compress(data) if gz else data)
    return root


def translation_table(pairs, langs=("de", "en")):
    import pyarrow as pa

    return pa.table({"translation": [{langs[0]: s, langs[1]: t} for s, t in pairs]})


def write_parquet(path: Path, pairs, langs=("de", "en")) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(translation_table(pairs, langs), path)


# ----------------------------------------------------------------------------- read_lines


def test_read_lines_normalises_crlf_and_strips_only_the_newline(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"one  \r\ntwo\n\n  three\r\nlast without newline")
    assert list(read_lines(path)) == ["one  ", "two", "", "  three", "last without newline"]
    assert count_lines(path) == 5


def test_read_lines_gzip_bom_and_inner_cr(tmp_path: Path) -> None:
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress("\ufeffä\rb\nö\n".encode()))
    assert list(read_lines(path)) == ["ä b", "ö"]
    assert count_lines(path) == 2


def test_only_the_first_lines_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    """A U+FEFF opening a later line is text (a zero-width no-break space), kept as written;
    the line reader and the block reader agree."""
    text = "\ufeffeins\n\ufeffzwei\ndrei\n".encode()
    path = tmp_path / "a.txt"
    path.write_bytes(text)
    assert list(read_lines(path)) == ["eins", "\ufeffzwei", "drei"]
    assert decode_block(text, "a.txt", 1) == ["eins", "\ufeffzwei", "drei"]
    assert decode_block(text, "a.txt", 5) == ["\ufeffeins", "\ufeffzwei", "drei"]  # a block from line 5 on


def test_read_lines_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.de"
    path.write_bytes(b"fine\nalso fine\nbroken \xff here\n")
    with pytest.raises(DataError, match=r"bad\.de:3: invalid UTF-8") as info:
        list(read_lines(path))
    assert "\n" not in str(info.value)
    path.write_bytes("ein hund\nrot\n".encode("utf-16"))  # (Notepad's "Unicode")
    with pytest.raises(DataError, match=r"bad\.de:1: invalid UTF-8 \(byte 0xff at column 1\); it is UTF-16 text: "
                                        r"convert it, iconv -f UTF-16 -t UTF-8$"):
        list(read_lines(path))


def test_read_lines_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "x.de.gz"
    path.write_bytes(gzip.compress(b"a\nb\n" * 100)[:-20])
    with pytest.raises(DataError, match="x.de.gz"):
        list(read_lines(path))


def test_read_lines_is_lazy(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    path.write_bytes(b"ok\n" + b"\xff\n")
    lines = read_lines(path)
    assert next(lines) == "ok"  # the bad second line is not touched yet
    with pytest.raises(DataError):
        next(lines)


# ----------------------------------------------------------------------------- text directories


def test_text_dir_pairs_plain_and_gz(tmp_path: Path) -> None:
    for gz in (False, True):
        root = write_text_dir(tmp_path / f"c{gz}", {"train": PAIRS, "val": PAIRS[:2]}, gz=gz)
        source = open_source(str(root), "de", "en")
        assert isinstance(source, TextDirSource)
        assert source.splits() == ["train", "val"]
        source.check(["train", "val"])
        assert list(source.pairs("train")) == PAIRS
        assert list(source.pairs("val")) == PAIRS[:2]


def test_a_tsv_name_may_hold_language_codes_with_hyphens(tmp_path: Path) -> None:
    """<split>.en-zh-Hant.tsv is read for en and zh-Hant, either way, not taken for split
    'train.en-zh-Hant'."""
    root = tmp_path / "c"
    root.mkdir()
    (root / "train.en-zh-Hant.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    forward, backward = open_source(str(root), "en", "zh-Hant"), open_source(str(root), "zh-Hant", "en")
    assert forward.splits() == ["train"] and forward.languages("train") == ["en", "zh-Hant"]
    forward.check(["train"])
    assert list(forward.pairs("train")) == PAIRS and list(backward.pairs("train")) == [(t, s) for s, t in PAIRS]


@pytest.mark.parametrize("gz", [False, True])
def test_a_tsv_file_holds_both_sides_read_either_way(tmp_path: Path, gz: bool) -> None:
    """<split>.<l1>-<l2>.tsv: the pairs in the name's order; de->en and en->de read the same file."""
    root = tmp_path / "c"
    root.mkdir()
    for split, pairs in (("train", PAIRS), ("val", PAIRS[:2])):
        data = "".join(f"{s}\t{t}\n" for s, t in pairs).encode()
        (root / f"{split}.de-en.tsv{'.gz' if gz else ''}").write_bytes(gzip.compress(data) if gz else data)
    forward, backward = open_source(str(root), "de", "en"), open_source(str(root), "en", "de")
    assert isinstance(forward, TextDirSource) and forward.splits() == ["train", "val"]
    assert forward.languages("train") == ["de", "en"]
    forward.check(["train", "val"])
    assert list(forward.pairs("train")) == PAIRS and list(forward.pairs("val")) == PAIRS[:2]
    assert list(backward.pairs("train")) == [(t, s) for s, t in PAIRS]
    assert forward.plain_files("train") is None  # read line by line, not cut into byte ranges
    assert [name for name, _ in forward._input_files(["train"])] == [f"train.de-en.tsv{'.gz' if gz else ''}"]
    with pytest.raises(DataError, match=r"no train.de-fr.tsv \(or train.de and train.fr\) for the pair de-fr "
                                        rf"\(split 'train' is in: train.de-en.tsv{'.gz' if gz else ''}\)$"):
        open_source(str(root), "de", "fr").check(["train"])


def test_a_csv_quoted_tsv_is_warned_of_naming_its_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pandas' to_csv(sep="\\t") quotes a field holding a quote and doubles it: read as they are,
    52 of 300 references kept the quotes, unsaid (BLEU against corrupted references)."""
    from mtcli.data.tsv import table_blocks, table_pairs

    path = tmp_path / "test.de-en.tsv"
    path.write_text('de\ten\nein hund\ta dog\n"er sagte ""hallo"""\t"he said ""hello"""\n', encoding="utf-8")
    pairs = list(table_pairs(path, ("de", "en"), "de", verbatim=True))
    assert pairs[1] == ('"er sagte ""hallo"""', '"he said ""hello"""')  # as they are (documented)
    blocks = list(table_blocks(path, ("de", "en"), "de"))
    assert b"".join(side for side, _ in blocks).decode().splitlines() == [p for p, _ in pairs]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{path}:3: a field in quotes with its quotes doubled, as a CSV writer quotes it; a .tsv's "
                      "fields are read as they are, quotes and all: write it without CSV quoting, or as "
                      "<split>.<lang> text files"] * 2, warned
    caplog.clear()
    path.write_text('ein "hund"\ta "dog"\n"rot"\tred\n', encoding="utf-8")  # quotes in text: no warning
    list(table_pairs(path, ("de", "en"), "de"))
    list(table_blocks(path, ("de", "en"), "de"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # every field in quotes (pandas' QUOTE_ALL, R's write.table): kept, unsaid
    path.write_text('de\ten\n"ein hund"\t"a dog"\n"rot"\t"red"\n', encoding="utf-8")
    assert list(table_pairs(path, ("de", "en"), "de"))[1] == ('"rot"', '"red"')
    list(table_blocks(path, ("de", "en"), "de"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{path}: every field of its first lines is in quotes, as a CSV writer that quotes all fields "
                      "writes them; a .tsv's fields are read as they are, quotes and all: write it without CSV "
                      "quoting, or as <split>.<lang> text files"] * 2, warned


def test_a_tsv_line_without_two_columns_is_an_empty_pair_and_a_split_in_both_forms_an_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tab inside a sentence: the line is read as an empty pair (cleaning drops it from a
    training split) and warned of; a validation or test split that lost a line is an error."""
    root = tmp_path / "c"
    root.mkdir()
    (root / "train.de-en.tsv").write_text("ein hund\ta dog\nzwei\tkatzen\tcats\nrot\nblau\tblue\n", encoding="utf-8")
    source = open_source(str(root), "de", "en")
    assert list(source.pairs("train")) == [("ein hund", "a dog"), ("", ""), ("", ""), ("blau", "blue")]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{root / 'train.de-en.tsv'}: 2 line(s) without 2 tab-separated columns (the first: line 2), read as empty pairs"]
    with pytest.raises(DataError, match=r"train.de-en.tsv:2: expected 2 tab-separated columns, found 3; a validation "
                                        r"or test split keeps every line: mend the file$"):
        list(source.verbatim_pairs("train"))
    (root / "train.de").write_text("ein hund\n", encoding="utf-8")
    (root / "train.en").write_text("a dog\n", encoding="utf-8")
    (root / "val.de-en.tsv").write_text("de\ten\nein hund\ta dog\n", encoding="utf-8")  # a header line
    assert list(open_source(str(root), "de", "en").pairs("val")) == [("ein hund", "a dog")]
    assert list(open_source(str(root), "en", "de").pairs("val")) == [("a dog", "ein hund")]
    with pytest.raises(DataError, match=r"train.de-en.tsv and train.de and train.en all hold split 'train'; keep one"):
        open_source(str(root), "de", "en").check(["train"])


def test_text_dir_missing_split_lists_found(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "c", {"train": PAIRS, "dev": PAIRS})
    source = open_source(str(root), "de", "en")
    with pytest.raises(DataError, match=r"no split 'val' \(found splits: dev, train\)"):
        source.check(["train", "val"])


def test_text_dir_missing_language_lists_found(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "c", {"train": PAIRS}, langs=("de", "fr"))
    source = open_source(str(root), "de", "en")
    with pytest.raises(DataError, match=r"language 'en'.*languages: de, fr"):
        source.check(["train"])


def test_text_dir_mismatched_counts_names_both_files(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    (root / "train.en").write_text("a\nb\n")
    source = open_source(str(root), "de", "en")
    with pytest.raises(DataError) as info:
        list(source.pairs("train"))
    message = str(info.value)
    assert "train.de has 4 lines" in message and "train.en has 2 lines" in message
    (root / "train.en").write_text("a\nb\nc\nd\ne\nf\n")
    with pytest.raises(DataError, match=r"train.de has 4 lines.*train.en has 6 lines"):
        list(source.pairs("train"))


def test_text_dir_plain_and_gz_both_present_is_ambiguous(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    (root / "train.de.gz").write_bytes(gzip.compress(b"x\n"))
    with pytest.raises(DataError, match="keep one"):
        open_source(str(root), "de", "en").check(["train"])


def test_text_dir_fingerprint_follows_content(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    first = open_source(str(root), "de", "en").fingerprint(["train"])
    assert first == open_source(str(root), "de", "en").fingerprint(["train"])
    (root / "train.en").write_text("changed\n" * 4)
    assert open_source(str(root), "de", "en").fingerprint(["train"]) != first


def test_open_source_missing_directory_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="directory not found"):
        open_source(str(tmp_path / "nope"), "de", "en")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("x")
    with pytest.raises(DataError, match=r"no <split>.<lang> text files.*README"):
        open_source(str(tmp_path / "empty"), "de", "en")


def test_a_misspelt_directory_under_a_local_one_is_not_taken_for_a_hub_id(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """``corpora/en_fr`` for ``corpora/en-fr`` went to the hub (about 26 s offline) and never said
    the directory was missing: a hub id's organisation is no local directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpora").mkdir()
    with pytest.raises(DataError, match=r"data.source corpora/en_fr: directory not found \(relative paths are from"):
        open_source("corpora/en_fr", "en", "fr")
    assert isinstance(open_source("some-org/en_fr", "en", "fr"), HubSource)  # no local some-org/


def test_a_misspelt_corpus_or_directory_name_is_refused_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """``multi30`` for ``multi30k`` (or ``Corpus`` for a directory ``corpus/``) went to the hub as a
    dataset id, about 25 s offline, before its error: a name this close to one known is a typo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-corpus").mkdir()
    with pytest.raises(DataError, match=r"data.source multi30: no such directory or corpus; did you mean multi30k\?"):
        open_source("multi30", "en", "de")
    with pytest.raises(DataError, match=r"did you mean my-corpus\?"):
        open_source("My_Corpus", "en", "de")
    assert isinstance(open_source("opus_books", "en", "fr"), HubSource)  # a bare hub id near nothing here


def test_a_hub_config_beside_a_text_directory_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """data.hub_config: de-en with a directory of text files was left out without a word."""
    import logging

    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        open_source(str(root), "de", "en", hub_config="de-en")
        open_source(str(root), "de", "en")
    assert [r.getMessage() for r in caplog.records] == [
        f"data.source {root}: a directory of text files has no configurations to pick from; hub_config de-en is "
        "left out"]


def test_a_corpus_of_several_that_cannot_be_opened_is_named_by_its_key(tmp_path: Path) -> None:
    """The error said data.source of a config that has data.sources, naming no entry of it."""
    from mtcli.config import config_from_dict
    from mtcli.data.corpora import plan_corpora

    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    data = config_from_dict({"data": {"name": "x", "src_lang": "de", "tgt_lang": "en", "sources": [
        {"source": str(root)}, {"source": str(tmp_path / "nodir")}]}}).data
    with pytest.raises(DataError, match=rf"^data.sources\[1\].source {re.escape(str(tmp_path / 'nodir'))}: directory "
                                        "not found"):
        plan_corpora(data)


def test_files_named_lang_dot_split_are_said_to_be_swapped(tmp_path: Path) -> None:
    """en.train, fr.train: the advice was data.train_split, naming the splits 'en' and 'fr'."""
    root = tmp_path / "c"
    root.mkdir()
    for lang in ("de", "en"):
        (root / f"{lang}.train").write_text("x\n", encoding="utf-8")
    with pytest.raises(DataError, match=r": no split 'train': its files are named <lang>.<split> \(de.train, "
                                        r"en.train\), and mtcli reads <split>.<lang>: rename them \(train.de, "
                                        r"train.en\)$"):
        open_source(str(root), "de", "en").check(["train"])


def test_open_source_hub_id_is_lazy() -> None:
    source = open_source("some-org/some-dataset", "de", "en", "de-en")
    assert isinstance(source, HubSource)
    assert source.hub_id == "some-org/some-dataset" and source.hub_config == "de-en"


def test_a_name_that_is_no_local_directory_nor_on_the_hub_says_both(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """``data.source: corpx`` (``corpus`` misspelt) is read as a hub id: when the hub has none,
    the error says there is no such local directory either."""
    datasets = pytest.importorskip("datasets")

    import logging

    said = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    def unreachable(*args: object, **kwargs: object) -> None:
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 8s [Retry 4/5].")
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.chdir(tmp_path)
    logging.getLogger().addHandler(handler := Said())
    try:
        with pytest.raises(DataError, match=f"no directory {re.escape(str(tmp_path / 'corpx'))} exists"):
            open_source("corpx", "de", "en").check(["train"])
    finally:
        logging.getLogger().removeHandler(handler)
    assert said == []  # eleven retry lines before the error, offline


# ----------------------------------------------------------------------------- hub layout, offline


@pytest.mark.parametrize(
    "layout",
    ["train-00000-of-00002.parquet", "train/part-0.parquet", "data/train-00000-of-00001.parquet"],
)
def test_parquet_layouts(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "pq"
    write_parquet(root / layout, PAIRS)
    write_parquet(root / layout.replace("train", "validation"), PAIRS[:1])
    assert detect_kind(root) == "parquet"
    source = open_source(str(root), "de", "en")
    assert isinstance(source, ParquetDirSource)
    assert source.splits() == ["train", "validation"]
    source.check(["train", "validation"])
    assert list(source.pairs("train")) == PAIRS
    assert list(source.pairs("validation")) == PAIRS[:1]


def test_parquet_shards_in_order_and_config_subdir(tmp_path: Path) -> None:
    root = tmp_path / "pq"
    write_parquet(root / "de-en" / "train-00000-of-00002.parquet", PAIRS[:2])
    write_parquet(root / "de-en" / "train-00001-of-00002.parquet", PAIRS[2:])
    source = open_source(str(root), "de", "en", hub_config="de-en")
    assert list(source.pairs("train")) == PAIRS


def test_parquet_missing_language_and_split(tmp_path: Path) -> None:
    root = tmp_path / "pq"
    write_parquet(root / "train-00000-of-00001.parquet", PAIRS, langs=("de", "fr"))
    source = open_source(str(root), "de", "en")
    with pytest.raises(DataError, match=r"no language 'en'.*languages: de, fr"):
        source.check(["train"])
    with pytest.raises(DataError, match=r"no split 'test' \(found splits: train\)"):
        source.check(["test"])


def test_parquet_language_columns_and_newlines_in_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"de": ["a\nb", None], "en": ["c", "d"]}), root / "train-0.parquet")
    assert list(open_source(str(root), "de", "en").pairs("train")) == [("a b", "c"), ("", "d")]
    # a validation or test split keeps every pair: a missing value there is named, as a TSV's is
    pq.write_table(pa.table({"translation": [{"de": "a", "en": "c"}, None]}), root / "validation-0.parquet")
    with pytest.raises(DataError, match=r"validation-0.parquet, row 2: no 'de' text \(a missing value\)"):
        list(open_source(str(root), "de", "en").verbatim_pairs("validation"))
    # a split of several files: the row of the file that holds it (it was counted across the files, unnamed)
    pq.write_table(pa.table({"translation": [{"de": "a", "en": "c"}, {"de": "b", "en": "d"}]}),
                   root / "validation-0.parquet")
    pq.write_table(pa.table({"translation": [{"de": "e", "en": "f"}, {"de": "g", "en": None}]}),
                   root / "validation-1.parquet")
    with pytest.raises(DataError, match=r"validation-1.parquet, row 2: no 'en' text \(a missing value\)"):
        list(open_source(str(root), "de", "en").verbatim_pairs("validation"))


@pytest.mark.parametrize(("table", "said"), [
    ({"de": [1, 2], "en": ["c", "d"]}, "column 'de' is int64, not text"),  # was a TypeError traceback
    ({"de": [b"a", b"b"], "en": ["c", "d"]}, "column 'de' is binary, not text"),
    ({"de": [["a"], ["b"]], "en": ["c", "d"]}, "column 'de' is list<element: string>, not text"),
    ({"translation": [["a", "c"], ["b", "d"]]}, "its 'translation' column is list<element: string>, not a struct"),
    ({"translation": [{"de": {"text": "a"}, "en": "c"}]}, "translation.de is struct<text: string>, not text"),
])
def test_parquet_columns_that_are_not_text_are_one_line(tmp_path: Path, table: dict, said: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table(table), root / "train-0.parquet")
    with pytest.raises(DataError, match=f"split 'train': {re.escape(said)}"):
        open_source(str(root), "de", "en").check(["train"])


@pytest.mark.parametrize(("second", "said"), [
    ({"translation": [{"de": "a", "fr": "c"}]}, "has no language 'en' in its 'translation' column"),
    ({"de": [1], "en": ["c"]}, "column 'de' is int64, not text"),  # a TypeError traceback
    ({"de": ["a"], "english": ["c"]}, "'en'"),  # a KeyError traceback
])
def test_a_later_parquet_file_of_other_columns_is_one_line_naming_it(tmp_path: Path, second: dict, said: str) -> None:
    """Only a split's first file's columns were checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"de": ["a", "b"], "en": ["c", "d"]}), root / "train-00000-of-00002.parquet")
    pq.write_table(pa.table(second), root / "train-00001-of-00002.parquet")
    with pytest.raises(DataError, match=rf"train-00001-of-00002.parquet: split 'train'.*{re.escape(said)}"):
        open_source(str(root), "de", "en").check(["train"])


def test_a_stray_parquet_file_beside_text_files_leaves_them_text(tmp_path: Path) -> None:
    """A notes.parquet beside train.de/train.en made the whole directory a parquet source:
    'no split train (found splits: notes)'."""
    root = tmp_path / "corpus"
    for lang, side in (("de", 0), ("en", 1)):
        (root / f"train.{lang}").parent.mkdir(exist_ok=True)
        (root / f"train.{lang}").write_text("".join(pair[side] + "\n" for pair in PAIRS))
    write_parquet(root / "notes.parquet", PAIRS[:1])
    source = open_source(str(root), "de", "en")
    assert source.kind == "text" and list(source.pairs("train")) == PAIRS
    memories = tmp_path / "memories"  # so also beside a translation memory (whose languages are inside it)
    memories.mkdir()
    units = "".join(f'<tu><tuv xml:lang="de"><seg>{de}</seg></tuv><tuv xml:lang="en"><seg>{en}</seg></tuv></tu>'
                    for de, en in PAIRS)
    (memories / "train.tmx").write_text(f'<?xml version="1.0"?><tmx version="1.4"><body>{units}</body></tmx>')
    write_parquet(memories / "notes.parquet", PAIRS[:1])
    assert list(open_source(str(memories), "de", "en").pairs("train")) == PAIRS


@pytest.mark.parametrize("damage", ["empty", "cut"])
def test_a_damaged_parquet_file_is_named(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "pq"
    write_parquet(root / "train-00000-of-00002.parquet", PAIRS)
    bad = root / "train-00001-of-00002.parquet"
    write_parquet(bad, PAIRS)
    bad.write_bytes(b"" if damage == "empty" else bad.read_bytes()[:-20])  # ArrowInvalid tracebacks before
    with pytest.raises(DataError, match=f"{re.escape(str(bad))}: unreadable parquet file"):
        open_source(str(root), "de", "en").check(["train"])


def test_a_translation_struct_of_dictionary_strings_in_row_groups_is_read(tmp_path: Path) -> None:
    """Arrow gave ArrowNotImplementedError ("Nested data conversions not implemented for chunked
    array outputs"), a traceback, for a valid file: the split is now read a row group at a time,
    as prepare's workers read it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mtcli.data.arrowrows import ParquetRowGroup

    pairs = [(f"{s} {i}", f"{t} {i}") for i in range(40) for s, t in PAIRS]
    struct = pa.StructArray.from_arrays([pa.array([s for s, _ in pairs]).dictionary_encode(),
                                         pa.array([t for _, t in pairs]).dictionary_encode()], names=["de", "en"])
    path = tmp_path / "pq" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"translation": struct}), path, row_group_size=30)
    source = open_source(str(tmp_path / "pq"), "de", "en")
    assert list(source.pairs("train")) == pairs
    blocks = [block for reader in source.block_readers("train") for block in reader.blocks()]
    assert b"".join(src for src, _ in blocks).decode().splitlines() == [s for s, _ in pairs]
    assert all(isinstance(reader, ParquetRowGroup) for reader in source.block_readers("train"))


def test_a_parquet_string_column_of_invalid_utf8_is_one_line(tmp_path: Path) -> None:
    """A UnicodeDecodeError traceback from one process, a RemoteTraceback from the workers."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = [s.encode() for _, s in PAIRS]
    raw[1] = b"caf\xe9"
    offsets = np.cumsum([0, *map(len, raw)]).astype(np.int32)
    bad = pa.Array.from_buffers(pa.string(), len(raw), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(raw))])
    path = tmp_path / "pq" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"de": pa.array([s for s, _ in PAIRS]), "en": bad}), path)
    source = open_source(str(tmp_path / "pq"), "de", "en")
    for read in (lambda: list(source.pairs("train")),
                 lambda: [block for reader in source.block_readers("train") for block in reader.blocks()]):
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: unreadable parquet file \(.*Invalid UTF8"):
            read()


def test_saved_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = lambda pairs: {"translation": [{"de": s, "en": t} for s, t in pairs]}  # noqa: E731
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(rows(PAIRS)), test=datasets.Dataset.from_dict(rows(PAIRS[:3]))
    )
    root = tmp_path / "saved"
    dd.save_to_disk(str(root))
    assert detect_kind(root) == "dataset"
    source = open_source(str(root), "de", "en")
    assert isinstance(source, DatasetDirSource)
    assert source.splits() == ["test", "train"]
    source.check(["train", "test"])
    assert list(source.pairs("train")) == PAIRS
    assert list(source.pairs("test")) == PAIRS[:3]
    with pytest.raises(DataError, match=r"no split 'val'.*test, train"):
        source.check(["val"])
    fp = source.fingerprint(["train"])
    assert fp["kind"] == "dataset" and fp["files"]


def test_saved_single_dataset_is_rejected(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"translation": [{"de": "a", "en": "b"}]}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="without splits"):
        open_source(str(tmp_path / "one"), "de", "en")


# ----------------------------------------------------------------------------- cleaning


def test_cleaner_counts_each_reason() -> None:
    long = " ".join(["w"] * 11)
    pairs = [
        ("a b", "c d"),  # kept
        ("", "x"),  # empty
        ("x", "   "),  # empty (whitespace only)
        (long, long),  # too_long (11 > 10)
        ("a", "a b c d"),  # ratio 4 > 3
        ("a b", "c d"),  # duplicate of the first
        ("a b c", "a"),  # ratio exactly 3: kept
    ]
    cleaner = PairCleaner(max_length=10, max_ratio=3.0, dedup=True)
    kept = list(cleaner(pairs))
    assert kept == [("a b", "c d"), ("a b c", "a")]
    assert cleaner.counts == CleanCounts(read=7, kept=2, empty=2, too_long=1, ratio=1, duplicate=1)
    assert cleaner.counts.to_dict()["dropped"] == {"empty": 2, "too_long": 1, "ratio": 1, "duplicate": 1}
    assert CleanCounts.from_dict(cleaner.counts.to_dict()) == cleaner.counts


def test_cleaner_without_dedup_keeps_duplicates() -> None:
    cleaner = PairCleaner(max_length=10, max_ratio=3.0, dedup=False)
    assert len(list(cleaner([("a", "b")] * 3))) == 3
    assert cleaner.counts.duplicate == 0


def test_cleaner_dedup_is_on_the_pair_not_one_side() -> None:
    cleaner = PairCleaner(max_length=10, max_ratio=3.0, dedup=True)
    assert list(cleaner([("a", "b"), ("a", "c"), ("a", "b")])) == [("a", "b"), ("a", "c")]


@pytest.mark.parametrize("breaks", [True, False])
def test_joined_lines_follow_the_pairs_rules(breaks: bool) -> None:
    import pyarrow as pa

    from mtcli.data.arrowrows import joined_lines
    from mtcli.data.sourcebase import single_line

    values = ["a\r\nb", None, "c\nd\re", "ä ü", "", "x"] if breaks else ["a b", None, "ä ü", "", "x" * 70]
    for column in (pa.array(values), pa.array(values, type=pa.large_string()), pa.array(["q", *values]).slice(1),
                   pa.chunked_array([pa.array(values[:2]), pa.array(values[2:])]), pa.array(["", ""]),
                   pa.array([], type=pa.string()),
                   pa.array(values).dictionary_encode()):  # a pandas category column (a traceback: two buffers)
        expected = "".join(single_line(v or "") + "\n" for v in column.to_pylist()).encode()
        assert joined_lines(column) == expected


class _FilesDataset:
    """What dataset_readers asks of a datasets.Dataset that is just its Arrow files."""

    _indices = None

    def __init__(self, files: list[str], num_rows: int) -> None:
        self.cache_files = [{"filename": name} for name in files]
        self.num_rows = num_rows


@pytest.mark.parametrize("slice_rows", [1, 10, 1000])
def test_dataset_slices_read_every_row_once_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      slice_rows: int) -> None:
    import pyarrow as pa

    from mtcli.data import arrowrows

    monkeypatch.setattr(arrowrows, "SLICE_ROWS", slice_rows)
    monkeypatch.setattr(arrowrows, "ARROW_BATCH", 4)
    rows = [{"de": f"satz {i}" if i % 5 else None, "en": f"sentence\n{i}"} for i in range(47)]
    files = []
    for k, part in enumerate((rows[:30], rows[30:])):  # two files of batches of 7 rows
        table = pa.table({"translation": part})
        files.append(str(tmp_path / f"data-{k}.arrow"))
        with pa.OSFile(files[-1], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    readers = arrowrows.dataset_readers(_FilesDataset(files, 47), "de", "en")
    assert len(readers) == {1: 8, 10: 5, 1000: 2}[slice_rows]  # batches of 7 rows; no slice spans two files
    blocks = [block for reader in readers for block in reader.blocks()]
    assert b"".join(src for src, _ in blocks).decode().splitlines() == [r["de"] or "" for r in rows]
    assert b"".join(tgt for _, tgt in blocks).decode().splitlines() == [r["en"].replace("\n", " ") for r in rows]
    with pytest.raises(DataError, match="hold 47 rows, the dataset 48"):
        arrowrows.dataset_readers(_FilesDataset(files, 48), "de", "en")
    whole = Path(files[1]).read_bytes()
    Path(files[1]).write_bytes(whole[: len(whole) // 2])  # cut short after the slices were made
    with pytest.raises(DataError, match=r"data-1\.arrow: unreadable Arrow file") as caught:
        [block for reader in readers for block in reader.blocks()]
    assert "\n" not in str(caught.value)
    with pytest.raises(DataError, match=r"data-1\.arrow: unreadable Arrow file"):
        arrowrows.dataset_readers(_FilesDataset(files, 47), "de", "en")


def test_capital_extensions_are_read(tmp_path: Path) -> None:
    """``train.de-en.TSV.GZ`` and ``val.TMX`` (some Windows tools write capitals) were read as
    one side of split 'train.de-en.TSV' in language 'GZ'; ``train.de.GZ`` is gunzipped on every
    path (the parallel cleaning's byte ranges were read from the compressed bytes)."""
    root = tmp_path / "c"
    root.mkdir()
    (root / "train.de-en.TSV.GZ").write_bytes(gzip.compress("".join(f"{s}\t{t}\n" for s, t in PAIRS).encode()))
    (root / "val.TMX").write_text('<tmx version="1.4"><header srclang="de"/><body><tu><tuv xml:lang="de"><seg>'
                                  'ein</seg></tuv><tuv xml:lang="en"><seg>one</seg></tuv></tu></body></tmx>')
    source = open_source(str(root), "de", "en")
    assert source.splits() == ["train", "val"]
    source.check(["train", "val"])
    assert list(source.pairs("train")) == PAIRS and list(source.pairs("val")) == [("ein", "one")]
    sides = write_text_dir(tmp_path / "sides", {"train": PAIRS}, gz=True)
    for lang in ("de", "en"):
        (sides / f"train.{lang}.gz").rename(sides / f"train.{lang}.GZ")
    source = open_source(str(sides), "de", "en")
    assert source.plain_files("train") is None and list(source.pairs("train")) == PAIRS


@pytest.mark.parametrize(("name", "said"), [
    ("val.tsv", "val.tsv is not read: a .tsv is named <split>.<l1>-<l2>.tsv (e.g. val.de-en.tsv)"),
    ("val.de-en.csv", "val.de-en.csv is not read: both sides in one file are a tab-separated "
                      "<split>.<l1>-<l2>.tsv (e.g. val.de-en.tsv)"),
    ("val.de.txt", "val.de.txt is not read: one side of a split is named <split>.<lang> (e.g. val.de)"),
    # another compression than gzip: it was split 'val.de' in language 'xz' ("no split 'val'", found 'val.de')
    ("val.de.xz", "val.de.xz is not read: mtcli reads plain text and .gz, not .xz; decompress it first (xz -dk "
                  "val.de.xz), or gzip it"),
    ("val.de-en.tsv.zst", "val.de-en.tsv.zst is not read: mtcli reads plain text and .gz, not .zst; decompress it "
                          "first (zstd -d val.de-en.tsv.zst), or gzip it"),
])
def test_a_file_named_as_a_format_is_not_a_split_and_says_how_to_name_it(tmp_path: Path, name: str,
                                                                         said: str) -> None:
    """``val.tsv`` was split 'val' in language 'tsv': 'split val has languages: tsv'."""
    root = write_text_dir(tmp_path / "c", {"train": PAIRS})
    (root / name).write_text("ein\tone\n")
    source = open_source(str(root), "de", "en")
    assert source.splits() == ["train"]
    with pytest.raises(DataError, match=rf"no split 'val' \(found splits: train\) \({re.escape(said)}\)$"):
        source.check(["val"])
    (root / "val.en").write_text("one\n")
    with pytest.raises(DataError, match=rf"languages: en\) \({re.escape(said)}\)$"):
        open_source(str(root), "de", "en").check(["val"])


def test_a_table_of_another_pair_gets_no_advice_to_rename_it() -> None:
    """train.en-zh-Hant.tsv in a de-en directory was told "e.g. train.en-zh-Hant.de-en.tsv"."""
    from mtcli.data.filenames import misnamed

    assert misnamed("train.en-zh-Hant.tsv", ("de", "en")) is None
    assert misnamed("val.tsv", ("de", "en")).endswith("(e.g. val.de-en.tsv)")
    assert misnamed("val.de_en.tsv", ("de", "en")).endswith("(e.g. val.de-en.tsv)")  # not val.de_en.de-en.tsv
    assert misnamed("my.val.tsv", ("de", "en")).endswith("(e.g. my.val.de-en.tsv)")


def test_a_name_that_is_only_a_suffix_is_no_split() -> None:
    """``.tmx`` and ``.de-en.tsv`` (hidden files, or a name cut short) hold no split named ''."""
    from mtcli.data.filenames import read_name

    for name in (".tmx", ".de-en.tsv", ".en-de.tsv"):
        assert read_name(name, "de", "en").kind == "other", name
    assert read_name("a.tmx", "de", "en")[:2] == ("memory", "a")
    assert read_name("a.en-de.tsv", "de", "en")[:3] == ("table", "a", ("en", "de"))


def test_lone_cr_line_ends_are_refused_by_the_reader(tmp_path: Path) -> None:
    """A file of classic Mac OS line ends was one sentence, its line ends spaces."""
    path = tmp_path / "train.de"
    for text in (b"ein hund\rzwei katzen\r", b"ein\rhund\rzwei katzen\r\n", b"ein\rhund\rzwei katzen\n"):
        path.write_bytes(text)  # (a classic Mac OS file that an editor ended with one \n: one sentence too)
        with pytest.raises(DataError, match=rf"^{path}: its lines end in a lone \\r \(classic Mac OS line ends\)"):
            list(read_lines(path))
    path.write_bytes(b"ein\rhund\rzwei\nkatzen\n")  # stray \r inside the first of several lines: spaces
    assert list(read_lines(path)) == ["ein hund zwei", "katzen"]
    path.write_bytes(b"ein\rhund\r\n")  # a one-line Windows file with one stray \r: a space, not refused
    assert list(read_lines(path)) == ["ein hund"]
    path.write_bytes(b"ein\rhund\n")  # a stray \r inside a line: a space, as before
    assert list(read_lines(path)) == ["ein hund"]


def test_a_split_in_config_subdirs_names_them_for_hub_config(tmp_path: Path) -> None:
    """A hub snapshot of several configurations read without data.hub_config: its configurations
    were the splits found, nothing said data.hub_config picks one."""
    root = tmp_path / "pq"
    for config in ("cs-en", "de-en"):
        write_parquet(root / config / "train-00000-of-00001.parquet", PAIRS)
    with pytest.raises(DataError, match=r"no split 'train' \(found splits: cs-en, de-en\) \(in cs-en, de-en: set "
                                        r"data.hub_config to one\)$"):
        open_source(str(root), "de", "en").check(["train"])
    # one of several corpora: its own key (data.hub_config is refused beside data.sources)
    from mtcli.config import config_from_dict
    from mtcli.data.corpora import plan_corpora

    data = config_from_dict({"data": {"name": "pq", "src_lang": "de", "tgt_lang": "en", "sources": [
        {"source": str(root), "langs": ["de", "en"], "hub_config": "de-en"},
        {"source": str(root), "langs": ["cs", "en"]}]}}).data
    with pytest.raises(DataError, match=r"\(in cs-en, de-en: set data.sources\[1\].hub_config to one\); "
                                        r"data.train_split names it$"):
        plan_corpora(data)


def test_a_hub_config_without_its_sub_directory_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A data.hub_config naming no sub-directory of a local parquet snapshot (a misspelt name,
    or a snapshot of that one configuration) was ignored without a word."""
    root = tmp_path / "pq"
    write_parquet(root / "train-00000-of-00001.parquet", PAIRS)
    source = open_source(str(root), "de", "en", hub_config="de-em")
    assert list(source.pairs("train")) == PAIRS
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"data.hub_config de-em: {root} has no such sub-directory; its top level is read"]
    caplog.clear()
    write_parquet(root / "de-em" / "train-00000-of-00001.parquet", PAIRS[:1])
    assert list(open_source(str(root), "de", "en", hub_config="de-em").pairs("train")) == PAIRS[:1]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
