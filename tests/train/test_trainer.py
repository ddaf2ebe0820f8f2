"""The training loop on the toy corpus: run directory, stopping rules, exact resume, signals."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    MTCLI,
    TOY_CONFIG,
    TOY_DIR,
    ForkedPython,
    assert_same_params,
    logged_losses,
    toy_train_config,
    toy_train_overrides,
    wait_until,
)

from mtcli.checkpoint import load_checkpoint
from mtcli.config import load_config, save_config, with_changes
from mtcli.device import cpu_has_bf16_units
from mtcli.errors import CheckpointError, ConfigError, DataError, TrainingError
from mtcli.rundir import read_index
from mtcli.train import train
from mtcli.train.loss import LabelSmoothedLoss


@pytest.fixture
def prepared(prepared_toy: Path) -> Path:
    return prepared_toy


base_overrides = toy_train_overrides
make_config = toy_train_config


def model_params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def test_a_fresh_start_hides_the_scalars_a_killed_run_left_in_tensorboard(prepared: Path, tmp_path: Path) -> None:
    """A run killed before its first checkpoint starts again from step 0: TensorBoard (and the
    learning curves) show the new run's points, not the old run's past its steps."""
    from torch.utils.tensorboard import SummaryWriter

    from mtcli.plots import read_scalars

    run = tmp_path / "run"
    with SummaryWriter(str(run / "tensorboard")) as writer:
        for step in range(1, 9):
            writer.add_scalar("train/loss", 99.0, step)
    stale, = (run / "tensorboard").glob("events.out.tfevents.*")
    stale.rename(stale.with_name("events.out.tfevents.1000000000.killed.1.0"))  # an older second
    (run / "train.log").write_text("the killed run's log\n", encoding="utf-8")
    train(make_config(prepared, run, "train.max_steps=3", "train.valid_every=100"))
    losses = read_scalars(run / "tensorboard")["train/loss"]
    assert [step for step, _ in losses] == [1, 2, 3] and 99.0 not in {value for _, value in losses}


def test_run_directory_layout_and_checkpoints(prepared: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=6", "train.valid_every=2",
                                "train.keep_last=2"))
    assert summary.steps == 6 and summary.stop_reason.startswith("max_steps")
    assert summary.best_valid_loss is not None and summary.parameters > 0
    assert "max_steps" in summary.summary() and str(run) in summary.summary()
    assert "training pairs too long (never trained on): 0" in summary.summary()  # (subword sampling: it varies by epoch)
    assert re.search(r"\| update: 1 batch\(es\) of \d+ tokens a step a process \| lr noam \(factor [\d.]+, warmup \d+\) "
                     r"\| label smoothing [\d.]+\n", (run / "train.log").read_text(encoding="utf-8"))  # was unsaid
    for name in ("config.yaml", "spm.model", "manifest.json", "train.log", "text/val.src",
                 "text/val.tgt", "text/test.src", "text/test.tgt"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("checkpoint_*.pt")) == [
        "checkpoint_4.pt", "checkpoint_6.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    index = read_index(run)
    assert set(index) == {2, 4, 6} and all(e["loss"] is not None for e in index.values())
    state = load_checkpoint(ckpts / "checkpoint_last.pt")
    for key in ("format", "step", "epoch", "model", "optimizer", "scheduler", "rng", "data_state",
                "train_state", "config", "vocab", "valid"):
        assert key in state, key
    assert state["step"] == 6 and state["scheduler"]["step"] == 6
    assert state["vocab"]["size"] > 0 and len(state["vocab"]["spm_sha256"]) == 64
    assert state["config"]["train"]["max_steps"] == 6
    best = load_checkpoint(ckpts / "checkpoint_best.pt")
    best_step = min(index, key=lambda s: index[s]["loss"])
    assert best["step"] == best_step
    # a validation writes the state once: best and last are further names of its step file (a
    # run that ends on a validation keeps no second copy of its final state)
    assert (ckpts / "checkpoint_last.pt").samefile(ckpts / "checkpoint_6.pt")
    if best_step in (4, 6):
        assert (ckpts / "checkpoint_best.pt").samefile(ckpts / f"checkpoint_{best_step}.pt")
    log = (run / "train.log").read_text(encoding="utf-8")
    assert "parameters" in log and "skipped" in log and "padding" in log
    # the peak memory, beside tokens/s: on a CPU the process's resident set, which holds at
    # least the model's weights and Adam's two moments
    peaks = [float(m) for m in re.findall(r"\| step \d+ \|.*\| peak mem (\d+)M \| eta \S+$", log, re.M)]
    floor = summary.parameters * 4 * 3 / 2**20
    assert len(peaks) == 6 and all(floor < p <= summary.peak_memory_mb + 0.5 for p in peaks), (peaks, floor)  # logged as %.0f
    assert f"peak memory: {summary.peak_memory_mb:,.0f} MiB on cpu" in summary.summary()
    assert re.findall(r"\| step \d+ \|.*\| eta (\S+)$", log, re.M)[-1] == "0s"  # the last step: nothing left


def test_the_eta_of_the_first_window_leaves_out_the_compiling_first_step() -> None:
    from mtcli.train.step import eta_step_seconds

    assert eta_step_seconds(70.0, 100, warmup_seconds=60.1) == pytest.approx(0.1)  # a minute's compile
    assert eta_step_seconds(10.0, 100) == 0.1  # later windows: their mean
    assert eta_step_seconds(10.0, 1, warmup_seconds=9.0) == 10.0  # a window of one step is that step
    assert eta_step_seconds(10.0, 100, warmup_seconds=20.0) == 0.1  # a first step outside the window


def test_the_time_left_counts_steps_validations_epochs_and_the_time_limit() -> None:
    from conftest import FakeArray

    from mtcli.config import TrainConfig
    from mtcli.data.batching import BatchStream
    from mtcli.train.step import seconds_left

    array = FakeArray([[5] * 4] * 100)
    stream = BatchStream(array, array, max_tokens=50, max_source_length=10, max_target_length=10, seed=1,
                         update_freq=2)  # 10 pairs a batch: 10 batches, 5 steps an epoch
    cfg = TrainConfig(max_steps=1000, valid_every=100)
    assert seconds_left(cfg, 400, stream, 0.5, 20.0, elapsed=0) == 600 * (0.5 + 0.2)  # a validation: 0.2 s a step
    limited = TrainConfig(max_steps=1000, valid_every=100, max_minutes=5)
    assert seconds_left(limited, 400, stream, 0.5, 20.0, elapsed=240) == 60  # the limit comes first
    assert seconds_left(limited, 400, stream, 0.5, 20.0, elapsed=0) == 300
    for _ in range(2):
        stream.next_group()  # 3 steps left in epoch 0
    assert stream.steps_until_epoch(3) == 3 + 2 * 5
    epochs = TrainConfig(max_steps=1000, valid_every=100, max_epochs=3)
    assert seconds_left(epochs, 2, stream, 1.0, 0.0, elapsed=0) == 13  # the epochs end first


def test_resume_is_exact(prepared: Path, tmp_path: Path) -> None:
    """8 steps straight == 4 steps, a new process-like restart, 4 more (dropout on)."""
    extra = ("model.dropout=0.2", "train.valid_every=4", "train.update_freq=2")
    straight = tmp_path / "straight"
    train(make_config(prepared, straight, "train.max_steps=8", *extra))
    split = tmp_path / "split"
    first = train(make_config(prepared, split, "train.max_steps=4", *extra))
    assert first.steps == 4
    torch.manual_seed(12345)  # disturb the global RNG: resume must restore it
    second = train(make_config(prepared, split, "train.max_steps=8", *extra))
    assert second.steps == 8 and second.resumed_from is not None
    assert logged_losses(split) == logged_losses(straight)
    assert len(logged_losses(straight)) == 8
    assert_same_params(model_params(straight / "checkpoints" / "checkpoint_last.pt"),
                       model_params(split / "checkpoints" / "checkpoint_last.pt"))
    a, b = read_index(straight), read_index(split)
    assert a[8]["loss"] == b[8]["loss"]
    # the training speed counts both processes: the token total survives the restart
    done = [load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")["train_state"]["tokens_done"]
            for run in (straight, split)]
    assert done[0] == done[1] > 0 and second.tokens_per_second > 0
    log = (split / "train.log").read_text(encoding="utf-8")
    assert "train.max_steps: 4 -> 8" in log
    # the weights' sha256 (what evaluate and serve report) says so; the files' payloads differ
    from mtcli.checkpoint import load_checkpoint_with_id, weights_sha256

    (one, one_payload), (two, two_payload) = (load_checkpoint_with_id(run / "checkpoints" / "checkpoint_last.pt")
                                              for run in (straight, split))
    assert weights_sha256(one["model"]) == weights_sha256(two["model"]) and one_payload != two_payload


def test_logged_loss_is_the_window_mean_and_survives_resume(prepared: Path, tmp_path: Path) -> None:
    """With log_every=3 a log line reports the token-weighted mean of its 3 steps (not the last
    step alone), and a restart in the middle of a window logs the same means as a straight run."""
    import re

    per_step = tmp_path / "per_step"
    train(make_config(prepared, per_step, "train.max_steps=6", "train.valid_every=2"))
    steps = {k: float(v.split()[0]) for k, v in logged_losses(per_step).items()}
    straight = tmp_path / "straight"
    train(make_config(prepared, straight, "train.max_steps=6", "train.valid_every=2", "train.log_every=3"))
    windowed = {k: float(v.split()[0]) for k, v in logged_losses(straight).items()}
    assert sorted(windowed) == [3, 6]
    for end in (3, 6):
        window = [steps[s] for s in range(end - 2, end + 1)]
        assert min(window) - 1e-4 <= windowed[end] <= max(window) + 1e-4
        assert abs(windowed[end] - steps[end]) > 1e-4  # a mean, not the window's last step
    split = tmp_path / "split"
    train(make_config(prepared, split, "train.max_steps=4", "train.valid_every=2", "train.log_every=3"))
    train(make_config(prepared, split, "train.max_steps=6", "train.valid_every=2", "train.log_every=3"))
    assert logged_losses(split) == logged_losses(straight)
    pad = re.findall(r"step 6 \| .*\| pad (\S+)", (split / "train.log").read_text(encoding="utf-8"))
    assert pad and 0.0 <= float(pad[-1]) < 1.0


def test_rdrop_without_dropout_is_plain_training_and_with_dropout_is_not(
        prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two passes without dropout agree (KL 0, CE twice halved): R-Drop = the plain step.

    Compared by the losses logged at every step, not the weights: the key projection's bias
    has a zero gradient in exact arithmetic (softmax ignores a shift shared by all keys), and
    Adam turns float rounding noise there into full-size steps that change nothing else."""
    no_dropout = ("model.dropout=0.0", "model.attention_dropout=0.0", "model.activation_dropout=0.0",
                  "train.max_steps=6", "train.valid_every=6", "train.precision=fp32")
    for name, extra in (("plain", ()), ("rdrop", ("train.rdrop_alpha=5.0",))):
        train(make_config(prepared, tmp_path / name, *no_dropout, *extra))
    plain, rdrop = logged_losses(tmp_path / "plain"), logged_losses(tmp_path / "rdrop")
    warned = [r.message for r in caplog.records if "with every model dropout at 0" in r.message]
    assert len(warned) == 1 and "only doubles the step's cost" in warned[0]  # the rdrop run's, not the plain one's
    assert sorted(plain) == sorted(rdrop) == list(range(1, 7))
    for step in plain:
        assert [float(x) for x in rdrop[step].split()] == pytest.approx(
            [float(x) for x in plain[step].split()], rel=1e-3), step
    with_dropout = ("model.dropout=0.3", "train.max_steps=4", "train.valid_every=4", "train.precision=fp32")
    runs = {}
    for name, extra in (("plain_d", ()), ("rdrop_d", ("train.rdrop_alpha=5.0",))):
        train(make_config(prepared, tmp_path / name, *with_dropout, *extra))
        runs[name] = model_params(tmp_path / name / "checkpoints" / "checkpoint_last.pt")
    assert any(not torch.allclose(value, runs["rdrop_d"][key], atol=1e-5, rtol=1e-4)
               for key, value in runs["plain_d"].items())


def test_resume_refuses_model_change(prepared: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2"))
    with pytest.raises(CheckpointError, match="model.d_model"):
        train(make_config(prepared, run, "train.max_steps=4", "model.d_model=16"))
    with pytest.raises(CheckpointError, match="model.output_vocab"):
        train(make_config(prepared, run, "train.max_steps=4", "model.output_vocab=target"))


def test_a_cache_model_of_other_bytes_but_the_same_pieces_resumes_and_the_run_keeps_its_own(
        prepared: Path, tmp_path: Path) -> None:
    """A cache prepared again by another mtcli wrote the same SentencePiece model with another
    ``trainer_spec.num_threads``: every run made before refused to resume ("differs from ... the
    cache was re-prepared"). Here the run's copy and its checkpoints are the other bytes."""
    from conftest import respell_run_spm

    from mtcli import Translator
    from mtcli.fileio import sha256_file

    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2"))
    own = respell_run_spm(run, lambda proto: setattr(proto.trainer_spec, "num_threads", 7))
    assert own != sha256_file(prepared / "spm.model")
    assert train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2")).steps == 4
    assert sha256_file(run / "spm.model") == own
    assert {load_checkpoint(p)["vocab"]["spm_sha256"] for p in (run / "checkpoints").glob("*.pt")} == {own}
    assert len(Translator.from_run(run, device="cpu").translate(["ein hund"])) == 1
    respell_run_spm(run, lambda proto: setattr(proto.pieces[5], "score", proto.pieces[5].score + 1))  # another model
    with pytest.raises(CheckpointError, match="the checkpoint's SentencePiece model differs from"):
        train(make_config(prepared, run, "train.max_steps=6", "train.valid_every=2"))


def test_an_optimizer_state_of_other_groups_is_refused_with_a_way_on(prepared: Path, tmp_path: Path) -> None:
    """A run of an older mtcli (``train.decay_norms_and_biases: false``, one group of Adam's) gave
    "cannot restore model/optimizer (loaded state dict has a different number of parameter
    groups)", neither the cause nor what to do."""
    from mtcli.checkpoint import save_checkpoint

    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2"))
    last = run / "checkpoints" / "checkpoint_last.pt"
    state = load_checkpoint(last)
    *kept, group = state["optimizer"]["param_groups"]  # its last group split in two
    state["optimizer"]["param_groups"] = [*kept, {**group, "params": group["params"][:1]},
                                          {**group, "params": group["params"][1:]}]
    save_checkpoint(last, state)
    with pytest.raises(CheckpointError, match=r"cannot restore model/optimizer \(.*\): it was trained with other "
                                              rf"settings, or by another mtcli; .* \(--init-from {re.escape(str(run))}\)"):
        train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2"))


def test_a_checkpoint_directory_that_cannot_be_written_is_said_before_training(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoints/ on a read-only disk (a link there) was found at the first checkpoint, a
    whole validation interval of training later, and that training was lost."""
    import errno
    import tempfile

    import mtcli.train.run as run_module

    real = tempfile.TemporaryFile

    def read_only(*args: object, dir: str | Path | None = None, **kwargs: object) -> object:  # noqa: A002
        if dir is not None and Path(dir).name == "checkpoints":
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(run_module.tempfile, "TemporaryFile", read_only)
    steps: list[int] = []
    monkeypatch.setattr(run_module.Trainer, "train_step", lambda self, *a: steps.append(self.step))
    run = tmp_path / "run"
    with pytest.raises(OSError, match=r"Read-only file system: no checkpoint could be saved there") as caught:
        train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2"))
    assert caught.value.filename == str(run / "checkpoints") and steps == []


def test_resume_refuses_other_training_or_validation_pairs(prepared: Path, tmp_path: Path) -> None:
    """The cache prepared again from other data with the same SentencePiece model: the saved
    position would index other pairs (the rest of an epoch silently skipped), and the best
    checkpoint and patience would compare scores on other validation pairs."""
    import shutil

    from conftest import TOY_DIR

    from mtcli.data.prepare import prepare

    corpus = tmp_path / "corpus"
    shutil.copytree(TOY_DIR, corpus)
    run, cache = tmp_path / "run", tmp_path / "cache"

    def config(*extra: str):  # noqa: ANN202
        return make_config(prepared, run, f"data.source={corpus}", f"data.prepared_dir={cache}",
                           f"data.spm_model={prepared / 'spm.model'}", *extra)

    prepare(config())
    train(config("train.max_steps=2"))
    for split, what in (("train", "training"), ("val", "validation")):
        originals = {lang: (corpus / f"{split}.{lang}").read_text() for lang in ("src", "tgt")}
        for lang, text in originals.items():
            (corpus / f"{split}.{lang}").write_text("".join(text.splitlines(keepends=True)[: 30]))
        prepare(config())
        with pytest.raises(CheckpointError, match=f"cannot resume: the {what} pairs of .*cache are not the "
                                                  "checkpoint's"):
            train(config("train.max_steps=4"))
        for lang, text in originals.items():
            (corpus / f"{split}.{lang}").write_text(text)
        prepare(config())
    assert train(config("train.max_steps=4")).steps == 4  # the same pairs again: it resumes
    moved = shutil.copytree(corpus, tmp_path / "copy")  # the same files elsewhere (make ... DATA=copy): was
    prepare(config(f"data.source={moved}"))  # "cannot resume: data.source: ... -> ...", though the pairs are
    assert train(config(f"data.source={moved}", "train.max_steps=6")).steps == 6  # the checkpoint's
    assert f"INFO | config change on resume: data.source: '{corpus}' -> '{moved}'\n" in (run / "train.log").read_text("utf-8")


def test_output_vocabulary_target_trains_resumes_and_decodes_from_the_list(prepared: Path,
                                                                          tmp_path: Path) -> None:
    """``model.output_vocab: target``: the list is the training targets' pieces plus the special
    ids; it is saved with the weights, a resume continues exactly, and inference decodes from it."""
    from mtcli.data.batching import collate_sources
    from mtcli.data.cache import PreparedCorpus
    from mtcli.infer.loading import load_for_inference
    from mtcli.infer.search import generate

    extra = ("model.output_vocab=target", "train.valid_every=100000")
    straight = tmp_path / "straight"
    train(make_config(prepared, straight, "train.max_steps=4", *extra))
    split = tmp_path / "split"
    train(make_config(prepared, split, "train.max_steps=2", *extra))
    train(make_config(prepared, split, "train.max_steps=4", *extra))
    assert logged_losses(split) == logged_losses(straight)

    corpus = PreparedCorpus.open(prepared, verify=False)
    train_tgt = corpus.array("train", corpus.tgt_lang)
    expected = sorted({0, 1, 2, 3} | {int(t) for i in range(len(train_tgt)) for t in train_tgt[i]})
    assert len(expected) < corpus.vocab_size, "degenerate test: the targets use every piece"
    assert model_params(straight / "checkpoints" / "checkpoint_last.pt")["output_ids"].tolist() == expected
    assert f"output vocabulary: the {len(expected)} of {corpus.vocab_size} pieces" in \
        (straight / "train.log").read_text(encoding="utf-8")

    joint = tmp_path / "joint"  # the joint softmax smooths over more pieces: another loss
    train(make_config(prepared, joint, "train.max_steps=1", "train.valid_every=100000"))
    assert logged_losses(joint)[1] != logged_losses(straight)[1]

    bundle = load_for_inference(straight, "last")
    assert bundle.model.output_ids.tolist() == expected
    source = corpus.array("test", corpus.src_lang)
    with torch.inference_mode():
        hyps = generate(bundle.model, collate_sources([source[i].tolist() for i in range(8)], "cpu"),
                        beam_size=2, nbest=2)
    produced = {t for row in hyps for h in row for t in h.tokens}
    assert produced and produced <= set(expected)


def test_output_vocabulary_target_refuses_sampled_targets(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.output_vocab: target"):
        make_config(prepared, tmp_path / "run", "model.output_vocab=target", "train.subword_alpha=0.1")


def test_missing_cache_says_run_prepare(tmp_path: Path) -> None:
    config = make_config(tmp_path / "nothing", tmp_path / "run")
    # the command prepares what and where train reads (the data --set), not the train ones
    nothing, elsewhere = tmp_path / "nothing", tmp_path / "elsewhere"
    sets = " ".join(f"--set {shlex.quote(text)}" for text in (f"data.source={TOY_DIR}", f"data.prepared_dir={nothing}"))
    with pytest.raises(DataError, match=re.escape(f"run `mtcli prepare {shlex.quote(str(TOY_CONFIG))} {sets}` first")):
        train(config)
    # a data change made since, by a library caller, is said as its --set; one no --set can say is not
    from mtcli.config import with_changes

    moved = with_changes(config, "data", prepared_dir=str(elsewhere))
    assert moved.prepare_command().endswith(f" --set {shlex.quote(f'data.prepared_dir={elsewhere}')}")
    assert dataclasses.replace(config, overrides=None).prepare_command() == "mtcli prepare CONFIG"


def test_patience_stops_when_validation_does_not_improve(prepared: Path, tmp_path: Path) -> None:
    # lr factor 0: the weights never change, so validation never improves after the first.
    summary = train(make_config(prepared, tmp_path / "run", "train.lr_factor=0.0",
                                "train.max_steps=100", "train.valid_every=2", "train.patience=2"))
    assert summary.steps == 6
    assert summary.stop_reason.startswith("patience")
    # a rate of 0 is said: a user who typed it by mistake would otherwise wait on a run that learns nothing
    assert "train.lr_factor 0: the learning rate is 0 at every step" in \
        (tmp_path / "run" / "train.log").read_text("utf-8")


def test_a_resume_under_more_label_smoothing_measures_the_best_loss_anew(prepared: Path, tmp_path: Path) -> None:
    """The smoothed loss of a resume is higher than the unsmoothed best before it: compared,
    checkpoint_best stayed at the old step and patience counted a worse validation."""
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2", "train.label_smoothing=0.0"))
    # lr 0 after the resume: the same weights, so the smoothed loss is the higher one
    summary = train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2",
                                "train.label_smoothing=0.3", "train.lr_factor=0.0"))
    index = read_index(run)
    assert index[4]["loss"] > index[2]["loss"]
    assert load_checkpoint(run / "checkpoints" / "checkpoint_best.pt")["step"] == 4
    assert summary.best_valid_loss == index[4]["loss"]
    assert "the validation loss is measured otherwise now (label_smoothing 0.0 -> 0.3)" in \
        (run / "train.log").read_text("utf-8")


def test_adam_settings_changed_on_resume_are_applied(prepared: Path, tmp_path: Path) -> None:
    """adam_betas, adam_eps and weight_decay changed on resume were logged as applied, but the
    optimizer's saved settings came back with its state: the run went on as before."""
    runs = {name: tmp_path / name for name in ("same", "changed")}
    for run in runs.values():
        train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2"))
    train(make_config(prepared, runs["same"], "train.max_steps=4", "train.valid_every=2"))
    train(make_config(prepared, runs["changed"], "train.max_steps=4", "train.valid_every=2",
                      "train.adam_betas=[0.5, 0.6]", "train.adam_eps=0.001", "train.weight_decay=0.5"))
    group = load_checkpoint(runs["changed"] / "checkpoints" / "checkpoint_last.pt")["optimizer"]["param_groups"][0]
    assert (tuple(group["betas"]), group["eps"], group["weight_decay"]) == ((0.5, 0.6), 0.001, 0.5)
    same, changed = (model_params(run / "checkpoints" / "checkpoint_last.pt") for run in runs.values())
    assert any(not torch.equal(same[name], changed[name]) for name in same)


def logged_lr_ratios(prepared: Path, run: Path) -> dict[int, float]:
    """Logged learning rate / Noam's rate at that step, by step, from the run's train.log."""
    import re

    from mtcli.train.schedule import noam_lr

    config = make_config(prepared, run)
    ratios = {}
    for line in (run / "train.log").read_text(encoding="utf-8").splitlines():
        m = re.search(r"\| step (\d+) \| .*\| lr (\S+) \|", line)
        if m:
            step, lr = int(m.group(1)), float(m.group(2))
            ratios[step] = lr / noam_lr(step, config.model.d_model, config.train.warmup_steps,
                                         config.train.lr_factor)
    return ratios


def test_time_limit_includes_the_final_validation(prepared: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps take >= 0.3 s and validations >= 1 s here. A run that stopped once the 6-second
    # budget was spent (the old rule) always ended past it; now it stops while one more step
    # and the final validation still fit, and the step's 0.3 s absorbs the timing jitter.
    import time

    from mtcli.train import Trainer

    validate, train_step = Trainer.validate, Trainer.train_step

    def slow_validate(self: Trainer) -> dict:
        time.sleep(1.0)
        return validate(self)

    def slow_step(self: Trainer, group: object, batches: object = None) -> object:
        time.sleep(0.3)
        return train_step(self, group, batches)

    monkeypatch.setattr(Trainer, "validate", slow_validate)
    monkeypatch.setattr(Trainer, "train_step", slow_step)
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=100000", "train.valid_every=4",
                                "train.max_minutes=0.1"))
    assert summary.stop_reason.startswith("max_minutes")
    assert 6.0 - 2.5 < summary.elapsed_seconds <= 6.0, summary.elapsed_seconds
    # given again, it looks ahead by the step and validation times it saved (they were 0 in a
    # new process, so it trained another step past the limit); a step that still fits (the
    # first run's times jittered under load) may be taken, but never one past the limit
    again = train(make_config(prepared, run, "train.max_steps=100000", "train.valid_every=4", "train.max_minutes=0.1"))
    assert again.stop_reason.startswith("max_minutes") and again.elapsed_seconds <= 6.0, again.elapsed_seconds
    assert again.steps <= summary.steps + 1


def test_cooldown_steps_scale_the_last_updates_down_linearly(prepared: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=8", "train.cooldown_steps=4",
                                "train.log_every=1", "train.valid_every=100000"))
    assert summary.steps == 8
    ratios = logged_lr_ratios(prepared, run)
    # update s runs at min(1, (max_steps - s + 1) / cooldown_steps) of Noam's rate
    expected = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 0.75, 7: 0.5, 8: 0.25}
    assert ratios == pytest.approx(expected, rel=2e-3)
    assert "is not cooled down" not in (run / "train.log").read_text(encoding="utf-8")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_each_update_runs_at_the_rate_the_log_gives_it(prepared: Path, tmp_path: Path, precision: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16's scaler stepped the optimizer before the cool-down set that update's rate: each
    update ran at the one before's, and the log gave a rate no update used."""
    used: list[float] = []
    real_step = torch.optim.Adam.step

    def step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        used.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=6", "train.cooldown_steps=3", "train.log_every=1",
                      "train.valid_every=100000", f"train.precision={precision}"))
    logged = [float(m.group(1)) for m in re.finditer(r"\| step \d+ \| .*\| lr (\S+) \|",
                                                    (run / "train.log").read_text(encoding="utf-8"))]
    assert len(used) == len(logged) == 6
    assert used == pytest.approx(logged, rel=2e-3)
    assert logged_lr_ratios(prepared, run)[6] == pytest.approx(1 / 3, rel=2e-3)  # the last update's cooled rate


def test_a_resume_in_the_cooldown_holds_the_rate_an_unbroken_run_holds(prepared: Path, tmp_path: Path) -> None:
    """The cool-down's scale is not saved: a resumed run saved, before its first update (a stop
    at a validation), Noam's rate unscaled where the unbroken run held the cooled one."""
    from mtcli.data.cache import PreparedCorpus
    from mtcli.train.distributed import DistInfo
    from mtcli.train.trainer import Trainer

    run = tmp_path / "run"
    config = make_config(prepared, run, "train.max_steps=8", "train.cooldown_steps=4", "train.valid_every=2",
                         "train.valid_bleu=false", "train.keep_last=10")
    train(config)
    for step in (6, 8):
        path = run / "checkpoints" / f"checkpoint_{step}.pt"
        state = load_checkpoint(path)
        trainer = Trainer(config, DistInfo.from_env(), torch.device("cpu"), PreparedCorpus.open(prepared), run)
        trainer.resume(path, state)
        assert trainer.optimizer.param_groups[0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]


def test_a_cooldown_that_another_stop_rule_would_skip_is_warned_of(prepared: Path, tmp_path: Path) -> None:
    """The cool-down counts back from max_steps: a run that max_minutes, max_epochs or patience
    ended first ran at the full rate to its end, without a word."""
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=1000", "train.max_epochs=1", "train.cooldown_steps=4",
                      "train.valid_every=100000"))
    assert "train.cooldown_steps 4 counts back from train.max_steps (1000): a run that train.max_epochs ends " \
           "first is not cooled down" in (run / "train.log").read_text(encoding="utf-8")


def test_validation_bleu_of_a_thai_target_is_said_to_count_phrases(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """13a splits Thai at its spaces, which part phrases: checkpoint_best chosen by that BLEU was
    chosen by a score of whole phrases, and evaluate's BLEU was of them, without a word."""
    import shutil

    from mtcli.data.prepare import prepare
    from mtcli.evaluate import evaluate

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "val", "test"):
        shutil.copyfile(TOY_DIR / f"{split}.src", corpus / f"{split}.de")
        shutil.copyfile(TOY_DIR / f"{split}.tgt", corpus / f"{split}.th")
    langs = [f"data.source={corpus}", "data.src_lang=de", "data.tgt_lang=th", "data.max_length_ratio=20"]
    prepared = tmp_path / "prepared"
    prepare(load_config(TOY_CONFIG, [*langs, f"data.prepared_dir={prepared}"]))
    said = "BLEU of 'th' text splits it into words at its spaces (13a), which part phrases in it"
    for name, metric, warned in (("bleu", "bleu", True), ("chrf", "chrf", False)):
        run = tmp_path / name
        train(make_config(prepared, run, *langs, "train.max_steps=1", "train.valid_bleu=true",
                          f"train.valid_metric={metric}", "train.valid_every=100000"))
        log = (run / "train.log").read_text(encoding="utf-8")
        assert (said in log and "train.valid_metric: chrf picks checkpoint_best by it instead" in log) == warned
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        evaluate(tmp_path / "chrf", split="test", beam=1, metrics=["bleu"])
    assert f"test de-th: {said}" in caplog.text and "read chrF (--metrics bleu,chrf)" in caplog.text


def test_cooldown_steps_are_checked_and_may_exceed_a_shortened_run(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.cooldown_steps"):
        make_config(prepared, tmp_path / "run", "train.cooldown_steps=-1")
    # a recipe's cool-down survives --set train.max_steps=10: the whole run cools down
    assert make_config(prepared, tmp_path / "run", "train.max_steps=10", "train.cooldown_steps=11").train.cooldown_steps == 11


def test_subword_regularisation_trains_and_resumes_exactly(prepared: Path, tmp_path: Path) -> None:
    """Sampled segmentations: 2 epochs straight == stop mid-epoch 1, resume; pieces differ per epoch."""
    extra = ("train.subword_alpha=0.1", "train.valid_every=100000")
    straight = tmp_path / "straight"
    full = train(make_config(prepared, straight, "train.max_epochs=2", *extra))
    assert full.epochs == 2
    split = tmp_path / "split"
    train(make_config(prepared, split, f"train.max_steps={full.steps - 3}", *extra))
    train(make_config(prepared, split, "train.max_epochs=2", "train.max_steps=100000", *extra))
    assert logged_losses(split) == logged_losses(straight)
    assert_same_params(model_params(straight / "checkpoints" / "checkpoint_last.pt"),
                       model_params(split / "checkpoints" / "checkpoint_last.pt"))
    plain = tmp_path / "plain"
    train(make_config(prepared, plain, "train.max_steps=2", "train.valid_every=100000"))
    assert logged_losses(plain)[1] != logged_losses(straight)[1]  # other pieces, other loss
    assert "subword regularisation" in (straight / "train.log").read_text(encoding="utf-8")


def test_packed_batches_train_and_resume_exactly(prepared: Path, tmp_path: Path) -> None:
    """train.pack_length: one batch shape, pairs packed in rows; stop mid-epoch and resume
    gives the straight run's losses and weights."""
    extra = ("train.pack_length=64", "train.valid_every=100000", "train.log_every=1")
    straight = tmp_path / "straight"
    full = train(make_config(prepared, straight, "train.max_steps=8", *extra))
    assert full.steps == 8
    log = (straight / "train.log").read_text(encoding="utf-8")
    assert "| pad 0.0" in log or "| pad 0.1" in log  # rows packed full: little padding
    split = tmp_path / "split"
    train(make_config(prepared, split, "train.max_steps=5", *extra))
    train(make_config(prepared, split, "train.max_steps=8", *extra))
    assert logged_losses(split) == logged_losses(straight)
    assert_same_params(model_params(straight / "checkpoints" / "checkpoint_last.pt"),
                       model_params(split / "checkpoints" / "checkpoint_last.pt"))
    # R-Drop runs a packed batch twice as one, row for row
    rdrop = train(make_config(prepared, tmp_path / "rdrop", "train.max_steps=2", "train.rdrop_alpha=1", *extra))
    losses = logged_losses(tmp_path / "rdrop")
    assert rdrop.steps == 2 and len(losses) == 2 and all("nan" not in v for v in losses.values())


def test_a_limit_that_leaves_most_pairs_out_is_a_warning(prepared: Path, tmp_path: Path) -> None:
    """train.pack_length 4 trained on a few of the pairs, said in an INFO line only."""
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=1", "train.pack_length=4", "train.valid_every=100000"))
    warned = [line for line in (run / "train.log").read_text(encoding="utf-8").splitlines() if "| WARNING |" in line]
    assert any(re.search(r"\d+ of \d+ training pairs are longer than the limits and never trained on "
                         r"\(train.pack_length\)", line) for line in warned), warned


@pytest.mark.parametrize("extra", [["train.subword_alpha=-0.1"],
                                   ["train.subword_alpha=0.1", "data.spm_model_type=bpe"],
                                   ["train.subword_alpha=0.1", "train.subword_nbest=0"]])
def test_subword_settings_are_checked(prepared: Path, tmp_path: Path, extra: list[str]) -> None:
    with pytest.raises(ConfigError, match="train.subword_"):
        make_config(prepared, tmp_path / "run", *extra)


def test_max_epochs(prepared: Path, tmp_path: Path) -> None:
    config = make_config(prepared, tmp_path / "run", "train.max_epochs=1", "train.max_steps=100000",
                         "train.valid_every=1000", "train.max_tokens=4096")
    summary = train(config)
    assert summary.epochs == 1 and summary.stop_reason.startswith("max_epochs")
    assert f"after {summary.steps} steps (1 full epoch)," in summary.summary()
    from mtcli.data.batching import BatchStream
    from mtcli.data.cache import PreparedCorpus

    corpus = PreparedCorpus.open(prepared)
    stream = BatchStream(corpus.array("train", "src"), corpus.array("train", "tgt"), max_tokens=4096,
                         max_source_length=256, max_target_length=256, seed=1)
    assert summary.steps == len(stream.epoch_batches(0))


def test_nonfinite_loss_skips_then_stops(prepared: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_forward = LabelSmoothedLoss.forward
    calls = {"n": 0}

    def flaky(self, logits, target):  # noqa: ANN001, ANN202
        calls["n"] += 1
        out = real_forward(self, logits, target)
        if calls["n"] == 2 and self.training:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(LabelSmoothedLoss, "forward", flaky)
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=100"))
    assert summary.steps == 4  # the NaN step was skipped, not counted
    assert "non-finite" in (run / "train.log").read_text(encoding="utf-8")

    def always_nan(self, logits, target):  # noqa: ANN001, ANN202
        out = real_forward(self, logits, target)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(LabelSmoothedLoss, "forward", always_nan)
    with pytest.raises(TrainingError, match=r"3 non-finite losses or gradients in a row.*; lower train.lr_factor \(now 2\), set "
                                            "train.clip_norm, or check the data$"):
        train(make_config(prepared, tmp_path / "run2", "train.max_steps=10", "train.max_nonfinite=3",
                          "train.lr_factor=2", "train.clip_norm=0"))
    with pytest.raises(TrainingError, match=r"; lower train.lr \(now 0.001\), set train.clip_norm"):  # (Noam's alone)
        train(make_config(prepared, tmp_path / "run3", "train.max_steps=10", "train.max_nonfinite=3",
                          "train.lr_schedule=constant", "train.lr=0.001", "train.lr_factor=1", "train.clip_norm=0"))
    with pytest.raises(TrainingError, match=r"; lower train.lr_factor \(now 2\), or check the data$"):  # clipped
        train(make_config(prepared, tmp_path / "run4", "train.max_steps=10", "train.max_nonfinite=3",
                          "train.lr_factor=2", "train.clip_norm=1.0"))


def nan_gradients_at(monkeypatch: pytest.MonkeyPatch, calls: set[int] | None) -> None:
    """The first parameter's gradient is NaN in the backward passes numbered ``calls`` (from 1;
    every one when None), the loss finite: what a bad batch's backward can give."""
    from mtcli.train.trainer import Trainer

    real_init = Trainer.__init__
    count = {"n": 0}

    def poisoned(grad: torch.Tensor) -> torch.Tensor:
        count["n"] += 1
        return grad * float("nan") if calls is None or count["n"] in calls else grad

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        real_init(self, *args, **kwargs)
        next(self.model.parameters()).register_hook(poisoned)

    monkeypatch.setattr(Trainer, "__init__", init)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_non_finite_gradient_is_skipped_without_clipping_or_a_log_step(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """With train.clip_norm 0 (every recipe) the gradient norm was measured on log steps only,
    so a NaN gradient with a finite loss was applied on the others: NaN weights, then a stop
    for non-finite losses. It is skipped as a non-finite loss is (fp16: as an overflow)."""
    nan_gradients_at(monkeypatch, {3})
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=6", "train.log_every=5", "train.valid_every=100",
                                "train.clip_norm=0", f"train.precision={precision}"))
    assert summary.steps == 6
    assert all(torch.isfinite(p).all() for p in model_params(run / "checkpoints" / "checkpoint_last.pt").values())
    log = (run / "train.log").read_text(encoding="utf-8")
    assert ("fp16 gradients overflowed at step 3: loss scale" if precision == "fp16" else
            "non-finite loss/gradient at step 3 (epoch 0): update skipped (1 in a row)") in log


def test_fp16_gradients_that_overflow_at_any_scale_stop_the_run(prepared: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each overflow halved the loss scale with a debug line alone, and never stopped: the scale
    sank towards 0 (gradients then vanish, and at 0 an overflow read as a clean step) while the
    run dropped every batch. Each is said; below fairseq's 1e-4 the run stops with one line."""
    nan_gradients_at(monkeypatch, None)
    run = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"^fp16 loss scale 6.1\d*e-05 at step 1, below 0.0001: the gradients "
                                            r"overflow at any scale.*train in bf16 or fp32 \(train.precision\)$"):
        train(make_config(prepared, run, "train.max_steps=6", "train.valid_every=100", "train.precision=fp16"))
    log = (run / "train.log").read_text(encoding="utf-8")
    assert log.count("fp16 gradients overflowed at step 1: loss scale") == 30  # 65536 halved 30 times


def test_a_skipped_step_before_a_log_step_keeps_the_step_numbers(prepared: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A step is counted a step late (the device skips a non-finite update itself): a skip just
    before a log step must still leave the log lines at steps 2, 4 and 6, each with finite sums."""
    real_forward = LabelSmoothedLoss.forward
    calls = {"n": 0}

    def flaky(self, logits, target):  # noqa: ANN001, ANN202
        out = real_forward(self, logits, target)
        calls["n"] += 1
        if calls["n"] == 2:  # the second training step
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(LabelSmoothedLoss, "forward", flaky)
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=6", "train.log_every=2", "train.valid_every=100"))
    losses = logged_losses(run)
    assert summary.steps == 6 and sorted(losses) == [2, 4, 6] and all("nan" not in v for v in losses.values())
    assert "non-finite loss/gradient at step 2" in (run / "train.log").read_text(encoding="utf-8")


def test_keep_best_keeps_the_best_step_checkpoints_beside_the_last(prepared: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=10", "train.valid_every=2",
                      "train.keep_last=1", "train.keep_best=2"))
    index = read_index(run)
    assert set(index) == {2, 4, 6, 8, 10}
    best_two = sorted(index, key=lambda s: (index[s]["loss"], -s))[:2]
    kept = {p.name for p in (run / "checkpoints").glob("checkpoint_[0-9]*.pt")}
    assert kept == {f"checkpoint_{s}.pt" for s in {10, *best_two}}


def test_validation_bleu_selects_best(prepared: Path, tmp_path: Path) -> None:
    pytest.importorskip("mtcli.infer.search")
    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2",
                                "train.valid_bleu=true", "train.valid_max_sentences=8"))
    index = read_index(run)
    assert all(entry["bleu"] is not None for entry in index.values())
    assert summary.best_valid_bleu == max(entry["bleu"] for entry in index.values())
    # each metric's best may come from another step: the line says so, and what checkpoint_best followed
    assert "(each at its own best step; checkpoint_best is the best by BLEU)" in summary.summary()


def test_valid_metric_chrf_picks_the_best_by_chrf(prepared: Path, tmp_path: Path) -> None:
    """checkpoint_best, the index's ranking (average --best) and the summary follow chrF."""
    from mtcli.rundir import select_checkpoints

    run = tmp_path / "run"
    summary = train(make_config(prepared, run, "train.max_steps=6", "train.valid_every=2", "train.keep_last=3",
                                "train.valid_bleu=true", "train.valid_max_sentences=8", "train.valid_metric=chrf"))
    index = read_index(run)
    assert all(entry["by"] == "chrf" and entry["chrf"] is not None for entry in index.values())
    best = max(sorted(index), key=lambda s: index[s]["chrf"])  # the first of equals stays the best
    assert load_checkpoint(run / "checkpoints" / "checkpoint_best.pt")["step"] == best
    assert select_checkpoints(run, best=1) == [run / "checkpoints" / f"checkpoint_{best}.pt"]
    assert summary.best_valid_chrf == max(entry["chrf"] for entry in index.values())
    assert f"chrF: {summary.best_valid_chrf:.2f}" in summary.summary()
    assert "| chrf " in (run / "train.log").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- subprocesses


def cli_train(prepared: Path, run_dir: Path, *extra: str) -> ForkedPython:
    """``mtcli train`` of the toy recipe in a process of its own (forked: :class:`ForkedPython`)."""
    args = ["train", str(TOY_CONFIG)]
    for item in base_overrides(prepared, run_dir) + list(extra):
        args += ["--set", item]
    return ForkedPython(MTCLI, args, run_dir.parent / "stderr.txt", env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("at", [4, 3], ids=["validating-step", "logging-step"])
def test_a_stop_signal_at_a_step_keeps_its_log_line_and_its_validation(prepared: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       at: int) -> None:
    """Ctrl-C during a step that logs and validates: the step's loss line was lost (the next line
    the mean of two steps), and its validation and checkpoint_<step> never happened, so the best
    checkpoint and patience could differ from an uninterrupted run. The line is written before
    stopping; the validation runs first thing on resuming."""
    from mtcli.errors import TrainingInterrupted
    from mtcli.train.trainer import Trainer

    extra = ("train.valid_every=4", "train.max_steps=8", "model.dropout=0.1")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(make_config(prepared, straight, *extra))
    step = Trainer.train_step

    def signalled(self: Trainer, *args: object, **kwargs: object) -> list:
        counted = step(self, *args, **kwargs)
        if self.step == at:
            self.signals.signum = signal.SIGINT
        return counted

    monkeypatch.setattr(Trainer, "train_step", signalled)
    with pytest.raises(TrainingInterrupted, match=f"at step {at}"):
        train(make_config(prepared, split, *extra))
    monkeypatch.undo()
    train(make_config(prepared, split, *extra))
    assert logged_losses(split) == logged_losses(straight)
    assert read_index(split) == read_index(straight)
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == sorted(
        p.name for p in (straight / "checkpoints").iterdir())


def test_a_stop_signal_during_a_validation_cuts_it_short_and_the_resume_validates_first(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during a validation waited for all of it (a large validation set: minutes past
    the grace a cluster gives before SIGKILL). It stops the validation now; the resumed run
    validates that step first, so the run ends as an uninterrupted one."""
    import mtcli.train.trainer as trainer_module
    from mtcli.errors import TrainingInterrupted

    extra = ("train.valid_every=4", "train.max_steps=8", "model.dropout=0.1")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(make_config(prepared, straight, *extra))
    real, seen = trainer_module.validation_loss, []

    def interrupted(*args: object, **kwargs: object) -> object:
        seen.append(1)
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # (the handler raises at once: nothing below runs)
            seen.append("ran on")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "validation_loss", interrupted)
    with pytest.raises(TrainingInterrupted, match="interrupted by SIGINT at step 4"):
        train(make_config(prepared, split, *extra))
    assert seen == [1] and 4 not in read_index(split)
    monkeypatch.undo()
    train(make_config(prepared, split, *extra))
    assert logged_losses(split) == logged_losses(straight)
    assert read_index(split) == read_index(straight)
    assert "received SIGINT: stopping the validation, then saving checkpoint_last" in \
        (split / "train.log").read_text(encoding="utf-8")


def test_validation_scores_the_model_as_it_trains_whatever_int8_or_shortlist_a_recipe_asks(
        prepared: Path, tmp_path: Path) -> None:
    """A recipe's decode.int8 or decode.shortlist (for later decoding on a CPU) changed the
    validation BLEU and chrF that pick checkpoint_best; on a GPU int8 stopped the training at its
    first validation (int8 runs on the CPU only), nothing saved."""
    plain, asked = tmp_path / "plain", tmp_path / "asked"
    train(make_config(prepared, plain, "train.max_steps=4", "train.valid_every=4", "train.valid_bleu=true"))
    train(make_config(prepared, asked, "train.max_steps=4", "train.valid_every=4", "train.valid_bleu=true",
                      "decode.int8=true",
                      "decode.shortlist=1", "decode.shortlist_frequent=0"))
    assert read_index(asked) == read_index(plain) and read_index(plain)[4]["bleu"] is not None


def test_pairs_wider_than_the_token_budget_are_warned_of(prepared: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """train.max_tokens=5 trained every pair as a batch of its own, over the budget, unsaid (on a
    GPU: an out-of-memory error nothing explained)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="mtcli"):
        train(make_config(prepared, tmp_path / "run", "train.max_steps=1", "train.max_tokens=5"))
    assert re.search(r"\d+ of \d+ training pairs are longer than train.max_tokens=5 tokens \(the longest: (\d+)\): "
                     r"each is a batch of its own, over the budget; raise train.max_tokens to at least \1", caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        train(make_config(prepared, tmp_path / "run2", "train.max_steps=1"))
    assert "longer than train.max_tokens" not in caplog.text


def test_a_finished_run_given_again_is_left_as_it_was(prepared: Path, tmp_path: Path) -> None:
    """Given again with another setting (a batch size), a finished run trained no step but wrote
    the new setting and a rebatched data position into its checkpoint and config.yaml: training
    further then differed from an uninterrupted run."""
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2"))
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != "train.log"}
    again = train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2", "train.max_tokens=100"))
    assert again.steps == 4 and again.stop_reason == "max_steps=4" and not again.trained
    assert "nothing trained now: the run was at step 4 already (max_steps=4)" in again.summary()
    assert "peak memory" not in again.summary()  # (this call's, which trained nothing, was shown as the run's)
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != "train.log"} == files
    assert "nothing to train: max_steps=4 at step 4" in (run / "train.log").read_text(encoding="utf-8")
    # decode settings, which evaluate reads from config.yaml, are taken; nothing else changes
    train(make_config(prepared, run, "train.max_steps=4", "train.valid_every=2", "decode.beam_size=3"))
    assert load_config(run / "config.yaml").decode.beam_size == 3
    assert {p: p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name not in ("train.log", "config.yaml")} == {
        p: data for p, data in files.items() if p.name != "config.yaml"}
    assert "but for its decode settings, taken into config.yaml" in (run / "train.log").read_text(encoding="utf-8")
    # started again from its config.yaml: the decode change is not said again, at every start
    train(load_config(run / "config.yaml"))
    said = (run / "train.log").read_text(encoding="utf-8").split("but for its decode settings")[-1]
    assert "config change on resume: decode.beam_size" not in said


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_saves_checkpoint_and_exits_143(prepared: Path, tmp_path: Path, signum: signal.Signals) -> None:
    """And a hang-up, 129: the command line's own SIGHUP handler is installed first; training
    takes the signal over from it (it did only from the default disposition)."""
    run = tmp_path / "run"
    proc = cli_train(prepared, run, "train.max_steps=100000", "train.valid_every=100000")
    log = run / "train.log"
    wait_until(lambda: log.exists() and "| step 3 |" in log.read_text(encoding="utf-8"), proc,
               "step 3 in train.log", timeout=60.0)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert f"interrupted by {signum.name}" in err and "checkpoint_last" in err
    state = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert state["step"] >= 3
    assert not (run / "train.lock").exists()


@pytest.mark.parametrize(("line", "expected"), [
    ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", True),    # Zen 4, Cooper Lake
    ("flags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n", True),                   # Sapphire Rapids
    ("Features\t: fp asimd bf16 i8mm sve\n", True),                            # Arm v8.6+
    ("flags\t\t: fpu sse2 avx2 fma\n", False),                                 # Zen 3: slow bf16
])
def test_cpu_has_bf16_units_reads_the_cpu_flags(tmp_path: Path, line: str, expected: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some cpu\n" + line, encoding="utf-8")
    assert cpu_has_bf16_units(str(cpuinfo)) is expected
    assert cpu_has_bf16_units(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("has_units", [True, False])
def test_precision_auto_follows_the_device_and_the_run_records_the_choice(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, has_units: bool) -> None:
    import mtcli.device

    monkeypatch.setattr(mtcli.device, "cpu_has_bf16_units", lambda *args: has_units)
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2",
                      "train.device=cpu", "train.precision=auto"))
    state = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    chosen = "bf16" if has_units else "fp32"
    assert state["config"]["train"]["precision"] == chosen
    assert f"precision {chosen} (auto: the cpu has" in (run / "train.log").read_text(encoding="utf-8")
    saved = (run / "config.yaml").read_text(encoding="utf-8")
    assert f"precision: {chosen}" in saved


def test_the_same_seed_gives_the_same_checkpoints_and_bleu_another_seed_other_weights(
        prepared: Path, tmp_path: Path) -> None:
    """Determinism on one CPU type: two runs of the same command and seed end with bit-identical
    parameters and optimiser state and the same validation and test BLEU; another seed does not
    (another initialisation, batch order and dropout). Dropout is on here, so the masks count."""
    from mtcli.evaluate import evaluate

    extra = ("train.max_steps=12", "train.valid_every=6", "model.dropout=0.1",
             "model.attention_dropout=0.1")
    runs = {name: tmp_path / name for name in ("a", "b", "other")}
    summaries = {name: train(make_config(prepared, run, *extra, f"train.seed={2 if name == 'other' else 1}"))
                 for name, run in runs.items()}
    states = {name: load_checkpoint(run / "checkpoints" / "checkpoint_last.pt") for name, run in runs.items()}
    assert_same_params(states["a"]["model"], states["b"]["model"])
    for slot, moments in states["a"]["optimizer"]["state"].items():
        assert_same_params(moments, states["b"]["optimizer"]["state"][slot])
    assert summaries["a"].best_valid_bleu == summaries["b"].best_valid_bleu
    assert logged_losses(runs["a"]) == logged_losses(runs["b"])
    scores = [evaluate(runs[name], output_dir=tmp_path / f"eval_{name}")["bleu"] for name in ("a", "b")]
    assert scores[0] == scores[1]
    assert any(not torch.equal(states["a"]["model"][k], states["other"]["model"][k]) for k in states["a"]["model"])


def test_fp16_resumes_exactly_with_its_gradient_scaler(prepared: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """train.precision fp16: the loss scaler's state is checkpointed, so 4 + 4 steps equal 8. The
    scaler starts at 2^40 here, so fp16 gradients overflow and steps are skipped (and not counted)
    while it backs off."""
    import functools

    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**40))
    extra = ("train.precision=fp16", "train.valid_every=4", "train.device=cpu")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(make_config(prepared, straight, "train.max_steps=8", *extra))
    train(make_config(prepared, split, "train.max_steps=4", *extra))
    train(make_config(prepared, split, "train.max_steps=8", *extra))
    states = [load_checkpoint(run / "checkpoints" / "checkpoint_last.pt") for run in (straight, split)]
    assert states[0]["config"]["train"]["precision"] == "fp16"
    assert states[0]["scaler"] == states[1]["scaler"]
    assert 0 < states[0]["scaler"]["scale"] < 2.0**40  # below its start: overflowed steps were skipped
    assert logged_losses(split) == logged_losses(straight)
    assert_same_params(states[0]["model"], states[1]["model"])


def test_a_plain_train_on_a_machine_of_several_gpus_says_how_to_use_them_all() -> None:
    from mtcli.train.run import idle_gpus_hint

    hint = idle_gpus_hint(torch.device("cuda:0"), processes=1, gpus=8, max_tokens=25000)
    assert hint is not None and "torchrun --nproc-per-node 8 -m mtcli.cli train" in hint
    assert "--set train.max_tokens=3125" in hint  # 8 x 3,125: the same 25k-token update
    assert idle_gpus_hint(torch.device("cuda:0"), processes=8, gpus=8, max_tokens=3125) is None  # under torchrun
    assert idle_gpus_hint(torch.device("cuda:0"), processes=1, gpus=1, max_tokens=25000) is None
    assert idle_gpus_hint(torch.device("cpu"), processes=1, gpus=2, max_tokens=4096) is None


def test_compile_is_turned_off_on_a_gpu_triton_cannot_compile_for(prepared: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from mtcli.train.run import resolve_compile

    config = make_config(prepared, tmp_path / "run", "train.compile=true")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    assert resolve_compile(config, torch.device("cuda:0")).train.compile is False
    assert "Tesla P100-PCIE-16GB is 6.0: training uncompiled" in caplog.text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert resolve_compile(config, torch.device("cuda:0")) is config
    caplog.clear()
    assert resolve_compile(config, torch.device("cpu")) is config  # slower there, but it runs: said, kept
    said = caplog.text
    assert "train.compile on a CPU" in said and "(--set train.compile=false trains eager)" in said


def test_a_device_that_is_not_one_is_a_config_error_before_any_work(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"with --set .*train.device=gpu: train.device must be auto, cpu, cuda or "
                                          "cuda:N"):  # where the value came from, as for every other key
        train(make_config(prepared, tmp_path / "run", "train.device=gpu"))
    assert not (tmp_path / "run").exists()

def test_a_gpu_this_machine_lacks_names_the_set_or_file_that_asked(prepared: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The value is a device, yet not one here: the error said so without saying where it came from."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"with --set train.device=cuda:1: train.device='cuda:1' but CUDA is not "
                                          r"available"):
        train(make_config(prepared, tmp_path / "run", "train.device=cuda:1"))
    recipe = tmp_path / "gpu.yaml"
    save_config(with_changes(make_config(prepared, tmp_path / "run"), "train", device="cuda"), recipe)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}: train.device='cuda' but CUDA"):
        train(load_config(recipe))
    assert not (tmp_path / "run").exists()


def test_more_processes_than_gpus_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --nproc-per-node 2 on a one-GPU machine: cuda:1 went on to a traceback
    (Invalid device id) where train.device=cuda:1 said it in one line."""
    from mtcli.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto", 0) == torch.device("cuda:0")
    for name in ("auto", "cuda"):
        with pytest.raises(ConfigError, match=rf"train.device='{name}': process 1 of this machine has no GPU of its "
                                              r"own \(1 visible\): start at most 1 processes .* set "
                                              "train.device=cuda:0"):
            resolve_device(name, 1)
    # each process sees only its own GPU (SLURM's --gpus-per-task): cuda:0 is every process's
    assert resolve_device("cuda:0", 1, local_processes=2) == torch.device("cuda:0")
    # every process sees them all: a config's cuda:0 put every rank on one GPU, and NCCL stopped
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:0", 0) == torch.device("cuda:0") and resolve_device("auto", 1) == torch.device("cuda:1")
    for rank in (0, 1):  # every rank says it (rank 0 went on, to wait for the others until killed)
        with pytest.raises(ConfigError, match=r"train.device='cuda:0' puts every process of this machine on one of "
                                              r"its 2 visible GPUs: set train.device=auto"):
            resolve_device("cuda:0", rank, local_processes=2)


@pytest.mark.parametrize(("capability", "chosen"), [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_precision_auto_on_a_gpu_is_bf16_from_ampere_on_and_fp16_before(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
        chosen: str) -> None:
    """A V100 (7.0) or T4 (7.5) only emulates bf16, though torch.cuda.is_bf16_supported() says
    True there: auto gives them fp16 with a gradient scaler."""
    from mtcli.train.run import resolve_precision

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    config, text = resolve_precision(make_config(prepared, tmp_path / "run", "train.precision=auto"),
                                     torch.device("cuda:0"))
    assert config.train.precision == chosen and text.startswith(f"{chosen} (auto: the cuda has")


@pytest.mark.parametrize("capability", [(7, 0), (9, 0)])
def test_fp32_on_a_gpu_with_bf16_units_says_auto_is_faster(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capability: tuple[int, int]) -> None:
    """A config that leaves train.precision out trains in fp32; on an A100 or H100 that is a
    fraction of the bf16 rate, so the log says what to set (not on a V100, where auto is fp16)."""
    from mtcli.train.run import resolve_precision

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    caplog.set_level(logging.INFO, logger="mtcli")  # (an info line: not only after a test that set the level)
    config, text = resolve_precision(make_config(prepared, tmp_path / "run", "train.precision=fp32"),
                                     torch.device("cuda:0"))
    assert config.train.precision == text == "fp32"
    said = [r.getMessage() for r in caplog.records if "train.precision=auto" in r.getMessage()]
    # (faster only where the matrix products are large: a step of Multi30k's size ran faster in fp32)
    assert said == (["train.precision fp32 on a GPU with bf16 units: --set train.precision=auto trains in bf16, "
                     "faster where the matrix products are large (2.3x at the WMT14 base shape on an H100; a step "
                     "as small as Multi30k's ran faster in fp32)"] if capability >= (8, 0) else [])


def test_fp16_on_a_cpu_is_warned_about(prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It ran 8x slower than fp32 without a word (bf16 without bf16 units was warned about)."""
    from mtcli.train.run import resolve_precision

    resolve_precision(make_config(prepared, tmp_path / "run", "train.precision=fp16"), torch.device("cpu"))
    assert any("fp16 on a CPU: expect it to run many times slower" in r.getMessage() for r in caplog.records)


def test_a_precision_warning_is_in_the_runs_log(prepared: Path, tmp_path: Path) -> None:
    """It came before train.log was opened: on the console only, gone with the terminal."""
    train(make_config(prepared, tmp_path / "run", "train.precision=fp16", "train.max_steps=1", "train.device=cpu"))
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert "WARNING | train.precision fp16 on a CPU: expect it to run many times slower" in log


def test_the_first_signal_is_the_one_a_stop_reports() -> None:
    """torchrun follows a Ctrl-C's SIGINT with a SIGTERM of its own: the stop says SIGINT (exit 130)."""
    from mtcli.train.signals import StopSignals

    signals = StopSignals()
    signals._handle(signal.SIGINT, None)
    signals._handle(signal.SIGTERM, None)
    assert signals.signum == signal.SIGINT


def test_the_error_that_stops_a_run_is_in_its_log(prepared: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A log read later (nohup, a batch job) said nothing of why the run stopped."""
    from mtcli.train.trainer import Trainer

    def fail(self: Trainer) -> str:
        raise TrainingError("the loss is not finite for 5 steps in a row")

    monkeypatch.setattr(Trainer, "run", fail)
    run = tmp_path / "run"
    with pytest.raises(TrainingError):
        train(make_config(prepared, run, "train.max_steps=2"))
    assert "| ERROR | stopped: the loss is not finite for 5 steps in a row" in (run / "train.log").read_text()


def test_a_step_whose_objective_is_not_finite_is_skipped_though_its_logged_loss_is(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R-Drop's KL term is backpropagated but not logged: an infinite objective with a finite
    cross-entropy was applied (no gradient norm is taken without clipping or a log line), and
    the model became NaN, saved as checkpoint_best."""
    real = LabelSmoothedLoss.objective
    calls = {"n": 0}

    def overflowing(self, logits, target):  # noqa: ANN001, ANN202
        objective, out = real(self, logits, target)
        if self.training and torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 2:
                objective = objective * float("inf")
        return objective, out

    monkeypatch.setattr(LabelSmoothedLoss, "objective", overflowing)
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=3", "train.clip_norm=0", "train.log_every=100",
                      "train.valid_every=100"))
    state = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert all(torch.isfinite(value).all() for value in state["model"].values() if value.is_floating_point())
    assert "non-finite loss/gradient at step 2" in (run / "train.log").read_text(encoding="utf-8")


def test_a_run_is_not_resumed_from_another_config_file_of_its_name(prepared: Path, tmp_path: Path) -> None:
    """exp1/config.yaml and exp2/config.yaml both name data/runs/config: the second went on
    training the first's run with its own settings (a warning, exit 0), and exp1's checkpoints
    were exp2's from then on. It is refused, the run left as it was; the run's own config.yaml,
    and the same file by another path, go on."""
    import shutil

    from mtcli.config import load_config
    from mtcli.errors import ConfigError

    for exp in ("exp1", "exp2"):
        (tmp_path / exp).mkdir()
        shutil.copy(TOY_CONFIG, tmp_path / exp / "config.yaml")
    run = tmp_path / "run"

    def train_from(path: Path, steps: int) -> None:
        train(load_config(path, toy_train_overrides(prepared, run, f"train.max_steps={steps}", "train.device=cpu")))

    train_from(tmp_path / "exp1" / "config.yaml", 1)
    train_from(tmp_path / "exp1" / "config.yaml", 2)  # the same file
    last = (run / "checkpoints" / "checkpoint_last.pt").read_bytes()
    with pytest.raises(ConfigError) as refused:
        train_from(tmp_path / "exp2" / "config.yaml", 3)
    assert str(refused.value) == (
        f"{run} was trained from {tmp_path / 'exp1' / 'config.yaml'}, not from {tmp_path / 'exp2' / 'config.yaml'}: "
        "going on would train that run with this config's settings; set train.run_dir for a run of this config's "
        "own (a run is named after its config file's name), or go on with the run's own config: mtcli train "
        f"{run / 'config.yaml'} [--set KEY=VALUE]")
    assert (run / "checkpoints" / "checkpoint_last.pt").read_bytes() == last
    train(load_config(run / "config.yaml", [f"data.prepared_dir={prepared}", "train.max_steps=4"]))  # its own
    (tmp_path / "exp1" / "sub").mkdir()  # the same file by another path, after the run's own config.yaml
    train_from(tmp_path / "exp1" / "sub" / ".." / "config.yaml", 5)
    assert load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")["step"] == 5


def test_validation_decodes_greedily_under_a_sampling_default(prepared: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe's decode.sampling (a default for translate and serve) made validation score
    samples: checkpoint_best was picked by chance. A truncation warning names the validation
    text (it said "input")."""
    import mtcli.train.validation as validation
    from mtcli.data.cache import PreparedCorpus

    decoded = []

    def translate_texts(bundle, sources, decode, device, name):  # noqa: ANN001, ANN202
        decoded.append((decode, name))
        return list(sources)

    monkeypatch.setattr(validation, "translate_texts", translate_texts)
    config = make_config(prepared, tmp_path / "run", "decode.sampling=topk", "decode.beam_size=1")
    validation.validation_scores(torch.nn.Linear(1, 1), PreparedCorpus.open(prepared), config, torch.device("cpu"))
    assert [(d.sampling, d.beam_size, d.nbest, name) for d, name in decoded] == [
        ("none", 1, 1, str(prepared / "val.src.txt"))]


def test_a_direction_whose_every_corpus_is_tagged_is_named() -> None:
    """A tag on the only corpus of en->cs: decoding gives none, so that direction was decoded
    from input unlike any it trained on, unsaid."""
    from mtcli.config import config_from_dict
    from mtcli.train.run import _only_tagged

    def sources(*corpora: dict) -> object:
        return config_from_dict({"data": {"name": "x", "src_lang": "en", "tgt_lang": "de", "sources": list(corpora)}})

    real, bt = {"source": "a"}, {"source": "b", "tag": "<bt>"}
    assert _only_tagged(sources(real, bt)) == ""  # back-translations beside real pairs: as meant
    assert _only_tagged(sources(real, {"source": "c", "langs": ["en", "cs"], "tag": "<x>"})) == "en->cs"
    assert _only_tagged(sources(bt)) == "en->de"


def test_a_hangup_saves_and_stops_unless_ignored() -> None:
    """SIGHUP (a closed ssh session) killed a training as SIGKILL would: the steps since the last
    checkpoint lost. Under nohup (SIGHUP ignored) it stays ignored."""
    from mtcli.train.signals import StopSignals

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGHUP)
            assert signals.signum == signal.SIGHUP
        signals.restore()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with StopSignals() as signals:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signals.signum is None
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_learning_curves_or_tensorboard_that_cannot_be_written_fail_no_training(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk after the last step (learning_curves.png) was exit 1 with every checkpoint
    saved; an event file that could not be made stopped the run at its start."""
    import mtcli.train.run as run_module
    import mtcli.train.scalars as scalars

    def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_module, "write_learning_curves", full)
    monkeypatch.setattr(scalars, "SummaryWriter", full)
    summary = train(make_config(prepared, tmp_path / "run", "train.max_steps=2", "train.device=cpu"))
    assert summary.steps == 2
    said = caplog.text
    assert "learning curves not drawn (No space left on device); the training is saved" in said
    assert "tensorboard: cannot write TensorBoard's scalars (No space left on device); the training goes on" in said


def test_a_stop_while_the_learning_curves_are_drawn_is_said_and_the_rerun_draws_them(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C while learning_curves.png was drawn: a failed run by its exit with every step saved,
    and the same command (nothing to train) never drew the picture."""
    import mtcli.train.run as run_module

    run = tmp_path / "run"
    real = run_module.write_learning_curves

    def stopped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "write_learning_curves", stopped)
    with pytest.raises(KeyboardInterrupt):
        train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2"))
    assert "learning curves not drawn (stopped); the training is complete and saved" in caplog.text
    assert not (run / "learning_curves.png").exists()
    monkeypatch.setattr(run_module, "write_learning_curves", real)
    assert train(make_config(prepared, run, "train.max_steps=2", "train.valid_every=2")).steps == 2
    assert (run / "learning_curves.png").is_file()


def test_a_stop_signal_inside_a_log_call_still_cuts_the_validation() -> None:
    """Raised as an Exception inside a log call (a validation warns of long lines), the cut was
    swallowed by logging's error handler and the validation ran to its end."""
    import logging

    from mtcli.train.signals import StopSignals, ValidationCut

    class Signalling:
        def write(self, text: str) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises here, inside StreamHandler.emit

        def flush(self) -> None:
            pass

    log = logging.getLogger("mtcli.tests.cut")
    log.addHandler(logging.StreamHandler(Signalling()))
    try:
        with StopSignals() as signals:
            with pytest.raises(ValidationCut), signals.cutting():
                log.warning("a line of the validation set is longer than the model's positions")
            assert signals.signum == signal.SIGINT
        signals.restore()
    finally:
        log.handlers.clear()


@pytest.mark.parametrize("clip_norm", [0.0, 0.5])
def test_gradients_are_clipped_to_clip_norm_and_the_norm_before_is_reported(clip_norm: float, prepared: Path,
                                                                            tmp_path: Path) -> None:
    """No test trained with train.clip_norm > 0: clipping could be switched off unnoticed."""
    from mtcli.data.cache import PreparedCorpus
    from mtcli.train.distributed import DistInfo
    from mtcli.train.trainer import Trainer

    config = make_config(prepared, tmp_path / "run", f"train.clip_norm={clip_norm}")
    trainer = Trainer(config, DistInfo.from_env(), torch.device("cpu"), PreparedCorpus.open(prepared), tmp_path / "run")
    params = list(trainer.model.parameters())
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    before = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    reported = trainer._grad_norm()
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert float(reported) == pytest.approx(float(before), rel=1e-5) and float(before) > 1.0
    assert float(after) == pytest.approx(clip_norm if clip_norm > 0 else float(before), rel=1e-4)


def test_a_step_follows_the_gradient_of_the_loss_per_target_token(prepared: Path, tmp_path: Path) -> None:
    """The loss a step backpropagates is the label-smoothed sum over its batches (here two,
    update_freq 2) divided by their target tokens (eos included): its gradient norm, reported
    as the step's grad_norm, is that of this per-token loss computed directly."""
    import copy

    from mtcli.data.cache import PreparedCorpus
    from mtcli.train.distributed import DistInfo
    from mtcli.train.loss import reference_loss
    from mtcli.train.trainer import Trainer

    config = make_config(prepared, tmp_path / "run", "train.clip_norm=0", "train.update_freq=2",
                         "train.precision=fp32")
    trainer = Trainer(config, DistInfo.from_env(), torch.device("cpu"), PreparedCorpus.open(prepared), tmp_path / "run")
    assert trainer.model.cfg.dropout == 0.0 and trainer.model.cfg.attention_dropout == 0.0
    reference = copy.deepcopy(trainer.model).train()
    group, batches = trainer.feed.next()
    assert len(batches) == 2
    stats = [s for s in trainer.train_step(group, batches) + [trainer.settle()] if s is not None]
    tokens = sum(int(b.tgt_out.ne(0).sum()) for b in batches)
    loss = sum(reference_loss(reference(b.src, b.tgt_in), b.tgt_out, config.train.label_smoothing) for b in batches)
    (loss / tokens).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]))
    assert stats[0]["tokens"] == tokens
    assert stats[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-4)


def test_a_warmup_past_the_last_step_is_warned_of(prepared: Path, tmp_path: Path) -> None:
    """The README's own `--set train.max_steps=100` on the reference recipe (warmup 1600) never
    got past a sixteenth of the peak rate, without a word."""
    run = tmp_path / "run"
    train(make_config(prepared, run, "train.max_steps=2", "train.warmup_steps=8", "train.valid_every=100"))
    assert "train.warmup_steps 8 is past train.max_steps 2: the rate never reaches its peak, and ends at 25% of it" \
        in (run / "train.log").read_text(encoding="utf-8")


def test_a_beam_too_wide_for_the_vocabulary_is_refused_before_training(prepared: Path, tmp_path: Path) -> None:
    """decode.beam_size=1000 on a small vocabulary trained and saved a run that translate and
    evaluate then refused; it is said at once, before any step."""
    from mtcli.errors import ConfigError

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"with --set decode.beam_size=1000: decode.beam_size=1000 needs an output "
                                          r"vocabulary of at least 2000 pieces .*translate and evaluate would refuse"):
        train(make_config(prepared, run, "decode.beam_size=1000"))
    assert not list((run / "checkpoints").glob("*.pt"))


def test_a_model_too_large_for_the_free_memory_is_refused_before_the_run_is_made(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.d_model=65536 ran out of memory allocating 48 GiB, naming no key, after the run's
    directory was made; a huge model.d_ff after a step, with advice to shrink the batches."""
    import mtcli.train.run as run_module
    from mtcli.data.cache import PreparedCorpus
    from mtcli.errors import ConfigError
    from mtcli.model import Transformer, count_parameters

    config = make_config(prepared, tmp_path / "run")
    corpus = PreparedCorpus.open(prepared)
    parameters = count_parameters(Transformer(config.model, corpus.vocab_size))
    monkeypatch.setattr(run_module, "available_bytes", lambda device: 16 * parameters - 1)
    with pytest.raises(ConfigError, match=rf"the model's {parameters / 1e6:,.1f}M parameters \(model.d_model="
                                          r".*Adam's two moments, 16 bytes a parameter\), more than the .* GiB free "
                                          r"on cpu: make the model smaller"):
        train(config)
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(run_module, "available_bytes", lambda device: 16 * parameters)
    assert train(dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=1))).trained


def test_more_threads_than_cores_are_warned_of(prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """train.num_threads: 64 on a 2-core machine ran 64 threads taking turns, without a word."""
    import logging

    import mtcli.train.run as run_module

    monkeypatch.setattr(run_module, "usable_cores", lambda limit: 2)
    saved = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            train(make_config(prepared, tmp_path / "run", "train.max_steps=1", "train.num_threads=3"))
    finally:
        torch.set_num_threads(saved)
    warned = [r.getMessage() for r in caplog.records if "train.num_threads" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith(
        ": train.num_threads=3 is more threads than the 2 cores this machine lets the run use; "
        "they take turns, which is slower than 2")
