"""Tests of mtcli.train.validation: which pairs the validation loss counts, and Bests: which
validation score picks checkpoint_best and counts for train.patience, and how the bests resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import toy_train_config

from mtcli.config import config_from_dict
from mtcli.errors import ConfigError
from mtcli.train.validation import Bests


def valid(loss: float, bleu: float | None = None, chrf: float | None = None) -> dict:
    return {"loss": loss, "bleu": bleu, "chrf": chrf}


@pytest.mark.parametrize(("metric", "improved"), [
    ("bleu", [True, True, False, False]),   # BLEU 10, 12, 11, 12 (equal is not better)
    ("chrf", [True, False, True, False]),   # chrF 40, 39, 41, 41
    ("loss", [True, True, True, False]),    # loss 5, 4, 3, 3.5
])
def test_the_deciding_metric_improves_and_counts_patience(metric: str, improved: list[bool]) -> None:
    bests = Bests(metric)
    runs = [valid(5, 10, 40), valid(4, 12, 39), valid(3, 11, 41), valid(3.5, 12, 41)]
    assert [bests.update(r) for r in runs] == improved
    assert bests.bad_validations == improved[::-1].index(True)  # validations since the last better one
    assert (bests.bleu, bests.chrf, bests.loss) == (12, 41, 3)
    assert bests.best_by == metric


def test_without_decoding_the_loss_decides_and_a_switch_of_metric_starts_anew() -> None:
    bests = Bests("chrf")
    assert bests.update(valid(5.0)) and bests.best_by == "loss" and bests.best == -5.0
    assert not bests.update(valid(6.0)) and bests.bad_validations == 1
    assert bests.update(valid(7.0, 10, 30)) and bests.best_by == "chrf" and bests.bad_validations == 0


def test_bests_resume_and_an_older_checkpoint_says_what_its_best_was() -> None:
    bests = Bests("chrf")
    bests.update(valid(4, 10, 40))
    bests.update(valid(5, 9, 39))
    again = Bests("chrf")
    again.load_state_dict(bests.state_dict())
    assert again == bests
    older = Bests("bleu")  # a checkpoint written before chrF and best_by were recorded
    older.load_state_dict({"best": 12.5, "best_bleu": 12.5, "best_loss": 3.0, "bad_validations": 2})
    assert older.best_by == "bleu" and older.bad_validations == 2 and older.chrf is None
    older.load_state_dict({"best": -3.0, "best_bleu": None, "best_loss": 3.0})
    assert older.best_by == "loss"


def test_a_resume_under_another_metric_starts_its_patience_anew() -> None:
    """A run stopped by patience=1 on chrF, resumed with valid_metric loss: it went on stopping
    at once ("no better validation chrF") while its loss improved."""
    stopped = Bests("chrf")
    stopped.update(valid(4, 10, 40))
    stopped.update(valid(3, 9, 39))
    assert stopped.bad_validations == 1
    resumed = Bests("loss")
    said = resumed.load_state_dict(stopped.state_dict())
    assert resumed.bad_validations == 0
    assert said == ["checkpoint_best was picked by chrF, and loss picks it now: the next validation it scores replaces "
                    "it, and the best that picks it and counts patience starts again from there"]  # (it was unsaid)
    assert resumed.update(valid(3.5))  # worse than the best loss, 3: yet checkpoint_best's now, as said
    same = Bests("chrf")
    assert same.load_state_dict(stopped.state_dict()) == []
    assert same.bad_validations == 1  # the same metric: exactly where it was


def test_chrf_without_decoding_is_refused() -> None:
    with pytest.raises(ConfigError, match="train.valid_metric: chrf scores the decoded validation split"):
        config_from_dict({"data": {"name": "x", "source": "x", "src_lang": "de", "tgt_lang": "en"},
                          "train": {"valid_metric": "chrf", "valid_bleu": False}})


def test_a_resume_under_another_label_smoothing_or_subset_forgets_the_bests_it_changed() -> None:
    """A run resumed with label_smoothing 0.1 -> 0: its unsmoothed losses were compared with
    the smoothed best, so checkpoint_best froze and patience counted them as worse."""
    smoothed = Bests("loss", {"label_smoothing": 0.1, "valid_max_sentences": 0})
    smoothed.update(valid(3.0, 20, 50))
    smoothed.update(valid(3.2, 19, 49))
    resumed = Bests("loss", {"label_smoothing": 0.0, "valid_max_sentences": 0})
    notes = resumed.load_state_dict(smoothed.state_dict(), {"label_smoothing": 0.1, "valid_max_sentences": 0})
    assert notes == ["the validation loss is measured otherwise now (label_smoothing 0.1 -> 0.0): its best so far "
                     "starts again, and so does the best that picks checkpoint_best and counts patience"]
    assert (resumed.best, resumed.loss, resumed.bad_validations) == (None, None, 0)
    assert (resumed.bleu, resumed.chrf) == (20, 50)  # decoding does not see the smoothing
    assert resumed.update(valid(3.5))  # the first unsmoothed loss is the new best
    by_bleu = Bests("bleu", {"label_smoothing": 0.0, "valid_max_sentences": 0})
    by_bleu.load_state_dict(smoothed.state_dict() | {"best": 20, "best_by": "bleu", "bad_validations": 1})
    by_bleu.rebase({"label_smoothing": 0.1, "valid_max_sentences": 0})
    assert (by_bleu.best, by_bleu.bad_validations, by_bleu.loss) == (20, 1, None)
    subset = Bests("bleu", {"label_smoothing": 0.1, "valid_max_sentences": 100})
    subset.load_state_dict(by_bleu.state_dict())
    assert subset.rebase({"label_smoothing": 0.1, "valid_max_sentences": 0})
    assert (subset.best, subset.bleu, subset.chrf, subset.bad_validations) == (None, None, None, 0)
    same = Bests("bleu", {"label_smoothing": 0.1, "valid_max_sentences": 0})
    same.load_state_dict(by_bleu.state_dict())
    assert same.rebase({"label_smoothing": 0.1}) == [] and same.best == 20  # an older config lacks a key


def test_the_validation_loss_counts_the_first_valid_max_sentences_and_pairs_at_the_length_limit(
        prepared_toy: Path, tmp_path: Path) -> None:
    """Target tokens (eos included) the validation loss counts: every pair of the split when
    model.max_positions - 1 is its longest side (a pair at the limit is kept), all but those
    longest pairs one position less; and with train.valid_max_sentences=3 the first three."""
    from mtcli.data.cache import PreparedCorpus
    from mtcli.data.tokenizer import PAD_ID
    from mtcli.model import Transformer
    from mtcli.train.loss import LabelSmoothedLoss
    from mtcli.train.validation import validation_loss

    corpus = PreparedCorpus.open(prepared_toy)
    split = corpus.eval_split("val", "src", "tgt")
    src, tgt = corpus.array(split, "src").lengths, corpus.array(split, "tgt").lengths
    assert corpus.source_prefix("tgt") == []
    longest = max(src.max(), tgt.max())
    pair_width = [max(int(a), int(b)) for a, b in zip(src, tgt, strict=True)]

    def tokens(*extra: str) -> int:
        config = toy_train_config(prepared_toy, tmp_path / "run", *extra)
        model = Transformer(config.model, corpus.vocab_size)
        with torch.no_grad():
            return validation_loss(model, LabelSmoothedLoss(0.1, PAD_ID), corpus, config, torch.device("cpu"))[2]

    assert tokens(f"model.max_positions={longest + 1}") == int(tgt.sum()) + len(tgt)
    shorter = [int(n) + 1 for n, w in zip(tgt, pair_width, strict=True) if w < longest]
    assert len(shorter) < len(tgt)
    assert tokens(f"model.max_positions={longest}") == sum(shorter)
    assert tokens("train.valid_max_sentences=3") == int(tgt[:3].sum()) + 3
