"""Sampling decoding (mtcli.infer.sampling): the filters keep what they should, samples are seeded
and independent of batching, their log-probabilities are the model's, and the option reaches
Translator, `mtcli translate`, the server and the CTranslate2 engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import mtcli_here

from mtcli.data.tokenizer import BOS_ID, PAD_ID
from mtcli.errors import ConfigError
from mtcli.infer.sampling import filtered_logprobs
from mtcli.infer.search import Sampling, generate
from mtcli.infer.translator import Translator
from tests.infer.test_search import pad_batch, random_model, random_sources, teacher_forced_logprob

LINES = ["eine katze spielt", "ein hund läuft im park", "rot"]


def test_topk_keeps_the_k_best_and_topp_the_smallest_nucleus() -> None:
    logp = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), dim=-1)
    kept = filtered_logprobs(logp, "topk", 2, 1.0, 1.0).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]
    probs = logp.exp()[0].tolist()  # about 0.64, 0.24, 0.09, ...
    nucleus = filtered_logprobs(logp, "topp", 10, probs[0] + 0.01, 1.0).isfinite()
    assert nucleus.tolist() == [[True, True, False, False, False]]  # the best alone is short of p
    assert filtered_logprobs(logp, "topp", 10, 0.01, 1.0).isfinite().tolist() == [[True] + [False] * 4]
    # a nucleus below float32's least value (it reads as 0) still keeps the best token: it kept none
    assert filtered_logprobs(logp, "topp", 10, 1e-300, 1.0).isfinite().tolist() == [[True] + [False] * 4]
    hot = filtered_logprobs(logp, "topk", 5, 1.0, 2.0)
    assert torch.allclose(hot, logp / 2.0)


def test_both_filters_sample_from_the_tempered_distribution() -> None:
    """Temperature applies under top-p as under top-k: with every token kept (topp 1.0, k = V)
    the draw is from softmax(log p / T), not from the model's own p; and the nucleus is that of
    the tempered distribution (T 0.5 sharpens it, so fewer tokens reach the same mass)."""
    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), dim=-1)
    want = torch.softmax(logp / 0.5, dim=-1)
    for method in ("topp", "topk"):
        got = filtered_logprobs(logp, method, 4, 1.0, 0.5).softmax(dim=-1)
        assert torch.allclose(got, want, atol=1e-6), method
    # untempered the best token holds 0.64 and the first two 0.88; at T 0.5, 0.86 and 0.98
    assert filtered_logprobs(logp, "topp", 4, 0.8, 1.0).isfinite().tolist() == [[True, True, False, False]]
    assert filtered_logprobs(logp, "topp", 4, 0.8, 0.5).isfinite().tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("method", ["topk", "topp"])
def test_samples_are_seeded_and_do_not_depend_on_the_batch(method: str) -> None:
    model, sources = random_model(seed=3), random_sources(seed=4, n=5)
    how = Sampling(method, topk=20, topp=0.95, temperature=1.3, seed=11)
    batch = generate(model, pad_batch(sources), nbest=3, length_penalty=1.0, sample=how)
    again = generate(model, pad_batch(sources), nbest=3, length_penalty=1.0, sample=how)
    alone = generate(model, pad_batch(sources[2:3]), nbest=3, length_penalty=1.0, sample=how)
    other = generate(model, pad_batch(sources), nbest=3, length_penalty=1.0,
                     sample=Sampling(method, topk=20, topp=0.95, temperature=1.3, seed=12))
    tokens = [[h.tokens for h in hyps] for hyps in batch]
    assert all(len(hyps) == 3 for hyps in batch)
    assert tokens == [[h.tokens for h in hyps] for hyps in again]
    assert tokens[2] == [h.tokens for h in alone[0]]
    assert tokens != [[h.tokens for h in hyps] for hyps in other]
    assert len({tuple(t) for hyps in tokens for t in hyps}) > 5  # samples differ from one another


def test_a_sample_scores_the_model_log_probability_and_never_draws_pad_or_bos() -> None:
    model, sources = random_model(seed=5), random_sources(seed=6, n=4)
    results = generate(model, pad_batch(sources), nbest=2, length_penalty=0.0,
                       sample=Sampling("topk", topk=50, temperature=2.0, seed=1))
    for src_ids, hyps in zip(sources, results, strict=True):
        for h in hyps:
            assert PAD_ID not in h.tokens and BOS_ID not in h.tokens
            assert h.logprob == pytest.approx(teacher_forced_logprob(model, src_ids, h.tokens), abs=1e-4)
            assert h.score == pytest.approx(h.logprob)


def test_a_uniform_draw_of_exactly_zero_takes_no_token_of_probability_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.rand gives 0.0 once in 2^24 draws: the inverse CDF then took the first token, pad,
    at probability 0 (a pad mid-sample, its score -inf)."""
    from mtcli.infer import sampling

    inf = float("-inf")
    logits = torch.tensor([[inf, inf, -1.0, inf, -0.5], [inf, inf, inf, -2.0, 0.0]])  # pad, bos at -inf
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(*args))
    assert sampling.draw(logits, [torch.Generator(), torch.Generator()]).tolist() == [2, 3]
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.full(args, 1 - 2 ** -24))
    assert sampling.draw(logits, [torch.Generator(), torch.Generator()]).tolist() == [4, 4]


def test_bad_sampling_settings_name_their_key() -> None:
    model, src = random_model(), pad_batch(random_sources(n=1))
    with pytest.raises(ConfigError, match="decode.temperature must be > 0"):
        generate(model, src, sample=Sampling("topk", temperature=0.0))
    with pytest.raises(ConfigError, match="decode.topp must be in"):
        generate(model, src, sample=Sampling("topp", topp=1.5))


def test_the_command_line_names_its_own_sampling_options_and_takes_the_configs_values(tiny_run_dir: Path) -> None:
    """``--sampling foo`` and ``--temperature 0`` were refused as the config keys
    ``decode.sampling`` and ``decode.temperature``, which the user had not written."""
    import typing

    from mtcli.cli_options import SAMPLING_SCHEMES, TEMPERATURE_RANGE
    from mtcli.config import DECODE_RANGES
    from mtcli.settings import DecodeConfig

    assert SAMPLING_SCHEMES == typing.get_args(typing.get_type_hints(DecodeConfig)["sampling"])
    assert TEMPERATURE_RANGE == DECODE_RANGES["temperature"]
    for args, said in ((["--sampling", "foo"], "Invalid value for '--sampling': 'foo' is not one of none, topk, topp"),
                       (["--sampling", "topk", "--temperature", "0"], "Invalid value for '--temperature'"),
                       (["--temperature", "101"], "Invalid value for '--temperature'")):
        done = mtcli_here("translate", str(tiny_run_dir), *args, stdin=b"rot\n")
        assert done.returncode == 2 and said in done.stderr.decode(), done.stderr
        assert "decode." not in done.stderr.decode()


def test_translator_and_the_command_line_sample(tiny_run_dir: Path, tmp_path: Path) -> None:
    translator = Translator.from_run(tiny_run_dir, device="cpu")
    samples = translator.nbest(LINES, 4, sampling="topk", topk=5, seed=7)
    assert [len(n) for n in samples] == [4, 4, 4]
    assert translator.nbest(LINES[1:2], 4, sampling="topk", topk=5, seed=7)[0] == samples[1]
    assert translator.translate(LINES, sampling="topk", topk=5, seed=7) == [n[0].text for n in samples]
    with pytest.raises(ConfigError, match="decode.sampling"):
        translator.translate(LINES, sampling="nucleus")
    with pytest.raises(ConfigError, match="^temperature: for sampling only"):  # a search would ignore it
        translator.translate(LINES, temperature=0.8)
    with pytest.raises(ConfigError, match="^topk, temperature: for sampling only"):
        Translator.from_run(tiny_run_dir, device="cpu", beam=2, topk=5, temperature=0.8)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "mtcli.cli", "translate", str(tiny_run_dir), str(source), "--sampling", "topp",
           "--temperature", "0.8", "--seed", "3", "--nbest", "2"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    texts = [line.split("\t", 1)[1] for line in first.stdout.splitlines()]
    drawn = translator.nbest(LINES, 2, sampling="topp", temperature=0.8, seed=3)
    assert texts == [h.text for hyps in drawn for h in hyps]  # the same samples as from Python


def test_the_server_samples_as_the_translator_does(tiny_run_dir: Path) -> None:
    pytest.importorskip("fastapi", reason="mtcli serve needs the serve extra")
    pytest.importorskip("httpx", reason="the test client needs httpx")
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    expected = translator.translate(LINES, sampling="topk", temperature=1.5, seed=5)
    with TestClient(create_app(translator)) as client:
        answer = client.post("/translate", json={"text": LINES, "sampling": "topk", "temperature": 1.5, "seed": 5})
        assert answer.status_code == 200 and answer.json()["translations"] == expected
        assert client.post("/translate", json={"text": LINES, "sampling": "beam"}).status_code == 422
        assert client.post("/translate", json={"text": LINES, "temperature": 0}).status_code == 422
        ignored = client.post("/translate", json={"text": LINES, "temperature": 1.5})  # no sampling asked for
        assert ignored.status_code == 422 and "temperature" in ignored.json()["error"], ignored.text
        assert "nbest" not in answer.json()  # the answer's shape without nbest is unchanged


def test_the_server_answers_n_samples_or_the_n_best_per_line(tiny_run_dir: Path) -> None:
    pytest.importorskip("fastapi", reason="mtcli serve needs the serve extra")
    pytest.importorskip("httpx", reason="the test client needs httpx")
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    drawn = translator.nbest(LINES, 3, sampling="topp", temperature=1.2, seed=7)
    best = translator.nbest(LINES, 3)  # the run's beam (2) widens to 3
    with pytest.raises(ConfigError, match="nbest 3 with beam 2"):
        translator.nbest(LINES, 3, beam=2)
    with TestClient(create_app(translator)) as client:
        answer = client.post("/translate", json={"text": LINES, "sampling": "topp", "temperature": 1.2,
                                                 "seed": 7, "nbest": 3})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert [[h["text"] for h in hyps] for hyps in body["nbest"]] == [[h.text for h in d] for d in drawn]
        assert body["translations"] == [d[0].text for d in drawn]
        narrow = client.post("/translate", json={"text": LINES, "beam": 2, "nbest": 3})
        assert narrow.status_code == 422 and "nbest 3 with beam 2" in narrow.json()["error"]
        searched = client.post("/translate", json={"text": LINES, "nbest": 3}).json()
        assert [[round(h["score"], 4) for h in hyps] for hyps in searched["nbest"]] == \
            [[round(h.score, 4) for h in b] for b in best]
        for n in (0, 17):
            refused = client.post("/translate", json={"text": LINES, "nbest": n})
            assert refused.status_code == 422 and "nbest must be between 1 and 16" in refused.json()["error"]


def test_the_ctranslate2_engine_samples_and_says_its_samples_are_not_seeded(
        tiny_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer import ct2

    ct2._warn_unseeded.cache_clear()  # said once a process: another test of this worker may have said it
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    engine = Translator.from_run(run, device="cpu", engine="ctranslate2")
    samples = engine.nbest(LINES, 3, sampling="topk", topk=5)
    assert [len(n) for n in samples] == [3, 3, 3]
    assert "not reproducible" in caplog.text
    # a seed asked for is refused, as serve refuses it in a request: it would give other samples each call
    with pytest.raises(ConfigError, match="^seed: --engine ctranslate2's samples cannot be seeded"):
        engine.nbest(LINES, 3, sampling="topk", seed=1)
    for given in ({"sampling": "topk", "seed": 1}, {"overrides": ["decode.seed=4"]}):
        with pytest.raises(ConfigError, match="^seed: --engine ctranslate2's samples cannot be seeded"):
            Translator.from_run(run, device="cpu", engine="ctranslate2", **given)
