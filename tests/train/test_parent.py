"""Starting a run from a trained model (train.init_from): exact weights, fresh optimiser and
schedule, the parent recorded, exact resume of the child, one-line refusals, no code run."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    TOY_CONFIG,
    TOY_DIR,
    assert_same_params,
    mtcli_here,
    toy_train_config,
    toy_train_overrides,
)

import mtcli.checkpoint as ck
from mtcli.checkpoint import load_checkpoint
from mtcli.config import load_config
from mtcli.data.cache import PreparedCorpus
from mtcli.data.prepare import prepare
from mtcli.errors import CheckpointError, ConfigError
from mtcli.fileio import sha256_file
from mtcli.infer.averaging import average_checkpoints
from mtcli.model import Transformer
from mtcli.train import train
from mtcli.train.distributed import DistInfo
from mtcli.train.parent import load_parent, start_from
from mtcli.train.trainer import Trainer

CHILD = ("train.seed=7", "train.lr_schedule=constant", "train.lr=0.0005", "train.lr_factor=1",
         "train.warmup_steps=2")


@pytest.fixture(scope="module")
def parent_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A toy run of 8 steps with step checkpoints at 4, 6 and 8 (the parent), and its cache."""
    root = tmp_path_factory.mktemp("parent")
    prepared = root / "prepared"
    prepare(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={prepared}"]))
    run = root / "run"
    train(toy_train_config(prepared, run, "train.max_steps=8", "train.valid_every=2", "train.keep_last=3"))
    return prepared, run


def child_config(prepared: Path, run: Path, parent: Path, *extra: str):
    return toy_train_config(prepared, run, f"train.init_from={parent}", *CHILD, *extra)


def test_child_starts_from_the_parents_exact_weights(parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    """The child's weights are the parent's last checkpoint's, and its first step's loss is the
    parent's loss on that batch; the optimiser and schedule start fresh."""
    prepared, parent = parent_run
    config = child_config(prepared, tmp_path / "child", parent)
    corpus = PreparedCorpus.open(prepared)
    trainer = Trainer(config, DistInfo.from_env(), torch.device("cpu"), corpus, tmp_path / "child")
    family = load_parent(str(parent))
    assert [p.name for p in family.checkpoints] == ["checkpoint_8.pt"]
    start_from(trainer.model, family, config, trainer.spm_sha256)
    assert_same_params(trainer.model.state_dict(), ck.load_checkpoint(parent / "checkpoints/checkpoint_8.pt")["model"])
    reference = Transformer(config.model, corpus.vocab_size)
    reference.load_state_dict(family.model)
    group = trainer.stream.next_group()
    batch = trainer.stream.collate(group.mine()[0])
    with torch.no_grad():
        logits = reference(batch.src, batch.tgt_in)
        parent_loss, _ = trainer.criterion.objective(logits, batch.tgt_out)
    counted = trainer.train_step(group)
    stats = counted[-1] if counted else trainer.settle()  # a step not yet counted is counted now
    assert stats is not None and stats["loss"] == pytest.approx(float(parent_loss) / batch.tgt_tokens, rel=1e-6)
    assert stats["lr"] == pytest.approx(0.0005 / 2)  # the child's own schedule from step 1


def test_child_run_records_its_parent_and_resumes_exactly(parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    prepared, parent = parent_run
    straight = tmp_path / "straight"
    summary = train(child_config(prepared, straight, parent, "train.max_steps=6", "train.valid_every=3",
                                 "model.dropout=0.2"))
    assert summary.steps == 6
    record = json.loads((straight / "parent.json").read_text())
    assert record["init_from"] == str(parent.resolve()) and record["average"] == 1
    assert record["checkpoints"][0]["sha256"] == sha256_file(parent / "checkpoints/checkpoint_8.pt")
    assert record["spm_sha256"] == sha256_file(parent / "spm.model")
    state = ck.load_checkpoint(straight / "checkpoints/checkpoint_last.pt")
    assert state["step"] == 6 and state["scheduler"]["step"] == 6 and state["scheduler"]["kind"] == "constant"
    halves = tmp_path / "halves"
    train(child_config(prepared, halves, parent, "train.max_steps=3", "train.valid_every=3", "model.dropout=0.2"))
    train(child_config(prepared, halves, parent, "train.max_steps=6", "train.valid_every=3", "model.dropout=0.2"))
    assert_same_params(state["model"], ck.load_checkpoint(halves / "checkpoints/checkpoint_last.pt")["model"])
    assert "resumed from" in (halves / "train.log").read_text()
    with pytest.raises(CheckpointError, match=r"train.init_from: .* -> .*elsewhere"):  # it would not be read
        train(child_config(prepared, halves, tmp_path / "elsewhere", "train.max_steps=9", "model.dropout=0.2"))


def test_init_average_takes_the_mean_of_the_last_k(parent_run: tuple[Path, Path]) -> None:
    prepared, parent = parent_run
    family = load_parent(str(parent), average=2)
    assert [p.name for p in family.checkpoints] == ["checkpoint_6.pt", "checkpoint_8.pt"]
    expected = average_checkpoints(family.checkpoints)["model"]
    assert_same_params(family.model, expected)
    with pytest.raises(ConfigError, match="asked for the last 9 checkpoints, found 3"):
        load_parent(str(parent), average=9)
    with pytest.raises(ConfigError, match="init_average: 2 needs train.init_from to be a run directory"):
        load_parent(str(parent / "checkpoints/checkpoint_8.pt"), average=2)


def cli_train(*args: str) -> subprocess.CompletedProcess:
    """``mtcli train`` of the toy recipe (in this process), with text stdout and stderr."""
    res = mtcli_here("train", str(TOY_CONFIG), *args)
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(), res.stderr.decode())


def set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_a_parent_whose_model_is_other_bytes_of_the_cache_model_is_started_from(
        parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    """A parent run of an older mtcli (its spm.model of another trainer_spec.num_threads) was
    refused beside a cache of the same model prepared again ("SentencePiece model sha256 ...
    (parent) vs ... (this run)")."""
    import shutil

    from conftest import respell_run_spm

    prepared, parent = parent_run
    older = tmp_path / "older"
    shutil.copytree(parent, older)
    respell_run_spm(older, lambda proto: setattr(proto.trainer_spec, "num_threads", 7))
    assert train(child_config(prepared, tmp_path / "child", older, "train.max_steps=2")).steps == 2
    respell_run_spm(older, lambda proto: setattr(proto.pieces[5], "score", proto.pieces[5].score + 1))
    with pytest.raises(ConfigError, match=r"SentencePiece model sha256 \w+ \(parent, \d+ pieces\) vs"):
        train(child_config(prepared, tmp_path / "child2", older, "train.max_steps=2"))


def test_shape_and_vocabulary_mismatches_are_one_line_exit_2(parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    prepared, parent = parent_run
    other = tmp_path / "other-prepared"  # another SentencePiece model (another size)
    prepare(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={other}",
                                     "data.vocab_size=48"]))
    overrides = toy_train_overrides(other, tmp_path / "child", "data.vocab_size=48", "model.d_ff=96", "model.n_heads=4",
                                    *CHILD)
    result = cli_train("--init-from", str(parent), *set_args(overrides))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if " | INFO | " not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    for needle in ("train.init_from", "model.d_ff 128 (parent) vs 96 (this run)", "model.n_heads 2 (parent) vs 4",
                   sha256_file(parent / "spm.model"), sha256_file(other / "spm.model"), "data.spm_model"):
        assert needle in line, line
    assert not (tmp_path / "child" / "checkpoints" / "checkpoint_last.pt").exists()


def test_missing_parent_is_one_line(tmp_path: Path, parent_run: tuple[Path, Path]) -> None:
    prepared, _ = parent_run
    with pytest.raises(ConfigError, match="no such run directory or checkpoint"):
        train(child_config(prepared, tmp_path / "child", tmp_path / "nowhere"))


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_a_crafted_checkpoint_as_parent_never_runs_code(parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    prepared, _ = parent_run
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"format": 1, "model": {"w": _Payload(marker)}}, buffer)
    evil = tmp_path / "evil.pt"
    evil.write_bytes(ck._frame(buffer.getvalue()) + buffer.getvalue())  # a valid checksum
    with pytest.raises(CheckpointError, match="refused"):
        train(child_config(prepared, tmp_path / "child", evil))
    assert not marker.exists()


def test_a_child_is_not_resumed_once_its_parent_has_other_weights(parent_run: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """The parent trained further (its last checkpoint now another step): resuming the child
    would pair a table's new parent with a child adapted from the old one."""
    import shutil

    prepared, original = parent_run
    parent = tmp_path / "parent"
    shutil.copytree(original, parent)
    child = tmp_path / "child"
    train(child_config(prepared, child, parent, "train.max_steps=2", "train.valid_every=2"))
    shutil.copyfile(parent / "checkpoints" / "checkpoint_6.pt", parent / "checkpoints" / "checkpoint_8.pt")
    with pytest.raises(CheckpointError, match=rf"started from checkpoint_8.pt of {parent.resolve()} \(parent.json\), "
                                              "which has other weights now; use a new run directory to adapt them, "
                                              "or give the command without --init-from and with --set "
                                              "train.init_from=null to go on"):
        train(child_config(prepared, child, parent, "train.max_steps=4", "train.valid_every=2"))
    other = parent / "checkpoints" / "checkpoint_6.pt"  # a path, not the one the child started from
    with pytest.raises(CheckpointError, match=rf"of {parent.resolve()} \(parent.json\), and train.init_from {other} "
                                              "names other weights; give the first to resume"):
        train(child_config(prepared, child, other, "train.max_steps=4", "train.valid_every=2"))
    # the way forward both name: let go of the parent, and the child goes on from its own checkpoint
    record = (child / "parent.json").read_text(encoding="utf-8")
    summary = train(child_config(prepared, child, parent, "train.max_steps=4", "train.valid_every=2",
                                 "train.init_from=null"))
    assert summary.steps == 4 and load_checkpoint(child / "checkpoints" / "checkpoint_last.pt")["step"] == 4
    assert (child / "parent.json").read_text(encoding="utf-8") == record  # where it started, still
    assert "train.init_from: " in (child / "train.log").read_text(encoding="utf-8")
    # the parent as it was again: naming it is no change of the weights the child started from
    shutil.copyfile(original / "checkpoints" / "checkpoint_8.pt", parent / "checkpoints" / "checkpoint_8.pt")
    summary = train(child_config(prepared, child, parent, "train.max_steps=6", "train.valid_every=2"))
    assert summary.steps == 6


def test_two_parents_named_two_ways_are_refused(parent_run: tuple[Path, Path], tmp_path: Path) -> None:
    """--init-from won over --set train.init_from naming another run, without a word."""
    prepared, parent = parent_run
    overrides = toy_train_overrides(prepared, tmp_path / "child", f"train.init_from={tmp_path / 'elsewhere'}", *CHILD)
    result = cli_train("--init-from", str(parent), *set_args(overrides))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"mtcli: error: --init-from {parent} and train.init_from {tmp_path / 'elsewhere'} name two parents; give one")
    assert not (tmp_path / "child").exists()
    same = toy_train_overrides(prepared, tmp_path / "same", f"train.init_from={parent}", *CHILD, "train.max_steps=1")
    assert cli_train("--init-from", str(parent), *set_args(same)).returncode == 0  # one parent, said twice
