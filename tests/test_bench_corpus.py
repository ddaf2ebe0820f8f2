"""bench/make_wmt_corpus.py at a small size: every form it writes (text, gz, parquet,
save_to_disk, tsv) prepares into the same cache with the WMT14 base recipe's data settings,
which trains a few steps; in the tsv form, the pairs with a tab inside a sentence are dropped."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import REPO, bench_script, shared_corpus

from mtcli.config import load_config
from mtcli.data.prepare import prepare
from mtcli.train import train

pytest.importorskip("pyarrow", reason="the parquet form needs pyarrow")
pytest.importorskip("datasets", reason="the save_to_disk form needs datasets")


def test_every_form_prepares_the_same_cache_and_trains(tmp_path: Path) -> None:
    shared_corpus("multi30k")
    shared_corpus("wmt-news-en-de")
    script = bench_script("make_wmt_corpus")
    report = script.write_corpus(tmp_path / "corpus", 1500, list(script.FORMS), seed=3)
    assert report["pairs"] == 1500
    train_en = (tmp_path / "corpus" / "text" / "train.en").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(train_en) == 1500 and len(set(train_en)) > 1400
    again = script.write_corpus(tmp_path / "again", 1500, ["text"], seed=3)  # deterministic
    assert (tmp_path / "again" / "text" / "train.de").read_bytes() == \
        (tmp_path / "corpus" / "text" / "train.de").read_bytes() and again["pairs"] == 1500
    digests = {}
    for form in script.FORMS:
        overrides = [f"data.source={tmp_path / 'corpus' / form}", "data.hub_config=null",
                     f"data.prepared_dir={tmp_path / 'prepared' / form}", "data.vocab_size=1000",
                     "data.num_workers=1", "model.d_model=64", "model.n_heads=2", "model.encoder_layers=1",
                     "model.decoder_layers=1", "model.d_ff=128", "train.device=cpu", "train.precision=fp32",
                     "train.max_steps=2", "train.update_freq=1", "train.max_tokens=1024",
                     "train.valid_bleu=false", "train.num_threads=1", "train.progress=false", "train.compile=false",
                     f"train.run_dir={tmp_path / 'runs' / form}"]
        config = load_config(REPO / "configs" / "wmt14_en_de_base.yaml", overrides)
        result = prepare(config)
        digests[form] = [hashlib.sha256((result.directory / name).read_bytes()).hexdigest()
                         for name in ("train.en.bin", "validation.de.bin")]
        assert result.counts["validation"]["kept"] == 3000 and result.counts["test"]["kept"] == 3003
        if form in ("text", "tsv"):  # the other forms' caches are the text form's (the digests below)
            assert train(config).steps == 2
        if form == "tsv":  # a sentence with a tab in it makes a line of three columns: an empty pair
            train_de = (tmp_path / "corpus" / "text" / "train.de").read_text(encoding="utf-8").split("\n")[:-1]
            tabbed = sum("\t" in en or "\t" in de for en, de in zip(train_en, train_de, strict=True))
            assert tabbed and result.counts["train"]["dropped"]["empty"] == tabbed
    del digests["tsv"]  # another training text: another SentencePiece model, other ids
    assert len({tuple(d) for d in digests.values()}) == 1, digests
    for name in ("validation.de.txt", "test.en.txt"):  # kept as they are, in every form
        assert (tmp_path / "prepared" / "tsv" / name).read_bytes() == (tmp_path / "prepared" / "text" / name).read_bytes()
