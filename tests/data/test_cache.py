"""Tests of mtcli.data.cache: streamed array writing, memory-mapped reading, verification."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from mtcli.data.cache import (
    FORMAT_VERSION,
    ArrayWriter,
    ConcatArray,
    PrefixedArray,
    PreparedCorpus,
    TokenArray,
    token_dtype,
    write_manifest,
)
from mtcli.errors import DataError

SENTS = {
    "train": [[5, 6, 7], [8], [9, 10, 11, 12], [60000, 4]],
    "val": [[4, 5], [], [6]],  # an empty line stays an empty sentence
}


def make_cache(root: Path, vocab_size: int = 65000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    for split, sents in SENTS.items():
        for lang in ("de", "en"):
            with ArrayWriter(root, split, lang, dtype) as writer:
                # two appends: the writer must continue offsets across chunks
                for part in (sents[:2], sents[2:]):
                    lengths = np.array([len(s) for s in part], dtype=np.int64)
                    ids = np.array([i for s in part for i in s], dtype=np.int64)
                    writer.append(ids, lengths)
            (root / f"{split}.{lang}.txt").write_text("".join(f"{s}\n" for s in sents))
    (root / "spm.model").write_bytes(b"model bytes")
    manifest = {
        "src_lang": "de",
        "tgt_lang": "en",
        "splits": ["train", "val"],
        "train_split": "train",
        "valid_split": "val",
        "test_splits": [],
        "sentences": {k: len(v) for k, v in SENTS.items()},
        "counts": {"train": {"read": 5, "kept": 4, "dropped": {"empty": 1}}},
        "token_dtype": dtype.name,
        "vocab": {"size": vocab_size},
    }
    write_manifest(root, manifest)
    return root


def test_token_dtype() -> None:
    assert token_dtype(8000) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32


def test_write_then_open_round_trip(tmp_path: Path) -> None:
    corpus = PreparedCorpus.open(make_cache(tmp_path / "c"))
    assert corpus.splits == ["train", "val"]
    assert (corpus.src_lang, corpus.tgt_lang, corpus.vocab_size) == ("de", "en", 65000)
    assert corpus.spm_path == tmp_path / "c" / "spm.model"
    assert corpus.counts()["train"]["kept"] == 4
    for split, sents in SENTS.items():
        array = corpus.array(split, "en")
        assert len(array) == len(sents)
        assert array.lengths.dtype == np.int64
        assert array.lengths.tolist() == [len(s) for s in sents]
        for i, s in enumerate(sents):
            assert array[i].dtype == np.int32
            assert array[i].tolist() == s
        assert array[-1].tolist() == sents[-1]
        with pytest.raises(IndexError):
            array[len(sents)]
    assert corpus.text_path("val", "de").read_text().splitlines()[1] == "[]"


def test_int32_ids_for_large_vocab(tmp_path: Path) -> None:
    corpus = PreparedCorpus.open(make_cache(tmp_path / "c", vocab_size=100_000))
    assert corpus.array("train", "de")[3].tolist() == [60000, 4]
    assert (tmp_path / "c" / "train.de.bin").stat().st_size == 4 * sum(map(len, SENTS["train"]))


def test_writer_rejects_ids_out_of_range(tmp_path: Path) -> None:
    with ArrayWriter(tmp_path, "t", "x", np.uint16) as writer, pytest.raises(ValueError):
        writer.append(np.array([70000]), np.array([1]))


def test_writer_takes_ids_in_its_own_type_as_they_are_and_checks_the_lengths(tmp_path: Path) -> None:
    with ArrayWriter(tmp_path, "t", "x", np.uint16) as writer:
        writer.append(np.array([65535, 0, 7], dtype=np.uint16), np.array([2, 1]))
        writer.append(np.array([], dtype=np.uint16), np.array([0]))  # an empty sentence
        with pytest.raises(ValueError, match="add up"):
            writer.append(np.array([1, 2], dtype=np.uint16), np.array([1]))
    array = TokenArray(writer.bin_path, writer.idx_path, np.uint16)
    assert [array[i].tolist() for i in range(len(array))] == [[65535, 0], [7], []]


@pytest.mark.parametrize("chunk", [1 << 24, 3])
def test_id_counts_count_every_sentence(tmp_path: Path, chunk: int) -> None:
    corpus = PreparedCorpus.open(make_cache(tmp_path / "c"))
    for lang in ("de", "en"):
        array = corpus.array("train", lang)
        ids = [t for i in range(len(array)) for t in array[i].tolist()]
        expected = np.bincount(np.asarray(ids, dtype=np.int64), minlength=corpus.vocab_size)
        assert array.id_counts(corpus.vocab_size, chunk=chunk).tolist() == expected.tolist()
    with pytest.raises(DataError, match="beyond the vocabulary"):
        corpus.array("train", "de").id_counts(10)


def test_token_array_pickles_by_path(tmp_path: Path) -> None:
    array = PreparedCorpus.open(make_cache(tmp_path / "c")).array("train", "de")
    blob = pickle.dumps(array)
    assert len(blob) < 1000
    assert pickle.loads(blob)[2].tolist() == SENTS["train"][2]


def test_unknown_split_or_language(tmp_path: Path) -> None:
    corpus = PreparedCorpus.open(make_cache(tmp_path / "c"))
    with pytest.raises(DataError, match=r"no split 'test' \(prepared splits: train, val\)"):
        corpus.array("test", "de")
    with pytest.raises(DataError, match="no language 'fr'"):
        corpus.text_path("train", "fr")


def test_missing_directory_or_manifest(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no prepared cache"):
        PreparedCorpus.open(tmp_path / "nothing")
    root = make_cache(tmp_path / "c")
    (root / "manifest.json").unlink()
    with pytest.raises(DataError, match="no manifest.json"):
        PreparedCorpus.open(root)


def test_corrupt_byte_is_caught_only_with_verify(tmp_path: Path) -> None:
    root = make_cache(tmp_path / "c")
    path = root / "train.en.bin"
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    PreparedCorpus.open(root, verify=False)  # same size: only the checksum can tell
    with pytest.raises(DataError, match=r"train.en.bin: checksum differs"):
        PreparedCorpus.open(root, verify=True)


def test_truncated_or_missing_files(tmp_path: Path) -> None:
    root = make_cache(tmp_path / "c")
    bin_path = root / "val.de.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"val.de.bin: \d+ bytes, manifest says"):
        PreparedCorpus.open(root, verify=False)
    root = make_cache(tmp_path / "d")
    (root / "val.en.idx").unlink()
    with pytest.raises(DataError, match="val.en.idx: missing"):
        PreparedCorpus.open(root)


def test_manifest_must_list_every_array(tmp_path: Path) -> None:
    root = make_cache(tmp_path / "c")
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["files"]["val.en.txt"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="does not list val.en.txt"):
        PreparedCorpus.open(root)


def test_wrong_format_or_garbled_manifest(tmp_path: Path) -> None:
    root = make_cache(tmp_path / "c")
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] == FORMAT_VERSION
    manifest["format"] = FORMAT_VERSION + 1
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="cache format"):
        PreparedCorpus.open(root)
    (root / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable manifest"):
        PreparedCorpus.open(root)


@pytest.mark.parametrize("mangle", [
    lambda m: m["files"].update({"train.de.bin": None}),
    lambda m: m.update(files=list(m["files"])),
    lambda m: m["files"]["train.de.bin"].update(size=str(m["files"]["train.de.bin"]["size"])),
    lambda m: m["files"]["train.de.bin"].pop("sha256"),
    lambda m: m["files"]["train.de.bin"].update(hashed_at_ns=None),
    lambda m: m.update(spm="spm.model"),  # the other mappings: an AttributeError once
    lambda m: m.update(sentences={k: str(v) for k, v in m["sentences"].items()}),
])
def test_a_manifest_of_the_right_format_with_a_mangled_file_list_is_one_error(tmp_path: Path, mangle) -> None:
    """Valid JSON but a file entry that is not {size, sha256, ...}: a DataError naming the
    manifest (prepare then rebuilds), not a TypeError or KeyError from deep inside."""
    root = make_cache(tmp_path / "c")
    manifest = json.loads((root / "manifest.json").read_text())
    mangle(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    try:
        PreparedCorpus.open(root)
    except DataError as exc:
        assert "manifest" in str(exc) and "\n" not in str(exc)
    else:  # only the hashing record was mangled: the file is read and checked again instead
        assert "mtime_ns" in manifest["files"]["train.de.bin"]


def test_inconsistent_offsets_are_rejected(tmp_path: Path) -> None:
    root = make_cache(tmp_path / "c")
    with pytest.raises(DataError, match="expects"):
        TokenArray(root / "train.de.bin", root / "val.de.idx", np.uint16)


def test_a_file_system_that_cannot_lock_a_directory_leaves_the_cache_unlocked(tmp_path, monkeypatch) -> None:
    """NFS emulates flock with locks that need a file open for writing: a directory's failed with
    EBADF, which is not a refusal by another process."""
    import errno

    import mtcli.data.cache as cache

    def cannot(fd: int, operation: int) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(cache.fcntl, "flock", cannot)
    for exclusive in (True, False):
        assert cache.CacheLock(tmp_path, exclusive=exclusive).fd is None


def test_a_tag_prefix_goes_before_every_sentence_and_counts_in_its_length(tmp_path: Path) -> None:
    """Written with a prefix (a corpus's tags) or read through one (a sampled epoch's sources):
    the tags come first, and the lengths that batches are cut by count them."""
    sents = [[5, 6, 7], [8], [9, 10]]
    with ArrayWriter(tmp_path, "train.0", "de", np.uint16, prefix=[3, 4]) as writer:
        writer.append(np.array([i for s in sents for i in s]), np.array([len(s) for s in sents]))
    array = TokenArray(tmp_path / "train.0.de.bin", tmp_path / "train.0.de.idx", np.uint16)
    assert [array[i].tolist() for i in range(3)] == [[3, 4, 5, 6, 7], [3, 4, 8], [3, 4, 9, 10]]
    prefixed = PrefixedArray(ConcatArray([array]), [1])
    assert [prefixed[i].tolist()[:2] for i in range(3)] == [[1, 3]] * 3
    assert prefixed.lengths.tolist() == [len(prefixed[i]) for i in range(3)] == [6, 4, 5]
