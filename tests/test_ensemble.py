"""Ensembles: members trained side by side (one process each) and decoded together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import toy_train_config

from mtcli.checkpoint import load_checkpoint
from mtcli.ensemble import member_configs, member_dirs, train_members
from mtcli.train import train


def test_member_configs_split_seeds_threads_and_directories(prepared_toy: Path, tmp_path: Path) -> None:
    config = toy_train_config(prepared_toy, tmp_path / "run", "train.ensemble=2", "train.num_threads=4",
                              "train.seed=7")
    members = member_configs(config)
    assert [m.run_path() for m in members] == [tmp_path / "run" / "member1", tmp_path / "run" / "member2"]
    assert [m.train.seed for m in members] == [7, 8]
    assert all(m.train.num_threads == 2 and m.train.ensemble == 1 and not m.train.progress for m in members)


def test_members_train_side_by_side_like_one_model_runs(prepared_toy: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summaries = train_members(toy_train_config(prepared_toy, run, "train.ensemble=2", "train.max_steps=3",
                                               "train.valid_every=3", "train.num_threads=2"))
    assert [s.steps for s in summaries] == [3, 3]
    assert member_dirs(run) == [run / "member1", run / "member2"]
    one = load_checkpoint(run / "member1" / "checkpoints" / "checkpoint_last.pt")["model"]
    two = load_checkpoint(run / "member2" / "checkpoints" / "checkpoint_last.pt")["model"]
    assert any(not torch.equal(one[k], two[k]) for k in one)  # other seeds, other models
    # member 1 is the one-model run of the same recipe (seed and data order alike)
    alone = train(toy_train_config(prepared_toy, tmp_path / "alone", "train.max_steps=3", "train.valid_every=3"))
    assert alone.steps == 3
    single = load_checkpoint(tmp_path / "alone" / "checkpoints" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(one[k], single[k]) for k in one)


def test_a_failing_member_is_named(prepared_toy: Path, tmp_path: Path) -> None:
    from mtcli.errors import DataError

    config = toy_train_config(prepared_toy, tmp_path / "run", "train.ensemble=2", "train.max_steps=2",
                              f"data.prepared_dir={tmp_path / 'missing'}")
    with pytest.raises(DataError, match=r"ensemble member 1 .*member1"):
        train_members(config)
