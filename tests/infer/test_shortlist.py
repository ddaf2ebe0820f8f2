"""Lexical shortlists (mtcli.infer.shortlist): the table, and what a restricted search equals."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TOY_CONFIG, TOY_DIR, prepare_for_run
from test_search import VOCAB, pad_batch, random_model, random_sources, tokens_of

from mtcli.data.tokenizer import EOS_ID
from mtcli.errors import ConfigError
from mtcli.infer.loading import load_for_inference
from mtcli.infer.packed import pack_for_decoding, packing_supported
from mtcli.infer.quantize import int8_supported, quantize_for_decoding
from mtcli.infer.search import generate
from mtcli.infer.shortlist import Shortlist, build_shortlist
from mtcli.infer.translate import translate_lines, translate_texts
from mtcli.model import Transformer


def listing(ids: list[int]) -> Shortlist:
    """A shortlist whose candidates are ``ids`` (and the special pieces) whatever the source."""
    return Shortlist(torch.full((VOCAB, 1), -1, dtype=torch.long), torch.tensor(ids))


def assert_same_results(a: list, b: list) -> None:
    assert tokens_of(a) == tokens_of(b)
    for x, y in zip(a, b, strict=True):
        for hx, hy in zip(x, y, strict=True):
            assert hx.score == pytest.approx(hy.score, abs=1e-4)
            assert hx.logprob == pytest.approx(hy.logprob, abs=1e-4)


def test_table_keeps_the_likeliest_targets_of_each_source_piece() -> None:
    source = [np.array([4, 5]), np.array([4]), np.array([5, 6]), np.array([4, 6, 6])]
    target = [np.array([10, 11]), np.array([10]), np.array([12]), np.array([10, 13, 10])]
    shortlist = build_shortlist(source, target, 16, per_source=2, frequent=1)
    # p(t | 4): 10 in 3 of 3 pairs, 11 and 13 in 1 (ties keep the lower id); p(t | 6): all 1/2
    assert shortlist.table[4].tolist() == [10, 11]
    assert shortlist.table[5].tolist() == [10, 11]
    assert shortlist.table[6].tolist() == [10, 12]
    assert shortlist.table[7].tolist() == [-1, -1]
    assert shortlist.frequent.tolist() == [10]  # in 3 target sentences (repeats count once)
    src = torch.tensor([[6, EOS_ID, 0]])
    assert shortlist.candidates(src).tolist() == [0, 1, 2, 3, 10, 12]


def test_a_piece_repeated_in_a_sentence_counts_once_and_unseen_pieces_are_never_frequent() -> None:
    source = [np.array([4]), np.array([4]), np.array([4])]
    target = [np.array([11, 11, 11]), np.array([12]), np.array([12])]
    shortlist = build_shortlist(source, target, 16, per_source=1, frequent=5)
    assert shortlist.table[4].tolist() == [12]  # p(12 | 4) = 2/3, p(11 | 4) = 1/3 (not 3/3)
    assert sorted(shortlist.frequent.tolist()) == [11, 12]  # the two seen, not 5 ids


def test_the_pairs_counted_are_spread_over_every_corpus() -> None:
    """Only the first MAX_PAIRS pairs were counted: in a multilingual cache, its corpora one after
    another, a later direction's tag and pieces got no candidates."""
    source = [np.array([4])] * 6 + [np.array([5])] * 2  # a second corpus, after the first
    target = [np.array([10])] * 6 + [np.array([12])] * 2
    shortlist = build_shortlist(source, target, 16, per_source=1, frequent=2, max_pairs=4)
    assert shortlist.table[5].tolist() == [12] and shortlist.table[4].tolist() == [10]
    assert sorted(shortlist.frequent.tolist()) == [10, 12]


def test_a_shortlist_wider_than_the_vocabulary_is_the_vocabulary() -> None:
    """decode.shortlist=100000000 on a 64-piece vocabulary asked for a 47.7 GiB table."""
    source, target = [np.array([4, 5])], [np.array([10, 11])]
    shortlist = build_shortlist(source, target, 16, per_source=10**8, frequent=1)
    assert tuple(shortlist.table.shape) == (16, 16)
    assert shortlist.table[4].tolist()[:3] == [10, 11, -1]


@pytest.mark.parametrize("beam", [1, 4])
def test_a_shortlist_of_the_whole_vocabulary_changes_nothing(beam: int) -> None:
    model = random_model(seed=3)
    src = pad_batch(random_sources(seed=4, n=6))
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0)
    assert_same_results(generate(model, src, shortlist=listing(list(range(VOCAB))), **kwargs),
                        generate(model, src, **kwargs))


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("beam", [1, 4])
def test_a_shortlist_search_is_the_search_of_a_model_with_only_those_pieces(beam: int, use_cache: bool) -> None:
    """Restricting the output to the candidates and normalising over them is exactly what a
    model whose output vocabulary is the candidates computes."""
    candidates = [0, 1, 2, 3, 5, 8, 9, 13, 16, 19, 21, 23]
    model = random_model(seed=5)
    listed = Transformer(model.cfg, VOCAB, output_ids=candidates).eval()
    listed.load_state_dict(model.state_dict(), strict=False)
    src = pad_batch(random_sources(seed=6, n=6))
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0, use_cache=use_cache)
    restricted = generate(model, src, shortlist=listing(candidates[4:]), **kwargs)
    assert_same_results(restricted, generate(listed, src, **kwargs))
    assert {t for hyps in tokens_of(restricted) for h in hyps for t in h} <= set(candidates)


def test_greedy_output_stays_when_the_shortlist_holds_every_piece_it_produced() -> None:
    model = random_model(seed=7)
    src = pad_batch(random_sources(seed=8, n=8))
    full = generate(model, src)
    produced = sorted({t for hyps in tokens_of(full) for h in hyps for t in h} | {EOS_ID})
    assert len(produced) < VOCAB - 4, "degenerate test: the output uses every piece"
    assert tokens_of(generate(model, src, shortlist=listing(produced))) == tokens_of(full)


def test_a_model_with_an_output_vocabulary_keeps_only_listed_candidates() -> None:
    listed = [0, 1, 2, 3, 6, 11, 14, 17, 20, 22]
    model = Transformer(random_model(seed=9).cfg, VOCAB, output_ids=listed).eval()
    restriction = listing([6, 7, 8, 11, 22]).restrict(model, pad_batch(random_sources(seed=10)))
    assert restriction.ids.tolist() == [0, 1, 2, 3, 6, 11, 22]
    hidden = torch.randn(3, model.cfg.d_model)
    expected = model.project(hidden)[:, [0, 1, 2, 3, 4, 5, 9]]
    torch.testing.assert_close(restriction.product(hidden), expected.detach())


@pytest.mark.parametrize("precision", ["packed", "int8"])
def test_decoding_copies_restrict_their_own_product(precision: str) -> None:
    if precision == "packed" and not packing_supported():
        pytest.skip("this PyTorch build has no oneDNN linear")
    if precision == "int8" and int8_supported() is not None:
        pytest.skip("no int8 kernels in this PyTorch build")
    model = random_model(seed=11)
    copy = pack_for_decoding(model) if precision == "packed" else quantize_for_decoding(model)
    restriction = listing([5, 9, 12]).restrict(copy, pad_batch(random_sources(seed=12)))
    hidden = torch.randn(4, 1, model.cfg.d_model)
    expected = copy.project(hidden)[..., restriction.ids]
    torch.testing.assert_close(restriction.product(hidden), expected, rtol=1e-4, atol=1e-4)


def test_translate_builds_the_table_from_the_run_s_prepared_cache(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    bundle = load_for_inference(run, "best")
    lines = (run / "text" / "val.src").read_text(encoding="utf-8").splitlines()[:6]
    decode = dataclasses.replace(bundle.config.decode, beam_size=2, shortlist=3, shortlist_frequent=10)
    with pytest.raises(ConfigError, match="decode.shortlist builds its table from the prepared cache"):
        translate_texts(bundle, lines, decode)
    # said when the model is loaded (serve then refuses to start), not at every request
    from mtcli.infer.translator import Translator

    with pytest.raises(ConfigError, match="decode.shortlist builds its table from the prepared cache"):
        Translator.from_run(run, device="cpu", shortlist=3)
    bundle.config.data.prepared_dir = str(prepare_for_run(run, tmp_path / "prepared"))
    assert len(translate_texts(bundle, lines, decode)) == len(lines)
    assert list(bundle.shortlists) == [(3, 10)]  # built once, kept for the next call
    shortlist = bundle.shortlists[(3, 10)]
    allowed = set(shortlist.candidates(torch.tensor([bundle.tokenizer.encode(line) for line in lines[:1]])).tolist())
    produced = translate_lines(bundle, lines[:1], decode)
    assert set(next(iter(produced))[0].tokens) <= allowed
    # the cache prepared again since, with another tokenizer: its ids are other pieces (the
    # table was built from them, and decoding wrote garbage or failed on an index)
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare

    again = tmp_path / "again"
    prepare(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={again}", "data.spm_model_type=bpe"]))
    bundle = load_for_inference(run, "best")
    bundle.config.data.prepared_dir = str(again)
    with pytest.raises(ConfigError, match="whose tokenizer is not this run's"):
        translate_texts(bundle, lines, decode)


def test_a_translator_of_a_relative_run_still_finds_its_files_after_a_change_of_directory(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host program that changed directory: a shortlist asked for later hashed 'run/spm.model',
    relative to the new directory (FileNotFoundError)."""
    import shutil

    from mtcli import Translator

    shutil.copytree(tiny_run_dir, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    translator = Translator.from_run("run", device="cpu")
    monkeypatch.chdir("/")
    assert translator.bundle.tokenizer.model_path == tmp_path / "run" / "spm.model"
