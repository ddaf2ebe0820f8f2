"""Subword regularisation: per-word n-best sampling of the training text's segmentation."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from mtcli.data.sampling import WordSegmentationSampler
from mtcli.data.textio import read_lines
from mtcli.data.tokenizer import Tokenizer

TOY_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "toy"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    text = list(read_lines(TOY_DIR / "train.src")) + list(read_lines(TOY_DIR / "train.tgt"))
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    path = Tokenizer.train(text, prefix, vocab_size=64, model_type="unigram",
                           character_coverage=1.0, max_sentences=1_000_000)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return list(read_lines(TOY_DIR / "train.tgt"))


def _sampler(tokenizer: Tokenizer, sentences: list[str], alpha: float, **kw) -> WordSegmentationSampler:
    best = [tokenizer.encode(s) for s in sentences]
    return WordSegmentationSampler(tokenizer, sentences, best, alpha, **kw)


def test_samples_spell_the_same_text_vary_and_repeat_per_seed(tokenizer: Tokenizer,
                                                              sentences: list[str]) -> None:
    sampler = _sampler(tokenizer, sentences, alpha=0.2)
    assert sampler.fixed == 0
    a = sampler.sample(np.random.default_rng([1, 0, 0]))
    again = sampler.sample(np.random.default_rng([1, 0, 0]))
    other = sampler.sample(np.random.default_rng([1, 1, 0]))
    assert np.array_equal(a.ids, again.ids) and np.array_equal(a.offsets, again.offsets)
    changed = 0
    for i, sentence in enumerate(sentences):
        best = tokenizer.encode(sentence)
        assert tokenizer.decode(a[i].tolist()) == tokenizer.decode(best)
        assert a.lengths[i] == len(a[i])
        changed += a[i].tolist() != best
    assert changed > len(sentences) // 4  # alpha 0.2 re-segments many sentences
    assert not np.array_equal(a.ids, other.ids) or not np.array_equal(a.offsets, other.offsets)
    assert a.lengths.sum() > sum(len(tokenizer.encode(s)) for s in sentences)  # finer on average


def test_large_alpha_gives_the_best_segmentation(tokenizer: Tokenizer, sentences: list[str]) -> None:
    sampler = _sampler(tokenizer, sentences, alpha=1000.0)
    sample = sampler.sample(np.random.default_rng(0))
    assert all(sample[i].tolist() == tokenizer.encode(s) for i, s in enumerate(sentences))


def test_candidates_are_drawn_with_probability_p_alpha(tokenizer: Tokenizer,
                                                      sentences: list[str]) -> None:
    words = sorted({w for s in sentences for w in s.split()})
    word = max(words, key=lambda w: len(tokenizer.nbest([w], 8)[0]))
    cands = tokenizer.nbest([word], 8)[0]
    assert len(cands) >= 2
    alpha = 0.5
    scores = np.array([s for _, s in cands]) * alpha
    expected = np.exp(scores - scores.max())
    expected /= expected.sum()
    n = 4000
    sampler = WordSegmentationSampler(tokenizer, [word] * n, [cands[0][0]] * n, alpha, nbest=8)
    sample = sampler.sample(np.random.default_rng(7))
    counts = np.zeros(len(cands))
    for i in range(n):
        counts[[ids for ids, _ in cands].index(sample[i].tolist())] += 1
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 5 * sigma + 1), (counts, n * expected)


def test_a_sentence_the_words_do_not_spell_keeps_its_best(tokenizer: Tokenizer,
                                                          sentences: list[str]) -> None:
    best = [tokenizer.encode(s) for s in sentences[:20]]
    best[3] = [5, 6, 7]  # not what its words concatenate to
    sampler = WordSegmentationSampler(tokenizer, sentences[:20], best, alpha=0.1)
    assert sampler.fixed == 1
    for seed in range(3):
        sample = sampler.sample(np.random.default_rng(seed))
        assert sample[3].tolist() == [5, 6, 7] and sample.lengths[3] == 3


def test_draws_are_the_same_in_another_process(tokenizer: Tokenizer, sentences: list[str],
                                               tmp_path: Path) -> None:
    """SentencePiece's own sampler gives different draws per process; ours must not."""
    code = (
        "import hashlib, sys, numpy as np\n"
        "from mtcli.data.textio import read_lines\n"
        "from mtcli.data.sampling import WordSegmentationSampler\n"
        "from mtcli.data.tokenizer import Tokenizer\n"
        "tok = Tokenizer(sys.argv[1]); lines = list(read_lines(sys.argv[2]))\n"
        "s = WordSegmentationSampler(tok, lines, [tok.encode(x) for x in lines], 0.2)\n"
        "d = s.sample(np.random.default_rng([1, 4, 1]))\n"
        "print(hashlib.sha256(d.ids.tobytes() + d.offsets.tobytes()).hexdigest())\n"
    )
    here = _sampler(tokenizer, sentences, alpha=0.2).sample(np.random.default_rng([1, 4, 1]))
    digest = hashlib.sha256(here.ids.tobytes() + here.offsets.tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", code, str(tokenizer.model_path),
                          str(TOY_DIR / "train.tgt")], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == digest


@pytest.mark.parametrize("sides", ["both", "source"])
def test_the_trainer_resegments_the_sides_asked_for(prepared_toy: Path, tmp_path: Path,
                                                    sides: str) -> None:
    from conftest import toy_train_config

    from mtcli.data.cache import PreparedCorpus
    from mtcli.data.sampling import subword_resegmenter

    config = toy_train_config(prepared_toy, tmp_path / "run", "train.subword_alpha=0.1",
                              f"train.subword_sides={sides}")
    corpus = PreparedCorpus.open(prepared_toy)
    tok = Tokenizer(corpus.spm_path)
    epoch0 = subword_resegmenter(corpus, config)(0)
    for side, lang in enumerate((config.data.src_lang, config.data.tgt_lang)):
        best = corpus.array(config.data.train_split, lang)
        same = [epoch0[side][i].tolist() == best[i].tolist() for i in range(len(best))]
        sampled = side == 0 or sides == "both"
        assert (not all(same)) if sampled else all(same), (lang, sides)
        assert all(tok.decode(epoch0[side][i].tolist()) == tok.decode(best[i].tolist())
                   for i in range(len(best)))
        if sampled:  # each side draws with its own generator, seeded (train.seed, epoch, side)
            lines = list(read_lines(corpus.text_path(config.data.train_split, lang)))
            drawn = WordSegmentationSampler(tok, lines, best, config.train.subword_alpha, nbest=config.train.subword_nbest
                                            ).sample(np.random.default_rng([config.train.seed, 0, side]))
            assert all(epoch0[side][i].tolist() == drawn[i].tolist() for i in range(len(best))), lang


def test_a_bpe_model_is_refused_in_one_line(prepared_toy: Path, tmp_path: Path) -> None:
    """data.spm_model of a BPE model passed the config's check (data.spm_model_type: unigram,
    which a given model ignores), then SentencePiece's NBestEncode raised a traceback."""
    import types

    from conftest import toy_train_config

    from mtcli.data.sampling import subword_resegmenter
    from mtcli.errors import ConfigError

    text = list(read_lines(TOY_DIR / "train.src")) + list(read_lines(TOY_DIR / "train.tgt"))
    bpe = Tokenizer.train(text, tmp_path / "bpe", vocab_size=64, model_type="bpe", character_coverage=1.0,
                          max_sentences=1_000_000)
    config = toy_train_config(prepared_toy, tmp_path / "run", "train.subword_alpha=0.1")
    with pytest.raises(ConfigError, match=rf"^train.subword_alpha > 0 samples from a unigram SentencePiece model; "
                                          rf"{bpe} is not one"):
        subword_resegmenter(types.SimpleNamespace(spm_path=bpe, corpora=None), config)  # type: ignore[arg-type]
