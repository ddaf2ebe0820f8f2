"""Tests of mtcli.data.prepare and `mtcli prepare`: every source kind, cleaning counts, the no-op,
--force, atomicity under SIGKILL, and a one-line error for every kind of bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
import yaml
from conftest import PREPARE_PAUSED_AFTER_SPM, REPO, TOY_CONFIG, TOY_DIR, shared_corpus
from typer.testing import CliRunner

import mtcli.data.cache as cache_module
import mtcli.data.cleaning as cleaning_module
import mtcli.data.corpora as corpora_module
import mtcli.data.encoding as encoding_module
import mtcli.data.prepare as prep
from mtcli import builddir, fileio
from mtcli.cli import app
from mtcli.config import load_config
from mtcli.data.cache import PreparedCorpus
from mtcli.data.freshness import changed_data_settings, open_prepared
from mtcli.data.textio import read_lines
from mtcli.data.tokenizer import UNK_ID, Tokenizer
from mtcli.data.vocabmap import load_tokenizer
from mtcli.errors import DataError
from mtcli.fileio import sha256_file

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d \| [A-Z]+ \| ")


def write_config(tmp_path: Path, source: Path | str, name: str = "cfg", **data) -> Path:
    """A toy-sized recipe reading ``source`` and writing the cache under ``tmp_path``."""
    section = {
        "name": name,
        "source": str(source),
        "src_lang": "src",
        "tgt_lang": "tgt",
        "valid_split": "val",
        "test_splits": ["test"],
        "prepared_dir": str(tmp_path / "prepared" / name),
        "vocab_size": 64,
        "num_workers": 1,
    }
    section.update(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"data": section}))
    return path


def run_cli(*args: str):
    result = CliRunner().invoke(app, ["prepare", *args])
    return result


def assert_one_line_error(result, *needles: str) -> str:
    """Exit code != 0, no traceback, and exactly one non-log line on stderr: the error."""
    assert result.exit_code not in (0, None), result.output
    stderr = result.stderr
    assert "Traceback" not in stderr
    other = [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(other) == 1 and other[0].startswith("mtcli: error: "), stderr
    for needle in needles:
        assert needle in other[0], other[0]
    return other[0]


def assert_nothing_written(config_path: Path) -> None:
    out = Path(yaml.safe_load(config_path.read_text())["data"]["prepared_dir"])
    assert not out.exists()
    if out.parent.exists():
        assert list(out.parent.iterdir()) == []


# ----------------------------------------------------------------------------- happy paths


def test_a_long_encode_off_a_terminal_says_where_it_is(tmp_path: Path, toy_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal (a batch job, nohup) encoding writes the progress bar's plain lines, as
    every other long loop does: a WMT-size encode showed nothing for minutes."""
    from mtcli import logs

    monkeypatch.setattr(logs, "on_terminal", lambda: False)
    monkeypatch.setattr(logs, "PLAIN_BAR_SECONDS", 0.0)  # a line on every update
    prep.prepare(load_config(write_config(tmp_path, toy_dir)))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("encode train")]
    assert lines and "\r" not in "".join(lines), lines


def test_prepare_toy_builds_a_complete_cache(tmp_path: Path, toy_dir: Path) -> None:
    config = load_config(write_config(tmp_path, toy_dir))
    report = prep.prepare(config)
    assert not report.skipped and report.vocab_size == 64
    corpus = PreparedCorpus.open(config.data.prepared_path(), verify=True)
    assert corpus.splits == ["train", "val", "test"]
    manifest = corpus.manifest
    assert manifest["counts"]["train"]["read"] == 600
    assert manifest["vocab"] == {"size": 64, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
    assert manifest["inputs"]["files"] == {
        f"{split}.{lang}": sha256_file(toy_dir / f"{split}.{lang}")
        for split in corpus.splits
        for lang in ("src", "tgt")
    }
    assert manifest["files"]["train.src.bin"]["sha256"] == sha256_file(corpus.directory / "train.src.bin")
    tok = Tokenizer(corpus.spm_path)
    for split in ("val", "test"):
        for lang in ("src", "tgt"):
            lines = list(read_lines(toy_dir / f"{split}.{lang}"))
            assert list(read_lines(corpus.text_path(split, lang))) == lines
            array = corpus.array(split, lang)
            assert [tok.decode(array[i]) for i in range(len(array))] == lines
    assert "prepared" in report.summary() and "train" in report.summary()


def test_a_cache_of_other_cleaning_rules_is_prepared_again(tmp_path: Path, toy_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache cleaned before invisible-only sides were empty was "up to date" to a prepare that
    would drop them: it kept them unseen."""
    (toy_dir / "train.src").write_text((toy_dir / "train.src").read_text(encoding="utf-8") + "\u200b\n",
                                       encoding="utf-8")
    (toy_dir / "train.tgt").write_text((toy_dir / "train.tgt").read_text(encoding="utf-8") + "thanks\n",
                                       encoding="utf-8")
    cfg = write_config(tmp_path, toy_dir)
    monkeypatch.setattr(prep, "CLEANING_RULES", 1)  # as a cache of the first rules was keyed
    assert not prep.prepare(load_config(cfg)).skipped
    monkeypatch.undo()
    again = prep.prepare(load_config(cfg))
    assert not again.skipped and again.counts["train"]["dropped"]["empty"] == 1


def test_train_warns_of_a_cache_cleaned_by_older_rules(tmp_path: Path, toy_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """train took a cache cleaned before invisible-only sides were empty, or before a language
    was measured in characters, without a word: a new run was cleaned by the old rules."""
    import logging

    cfg = write_config(tmp_path, toy_dir)
    prep.prepare(load_config(cfg))
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        open_prepared(load_config(cfg)).lock.release()
    assert "older mtcli's rules" not in caplog.text
    path = load_config(cfg).data.prepared_path() / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for recorded, said in (({}, "a side of invisible format characters alone was kept"),  # before it was recorded
                           ({"rules": 2, "characters": ["th"]}, "measured in characters: none now, th then")):
        path.write_text(json.dumps({**manifest, "cleaning": recorded}), encoding="utf-8")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            open_prepared(load_config(cfg)).lock.release()
        assert "was cleaned by an older mtcli's rules (" in caplog.text and said in caplog.text, caplog.text
        assert "a run resumed on it keeps them; for a new run, `mtcli prepare" in caplog.text


def test_no_op_force_and_rebuild_on_change(tmp_path: Path, toy_dir: Path) -> None:
    cfg = write_config(tmp_path, toy_dir)
    config = load_config(cfg)
    out = config.data.prepared_path()
    assert not prep.prepare(config).skipped
    created = json.loads((out / "manifest.json").read_text())["build_key"]
    stamp = (out / "manifest.json").stat().st_mtime_ns

    again = prep.prepare(load_config(cfg))
    assert again.skipped and "up to date" in again.summary()
    assert again.counts["train"]["read"] == 600
    assert (out / "manifest.json").stat().st_mtime_ns == stamp

    assert not prep.prepare(load_config(cfg), force=True).skipped
    assert (out / "manifest.json").stat().st_mtime_ns != stamp

    # a data-config change that alters the cache rebuilds; one that does not (workers) does not
    assert not prep.prepare(load_config(cfg, ["data.max_length=5"])).skipped
    assert prep.prepare(load_config(cfg, ["data.max_length=5", "data.num_workers=2"])).skipped
    changed = json.loads((out / "manifest.json").read_text())["build_key"]
    assert changed != created

    # an input change rebuilds
    with open(toy_dir / "test.src", "a") as handle, open(toy_dir / "test.tgt", "a") as other:
        handle.write("ein hund\n")
        other.write("a dog\n")
    report = prep.prepare(load_config(cfg, ["data.max_length=5"]))
    assert not report.skipped and report.counts["test"]["kept"] == 41


def test_a_cache_of_another_config_file_of_the_same_name_is_warned_of_before_it_is_replaced(
        tmp_path: Path, toy_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A copy of a recipe keeps its data.name, and with it the cache: preparing the copy with
    other data settings replaced the recipe's cache with an info line, and each then rebuilt the
    other's in turn."""
    import shutil

    cfg = write_config(tmp_path, toy_dir)
    copy = shutil.copy(cfg, tmp_path / "mine.yaml")
    assert not prep.prepare(load_config(cfg)).skipped
    manifest = json.loads((load_config(cfg).data.prepared_path() / "manifest.json").read_text())
    assert manifest["config_file"] == str(Path(cfg).resolve())
    caplog.clear()
    with caplog.at_level("WARNING", logger="mtcli"):
        assert prep.prepare(load_config(copy)).skipped  # the same data: its cache, nothing said
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        assert not prep.prepare(load_config(copy, ["data.max_length=5"])).skipped
    said = [r.getMessage() for r in caplog.records if "was prepared for" in r.getMessage()]
    assert len(said) == 1 and f"was prepared for {Path(cfg).resolve()}, a config of the same data.name" in said[0]


def test_a_cache_a_trainer_holds_is_not_rebuilt_under_it(tmp_path: Path, toy_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepare while a train ran swapped its validation set (the scores jumped, checkpoint_best
    froze), or, with another vocabulary, crashed it with an IndexError; two prepares of one cache
    both built it. A no-op prepare needs no lock, and no place to write (a read-only cache)."""
    cfg = write_config(tmp_path, toy_dir)
    prep.prepare(load_config(cfg))
    held = open_prepared(load_config(cfg))  # as a running train holds it
    with pytest.raises(DataError, match=r"in use by a running `mtcli train` \(or another `mtcli prepare`"):
        prep.prepare(load_config(cfg, ["data.max_length=5"]))
    with pytest.raises(DataError, match="in use by a running"):
        prep.prepare(load_config(cfg), force=True)
    assert held.directory.is_dir() and sha256_file(held.directory / "manifest.json") == \
        sha256_file(load_config(cfg).data.prepared_path() / "manifest.json")  # untouched
    monkeypatch.setattr(prep, "_check_writable", lambda out: (_ for _ in ()).throw(DataError("read-only")))
    assert prep.prepare(load_config(cfg)).skipped  # up to date: nothing to lock or write
    monkeypatch.undo()
    assert held.lock is not None
    held.lock.release()  # the train ended
    building = prep.CacheLock(load_config(cfg).data.prepared_path(), exclusive=True)  # a prepare building it
    with pytest.raises(DataError, match="another process is preparing it now"):
        open_prepared(load_config(cfg))
    building.release()
    assert not prep.prepare(load_config(cfg, ["data.max_length=5"])).skipped
    import threading  # a trainer opening the cache between prepare's two renames: it waits for the new one

    out, aside = held.directory, held.directory.with_name("aside")
    out.rename(aside)
    threading.Timer(0.2, aside.rename, (out,)).start()
    assert open_prepared(load_config(cfg, ["data.max_length=5"])).directory == out


def test_a_cache_put_in_place_during_a_first_build_is_not_swapped_out_under_its_trainer(
        tmp_path: Path, toy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two first builds at once: there is nothing to lock when they begin, so the second's swap
    would rename away the cache the first put there, under a trainer that had begun on it."""
    cfg = write_config(tmp_path, toy_dir)
    out = load_config(cfg).data.prepared_path()
    real, held = prep._spm_model, []

    def meanwhile(*args: object, **kwargs: object) -> object:
        out.mkdir()  # another prepare's cache, and a trainer reading it
        held.append(cache_module.CacheLock(out, exclusive=False))
        return real(*args, **kwargs)

    monkeypatch.setattr(prep, "_spm_model", meanwhile)
    with pytest.raises(DataError, match="in use by a running `mtcli train`"):
        prep.prepare(load_config(cfg))
    assert out.is_dir() and not any(out.iterdir()) and held[0].fd is not None  # left as the trainer has it


def test_corrupt_cache_is_rebuilt_not_trusted(tmp_path: Path, toy_dir: Path) -> None:
    cfg = write_config(tmp_path, toy_dir)
    out = load_config(cfg).data.prepared_path()
    prep.prepare(load_config(cfg))
    (out / "val.src.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError):
        PreparedCorpus.open(out)
    assert not prep.prepare(load_config(cfg)).skipped
    PreparedCorpus.open(out, verify=True)


def test_cli_prepare_then_up_to_date_then_force(tmp_path: Path, toy_dir: Path) -> None:
    cfg = write_config(tmp_path, toy_dir)
    first = run_cli(str(cfg))
    assert first.exit_code == 0, first.output
    assert "prepared" in first.stdout and "Traceback" not in first.stderr
    second = run_cli(str(cfg))
    assert second.exit_code == 0 and "up to date" in second.stdout
    third = run_cli(str(cfg), "--force", "--set", "data.dedup=true")
    assert third.exit_code == 0 and "prepared" in third.stdout


def test_cleaning_counts_end_to_end(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    good = [(f"ein hund {w}", f"a dog {w}") for w in "abcdefghijklmnopqrstuvwxyz"]
    train = good + [
        ("", "empty"),
        ("leer", "  "),
        ("x " * 30, "y " * 30),
        ("eins", "one two three four"),
        good[0],
        good[1],
    ]
    val = [("ein hund", "a dog"), ("", ""), ("x " * 30, "y")]  # kept verbatim
    for split, pairs in (("train", train), ("val", val), ("test", val)):
        for side, lang in enumerate(("src", "tgt")):
            (root / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))
    config = load_config(
        write_config(tmp_path, root, max_length=20, max_length_ratio=3.0, dedup=True, vocab_size=33)
    )
    report = prep.prepare(config)
    assert report.counts["train"] == {
        "read": 32,
        "kept": 26,
        "dropped": {"empty": 2, "too_long": 1, "ratio": 1, "duplicate": 2},
    }
    assert report.counts["val"] == {"read": 3, "kept": 3, "dropped": {"empty": 0, "too_long": 0, "ratio": 0, "duplicate": 0}}
    corpus = PreparedCorpus.open(config.data.prepared_path())
    assert list(read_lines(corpus.text_path("train", "tgt"))) == [t for _, t in good]
    assert list(read_lines(corpus.text_path("val", "src"))) == [s for s, _ in val]
    assert corpus.array("val", "src").lengths[1] == 0  # the empty line is an empty sentence
    assert corpus.manifest["counts"] == report.counts
    assert "dropped: empty 2, too_long 1, ratio 1, duplicate 2" in report.summary()


def _write_corpus(root: Path, langs: tuple[str, str], train: list[tuple[str, str]]) -> None:
    root.mkdir()
    held_out = [(train[i][0], train[(i + 1) % 3][1]) for i in range(3)]  # its words, but not its pairs
    for split, pairs in (("train", train), ("val", held_out), ("test", held_out)):
        for side, lang in enumerate(langs):
            (root / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")


def test_a_chinese_corpus_is_measured_in_characters(tmp_path: Path) -> None:
    """Spaces do not separate Chinese words: measured in words, each of these pairs failed the
    ratio rule and the corpus came out empty. Its vocabulary covers 99.95% of the characters,
    and spells any other in UTF-8 bytes: a character it has never seen is read and written
    back, not unknown."""
    animals = "猫狗鸟鱼马牛羊猪鸡鸭"
    train = [(f"一只{a}在草地上{b}玩", f"a {i} is playing on the grass {j}")
             for i, a in enumerate(animals) for j, b in enumerate("跑跳走")]
    _write_corpus(tmp_path / "zh", ("zh", "en"), train)
    path = write_config(tmp_path, tmp_path / "zh", src_lang="zh", tgt_lang="en", vocab_size=306)
    result = run_cli(str(path))
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.stderr
    config = load_config(path)
    assert config.data.character_coverage == 0.9995
    corpus = PreparedCorpus.open(config.data.prepared_path())
    assert corpus.manifest["counts"]["train"]["kept"] == len(train)
    assert corpus.manifest["spm"]["character_coverage"] == 0.9995 and corpus.manifest["spm"]["byte_fallback"]
    tokenizer = load_tokenizer(corpus.spm_path)
    unseen = "一只鲸在草地上跑玩"  # 鲸, whale, is in no training sentence
    ids = tokenizer.encode(unseen)
    assert UNK_ID not in ids and tokenizer.decode(ids) == unseen
    # a word model has no byte pieces: it spelled an unknown word in bytes with its '▁', which
    # decoding then wrote out ('a▁在一跳跳 dog')
    words = load_config(path, ["data.spm_model_type=word", "data.vocab_size=40", f"data.prepared_dir={tmp_path / 'words'}"])
    prep.prepare(words)
    assert PreparedCorpus.open(words.data.prepared_path()).manifest["spm"]["byte_fallback"] is False
    tokenizer = load_tokenizer(words.data.prepared_path() / "spm.model")
    assert "▁" not in tokenizer.decode(tokenizer.encode("a 一只鲸在草地上跑玩 dog"))


def test_a_word_models_cache_names_its_whole_sentence_ids_in_its_key(
        tmp_path: Path, toy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A word model's cache was made a word at a time (its neighbouring unknown words one <unk>
    each): its key names the new encoding, so that such a cache is made again, also for a word
    model given as data.spm_model."""
    keyed: list[bool] = []
    real = prep.build_key
    monkeypatch.setattr(prep, "build_key", lambda *args: keyed.append(args[4]) or real(*args))
    cfg = write_config(tmp_path, toy_dir, vocab_size=40)
    words = load_config(cfg, ["data.spm_model_type=word", f"data.prepared_dir={tmp_path / 'words'}"])
    prep.prepare(words)
    given = tmp_path / "words" / "spm.model"
    prep.prepare(load_config(cfg, [f"data.spm_model={given}", f"data.prepared_dir={tmp_path / 'given'}"]))
    prep.prepare(load_config(cfg, [f"data.prepared_dir={tmp_path / 'pieces'}"]))
    assert keyed == [True, True, False]


def test_a_word_models_cache_from_before_whole_sentence_ids_is_refused_by_train_and_made_again(
        tmp_path: Path, toy_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Such a cache (its manifest without ``word_model_ids``) was trained on without a word: its
    ids are not those translate gives. A cache made since, whose key is current, is made again
    too, rather than refused by train and called up to date by prepare."""
    from mtcli.errors import DataError

    cfg = write_config(tmp_path, toy_dir, vocab_size=40)
    words = load_config(cfg, ["data.spm_model_type=word", f"data.prepared_dir={tmp_path / 'words'}"])
    prep.prepare(words)
    manifest_path = tmp_path / "words" / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    assert manifest.pop("word_model_ids") == "sentences"
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(DataError, match=r"words was made by an older mtcli, which encoded a word model's sentences "
                                        r"a word at a time \(other ids than translate gives\); run `mtcli prepare "):
        open_prepared(words)
    caplog.set_level("INFO", logger="mtcli")
    assert not prep.prepare(words).skipped
    assert "an older mtcli, which encoded a word model's sentences a word at a time; rebuilding" in caplog.text
    open_prepared(words).lock.release()
    pieces = load_config(cfg, [f"data.prepared_dir={tmp_path / 'pieces'}"])
    prep.prepare(pieces)
    assert "word_model_ids" not in PreparedCorpus.open(tmp_path / "pieces").manifest
    open_prepared(pieces).lock.release()


def test_train_on_a_cache_path_that_is_a_file_says_so(tmp_path: Path, toy_dir: Path) -> None:
    """It said "no prepared cache; run mtcli prepare", which then refused the file."""
    from mtcli.errors import DataError

    (tmp_path / "afile").write_text("mine")
    config = load_config(write_config(tmp_path, toy_dir), [f"data.prepared_dir={tmp_path / 'afile'}"])
    with pytest.raises(DataError, match=r"afile: a file, where the prepared cache should be a directory$"):
        open_prepared(config)


def test_a_length_rule_that_drops_much_of_a_corpus_is_warned_of(tmp_path: Path) -> None:
    train = [(f"ein hund {w}", f"a dog {w}") for w in "abcdefghijklmnopqrst"]
    train += [(f"eins {w}", f"one two three four five six seven {w}") for w in "abcdefghij"]
    _write_corpus(tmp_path / "c", ("src", "tgt"), train)
    result = run_cli(str(write_config(tmp_path, tmp_path / "c", vocab_size=30)))
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warning) == 1, result.stderr
    assert ("train: data.max_length_ratio=3 dropped 10 of 30 pairs (33%; lengths: src in words/tgt in words)"
            in warning[0])


def _toy_pairs(split: str) -> list[tuple[str, str]]:
    return list(zip(read_lines(TOY_DIR / f"{split}.src"), read_lines(TOY_DIR / f"{split}.tgt"), strict=True))


def _cache_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".bin", ".idx", ".txt")}


def test_every_source_kind_gives_the_same_cache(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    splits = {s: _toy_pairs(s) for s in ("train", "val", "test")}

    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    for split, pairs in splits.items():
        for side, lang in enumerate(("src", "tgt")):
            (gz_dir / f"{split}.{lang}.gz").write_bytes(gzip.compress("".join(p[side] + "\n" for p in pairs).encode()))

    tsv_dir = tmp_path / "tsv"  # both sides in one file, target first
    tsv_dir.mkdir()
    for split, pairs in splits.items():
        (tsv_dir / f"{split}.tgt-src.tsv").write_text("".join(f"{t}\t{s}\n" for s, t in pairs), encoding="utf-8")

    pq_dir = tmp_path / "pq"
    for split, pairs in splits.items():
        half = len(pairs) // 2
        for i, part in enumerate((pairs[:half], pairs[half:])):
            (pq_dir / "data").mkdir(parents=True, exist_ok=True)
            table = pa.table({"translation": [{"src": s, "tgt": t} for s, t in part]})
            pq.write_table(table, pq_dir / "data" / f"{split}-{i:05d}-of-00002.parquet")

    ds_dir = tmp_path / "saved"
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({"translation": [{"src": a, "tgt": b} for a, b in p]}) for s, p in splits.items()}
    ).save_to_disk(str(ds_dir))

    tmx_dir = tmp_path / "tmx"  # a translation memory a split, with a third language
    tmx_dir.mkdir()
    for split, pairs in splits.items():
        units = "".join(f'<tu><tuv xml:lang="TGT"><seg>{escape(t)}</seg></tuv><tuv xml:lang="de"><seg>x</seg></tuv>'
                        f'<tuv xml:lang="src"><seg>{escape(s)}</seg></tuv></tu>\n' for s, t in pairs)
        (tmx_dir / f"{split}.tmx").write_text(f'<?xml version="1.0"?><tmx version="1.4"><header/><body>\n{units}'
                                              "</body></tmx>\n", encoding="utf-8")

    caches = {}
    for name, source in (("text", TOY_DIR), ("gz", gz_dir), ("tsv", tsv_dir), ("tmx", tmx_dir), ("parquet", pq_dir),
                         ("dataset", ds_dir)):
        config = load_config(write_config(tmp_path, source, name=name))
        report = prep.prepare(config)
        corpus = PreparedCorpus.open(report.directory)
        assert corpus.manifest["source"]["kind"] == ("text" if name in ("gz", "tsv", "tmx") else name)
        caches[name] = _cache_bytes(report.directory)
    assert caches["text"] and all(c == caches["text"] for c in caches.values())


def test_a_tsv_line_without_two_columns_is_dropped_from_training_and_refused_in_validation(tmp_path: Path) -> None:
    root = tmp_path / "tsv"
    root.mkdir()
    for split in ("train", "val", "test"):
        lines = [f"{s}\t{t}" for s, t in _toy_pairs(split)]
        if split == "train":
            lines[3] += "\tthird column"
        (root / f"{split}.src-tgt.tsv").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    cfg = write_config(tmp_path, root)
    result = run_cli(str(cfg))
    assert result.exit_code == 0, result.output
    assert "train.src-tgt.tsv: 1 line(s) without 2 tab-separated columns (the first: line 4)" in result.stderr
    counts = PreparedCorpus.open(load_config(cfg).data.prepared_path()).manifest["counts"]["train"]
    assert counts["read"] == len(_toy_pairs("train")) and counts["dropped"]["empty"] == 1
    val = root / "val.src-tgt.tsv"
    val.write_text(val.read_text(encoding="utf-8").replace("\t", "\t\t", 1), encoding="utf-8")
    result = run_cli(str(cfg), "--force")
    assert result.exit_code == 1
    assert_one_line_error(result, f"{val}:1: expected 2 tab-separated columns", "keeps every line")


def test_train_refuses_a_cache_prepared_with_other_data_settings_or_files(tmp_path: Path, toy_dir: Path) -> None:
    """A data setting changed in the config (or by a --set), or a corpus file edited, but not
    prepared again used to train on the old cache without a word; the cache's name, the worker
    count, a file's time, or the corpus gone since do not matter."""
    cfg = write_config(tmp_path, toy_dir)
    prep.prepare(load_config(cfg))
    manifest = PreparedCorpus.open(load_config(cfg).data.prepared_path()).manifest
    for same in ([], ["data.num_workers=2", "data.name=renamed"]):
        assert changed_data_settings(manifest["data_config"], load_config(cfg, same).data) == []
    changed = load_config(cfg, ["data.vocab_size=80", "data.dedup=true"]).data
    assert changed_data_settings(manifest["data_config"], changed) == [
        "data.dedup=False (the config: True)", "data.vocab_size=64 (the config: 80)"]
    given = load_config(cfg, ["data.vocab_size=80", f"data.spm_model={load_config(cfg).data.prepared_path()}"]).data
    assert changed_data_settings(manifest["data_config"], given) == []  # a given model: its own size
    older = {k: v for k, v in manifest["data_config"].items() if k != "spm_normalization"}  # before the key
    assert changed_data_settings(older, load_config(cfg, ["data.spm_normalization=identity"]).data) == [
        "data.spm_normalization='nmt_nfkc' (the config: 'identity')"]
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", "data.vocab_size=80",
                                      "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1
    # the prepare to run is the one with this command's data --set (not its train.run_dir)
    assert_one_line_error(result, "was prepared with data.vocab_size=64 (the config: 80); run `mtcli prepare "
                                  f"{shlex.quote(str(cfg))} --set data.vocab_size=80`, or give")
    # the settings it was prepared with, to resume a run begun on it (preparing again changed its Thai pairs)
    assert "or give this command the data settings prepare had (--set data.vocab_size=64): " in result.stderr
    assert not (tmp_path / "run").exists()
    # a run begun on the cache: preparing again, the first advice, ended its resume
    (tmp_path / "begun" / "checkpoints").mkdir(parents=True)
    (tmp_path / "begun" / "checkpoints" / "checkpoint_last.pt").write_bytes(b"")
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", "data.vocab_size=80",
                                      "--set", f"train.run_dir={tmp_path / 'begun'}"])
    assert_one_line_error(result, f"was prepared with data.vocab_size=64 (the config: 80), and {tmp_path / 'begun'} was "
                                  "begun on it as it is: to resume the run, give this command the data settings "
                                  "prepare had (--set data.vocab_size=64), or restore the files as they were; to train "
                                  "on the new data, run `mtcli prepare")
    # a corpus file edited since: named; the same content touched again, or the corpus gone: trained on
    train_file = toy_dir / "train.tgt"
    text = train_file.read_text(encoding="utf-8")
    train_file.write_text(text + "one more line\n", encoding="utf-8")
    (toy_dir / "train.src").write_text((toy_dir / "train.src").read_text(encoding="utf-8") + "noch eine\n",
                                       encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert_one_line_error(result, "was prepared with other content in train.src, train.tgt; run `mtcli prepare")
    assert open_prepared(load_config(cfg), check_inputs=False).manifest == manifest  # DDP's other ranks
    lines = (toy_dir / "train.src").read_text(encoding="utf-8").splitlines(keepends=True)[:-1]
    (toy_dir / "train.src").write_text("".join(lines), encoding="utf-8")
    train_file.write_text(text, encoding="utf-8")  # as prepared, though with another time
    overrides = ["train.max_steps=1", f"train.run_dir={tmp_path / 'run'}", "train.valid_every=1"]
    assert open_prepared(load_config(cfg, overrides)).manifest == manifest
    shutil.rmtree(toy_dir)
    assert open_prepared(load_config(cfg, overrides)).manifest == manifest
    # the corpus gone is fine; a path that never held it (mistyped) is trained on with a warning
    from mtcli.data.freshness import missing_sources

    assert missing_sources(load_config(cfg).data, manifest) == []
    typo = load_config(cfg, [f"data.source={tmp_path / 'tyop'}"]).data
    assert missing_sources(typo, manifest) == [(str(tmp_path / "tyop"), manifest["source"]["location"])]
    assert missing_sources(load_config(cfg, ["data.source=multi30k"]).data, manifest) == []  # a name: not a path


def test_train_refuses_a_cache_of_other_corpora_or_another_tokenizer(tmp_path: Path, toy_dir: Path) -> None:
    """What prepare rebuilds for, train refuses too: data.sources reordered (the weights would
    go to the other corpora), a tag or a direction changed, and data.spm_model given, changed
    or left out since the cache was encoded."""
    from mtcli.config import config_from_dict
    from mtcli.data.freshness import changed_corpora, changed_tokenizer

    def data(*sources: dict) -> object:
        section = {"name": "c", "src_lang": "en", "tgt_lang": "de", "sources": list(sources)}
        return config_from_dict({"data": section}).data

    recorded = [{"langs": ["en", "de"], "tag": None, "source": {"kind": "text", "hub_config": None}},
                {"langs": ["de", "en"], "tag": None, "source": {"kind": "text", "hub_config": None}}]
    forward, backward = {"source": "d"}, {"source": "d", "langs": ["de", "en"], "weight": 0.1}
    assert changed_corpora(recorded, data(forward, backward)) == []
    assert changed_corpora(recorded, data(backward, forward)) == [
        "data.sources[0].langs=['en', 'de'] (the config: ['de', 'en'])",
        "data.sources[1].langs=['de', 'en'] (the config: ['en', 'de'])"]
    assert changed_corpora(recorded, data(forward, {**backward, "tag": "<bt>"})) == [
        "data.sources[1].tag=None (the config: '<bt>')"]

    cfg = write_config(tmp_path, toy_dir)
    prep.prepare(load_config(cfg))
    own = PreparedCorpus.open(load_config(cfg).data.prepared_path()).manifest["spm"]
    model = load_config(cfg).data.prepared_path() / "spm.model"
    assert changed_tokenizer(own, load_config(cfg).data) == []
    assert changed_tokenizer(own, load_config(cfg, [f"data.spm_model={model}"]).data) == [
        f"data.spm_model=None, a model trained on the corpus (the config: {str(model)!r})"]
    other = Tokenizer.train(read_lines(toy_dir / "train.tgt"), tmp_path / "other", vocab_size=48,
                            model_type="unigram", character_coverage=1.0, max_sentences=0)
    given_cfg = write_config(tmp_path, toy_dir, name="given", spm_model=str(model))
    prep.prepare(load_config(given_cfg))
    given = PreparedCorpus.open(load_config(given_cfg).data.prepared_path()).manifest["spm"]
    assert changed_tokenizer(given, load_config(given_cfg).data) == []
    assert changed_tokenizer(given, load_config(given_cfg, [f"data.spm_model={other}"]).data) == [
        f"data.spm_model: another tokenizer than the one at {model.resolve()} then (the config: {str(other)!r})"]
    assert changed_tokenizer(given, load_config(cfg).data) == [f"data.spm_model={str(model.resolve())!r} (the config: None)"]
    with pytest.raises(DataError, match=r"was prepared with data.spm_model: another tokenizer"):
        open_prepared(load_config(given_cfg, [f"data.spm_model={other}"]))
    model.rename(tmp_path / "moved.model")  # the model gone since (a parent run pruned): the cache has its copy
    assert changed_tokenizer(given, load_config(given_cfg).data) == []
    with pytest.raises(DataError, match="tyop.model"):  # a path that never held it: a mistake, said
        changed_tokenizer(given, load_config(given_cfg, [f"data.spm_model={tmp_path / 'tyop.model'}"]).data)


def test_train_compares_the_content_of_a_named_corpus_found_here(
        tmp_path: Path, toy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.sources of a named corpus (a local copy of 'multi30k') and a directory: their order
    swapped after prepare drew each corpus's weight for the other's pairs, unseen, since only
    sources that are all directories were compared. A named corpus present here is compared too."""
    import mtcli.data.download as download

    copies = tmp_path / "copies"
    shutil.copytree(toy_dir, copies / "multi30k")
    monkeypatch.setattr(download, "LOCAL_COPIES", (copies,))
    other = tmp_path / "other"
    other.mkdir()
    for name in ("train", "val", "test"):
        for lang in ("src", "tgt"):
            lines = (toy_dir / f"{name}.{lang}").read_text(encoding="utf-8").splitlines()[::-1]
            (other / f"{name}.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    named, local = "{source: multi30k, langs: [src, tgt]}", f"{{source: {other}, langs: [src, tgt], weight: 5}}"
    cfg = write_config(tmp_path, "", sources=[])
    prep.prepare(load_config(cfg, [f"data.sources=[{named}, {local}]"]))
    open_prepared(load_config(cfg, [f"data.sources=[{named}, {local}]"]))
    with pytest.raises(DataError, match=r"was prepared with other content in corpora\[0\]/"):
        open_prepared(load_config(cfg, [f"data.sources=[{local}, {named}]"]))


def _parallel_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean and encode even the toy corpus in worker processes, in many small ranges."""
    monkeypatch.setattr(encoding_module, "PARALLEL_MIN_LINES", 1)
    monkeypatch.setattr(corpora_module, "PARALLEL_MIN_PAIRS", 1)  # the Arrow sources' rows
    monkeypatch.setattr(encoding_module, "CHUNK_BYTES", 500)  # ranges cut mid-file
    monkeypatch.setattr(corpora_module, "PARALLEL_CLEAN_BYTES", 1)
    monkeypatch.setattr(cleaning_module, "PAIRS_PER_RANGE", 64)


def test_parallel_cleaning_and_encoding_match_in_process(tmp_path: Path, toy_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with open(toy_dir / "train.src", "a") as src, open(toy_dir / "train.tgt", "a") as tgt:
        lines = list(zip(read_lines(toy_dir / "train.src"), read_lines(toy_dir / "train.tgt"), strict=True))
        for s, t in lines[:100:7]:  # duplicates of pairs in the first ranges
            src.write(s + "\n")
            tgt.write(t + "\n")
    serial = prep.prepare(load_config(write_config(tmp_path, toy_dir, name="serial", dedup=True)))
    _parallel_everywhere(monkeypatch)
    parallel = prep.prepare(load_config(write_config(tmp_path, toy_dir, name="parallel", dedup=True, num_workers=2)))
    assert serial.counts["train"]["dropped"]["duplicate"] >= 15
    assert parallel.counts == serial.counts
    assert _cache_bytes(serial.directory) == _cache_bytes(parallel.directory)


def test_the_vocabulary_does_not_depend_on_the_workers(tmp_path: Path) -> None:
    """SentencePiece's model depends on how many threads train it, which followed
    data.num_workers (this machine's cores when left out): one config built other vocabularies
    on other machines."""
    root = _word_corpus(tmp_path / "words")
    models = [prep.prepare(load_config(write_config(tmp_path, root, name=f"w{n}", vocab_size=500, num_workers=n)))
              .directory.joinpath("spm.model").read_bytes() for n in (1, 2)]
    assert models[0] == models[1]


def _word_corpus(root: Path) -> Path:
    """3,000 pairs of random words: enough text for SentencePiece's threads to matter."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    root.mkdir()
    for split, n in (("train", 3000), ("val", 20), ("test", 20)):
        for lang in ("src", "tgt"):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(n)]
            (root / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    return root


def test_sentencepiece_trains_in_a_process_that_ran_openmp_code(tmp_path: Path) -> None:
    """A SentencePiece trainer forked from a process whose OpenMP threads had run (a training
    before prepare, in one Python process) waited forever on libgomp's barrier."""
    import subprocess
    import sys

    config = write_config(tmp_path, _word_corpus(tmp_path / "words"), vocab_size=500)
    script = ("import sys, torch\ntorch.set_num_threads(2)\nfor _ in range(3): torch.ones(256, 256) @ torch.ones(256, 256)\n"
              "from mtcli.config import load_config\nfrom mtcli.data.prepare import prepare\n"
              "prepare(load_config(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_tsv_cleaned_in_parallel_matches_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large ``.tsv`` is split into columns by numpy, a block at a time, and cleaned by the
    workers: the same cache and counts as one process reading it line by line."""
    import mtcli.data.tsv as tsv_module

    root = tmp_path / "tsv"
    root.mkdir()
    for split in ("train", "val", "test"):
        pairs = _toy_pairs(split)
        lines = [f"{t}\t{s}" for s, t in (pairs + pairs[:90:9] if split == "train" else pairs)]  # target first
        if split == "train":
            lines[4] += "\ta third column"  # an empty pair, dropped
            lines[7] = lines[7].replace(" ", "\r", 1)  # a lone \r is a space
        ends = "\r\n" if split == "train" else "\n"
        (root / f"{split}.tgt-src.tsv").write_bytes(("tgt\tsrc" + ends + ends.join(lines) + ends).encode())
    serial = prep.prepare(load_config(write_config(tmp_path, root, name="serial", dedup=True)))
    _parallel_everywhere(monkeypatch)
    monkeypatch.setattr(tsv_module, "BLOCK_BYTES", 700)  # blocks cut mid-file
    blocks = []
    real = corpora_module.clean_text_blocks
    monkeypatch.setattr(corpora_module, "clean_text_blocks", lambda b, *a: real(blocks.append(1) or b, *a))
    parallel = prep.prepare(load_config(write_config(tmp_path, root, name="parallel", dedup=True, num_workers=2)))
    assert blocks, "the parallel path was not taken"
    assert serial.counts["train"]["dropped"]["duplicate"] >= 10 and serial.counts["train"]["dropped"]["empty"] == 1
    assert parallel.counts == serial.counts
    assert _cache_bytes(serial.directory) == _cache_bytes(parallel.directory)


@pytest.mark.parametrize("kind", ["parquet", "dataset"])
def test_arrow_rows_cleaned_in_parallel_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          kind: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import mtcli.data.arrowrows as arrowrows

    datasets = pytest.importorskip("datasets")
    train = _toy_pairs("train")
    train += train[:90:9]  # duplicates across blocks
    train[5] = ("zwei\r\nzeilen und\nmehr", "two\rlines")  # inner line breaks become spaces
    rows = {"train": train, "val": _toy_pairs("val"), "test": _toy_pairs("test")}
    rows = {split: [{"src": s, "tgt": t} for s, t in pairs] for split, pairs in rows.items()}
    rows["train"][11] = {"src": None, "tgt": "fehlt"}  # a missing value is an empty side
    root = tmp_path / kind
    if kind == "parquet":
        (root / "data").mkdir(parents=True)
        for split, part in rows.items():
            pq.write_table(pa.table({"translation": part}), root / "data" / f"{split}-00000-of-00001.parquet",
                           row_group_size=50)
    else:
        datasets.DatasetDict({split: datasets.Dataset.from_dict({"translation": part})
                              for split, part in rows.items()}).save_to_disk(str(root), num_shards={
                                  "train": 3, "val": 1, "test": 1})  # workers read the files in slices
    serial = prep.prepare(load_config(write_config(tmp_path, root, name="serial", dedup=True)))
    _parallel_everywhere(monkeypatch)
    monkeypatch.setattr(arrowrows, "ARROW_BATCH", 37)
    monkeypatch.setattr(arrowrows, "SLICE_ROWS", 100)
    parallel = prep.prepare(load_config(write_config(tmp_path, root, name="parallel", dedup=True, num_workers=2)))
    assert serial.counts["train"]["dropped"]["duplicate"] >= 10 and serial.counts["train"]["dropped"]["empty"] >= 1
    assert parallel.counts == serial.counts
    assert _cache_bytes(serial.directory) == _cache_bytes(parallel.directory)


def test_a_damaged_parquet_row_group_read_by_a_worker_is_one_data_error(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    (root / "data").mkdir(parents=True)
    for split in ("train", "val", "test"):
        rows = [{"src": s, "tgt": t} for s, t in _toy_pairs(split)]
        pq.write_table(pa.table({"translation": rows}), root / "data" / f"{split}-00000-of-00001.parquet",
                       row_group_size=100)
    train = root / "data" / "train-00000-of-00001.parquet"
    damaged = bytearray(train.read_bytes())
    for at in range(64, len(damaged) // 2, 101):  # the first row groups' pages; the footer is whole
        damaged[at] ^= 0xFF
    train.write_bytes(bytes(damaged))
    _parallel_everywhere(monkeypatch)
    config = load_config(write_config(tmp_path, root, name="damaged", num_workers=2))
    with pytest.raises(DataError, match=r"train-00000-of-00001\.parquet: unreadable parquet file") as caught:
        prep.prepare(config)
    assert "\n" not in str(caught.value)
    out = config.data.prepared_path()
    assert not out.exists() and not list(out.parent.glob(".*"))  # no cache, no temporary left


@pytest.mark.parametrize(
    ("damage", "needle"),
    [(lambda lines: lines[:-1], "train.tgt has 599 lines"),
     (lambda lines: [*lines[:300], b"ein \xc3\x28 hund", *lines[301:]], "train.tgt:301: invalid UTF-8")],
)
def test_bad_training_text_cleaned_in_parallel_is_one_line(tmp_path: Path, toy_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          damage, needle: str) -> None:
    lines = (toy_dir / "train.tgt").read_bytes().split(b"\n")[:-1]
    (toy_dir / "train.tgt").write_bytes(b"".join(line + b"\n" for line in damage(lines)))
    _parallel_everywhere(monkeypatch)
    cfg = write_config(tmp_path, toy_dir, num_workers=2)
    result = run_cli(str(cfg))
    assert_one_line_error(result, needle)
    assert_nothing_written(cfg)


def test_byte_ranges_cover_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    lines = [f"line {i} " + "x" * (i % 7) for i in range(100)]
    path.write_text("".join(line + "\n" for line in lines))
    ranges = encoding_module.byte_ranges(path, 37)
    assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    data = path.read_bytes()
    assert [x for a, b in ranges for x in data[a:b].decode().split("\n")[:-1]] == lines


# ----------------------------------------------------------------------------- bad input


def _corrupt(kind: str, root: Path) -> dict:
    """Damage a copy of the toy corpus; return config overrides for the case."""
    if kind == "mismatch":
        (root / "val.tgt").write_text("".join(f"{x}\n" for x in range(39)))
    elif kind == "utf8":
        data = (root / "test.src").read_bytes().split(b"\n")
        data[6] = b"ein \xc3\x28 hund"
        (root / "test.src").write_bytes(b"\n".join(data))
    elif kind == "split":
        return {"test_splits": ["test", "test2018"]}
    elif kind == "dev":  # the validation split under another name
        for side in ("src", "tgt"):
            (root / f"val.{side}").rename(root / f"dev.{side}")
    elif kind == "lang":
        return {"tgt_lang": "fr"}
    elif kind == "empty":
        return {"max_length": 1}
    elif kind == "vocab":
        return {"vocab_size": 5000}
    return {}


@pytest.mark.parametrize(
    ("kind", "needles"),
    [
        ("mismatch", ("val.src has 40 lines", "val.tgt has 39 lines")),
        ("utf8", ("test.src:7: invalid UTF-8",)),
        ("split", ("no split 'test2018'", "found splits: test, train, val); data.test_splits names it")),
        ("dev", ("no split 'val' (found splits: dev, test, train); data.valid_split names it (the source's one "
                 "other split: --set data.valid_split=dev)",)),
        ("lang", ("language 'fr'", "languages: src, tgt")),
        ("empty", ("empty after cleaning", "read 600 pairs", "too_long")),
        ("vocab", ("data.vocab_size=5000", "at most")),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, toy_dir: Path, kind: str, needles: tuple) -> None:
    overrides = _corrupt(kind, toy_dir)
    cfg = write_config(tmp_path, toy_dir, **overrides)
    result = run_cli(str(cfg))
    assert result.exit_code == 1
    assert_one_line_error(result, *needles)
    assert_nothing_written(cfg)


def _empty_tmx(path: Path) -> None:
    path.write_text('<?xml version="1.0"?><tmx version="1.4"><header/><body>\n</body></tmx>\n', encoding="utf-8")


@pytest.mark.parametrize("form", ["text", "tmx", "blank"])
def test_an_empty_validation_split_is_refused_before_training_text_is_cleaned(
        tmp_path: Path, toy_dir: Path, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty val.src/val.tgt, or a val.tmx without units: training would only fail at its first
    validation ("no hypotheses to score"). Known before the (expensive) cleaning of train. Blank
    lines only were taken: every validation scored 0, and train.patience stopped the run."""
    for side in ("src", "tgt"):
        (toy_dir / f"val.{side}").write_bytes(b"\n \n\n" if form == "blank" else b"")
    if form == "tmx":
        for side in ("src", "tgt"):
            (toy_dir / f"val.{side}").unlink()
        _empty_tmx(toy_dir / "val.tmx")
    monkeypatch.setattr(prep, "write_training", lambda *a: pytest.fail("the training split was cleaned first"))
    cfg = write_config(tmp_path, toy_dir)
    result = run_cli(str(cfg))
    assert result.exit_code == 1
    none = ("has 3 lines, none of them a pair of text (empty or blank lines)" if form == "blank"
            else "has no pairs")
    assert_one_line_error(result, f"text directory {toy_dir}: split 'val' (data.valid_split) {none}; "
                                  "validation needs at least one pair")
    assert_nothing_written(cfg)


def test_an_empty_test_split_is_prepared_with_a_warning_naming_it(tmp_path: Path, toy_dir: Path) -> None:
    (toy_dir / "test.src").write_bytes(b"")
    (toy_dir / "test.tgt").write_bytes(b"")
    cfg = write_config(tmp_path, toy_dir)
    result = run_cli(str(cfg))
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warning) == 1, result.stderr
    assert (f"text directory {toy_dir}: split 'test' (data.test_splits) has no pairs; mtcli evaluate cannot "
            "score it (scoring every direction, it leaves it out)") in warning[0]
    corpus = PreparedCorpus.open(load_config(cfg).data.prepared_path())
    assert corpus.manifest["counts"]["test"]["kept"] == 0 and corpus.manifest["counts"]["val"]["kept"] == 40


def test_a_test_reference_opening_with_a_byte_order_mark_is_warned_of(tmp_path: Path, toy_dir: Path) -> None:
    """Its mark was dropped unsaid, while sacreBLEU's command line on the file keeps it: the two
    scored it apart (chrF 11.7075 against 11.6951), as evaluate --ref says of such a file."""
    (toy_dir / "test.tgt").write_bytes(b"\xef\xbb\xbf" + (toy_dir / "test.tgt").read_bytes())
    result = run_cli(str(write_config(tmp_path, toy_dir)))
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "byte-order mark" in line]
    assert len(warned) == 1 and f"{toy_dir / 'test.tgt'}: opens with a byte-order mark, which mtcli drops" in warned[0]


def test_failed_rebuild_keeps_the_previous_cache(tmp_path: Path, toy_dir: Path) -> None:
    cfg = write_config(tmp_path, toy_dir)
    prep.prepare(load_config(cfg))
    out = load_config(cfg).data.prepared_path()
    before = _cache_bytes(out)
    _corrupt("mismatch", toy_dir)
    assert_one_line_error(run_cli(str(cfg), "--force"), "line counts differ")
    assert _cache_bytes(out) == before
    PreparedCorpus.open(out, verify=True)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_unwritable_output_directory(tmp_path: Path, toy_dir: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = write_config(tmp_path, toy_dir, prepared_dir=str(blocker / "prepared"))
    assert_one_line_error(run_cli(str(cfg)), f"{blocker}: not a directory, so {blocker / 'prepared'} cannot be made")
    cfg = write_config(tmp_path, toy_dir, prepared_dir=str(blocker))
    assert_one_line_error(run_cli(str(cfg)), "not a directory")
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cfg = write_config(tmp_path, toy_dir, prepared_dir=str(locked / "out"))
        assert_one_line_error(run_cli(str(cfg)), "cannot write", "ermission denied")


def test_a_prepared_dir_of_other_files_is_refused_and_kept(tmp_path: Path, toy_dir: Path) -> None:
    """``data.prepared_dir`` is the cache itself: pointed at a directory of the user's own files
    (``data/``), it is refused, not replaced by the cache."""
    mine = tmp_path / "data"
    mine.mkdir()
    (mine / "corpus.en").write_text("mine\n")
    cfg = write_config(tmp_path, toy_dir, prepared_dir=str(mine))
    result = run_cli(str(cfg))
    assert_one_line_error(result, f"{mine}: a directory of other files (it has no manifest.json)")
    assert [p.name for p in mine.iterdir()] == ["corpus.en"]
    assert "preparing" not in result.stderr  # refused before the work is begun (it logged "preparing ...")


def test_missing_source_directory(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tmp_path / "no-such-corpus")
    assert_one_line_error(run_cli(str(cfg)), "no-such-corpus", "directory not found")


def _run_mtcli(args: list[str], env_extra: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "mtcli.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )


WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("prepare imported torch")
sys.meta_path.insert(0, NoTorch())
from mtcli.cli import app
app(sys.argv[1:], prog_name="mtcli")
"""


def test_prepare_never_imports_torch(tmp_path: Path, toy_dir: Path) -> None:
    """prepare needs numpy and SentencePiece, not torch: its two seconds of imports came in
    through the names of a run's files (mtcli.rundir -> mtcli.checkpoint)."""
    cfg = write_config(tmp_path, toy_dir)
    for said in ("prepared", "up to date"):  # a build, then a no-op
        proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "prepare", str(cfg)], capture_output=True,
                              text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0 and said in proc.stdout, proc.stderr


def test_hub_id_unreachable_offline(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "mtcli-tests/no-such-dataset-7f3a", hub_config="de-en")
    offline = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),  # an empty cache: nothing to fall back on
    }
    proc = _run_mtcli(["prepare", str(cfg)], offline)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(errors) == 1, proc.stderr
    assert "mtcli-tests/no-such-dataset-7f3a" in errors[0]
    assert "offline" in errors[0] and "local directory" in errors[0]
    assert_nothing_written(cfg)


# ----------------------------------------------------------------------------- atomicity

_KILLABLE = PREPARE_PAUSED_AFTER_SPM + """
from mtcli.config import load_config
prep.prepare(load_config(sys.argv[1]), force=True)
"""


def _kill_mid_prepare(cfg: Path, marker: Path) -> None:
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, str(cfg), str(marker)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "prepare ended before it could be killed"
            assert time.monotonic() < deadline, "prepare never reached the kill point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_prepare_never_leaves_an_accepted_cache(tmp_path: Path, toy_dir: Path) -> None:
    cfg = write_config(tmp_path, toy_dir)
    out = load_config(cfg).data.prepared_path()
    marker = tmp_path / "marker"

    _kill_mid_prepare(cfg, marker)  # no previous cache: nothing a later step would accept
    with pytest.raises(DataError):
        PreparedCorpus.open(out, verify=False)
    leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers, "the killed run's temporary directory should be the only trace"

    report = prep.prepare(load_config(cfg))  # cleans the dead run's leftovers and builds
    assert not report.skipped
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    before = _cache_bytes(out)

    _kill_mid_prepare(cfg, marker)  # a killed --force rebuild keeps the previous cache
    assert PreparedCorpus.open(out, verify=True).manifest["counts"]["train"]["read"] == 600
    assert _cache_bytes(out) == before
    assert prep.prepare(load_config(cfg)).skipped


# ----------------------------------------------------------------------------- real data


@pytest.mark.shared_data
def test_multi30k_directory(tmp_path: Path) -> None:
    root = shared_corpus("multi30k")
    cfg = write_config(
        tmp_path,
        root,
        name="m30k",
        src_lang="de",
        tgt_lang="en",
        valid_split="val",
        test_splits=["test_2016_flickr"],
        vocab_size=1000,  # small and sampled: the full 8k recipe is timed in bench/bench_prepare.py
        spm_max_sentences=4000,
        num_workers=2,
    )
    report = prep.prepare(load_config(cfg))
    counts = report.counts
    assert counts["train"]["read"] == 29000 and counts["train"]["kept"] > 28000
    assert counts["val"]["kept"] == 1014 and counts["test_2016_flickr"]["kept"] == 1000
    corpus = PreparedCorpus.open(report.directory, verify=True)
    tok = Tokenizer(corpus.spm_path)
    refs = list(read_lines(root / "test_2016_flickr.en"))
    array = corpus.array("test_2016_flickr", "en")
    decoded = [tok.decode(array[i]) for i in range(len(array))]
    same = sum(d == r for d, r in zip(decoded, refs, strict=True))
    assert same >= 0.95 * len(refs)  # the rest differ by whitespace normalisation or unseen chars


def test_spm_model_encodes_with_the_given_model(tmp_path: Path, toy_dir: Path) -> None:
    """data.spm_model: the parent's model is copied byte for byte, the new corpus gets the ids
    the parent's tokenizer gives, the manifest says where the model came from, and the no-op
    check follows the model's content, not its path."""
    parent = load_config(write_config(tmp_path, toy_dir, name="parent"))
    prep.prepare(parent)
    parent_model = parent.data.prepared_path() / "spm.model"
    other = tmp_path / "other"  # another corpus: the toy's lines in reverse order, fewer of them
    other.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("src", "tgt"):
            lines = list(read_lines(toy_dir / f"{split}.{lang}"))[::-1][: 400 if split == "train" else None]
            (other / f"{split}.{lang}").write_text("".join(f"{line}\n" for line in lines))
    given = tmp_path / "given.model"
    given.write_bytes(parent_model.read_bytes())
    cfg = write_config(tmp_path, other, name="child", spm_model=str(given), vocab_size=32)
    report = prep.prepare(load_config(cfg))
    assert not report.skipped and report.vocab_size == 64  # the given model's size, not data.vocab_size
    child = PreparedCorpus.open(tmp_path / "prepared" / "child", verify=True)
    assert child.spm_path.read_bytes() == parent_model.read_bytes()
    assert child.manifest["spm"]["given"] == str(given.resolve())
    assert child.manifest["spm"]["sha256"] == sha256_file(parent_model)
    tok = Tokenizer(parent_model)
    for split in ("train", "val"):
        text = list(read_lines(other / f"{split}.src"))
        array = child.array(split, "src")
        assert [list(array[i]) for i in range(len(array))] == [tok.encode(line) for line in text]
    assert prep.prepare(load_config(cfg)).skipped
    given.write_bytes((tmp_path / "prepared" / "parent" / "spm.model").read_bytes())  # same content
    assert prep.prepare(load_config(cfg)).skipped
    # a run directory (or a cache) is accepted as well: its spm.model; another model rebuilds
    Tokenizer.train(read_lines(toy_dir / "train.tgt"), tmp_path / "run" / "spm", vocab_size=48,
                    model_type="unigram", character_coverage=1.0, max_sentences=0)
    rebuilt = prep.prepare(load_config(cfg, [f"data.spm_model={tmp_path / 'run'}"]))
    assert not rebuilt.skipped and rebuilt.vocab_size == 48


def test_a_chinese_target_keeps_its_full_width_punctuation_and_nfkc_is_warned_of(
        tmp_path: Path, toy_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A target written with Chinese full-width punctuation: by default (identity) the tokenizer
    gives the references back as written; under NFKC, which makes "，" a ",", prepare says the
    model cannot write them as the references do, and which key keeps them."""
    corpus = tmp_path / "zh"
    corpus.mkdir()
    for split in ("train", "val", "test"):
        shutil.copy(toy_dir / f"{split}.src", corpus / f"{split}.src")
        lines = (toy_dir / f"{split}.tgt").read_text(encoding="utf-8").splitlines()
        (corpus / f"{split}.zh").write_text("".join(line.replace(" ", "，", 1).replace(" ", "\u3000", 1) + "！\n"
                                                    for line in lines), encoding="utf-8")  # an ideographic space too
    cfg = write_config(tmp_path, corpus, tgt_lang="zh", max_length=1000, max_length_ratio=100.0, vocab_size=320)
    prep.prepare(load_config(cfg))
    corpus_ = PreparedCorpus.open(load_config(cfg).data.prepared_path())
    assert corpus_.manifest["spm"]["normalization"] == "identity"
    tok = load_tokenizer(corpus_.spm_path)
    refs = (corpus / "val.zh").read_text(encoding="utf-8").splitlines()
    assert [tok.decode(tok.encode(line)) for line in refs] == refs
    assert "do not come back as written" not in caplog.text
    prep.prepare(load_config(cfg, ["data.spm_normalization=nmt_nfkc"]))
    warned = [r.getMessage() for r in caplog.records if "do not come back as written" in r.getMessage()]
    assert warned and warned[0].startswith("val.zh: ") and "'，" in warned[0] and "data.spm_normalization: identity" \
        in warned[0], warned


def test_references_with_characters_the_vocabulary_lacks_are_not_blamed_on_normalisation(
        tmp_path: Path, toy_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Validation text with a character training never had comes back as ⁇: the warning names
    the vocabulary, not NFKC (identity would not help)."""
    val = toy_dir / "val.tgt"
    val.write_text("".join(f"{line} ☃\n" for line in val.read_text(encoding="utf-8").splitlines()), encoding="utf-8")
    prep.prepare(load_config(write_config(tmp_path, toy_dir)))
    warned = [r.getMessage() for r in caplog.records if "do not come back as written" in r.getMessage()]
    assert warned and "the vocabulary lacks some of its characters: they are not in the training text" in warned[0] \
        and "identity" not in warned[0] and "data.vocab_size" not in warned[0]  # (no size gives a character never seen)


def test_references_that_change_only_past_the_checked_lines_are_warned_of(
        tmp_path: Path, toy_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check read a split's first lines only: a test set whose changed lines came later
    (two files joined) was not warned of, and one whose first ones changed was "N of 1000"."""
    from mtcli.data import coverage

    val = toy_dir / "val.tgt"
    lines = val.read_text(encoding="utf-8").splitlines()
    half = len(lines) // 2
    val.write_text("".join(f"{line} ☃\n" if i >= half else f"{line}\n" for i, line in enumerate(lines)),
                   encoding="utf-8")
    monkeypatch.setattr(coverage, "ROUND_TRIP_LINES", max(2, half // 2))
    prep.prepare(load_config(write_config(tmp_path, toy_dir)))
    warned = [r.getMessage() for r in caplog.records if "do not come back as written" in r.getMessage()]
    step = -(-len(lines) // max(2, half // 2))
    assert warned and f"lines (one in {step} of {len(lines)}) do not come back" in warned[0], warned


def test_a_side_the_vocabulary_cannot_spell_is_warned_of(tmp_path: Path, toy_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A data.spm_model made for Latin text, given a Greek target side: each word encodes to
    unknown, which the model can neither learn nor write. prepare says so, per split and side,
    with the share and what to change; the side it spells is not named."""
    parent = load_config(write_config(tmp_path, toy_dir, name="parent"))
    prep.prepare(parent)
    assert "unknown to the SentencePiece model" not in caplog.text
    greek = str.maketrans("abcdefghijklmnopqrstuvwxyz", "αβψδεφγηιξκλμνοπ;ρστθωςχυζ")
    other = tmp_path / "greek"
    other.mkdir()
    for split in ("train", "val", "test"):
        shutil.copy(toy_dir / f"{split}.src", other / f"{split}.src")
        (other / f"{split}.tgt").write_text((toy_dir / f"{split}.tgt").read_text().translate(greek))
    cfg = write_config(tmp_path, other, name="child", spm_model=str(parent.data.prepared_path() / "spm.model"))
    prep.prepare(load_config(cfg))
    warned = [r.getMessage() for r in caplog.records if "unknown to the SentencePiece model" in r.getMessage()]
    assert warned and all(".tgt: " in w and "data.spm_model was made for other text" in w for w in warned), warned
    assert any(w.startswith("train.tgt: ") for w in warned)


def test_the_unknown_token_warning_says_what_would_help(caplog: pytest.LogCaptureFixture) -> None:
    """It said "raise data.character_coverage" at full coverage, the highest there is, and for
    a word vocabulary, which coverage does not change; "not in the training text" for a char
    model too small to hold every character of it."""
    from mtcli.config import DataConfig
    from mtcli.data.coverage import warn_of_unknown

    for data, given, said in ((DataConfig("x", "de", "en", character_coverage=1.0), False, "its characters are not in the "
                               "training text (another script?)"),
                              (DataConfig("x", "de", "en", character_coverage=0.9995), False, "raise data.character_coverage"),
                              (DataConfig("x", "de", "en", spm_model_type="word"), False, "data.spm_model_type word knows "
                               "only the training text's words"),
                              (DataConfig("x", "de", "en", spm_model_type="char", vocab_size=24), False, "a char model "
                               "of data.vocab_size=24 pieces has no room for every character: raise data.vocab_size"),
                              (DataConfig("x", "de", "en"), True, "data.spm_model was made for other text")):
        caplog.clear()
        warn_of_unknown("test", "en", 71, 1082, given, data)
        assert said in caplog.records[-1].getMessage(), said


def test_the_unknown_token_warning_starts_just_past_one_percent(caplog: pytest.LogCaptureFixture) -> None:
    from mtcli.config import DataConfig
    from mtcli.data.coverage import warn_of_unknown

    data = DataConfig("x", "de", "en")
    warn_of_unknown("test", "en", 10, 1000, False, data)  # 1% exactly: not yet
    assert not caplog.records
    warn_of_unknown("test", "en", 11, 1000, False, data)
    assert len(caplog.records) == 1 and "test.en" in caplog.records[0].getMessage()


def test_the_round_trip_warning_starts_just_past_one_percent_of_the_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from mtcli.data.corpora import text_path
    from mtcli.data.coverage import warn_of_changed_text

    class Lossy:  # gives back every line but those holding "☃" as written
        def encode(self, line: str) -> str:
            return line

        def decode(self, line: str) -> str:
            return line.replace("☃", "⁇")

    plan = SimpleNamespace(corpora=[SimpleNamespace(langs=("de", "en"))], eval_splits=["test"],
                           split_langs=lambda: {"test": ["de", "en"]})
    for changed, warns in ((1, False), (2, True)):  # of 100 lines
        caplog.clear()
        text_path(tmp_path, "test", "en").write_text(
            "".join(f"line {i}{' ☃' if i < changed else ''}\n" for i in range(100)), encoding="utf-8")
        warn_of_changed_text(tmp_path, plan, Lossy(), "nmt_nfkc")
        assert ("do not come back as written" in caplog.text) == warns, (changed, caplog.text)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda p: p / "missing.model", "missing.model: not found"),
    (lambda p: p, "no spm.model in that directory"),
    (lambda p: (p / "junk.model").write_text("not a model") and p / "junk.model", "not a readable SentencePiece model"),
])
def test_spm_model_errors_are_one_line(tmp_path: Path, toy_dir: Path, make, needle: str) -> None:
    cfg = write_config(tmp_path, toy_dir, spm_model=str(make(tmp_path)))
    result = run_cli(str(cfg))
    line = assert_one_line_error(result, "data.spm_model", needle)
    assert "Traceback" not in result.output, line
    assert_nothing_written(cfg)


# ----------------------------------------------------------------------------- the SentencePiece sample


def test_spm_sample_is_a_seeded_uniform_subset_in_file_order(tmp_path: Path) -> None:
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    paths[0].write_text("".join(f"a{i}\n" for i in range(300)), encoding="utf-8")
    paths[1].write_text("".join(f"b{i}\n" for i in range(200)), encoding="utf-8")
    every = [f"a{i}" for i in range(300)] + [f"b{i}" for i in range(200)]

    def lines(cap: int, seed: int = 1) -> list[str]:
        return b"".join(prep.spm_sample(paths, 500, cap, seed=seed)).decode().splitlines()

    assert lines(0) == every and lines(500) == every
    sample = lines(120)
    assert len(sample) == len(set(sample)) == 120
    assert sorted(sample, key=every.index) == sample  # in file order
    assert 30 < sum(line.startswith("b") for line in sample) < 70  # both files, in proportion
    assert lines(120) == sample and lines(120, seed=2) != sample


def test_line_blocks_cut_between_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    lines = [f"line {i} {'x' * (i % 5)}" for i in range(50)]
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    blocks = [(bytes(block), ends) for block, ends in encoding_module.line_blocks(path, block_bytes=7)]  # valid until the next
    assert len(blocks) > 1 and all(block.endswith(b"\n") for block, _ in blocks)
    got = [block[a:b].decode() for block, ends in blocks
           for a, b in zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)]
    assert got == [f"{line}\n" for line in lines]


def test_prepare_above_the_sample_cap_is_reproducible(tmp_path: Path, toy_dir: Path) -> None:
    """Two builds of one corpus whose training text exceeds data.spm_max_sentences train
    SentencePiece on the same sample: the same model, the same ids."""
    models = []
    for name in ("one", "two"):
        config = load_config(write_config(tmp_path, toy_dir, name=name, spm_max_sentences=400))
        report = prep.prepare(config)
        out = config.data.prepared_path()
        models.append(((out / "spm.model").read_bytes(), (out / "train.tgt.bin").read_bytes()))
        assert report.counts["train"]["kept"] * 2 > 400
    assert models[0] == models[1]


def test_no_op_reads_no_file_that_is_provably_unchanged(tmp_path: Path, toy_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At WMT size a no-op that re-hashed every input and the whole cache read gigabytes; files
    whose size, modification time and inode are those recorded when they were hashed are
    trusted, and a changed input is read again (and rebuilds)."""
    hour_ago = time.time_ns() - 3600 * 10**9
    for path in toy_dir.iterdir():
        os.utime(path, ns=(hour_ago, hour_ago))
    monkeypatch.setattr(fileio, "SETTLE_NS", 0)  # the cache was written a moment ago: let it count as settled
    cfg = write_config(tmp_path, toy_dir)
    assert not prep.prepare(load_config(cfg)).skipped
    reads: list[str] = []
    real = fileio.sha256_file

    def counting(path, *args):
        reads.append(Path(path).name)
        return real(path, *args)

    for module in (fileio, cache_module, prep):
        monkeypatch.setattr(module, "sha256_file", counting)
    assert prep.prepare(load_config(cfg)).skipped and reads == []
    with open(toy_dir / "test.src", "a") as handle, open(toy_dir / "test.tgt", "a") as other:
        handle.write("ein hund\n")
        other.write("a dog\n")
    assert not prep.prepare(load_config(cfg)).skipped
    assert "test.src" in reads and "train.src" not in reads


def test_a_missing_cache_at_a_relative_path_says_where_it_was_looked_for(tmp_path: Path, monkeypatch) -> None:
    """Prepared in one directory and trained from another, a relative data.prepared_dir is not
    found, and the advice to prepare did not say the path is from the current directory."""
    monkeypatch.chdir(tmp_path)
    config = load_config(REPO / "configs" / "toy.yaml", [f"data.source={TOY_DIR}", "data.prepared_dir=prep"])
    with pytest.raises(DataError, match=rf"^prep: no prepared cache \(relative paths are from {tmp_path}, where "
                                        r"prepare writes it too\); run `mtcli prepare"):
        open_prepared(config)


def test_train_while_the_first_prepare_builds_says_so(tmp_path: Path) -> None:
    """It said "no prepared cache; run mtcli prepare", which started a second build."""
    config = load_config(REPO / "configs" / "toy.yaml", [f"data.source={TOY_DIR}",
                                                         f"data.prepared_dir={tmp_path / 'prepared'}"])
    path = config.data.prepared_path()
    with pytest.raises(DataError, match="no prepared cache; run `mtcli prepare"):
        open_prepared(config)
    building = path.parent / f".{path.name}.abc123.tmp"
    building.mkdir(parents=True)
    (building / builddir.BUILDER_NAME).write_text(str(os.getpid()))  # this process's pid: a killed build's, reused
    with pytest.raises(DataError, match="no prepared cache; run `mtcli prepare"):
        open_prepared(config)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as prepare:  # a prepare under way
        try:
            (building / builddir.BUILDER_NAME).write_text(str(prepare.pid))
            with pytest.raises(DataError, match=rf"{path}: another process is preparing it now \(`mtcli prepare`, "
                                                rf"pid {prepare.pid}\): train once it has finished"):
                open_prepared(config)
        finally:
            prepare.kill()


def test_a_prepare_killed_between_the_renames_of_its_swap_is_put_in_place(tmp_path: Path) -> None:
    """The old cache moved aside, the new one whole beside it, not moved in: the cache was gone
    until a full build, which first deleted the whole one."""
    config = load_config(REPO / "configs" / "toy.yaml", [f"data.source={TOY_DIR}",
                                                         f"data.prepared_dir={tmp_path / 'prepared'}"])
    path = config.data.prepared_path()
    prep.prepare(config)
    gone = subprocess.Popen(["true"])
    gone.wait()  # the killed prepare's pid
    whole = path.parent / f".{path.name}.k1.tmp"
    shutil.copytree(path, whole)
    (whole / builddir.BUILDER_NAME).write_text(f"{gone.pid} {builddir.COMPLETE}")
    unfinished = path.parent / f".{path.name}.k2.tmp"  # a build killed earlier, half done: never put in
    unfinished.mkdir()
    (unfinished / builddir.BUILDER_NAME).write_text(str(gone.pid))
    path.rename(path.parent / f".{path.name}.old-{gone.pid}")
    with pytest.raises(DataError, match="no prepared cache"):
        open_prepared(config)
    report = prep.prepare(config)
    assert report.skipped  # up to date: nothing rebuilt
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert open_prepared(config).counts() == PreparedCorpus.open(path).counts()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here (it fails every write with ENOSPC)")
def test_a_full_standard_output_is_named(prepared_toy: Path) -> None:
    """`mtcli prepare CONFIG > /dev/full` said only "No space left on device", as if of the cache."""
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "mtcli.cli", "prepare", str(TOY_CONFIG), "--set",
                              f"data.source={TOY_DIR}", "--set", f"data.prepared_dir={prepared_toy}"],
                             stdout=full, stderr=subprocess.PIPE, timeout=300, check=False)
    assert res.returncode == 1
    assert res.stderr.decode().splitlines()[-1] == "mtcli: error: <stdout>: No space left on device"
