"""Tests of mtcli.data.overlap: prepare warns of validation and test pairs that are also training
pairs, counted alike whether the cleaner deduplicated (its keys asked) or not (the text hashed),
in one process or several, and in each corpus's own direction."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import TOY_CONFIG, TOY_DIR, make_trilingual, multi_overrides

import mtcli.data.corpora as corpora_module
from mtcli.config import load_config
from mtcli.data.overlap import eval_pair_keys, found_in_text, overlap_of
from mtcli.data.prepare import prepare
from mtcli.data.textio import read_lines

SHARED = re.compile(r"(\S+): pairs that are also training pairs \(of (\S+), source and target alike\): "
                    r"(\d+) of (\d+) \(")


def _append(path: Path, lines: list[str]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.writelines(f"{line}\n" for line in lines)


def _config(root: Path, tmp_path: Path, *more: str):
    return load_config(TOY_CONFIG, [f"data.source={root}", f"data.prepared_dir={tmp_path / 'prepared'}", *more])


def _warned(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, int, int]]:
    """(split, training split, shared pairs, pairs) of each overlap warning."""
    found = [SHARED.search(r.getMessage()) for r in caplog.records if r.levelname == "WARNING"]
    return [(m[1], m[2], int(m[3]), int(m[4])) for m in found if m]


@pytest.fixture
def leaky(toy_dir: Path) -> Path:
    """The toy corpus with three training pairs at the end of its test split (one of them
    twice), one in its validation split, and pairs that are not training pairs: a training
    source with another target, two training sides swapped, and a blank line."""
    src, tgt = list(read_lines(TOY_DIR / "train.src")), list(read_lines(TOY_DIR / "train.tgt"))
    _append(toy_dir / "test.src", [src[0], src[1], src[2], src[2], src[3], tgt[4], ""])
    _append(toy_dir / "test.tgt", [tgt[0], tgt[1], tgt[2], tgt[2], tgt[5], src[4], ""])
    _append(toy_dir / "val.src", [src[7]])
    _append(toy_dir / "val.tgt", [tgt[7]])
    return toy_dir


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_eval_pairs_that_are_training_pairs_are_counted_and_warned_of(
        leaky: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        dedup: bool, workers: int) -> None:
    """The same counts from the cleaner's keys (dedup) as from hashing the text, and from
    several workers (the parent's cleaner holds every range's keys) as from one."""
    monkeypatch.setattr(corpora_module, "PARALLEL_CLEAN_BYTES", 0)  # the toy corpus goes to the workers
    caplog.set_level("WARNING", logger="mtcli")
    prepare(_config(leaky, tmp_path, f"data.dedup={str(dedup).lower()}", f"data.num_workers={workers}"))
    assert sorted(_warned(caplog)) == [("test", "train", 4, 46), ("val", "train", 1, 41)]


def test_eval_splits_of_other_pairs_are_not_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="mtcli")
    prepare(_config(TOY_DIR, tmp_path))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_each_corpus_is_compared_in_its_own_direction(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A validation pair that is the toy's first training pair is one of the training pairs of
    every corpus that holds that pair: src->tgt, tgt->src (its sides the other way round),
    src->xx, and the tagged corpus made of the toy's first 100 pairs."""
    root = make_trilingual(tmp_path / "multi")
    for lang in ("src", "tgt", "xx"):
        _append(root / "tri" / f"val.{lang}", [next(iter(read_lines(root / "tri" / f"train.{lang}")))])
    caplog.set_level("WARNING", logger="mtcli")
    prepare(load_config(TOY_CONFIG, multi_overrides(root, tmp_path / "prepared")))
    assert sorted(_warned(caplog)) == [("val", f"train.{k}", 1, 41) for k in range(4)]


def test_the_training_split_as_validation_or_test_split_is_warned_of(
        toy_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="mtcli")
    prepare(_config(toy_dir, tmp_path, "data.valid_split=train", "data.test_splits=[test, train]"))
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2, said
    assert said[0].startswith("data.valid_split is the training split ('train'): validation scores pairs the model "
                              "trains on")
    assert said[1].startswith("data.test_splits holds the training split ('train'): its scores are of pairs")


def test_keys_are_found_across_blocks_and_in_the_order_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mtcli.data.overlap as overlap

    monkeypatch.setattr(overlap, "PAIRS_PER_BLOCK", 3)
    src, tgt = tmp_path / "a.src", tmp_path / "a.tgt"
    src.write_text("".join(f"s{i}\n" for i in range(10)))
    tgt.write_text("".join(f"t{i}\n" for i in range(10)))
    asked_src, asked_tgt = tmp_path / "e.src", tmp_path / "e.tgt"
    asked_src.write_text("s9\ns1\n \ns1\ns2\ns9")  # a blank source, and a last line with no newline
    asked_tgt.write_text("t9\nt2\nt3\nt1\nt2\nt9")
    keys = eval_pair_keys(asked_src, asked_tgt)
    assert len(keys) == 5 and keys.dtype == np.uint64
    assert found_in_text(src, tgt, keys).tolist() == [True, False, True, True, True]
    assert found_in_text(src, tgt, keys[:0]).tolist() == []


def test_the_count_is_recorded_and_said_again_when_the_cache_is_up_to_date(
        leaky: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mtcli.data.cache import PreparedCorpus

    config = _config(leaky, tmp_path)
    prepare(config)
    assert PreparedCorpus.open(tmp_path / "prepared").manifest["shared_with_training"] == {
        "test": {"train": {"langs": ["src", "tgt"], "shared": 4, "pairs": 46}},
        "val": {"train": {"langs": ["src", "tgt"], "shared": 1, "pairs": 41}}}
    caplog.clear()
    caplog.set_level("WARNING", logger="mtcli")
    assert prepare(config).skipped
    assert sorted(_warned(caplog)) == [("test", "train", 4, 46), ("val", "train", 1, 41)]


def test_evaluate_says_how_many_test_pairs_the_model_trained_on(
        leaky: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Beside the scores of a split that prepare counted, in the report and a warning; not
    known (None) for files given as --src/--ref, and none ({}) for a split without any."""
    from mtcli.evaluate import evaluate
    from mtcli.train.run import train

    for lang in ("src", "tgt"):  # the validation split as the toy's: no training pair
        (leaky / f"val.{lang}").write_bytes((TOY_DIR / f"val.{lang}").read_bytes())
    run = tmp_path / "run"
    config = _config(leaky, tmp_path, f"train.run_dir={run}", "train.max_steps=2", "train.valid_every=2",
                     "train.valid_bleu=false")
    prepare(config)
    train(config)
    options = dict(checkpoint="last", average_last=0, average_best=0, overrides=["decode.beam_size=1"],
                   output_dir=tmp_path / "eval")
    caplog.set_level("WARNING", logger="mtcli")
    report = evaluate(run, split="test", src_file=None, ref_file=None, **options)
    assert report["shared_with_training"] == {"train": {"shared": 4, "pairs": 46}}
    said = [r.getMessage() for r in caplog.records if "pairs the model trained on" in r.getMessage()]
    assert said == ["test src-tgt: 4 of its 46 pairs are also pairs the model trained on (of train, as prepare "
                    "counted them): its scores overstate how the model translates text it has not seen"]
    assert evaluate(run, split="val", src_file=None, ref_file=None, **options)["shared_with_training"] == {}
    given = evaluate(run, split=None, src_file=leaky / "test.src", ref_file=leaky / "test.tgt", **options)
    assert given["shared_with_training"] is None


def test_a_split_is_said_shared_by_the_corpora_of_its_two_languages_either_way() -> None:
    record = {"test": {"train.0": {"langs": ["en", "de"], "shared": 2, "pairs": 9},
                       "train.1": {"langs": ["de", "en"], "shared": 3, "pairs": 9},
                       "train.2": {"langs": ["en", "fr"], "shared": 4, "pairs": 9}}}
    assert overlap_of(record, "test", ("de", "en")) == {"train.0": {"shared": 2, "pairs": 9},
                                                       "train.1": {"shared": 3, "pairs": 9}}
    assert overlap_of(record, "test", ("fr", "de")) == {}
    assert overlap_of(record, "val", ("en", "de")) == {}
