"""Running out of memory: one line that names the setting to lower, and the advice works.

The allocator's failure is simulated (``torch.OutOfMemoryError`` raised where a GPU would raise
it: inside the loss or the search), since the test machine has no GPU to fill; everything
around it, from the trainer to the command line and the server, is the real code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import typer
from conftest import TOY_CONFIG, toy_train_overrides
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.device import is_out_of_memory
from mtcli.rundir import checkpoint_dir
from mtcli.train.loss import LabelSmoothedLoss

ALLOCATOR = "CUDA out of memory. Tried to allocate 2.00 GiB"


def test_is_out_of_memory_knows_the_allocators_failures_also_wrapped() -> None:
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**62, dtype=torch.uint8)  # more than any address space: the C allocator refuses
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError(ALLOCATOR))
    wrapped = RuntimeError("backend='inductor' raised")  # as torch.compile reports a failure inside it
    wrapped.inner_exception = torch.OutOfMemoryError(ALLOCATOR)  # type: ignore[attr-defined]
    assert is_out_of_memory(wrapped)
    try:
        raise RuntimeError("the step failed") from torch.OutOfMemoryError(ALLOCATOR)
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported ..."))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("CUDA failed with error out of memory"))  # CTranslate2's
    assert is_out_of_memory(MemoryError())  # std::bad_alloc of a C++ library, through pybind11
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    try:  # an allocation failure already handled is not the cause of the next error
        try:
            raise torch.OutOfMemoryError(ALLOCATOR)
        except torch.OutOfMemoryError:
            raise RuntimeError("something else") from None
    except RuntimeError as exc:
        assert not is_out_of_memory(exc)


def fail_training_forward(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """The ``call``-th training forward of the loss (counted from 1) runs out of memory."""
    real = LabelSmoothedLoss.forward
    calls = {"n": 0}

    def forward(self, logits, target):  # noqa: ANN001, ANN202
        if torch.is_grad_enabled():  # not the validation loss
            calls["n"] += 1
            if calls["n"] == call:
                raise torch.OutOfMemoryError(ALLOCATOR)
        return real(self, logits, target)

    monkeypatch.setattr(LabelSmoothedLoss, "forward", forward)


def train_argv(prepared: Path, run: Path, *extra: str) -> list[str]:
    argv = ["train", str(TOY_CONFIG)]
    for item in toy_train_overrides(prepared, run, "train.progress=false", *extra):
        argv += ["--set", item]
    return argv


def error_line(result) -> str:  # noqa: ANN001
    """The run's one error line (and that it is the only line on stderr naming an error)."""
    assert "Traceback" not in result.stderr and ALLOCATOR not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mtcli: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def train_out_of_memory(monkeypatch: pytest.MonkeyPatch, argv: list[str], call: int) -> str:
    """``mtcli train`` whose ``call``-th training forward runs out of memory: its error line."""
    fail_training_forward(monkeypatch, call)
    result = CliRunner().invoke(app, argv)
    monkeypatch.undo()
    assert result.exit_code == 1
    return error_line(result)


def test_a_first_run_that_does_not_fit_says_how_to_halve_the_batches(
        prepared_toy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    argv = train_argv(prepared_toy, run, "train.max_steps=3", "train.valid_every=100")
    line = train_out_of_memory(monkeypatch, argv, call=2)
    assert line.startswith("mtcli: error: out of memory on cpu after step 1: batches of train.max_tokens=512 do "
                           "not fit; run again with smaller ones"), line
    advice = "--set train.max_tokens=256 --set train.update_freq=2"
    assert f"({advice}, the same update size)" in line
    again = CliRunner().invoke(app, argv + advice.split())  # the advice, taken: nothing refuses it
    assert again.exit_code == 0, again.stderr


def test_running_out_after_a_checkpoint_says_resume_and_the_resume_finishes(
        prepared_toy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    argv = train_argv(prepared_toy, run, "train.max_steps=4", "train.valid_every=2")
    line = train_out_of_memory(monkeypatch, argv, call=3)
    assert "after step 2: run the same command to resume from the last checkpoint; if it fails again, resume " \
           "with smaller batches (--set train.max_tokens=256 --set train.update_freq=2" in line, line
    assert "PYTORCH_CUDA_ALLOC_CONF" not in line  # a CUDA setting, not offered on a CPU
    assert (checkpoint_dir(run) / "checkpoint_last.pt").is_file()
    again = CliRunner().invoke(app, argv)
    assert again.exit_code == 0, again.stderr
    assert "stopped at step 4" in (run / "train.log").read_text(encoding="utf-8")


def test_a_resume_that_does_not_fit_at_once_resumes_with_the_smaller_batches_it_is_given(
        prepared_toy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint that saved its batch budget resumes under a new train.max_tokens: the
    epoch's unseen pairs are batched anew (logged as inexact)."""
    run = tmp_path / "run"
    assert CliRunner().invoke(app, train_argv(prepared_toy, run, "train.max_steps=2")).exit_code == 0
    argv = train_argv(prepared_toy, run, "train.max_steps=4")
    line = train_out_of_memory(monkeypatch, argv, call=1)
    advice = "--set train.max_tokens=256 --set train.update_freq=2"
    assert f"after step 2: batches of train.max_tokens=512 do not fit; resume with smaller ones ({advice}" in line
    again = CliRunner().invoke(app, argv + advice.split())
    assert again.exit_code == 0, again.stderr
    log = (run / "train.log").read_text(encoding="utf-8")
    assert "WARNING | config change on resume: train.max_tokens: 512 -> 256 (resume no longer exact)" in log
    assert "resumed from" in log and "stopped at step 4" in log


def fail_batches_over(monkeypatch: pytest.MonkeyPatch, sentences: int,
                      error: type[BaseException] = torch.OutOfMemoryError) -> None:
    """The search runs out of memory (raises ``error``) on a batch of more than ``sentences``
    sentences."""
    import mtcli.infer.translate as translate

    real = translate.generate

    def generate(model, src, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if src.shape[0] > sentences:
            raise error(ALLOCATOR)
        return real(model, src, **kwargs)

    monkeypatch.setattr(translate, "generate", generate)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError], ids=["torch", "bad_alloc"])
def test_translate_decodes_a_batch_that_does_not_fit_in_halves(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]) -> None:
    """A long job goes on: the batch is decoded again in halves, to the same output, and a
    warning names decode.max_tokens. One sentence that does not fit alone stops it, naming the
    beam, with no output file written. A ``MemoryError`` (a C++ library's ``std::bad_alloc``)
    is an allocation failure too."""
    source = tmp_path / "in.txt"
    source.write_text("ein Hund\nzwei Hunde\ndrei Katzen\n", encoding="utf-8")
    argv = ["translate", str(tiny_run_dir), str(source), "-o"]
    assert CliRunner().invoke(app, [*argv, str(tmp_path / "whole.txt")]).exit_code == 0
    fail_batches_over(monkeypatch, sentences=1, error=error)
    halves = CliRunner().invoke(app, [*argv, str(tmp_path / "halves.txt")])
    assert halves.exit_code == 0, halves.stderr
    assert (tmp_path / "halves.txt").read_text(encoding="utf-8") == (tmp_path / "whole.txt").read_text(encoding="utf-8")
    warned = [line.partition(" | WARNING | ")[2] for line in halves.stderr.splitlines() if "two halves" in line]
    assert warned and warned[0].startswith("out of memory on cpu decoding 3 sentence(s) of up to ")
    assert warned[0].endswith("decoding them in two halves (a lower decode.max_tokens, now 512, avoids this)")
    fail_batches_over(monkeypatch, sentences=0, error=error)
    alone = CliRunner().invoke(app, [*argv, str(tmp_path / "none.txt")])
    assert alone.exit_code == 1
    assert re.search(r"decoding 1 sentence\(s\) of up to \d+ pieces with beam 2: lower the beam "
                     r"\(decode.beam_size, --beam\)$", error_line(alone))
    assert not (tmp_path / "none.txt").exists()


def test_after_a_batch_that_does_not_fit_the_next_windows_are_cut_smaller(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Only the first window pays for a failed batch: the later ones are cut to half its tokens,
    so the warning (and the wasted search) is not repeated window after window."""
    from mtcli.infer.translate import translate_lines
    from mtcli.infer.translator import Translator

    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    lines = ["ein Hund", "zwei Hunde"] * 4
    def run() -> list[str]:
        return [n[0].text for n in translate_lines(translator.bundle, lines, translator.decode, "cpu", window=2)]

    whole = run()
    fail_batches_over(monkeypatch, sentences=1)
    assert run() == whole
    warned = [r.getMessage() for r in caplog.records if "two halves" in r.getMessage()]
    assert len(warned) == 1, warned


def test_once_a_batch_fits_no_other_batch_of_the_window_fails(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A device that holds batches of at most 50 source slots: after the first batch did not
    fit, the window's other batches (made before) are cut to the lowered size before they are
    tried, instead of each failing in turn (a warning and a wasted search apiece)."""
    import mtcli.infer.translate as translate
    from mtcli.infer.translator import Translator

    lines = ["ein Hund läuft", "zwei Hunde", "drei Katzen", "rot", "die Frau mit dem Hund"] * 8
    whole = Translator.from_run(tiny_run_dir, beam=2, device="cpu", max_tokens=256).translate(lines)
    real, tried = translate.generate, []

    def generate(model, src, **kwargs):  # noqa: ANN001, ANN003, ANN202
        tried.append(src.numel() <= 50)
        if not tried[-1]:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return real(model, src, **kwargs)

    monkeypatch.setattr(translate, "generate", generate)
    assert Translator.from_run(tiny_run_dir, beam=2, device="cpu", max_tokens=256).translate(lines) == whole
    first_fit = tried.index(True)
    assert first_fit > 0 and all(tried[first_fit:]), tried
    warned = [r.getMessage() for r in caplog.records if "two halves" in r.getMessage()]
    assert len(warned) == first_fit


def test_a_translator_pays_for_a_batch_that_does_not_fit_once_not_once_a_call(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Under ``mtcli serve`` every request is a call of its own: after one batch did not fit, the
    later calls' batches are cut smaller at once, instead of failing and warning again each time.
    A call asking for fewer tokens than the lowered size keeps its own."""
    from mtcli.infer.translator import Translator

    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    lines = ["ein Hund", "zwei Hunde"]
    whole = translator.translate(lines)
    fail_batches_over(monkeypatch, sentences=1)
    assert [translator.translate(lines) for _ in range(3)] == [whole] * 3
    warned = [r.getMessage() for r in caplog.records if "two halves" in r.getMessage()]
    assert len(warned) == 1, warned
    assert translator.translate(lines, max_tokens=1) == whole  # below the lowered size: its own


def test_the_server_answers_503_only_for_a_request_that_does_not_fit_alone(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi", reason="serve is an extra: pip install -e '.[serve]'")
    from fastapi.testclient import TestClient

    from mtcli.infer.translator import Translator
    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    with TestClient(create_app(translator)) as client:
        fail_batches_over(monkeypatch, sentences=1)
        split = client.post("/translate", json={"text": ["ein Hund", "zwei Hunde"]})
        assert split.status_code == 200 and len(split.json()["translations"]) == 2  # in halves
        fail_batches_over(monkeypatch, sentences=0)
        big = client.post("/translate", json={"text": ["ein Hund"]})
        assert big.status_code == 503, big.text
        assert big.json()["error"].startswith("out of memory translating this request (request id ")
        assert big.json()["error"].endswith("send fewer or shorter lines")
        monkeypatch.undo()
        assert client.post("/translate", json={"text": ["ein Hund"]}).status_code == 200  # still serving


class _FillingTranslator:
    """A CTranslate2 translator whose device holds batches of at most ``fits`` source tokens."""

    def __init__(self, real, fits: int, error: BaseException) -> None:  # noqa: ANN001
        self.real, self.fits, self.error, self.sizes = real, fits, error, []

    def translate_batch(self, batch, *, max_batch_size, **options):  # noqa: ANN001, ANN201
        self.sizes.append(max_batch_size)
        if max_batch_size > self.fits:
            raise self.error
        return self.real.translate_batch(batch, max_batch_size=max_batch_size, **options)

    def score_batch(self, *args, **options):  # noqa: ANN002, ANN003, ANN201
        return self.real.score_batch(*args, **options)


def _ct2_translator(tiny_run_dir: Path, tmp_path: Path):  # noqa: ANN202
    """A CTranslate2 translator of a copy of the tiny run, and four lines for it (one output limit
    for all, so that a window is one call: the engine makes one call per limit)."""
    pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer.translator import Translator

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    return (Translator.from_run(run, beam=2, device="cpu", engine="ctranslate2", max_len_a=0.0, max_len_b=12),
            ["ein Hund", "zwei Hunde laufen", "drei Katzen", "rot"])


@pytest.mark.parametrize("error", [RuntimeError("CUDA failed with error out of memory"), MemoryError()],
                         ids=["cuda", "bad_alloc"])
def test_the_ctranslate2_engine_halves_its_batches_until_they_fit(
        tiny_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, error: BaseException) -> None:
    """CTranslate2's own allocation failures (its CUDA message; std::bad_alloc, a MemoryError in
    Python) make the engine halve its batches and keep them halved, to the same output; when a
    batch of one sentence does not fit, one error names the beam."""
    from mtcli.errors import DeviceMemoryError

    translator, lines = _ct2_translator(tiny_run_dir, tmp_path)
    whole = translator.translate(lines)
    engine = translator.engine
    filling = engine.translator = _FillingTranslator(engine.translator, fits=100, error=error)
    assert translator.translate(lines) == whole
    assert filling.sizes == [512, 256, 128, 64]
    warned = [r.getMessage() for r in caplog.records if "from now on" in r.getMessage()]
    assert warned[0] == ("out of memory on cpu decoding with CTranslate2 in batches of 512 tokens, beam 2: decoding "
                         "in batches of 256 tokens from now on (a lower decode.max_tokens, now 512, avoids this)")
    assert translator.translate(lines) == whole and filling.sizes[4:] == [64]  # kept halved
    filling.fits = 0
    with pytest.raises(DeviceMemoryError, match=r"in batches of \d+ tokens, beam 2: lower the beam"):
        translator.translate(lines)
    filling.error = RuntimeError("something else")
    with pytest.raises(RuntimeError, match="something else"):
        translator.translate(lines)


def test_the_ctranslate2_engine_tries_larger_batches_again_after_a_shortage(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtcli.device import MemoryBudget

    monkeypatch.setattr(MemoryBudget, "PATIENCE", 2)
    translator, lines = _ct2_translator(tiny_run_dir, tmp_path)
    whole = translator.translate(lines)
    engine = translator.engine
    filling = engine.translator = _FillingTranslator(engine.translator, fits=100, error=MemoryError())
    assert [translator.translate(lines) for _ in range(3)] == [whole] * 3
    assert filling.sizes == [512, 256, 128, 64, 64, 128, 64]  # a try at 128 after two windows fitted
    filling.fits = 1000  # the device has room again
    assert [translator.translate(lines) for _ in range(9)] == [whole] * 9
    assert filling.sizes[-6:] == [128, 128, 256, 256, 512, 512]  # back up, two windows a step

def test_score_scores_a_batch_that_does_not_fit_in_halves(tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from mtcli.errors import DeviceMemoryError
    from mtcli.infer.translator import Translator

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    sources, targets = ["ein Hund", "zwei Hunde", "rot"], ["a dog", "two dogs", "red"]
    whole = translator.score(sources, targets)
    model = translator.bundle.model
    real = type(model).forward

    def forward(self, src, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if src.shape[0] > fits:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    fits = 1
    assert translator.score(sources, targets) == pytest.approx(whole, abs=1e-5)
    assert any("scoring them in two halves (a lower max_tokens, now 512" in r.getMessage() for r in caplog.records)
    fits = 0
    with pytest.raises(DeviceMemoryError, match=r"scoring 1 pair\(s\) of up to \d+ pieces: the pair is too long"):
        translator.score(sources, targets)


def test_running_out_of_host_memory_where_nothing_can_go_smaller_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``MemoryError`` no step handles (numpy's, reading a corpus) ends the command with one
    line, not a traceback."""
    import mtcli.data.prepare as prepare

    def prepare_too_much(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise MemoryError("Unable to allocate 7.45 GiB for an array with shape (1000000000,)")

    monkeypatch.setattr(prepare, "prepare", prepare_too_much)
    result = CliRunner().invoke(app, ["prepare", str(TOY_CONFIG)])
    assert result.exit_code == 1
    assert result.stderr == "mtcli: error: out of memory: Unable to allocate 7.45 GiB for an array with shape " \
                            "(1000000000,)\n"


def test_once_a_scoring_batch_fits_no_other_fails_in_this_call_or_the_next(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtcli.infer.translator import Translator

    translator = Translator.from_run(tiny_run_dir, device="cpu", max_tokens=256)
    sources = ["ein Hund läuft", "zwei Hunde", "drei Katzen", "rot", "die Frau mit dem Hund"] * 8
    targets = ["a dog runs", "two dogs", "three cats", "red", "the woman with the dog"] * 8
    whole = translator.score(sources, targets)
    model = translator.bundle.model
    real, tried = type(model).forward, []

    def forward(self, src, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        tried.append(src.numel() <= 40)
        if not tried[-1]:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    assert translator.score(sources, targets) == pytest.approx(whole, abs=1e-5)
    first_fit = tried.index(True)
    assert first_fit > 0 and all(tried[first_fit:]), tried
    del tried[:]
    assert translator.score(sources, targets) == pytest.approx(whole, abs=1e-5)
    assert all(tried), tried  # the next call starts at the lowered size


class _SharedDevice:
    """A device that holds batches of at most ``room`` items (each item costs one token), and
    counts the batches that did not fit."""

    def __init__(self, room: int) -> None:
        self.room, self.failures, self.sizes = room, 0, []

    def run(self, items: list[int]) -> list[int]:
        self.sizes.append(len(items))
        if len(items) > self.room:
            self.failures += 1
            raise torch.OutOfMemoryError(ALLOCATOR)
        return items

    def call(self, budget, items: list[int]) -> list[int]:  # noqa: ANN001
        from mtcli.device import in_budget_halves

        def cut(part: list[int], most: int) -> list[list[int]]:
            return [list(range(i, min(i + most, len(part)))) for i in range(0, len(part), most)]

        return in_budget_halves(self.run, items, budget, len, cut, lambda part: "out of memory",
                                "too long", lambda part, where: None)


def test_a_lowered_budget_climbs_back_once_the_device_has_room_again() -> None:
    """A server beside a training: the training held memory for a while, then finished. The
    budget it lowered doubles back after ``PATIENCE`` batches that fit, to the batches of
    before, with the same results."""
    from mtcli.device import MemoryBudget

    budget, device, items = MemoryBudget(patience=8), _SharedDevice(room=25), list(range(40))
    assert [device.call(budget, items) for _ in range(10)] == [items] * 10
    assert budget.tokens == 20 and device.failures == 2  # the first batch, and a probe after 8
    device.room = 100  # the other process is gone
    for _ in range(10):
        assert device.call(budget, items) == items
    assert budget.tokens >= 40 and device.sizes[-3:] == [40] * 3 and device.failures == 2


def test_a_device_that_stays_short_pays_for_a_probe_less_and_less_often() -> None:
    """A failed probe puts the budget back where it fitted and doubles the wait for the next:
    over 2,000 batches, 6 failed batches (the first, then probes after 64, 128, 256, 512 and
    1,024 batches), not one every 64."""
    from mtcli.device import MemoryBudget

    budget, device, items = MemoryBudget(), _SharedDevice(room=25), list(range(40))
    for _ in range(1000):  # two batches of 20 a call
        assert device.call(budget, items) == items
    assert device.failures == 6 and budget.tokens == 20


def test_a_translator_decodes_larger_batches_again_after_a_shortage(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mtcli serve``'s Translator, through a shortage of 50 source slots: its batches shrink,
    then grow back to the size of before once the device has room again, to the same output."""
    import mtcli.infer.translate as translate
    from mtcli.device import MemoryBudget
    from mtcli.infer.translator import Translator

    monkeypatch.setattr(MemoryBudget, "PATIENCE", 4)
    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu", max_tokens=256)
    lines = ["ein Hund läuft", "zwei Hunde", "drei Katzen", "rot", "die Frau mit dem Hund"] * 8
    whole = translator.translate(lines)
    real, room, sizes = translate.generate, [50], []

    def generate(model, src, **kwargs):  # noqa: ANN001, ANN003, ANN202
        sizes.append(src.numel())
        if src.numel() > room[0]:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return real(model, src, **kwargs)

    monkeypatch.setattr(translate, "generate", generate)
    before = [translator.translate(lines) for _ in range(2)]
    assert before == [whole] * 2 and max(sizes) > 50
    room[0] = 10**9
    del sizes[:]
    after = [translator.translate(lines) for _ in range(8)]
    assert after == [whole] * 8
    assert max(sizes[-3:]) > 50, sizes  # the last calls' batches are as large as the first call's


def test_a_model_too_large_to_build_is_one_line(capsys: pytest.CaptureFixture) -> None:
    """model.d_model=200000 passed validation, then torch's CPU allocator failed in a
    RuntimeError the command's MemoryError branch did not catch: a traceback."""
    from mtcli.cli import handle_errors

    @handle_errors
    def builds() -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 43200000000 bytes")

    @handle_errors
    def fails() -> None:
        raise RuntimeError("something else")

    with pytest.raises(typer.Exit) as stopped:
        builds()
    assert stopped.value.exit_code == 1
    assert capsys.readouterr().err == ("mtcli: error: out of memory: [enforce fail at alloc_cpu.cpp:127] "
                                       "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                       "43200000000 bytes\n")
    with pytest.raises(RuntimeError, match="something else"):
        fails()


def test_an_os_error_naming_a_bytes_path_prints_the_path(capsys: pytest.CaptureFixture) -> None:
    """TensorBoard's writer names its event file in bytes: "b'/run/tensorboard/events...'"."""
    from mtcli.cli import handle_errors

    @handle_errors
    def refused() -> None:
        raise PermissionError(13, "Permission denied", b"/run/tensorboard/events.out")

    with pytest.raises(typer.Exit):
        refused()
    assert capsys.readouterr().err == "mtcli: error: /run/tensorboard/events.out: Permission denied\n"



@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 400000000 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
])
def test_a_checkpoint_that_does_not_fit_in_memory_is_not_called_unreadable(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException) -> None:
    """torch.load failing to allocate (``ulimit -v``, a full host) was reported as "unreadable
    checkpoint payload": read as a damaged file, which its user would delete. The payload's sha256
    has matched by then; the command says it ran out of memory, naming the file."""
    source = tmp_path / "in.txt"
    source.write_text("eine katze\n", encoding="utf-8")

    def load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise failure

    monkeypatch.setattr(torch, "load", load)
    result = CliRunner().invoke(app, ["translate", str(tiny_run_dir), str(source)])
    best = checkpoint_dir(tiny_run_dir) / "checkpoint_best.pt"
    assert result.exit_code == 1
    assert re.fullmatch(rf"mtcli: error: out of memory: {re.escape(str(best))}: loading its [\d,]+ MiB of weights "
                        r"\(.+\)\n", result.stderr), result.stderr


def test_a_checkpoint_that_cannot_be_serialised_for_memory_keeps_the_previous_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save failing to allocate was "cannot serialise checkpoint": read as a state that
    cannot be pickled. It is a shortage of memory, and the file before it stays as it was."""
    from mtcli.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "checkpoint_last.pt"
    save_checkpoint(path, {"step": 1})

    def save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise MemoryError()

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(MemoryError, match=rf"^{re.escape(str(path))}: serialising the checkpoint \(MemoryError\)$"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1


def test_a_checkpoint_too_large_to_read_names_the_file(tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory short already for the file's bytes: the error names the file and its size."""
    import io

    import mtcli.checkpoint as checkpoint

    class Unreadable(io.BytesIO):
        def read(self, *args: object) -> bytes:
            raise MemoryError()

    monkeypatch.setattr(checkpoint, "open", lambda *args, **kwargs: Unreadable(), raising=False)
    best = checkpoint_dir(tiny_run_dir) / "checkpoint_best.pt"
    with pytest.raises(MemoryError, match=rf"^{re.escape(str(best))}: reading its [\d,]+ MiB$"):
        checkpoint.load_checkpoint(best)


def test_a_model_that_does_not_fit_in_memory_is_not_called_a_mismatch(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's shapes are checked on the meta device first; building it for real can then
    fail only for memory, which was reported as "parameters do not fit the model of config.yaml"."""
    import mtcli.infer.loading as loading

    def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 43200000000 bytes")

    monkeypatch.setattr(loading, "Transformer", build)
    with pytest.raises(MemoryError, match=r"checkpoint_best.pt.*: building its model \(DefaultCPUAllocator"):
        loading.load_for_inference(tiny_run_dir)
