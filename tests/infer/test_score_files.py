"""Tests of ``mtcli score`` (mtcli.infer.files.score_files) and the scoring of pairs it runs
(Translator.score): the numbers, their lines, windows, lengths the model cannot read, and bad input."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import MTCLI, ForkedPython, fifo_of, mtcli_here

from mtcli import Translator
from mtcli.config import ModelConfig
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.errors import DataError
from mtcli.infer import files
from mtcli.infer.files import score_files
from mtcli.infer.translator import _target_logprobs
from mtcli.model import Transformer

SOURCES = ["eine katze spielt", "", "rot", "zwei kleine kinder", "ein hund"]
TARGETS = ["a cat plays", "red", "", "two small children", "a dog"]


@pytest.fixture(scope="module")
def translator(tiny_run_dir: Path) -> Translator:
    return Translator.from_run(tiny_run_dir, device="cpu")


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    src, tgt = tmp_path / "pairs.de", tmp_path / "pairs.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(TARGETS) + "\n", encoding="utf-8")
    return src, tgt


def test_each_line_is_the_pairs_log_probability(translator: Translator, tiny_run_dir: Path,
                                                 pair: tuple[Path, Path], tmp_path: Path) -> None:
    expected = translator.score(SOURCES, TARGETS)
    res = mtcli_here("score", str(tiny_run_dir), str(pair[0]), str(pair[1]), "--device", "cpu")
    assert res.returncode == 0, res.stderr.decode()
    assert [float(v) for v in res.stdout.decode().splitlines()] == pytest.approx(expected, abs=1e-4)
    assert all(v < 0 for v in expected)
    out = tmp_path / "scores.txt"
    res = mtcli_here("score", str(tiny_run_dir), str(pair[0]), str(pair[1]), "--device", "cpu", "--normalize",
                     "-o", str(out))
    assert res.returncode == 0 and res.stdout == b"", res.stderr.decode()
    pieces = [len(translator.bundle.tokenizer.encode(t)) + 1 for t in TARGETS]  # and </s>
    normalised = [float(v) for v in out.read_text(encoding="utf-8").splitlines()]
    assert normalised == pytest.approx([e / n for e, n in zip(expected, pieces, strict=True)], abs=1e-4)
    assert translator.score(SOURCES, TARGETS, normalize=True) == pytest.approx(normalised, abs=1e-4)


def test_windows_score_as_one_call_and_name_their_own_lines(translator: Translator, tiny_run_dir: Path,
                                                            pair: tuple[Path, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    long = " ".join(["hund"] * 400)
    pair[0].write_text("\n".join([*SOURCES, long]) + "\n", encoding="utf-8")
    pair[1].write_text("\n".join([*TARGETS, "a dog"]) + "\n", encoding="utf-8")
    monkeypatch.setattr(files, "WINDOW", 2)
    out = tmp_path / "scores.txt"
    summary = score_files(tiny_run_dir, pair[0], pair[1], out, device="cpu")
    assert summary["pairs"] == 6
    got = [float(v) for v in out.read_text(encoding="utf-8").splitlines()]
    assert got == pytest.approx(translator.score([*SOURCES, long], [*TARGETS, "a dog"]), abs=1e-4)
    assert f"{pair[0]}: line 6: 400 pieces, truncated to the model limit of" in caplog.text  # not line 2 of its window


def test_a_target_longer_than_the_model_can_produce_scores_minus_infinity(translator: Translator,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """It was a DataError that ended the whole call: one line of a crawled corpus lost the rest."""
    long = " ".join(["dog"] * 400)
    with caplog.at_level(logging.WARNING):
        scores = translator.score(["ein hund", "ein hund", *["rot"] * 5], ["a dog", long, *[long] * 5])
    assert math.isfinite(scores[0]) and scores[1:] == [-math.inf] * 6
    assert scores[0] == pytest.approx(translator.score(["ein hund"], ["a dog"])[0], abs=1e-5)
    assert "targets[1]: 400 pieces, more than the model's limit of" in caplog.text
    assert "targets: 3 more longer than the model's limit" in caplog.text and "(indices 4, 5, 6)" in caplog.text
    assert "targets[4]" not in caplog.text  # the rest in one line


def test_files_of_other_lengths_are_refused_before_the_model_loads(tiny_run_dir: Path, pair: tuple[Path, Path],
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pair[1].write_text("a cat plays\n", encoding="utf-8")

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Translator, "from_run", loaded)
    out = tmp_path / "scores.txt"
    with pytest.raises(DataError, match=rf"^{pair[0]}: 5 lines but {pair[1]}: 1; score takes one target line"):
        score_files(tiny_run_dir, pair[0], pair[1], out)
    assert not out.exists()


def test_a_stream_that_ends_first_is_named_and_nothing_is_written(tiny_run_dir: Path, pair: tuple[Path, Path],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "_is_regular", lambda path: False)  # counted as a stream is: not before
    monkeypatch.setattr(files, "WINDOW", 2)  # a window written before the end is found
    pair[1].write_text("\n".join(TARGETS[:3]) + "\n", encoding="utf-8")
    out = tmp_path / "scores.txt"
    with pytest.raises(DataError, match=rf"^{pair[1]}: ends at line 3, but {pair[0]} goes on"):
        score_files(tiny_run_dir, pair[0], pair[1], out, device="cpu")
    assert set(tmp_path.iterdir()) == set(pair)  # no output, nor a temporary one left


def test_pairs_from_streams_are_scored_as_they_arrive(translator: Translator, tiny_run_dir: Path,
                                                     tmp_path: Path) -> None:
    """score waited for 2,000 pairs or the end of its streams: a program that writes a pair and
    waits for its score (a reranker's co-process) waited for ever."""
    src, tgt, out = tmp_path / "src.fifo", tmp_path / "tgt.fifo", tmp_path / "out.txt"
    os.mkfifo(src)
    os.mkfifo(tgt)
    proc = ForkedPython(MTCLI, ["score", str(tiny_run_dir), str(src), str(tgt), "--device", "cpu", "-q"], out,
                        stdout=True)
    try:
        with open(src, "w", encoding="utf-8") as sources, open(tgt, "w", encoding="utf-8") as targets:
            for count, (source, target) in enumerate(zip(SOURCES[:2], TARGETS[:2], strict=True), 1):
                sources.write(source + "\n")
                sources.flush()
                targets.write(target + "\n")
                targets.flush()
                deadline = time.monotonic() + 60
                while len(re.findall(r"^-?[\d.]+$", proc.stderr_text(), re.M)) < count:
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr_text()
                    time.sleep(0.05)
        assert proc.wait(timeout=60) == 0, proc.stderr_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    scores = [float(v) for v in proc.stderr_text().split()]
    assert scores == pytest.approx(translator.score(SOURCES[:2], TARGETS[:2]), abs=1e-4)


def test_one_stream_given_twice_is_refused_before_it_is_read(tiny_run_dir: Path, pair: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """The two readers shared its lines: 4,000 scores of lines that were not pairs, then an
    error that named the stream as ending while it went on."""
    fifo = tmp_path / "pairs.fifo"
    fifo_of(pair[0], fifo)
    with pytest.raises(DataError, match=rf"^{fifo} and {fifo}: one stream given as both"):
        score_files(tiny_run_dir, fifo, fifo, None)


def test_its_messages_speak_of_scoring(tiny_run_dir: Path, pair: tuple[Path, Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of score's errors were translate's: "(translate t >> t); write the translation to
    another file" and "changed while it was translated; translate it again"."""
    import sys

    with open(pair[1], "a", encoding="utf-8") as appended:
        monkeypatch.setattr(sys, "stdout", appended)
        with pytest.raises(DataError, match=rf"^{pair[1]}: is also standard output \(>> {pair[1]}\); write the score "
                                            "list to another file"):
            score_files(tiny_run_dir, pair[0], pair[1], None)
    monkeypatch.undo()
    real = Translator.score

    def score(self: Translator, *args: object, **kwargs: object) -> list[float]:
        pair[1].write_text("x\n", encoding="utf-8")  # rewritten while being read
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Translator, "score", score)
    with pytest.raises(DataError, match=rf"^{pair[1]}: changed while score read it; score it again once it is"):
        score_files(tiny_run_dir, pair[0], pair[1], tmp_path / "scores.txt", device="cpu")


@pytest.mark.parametrize(("args", "says"), [
    (["missing.de", "{tgt}"], "missing.de: input file not found"),
    (["-", "{tgt}"], "-: score reads a source and a target file; give standard input as /dev/stdin"),
    (["{src}", "{tgt}", "-o", "{src}"], "{src}: is the input {src}; write the score list to another file"),
    (["{src}", "{tgt}", "-o", "{src}.gz"], "{src}.gz: the score list is written as plain text"),
])
def test_bad_input_is_one_line(args: list[str], says: str, tiny_run_dir: Path, pair: tuple[Path, Path]) -> None:
    given = [a.format(src=pair[0], tgt=pair[1]) for a in args]
    res = mtcli_here("score", str(tiny_run_dir), *given)
    assert res.returncode != 0
    error = res.stderr.decode().strip()
    assert error.startswith(f"mtcli: error: {says.format(src=pair[0])}") and "\n" not in error, error


def test_log_probabilities_are_read_off_the_output_vocabulary_as_off_the_widened_one() -> None:
    """A model whose softmax covers an output vocabulary: each listed target's log-probability is
    the widened softmax's, an unlisted one (which the model cannot produce) -inf, pad 0."""
    torch.manual_seed(0)
    listed = [PAD_ID, 1, BOS_ID, EOS_ID, 6, 11, 14, 17]
    config = ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, d_ff=32, max_positions=16)
    model = Transformer(config, 24, output_ids=listed).eval()
    logits = torch.randn(2, 4, model.output_size)
    target = torch.tensor([[6, 11, EOS_ID, PAD_ID], [14, 9, 17, EOS_ID]])  # 9 is not listed
    expected = torch.log_softmax(model.widen(logits), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    got = _target_logprobs(model, logits, target)
    assert got[0, 3] == 0.0 and got[1, 1] == -math.inf
    keep = torch.ones_like(target, dtype=torch.bool)
    keep[0, 3] = keep[1, 1] = False
    assert torch.allclose(got[keep], expected[keep], atol=1e-6)
    whole = Transformer(config, 24).eval()  # no output vocabulary: the joint softmax itself
    joint = torch.randn(2, 4, 24)
    assert torch.allclose(_target_logprobs(whole, joint, target)[keep],
                          torch.log_softmax(joint, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep], atol=1e-6)


def test_an_interrupted_scoring_goes_on_from_its_last_window(tiny_run_dir: Path, pair: tuple[Path, Path],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(files, "WINDOW", 2)
    whole = tmp_path / "whole.txt"
    score_files(tiny_run_dir, pair[0], pair[1], whole, device="cpu")
    scored = Translator.score
    calls: list[int] = []

    def interrupted(self: Translator, sources: list[str], targets: list[str], **kwargs: object) -> list[float]:
        calls.append(kwargs["first_line"])  # type: ignore[arg-type]
        if calls == [1, 3]:
            raise KeyboardInterrupt
        return scored(self, sources, targets, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Translator, "score", interrupted)
    out = tmp_path / "scores.txt"
    for normalize in (True, False):  # a partial output of other settings is scored again, not resumed
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            score_files(tiny_run_dir, pair[0], pair[1], out, device="cpu", normalize=normalize)
        assert not out.exists() and calls == [1, 3]
    calls.clear()
    with caplog.at_level(logging.INFO, logger="mtcli"):
        summary = score_files(tiny_run_dir, pair[0], pair[1], out, device="cpu")
    assert calls == [3, 5] and summary["resumed_after"] == 2 and summary["pairs"] == 5
    assert "resuming after input line 2" in caplog.text
    assert out.read_text(encoding="utf-8") == whole.read_text(encoding="utf-8")
