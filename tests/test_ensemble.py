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


# ------------------------------------------------------------------------------ decoding

def _mixture_logprob(models: list, src_ids: list[int], tokens: list[int], mode: str = "linear") -> float:
    """log of prod_t (1/M sum_m p_m(y_t | y_<t, x)) by teacher forcing each member (log_linear:
    of prod_t softmax(1/M sum_m log p_m)(y_t))."""
    from test_search import pad_batch

    from mtcli.tokenizer import BOS_ID, EOS_ID

    src = pad_batch([src_ids])
    tgt_in = torch.tensor([[BOS_ID] + tokens])
    tgt_out = torch.tensor(tokens + [EOS_ID])
    with torch.no_grad():
        logp = torch.stack([torch.log_softmax(m(src, tgt_in)[0].float(), -1) for m in models])
    if mode == "log_linear":
        mixture = torch.log_softmax(logp.mean(0), -1)
    else:
        mixture = torch.logsumexp(logp, 0) - torch.log(torch.tensor(float(len(models))))
    return mixture.gather(1, tgt_out[:, None]).sum().item()


@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_of_copies_decodes_like_the_model(beam: int) -> None:
    from test_search import pad_batch, random_model, random_sources, tokens_of

    from mtcli.ensemble import Ensemble
    from mtcli.search import generate

    model = random_model(3)
    src = pad_batch(random_sources(5))
    alone = generate(model, src, beam_size=beam, nbest=beam, length_penalty=1.0)
    pair = generate(Ensemble([model, random_model(3)]), src, beam_size=beam, nbest=beam, length_penalty=1.0)
    assert tokens_of(pair) == tokens_of(alone)
    for a, b in zip(alone, pair, strict=True):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize(("use_cache", "mode"), [(True, "linear"), (False, "linear"), (True, "log_linear")])
def test_ensemble_scores_are_the_mixture_of_its_members(beam: int, use_cache: bool, mode: str) -> None:
    from test_search import pad_batch, random_model, random_sources, tokens_of

    from mtcli.ensemble import Ensemble
    from mtcli.search import generate

    models = [random_model(1), random_model(2), random_model(5)]
    sources = random_sources(7)
    results = generate(Ensemble(models), pad_batch(sources), beam_size=beam, nbest=beam,
                       length_penalty=0.0, use_cache=use_cache, ensemble_mode=mode)
    for src_ids, hyps in zip(sources, results, strict=True):
        for h in hyps:
            assert h.logprob == pytest.approx(_mixture_logprob(models, src_ids, h.tokens, mode), abs=1e-3)
    # the mixture is not any one member: the search follows it, not the first model
    first = generate(models[0], pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=0.0)
    assert tokens_of(results) != tokens_of(first)


def test_ensemble_refuses_members_with_other_output_vocabularies() -> None:
    from test_search import random_model

    from mtcli.ensemble import Ensemble
    from mtcli.errors import CheckpointError
    from mtcli.model import Transformer

    model = random_model(0)
    listed = Transformer(model.cfg, model.vocab_size, output_ids=list(range(20)))
    with pytest.raises(CheckpointError, match="member 2"):
        Ensemble([model, listed])


def test_evaluate_and_translate_with_ensemble_members(tiny_run_dir: Path, tmp_path: Path) -> None:
    import shutil

    from conftest import build_tiny_run_dir

    from mtcli.errors import CheckpointError
    from mtcli.evaluate import evaluate
    from mtcli.fileio import sha256_file
    from mtcli.quantize import int8_supported
    from mtcli.translate import translate_files

    first = tmp_path / "first"
    shutil.copytree(tiny_run_dir, first)
    other = tmp_path / "other"  # the same SentencePiece model; its checkpoint_10 is another model
    shutil.copytree(tiny_run_dir, other)
    report = evaluate(first, split="val", ensemble=[other / "checkpoints" / "checkpoint_10.pt"],
                      overrides=["decode.beam_size=2"], output_dir=tmp_path / "eval")
    assert report["ensemble"] == [str(other / "checkpoints" / "checkpoint_10.pt")]
    assert Path(report["hypotheses"]).name == "val.best.ensemble2.hyp"
    assert "checkpoint_best.pt" in report["checkpoint"] and "other/checkpoint_10.pt" in report["checkpoint"]
    out = tmp_path / "out.txt"
    summary = translate_files(first, [first / "text" / "val.src"], out, ensemble=[other])
    assert summary["lines"] == len(out.read_text(encoding="utf-8").splitlines()) > 0
    if int8_supported() is None:  # int8 decoding quantises each member
        int8 = tmp_path / "int8.txt"
        translate_files(first, [first / "text" / "val.src"], int8, ensemble=[other],
                        overrides=["decode.int8=true"])
        assert len(int8.read_text(encoding="utf-8").splitlines()) == summary["lines"]
    # the parent of an ensemble run's members says how to decode them
    for member in ("member1", "member2"):
        shutil.copytree(first, tmp_path / "ens" / member)
    with pytest.raises(CheckpointError, match="an ensemble run .* --ensemble .*member2"):
        evaluate(tmp_path / "ens", split="val")
    with pytest.raises(CheckpointError, match="not a run directory nor a checkpoint"):
        evaluate(first, split="val", ensemble=[tmp_path / "nowhere.pt"])
    # a run whose checkpoints fit its own spm.model, of the same size but another model type
    stranger = build_tiny_run_dir(tmp_path / "stranger", seed=3, spm_model_type="bpe")
    assert sha256_file(stranger / "spm.model") != sha256_file(first / "spm.model")
    with pytest.raises(CheckpointError, match="spm.model differs from the first member's"):
        evaluate(first, split="val", ensemble=[stranger])


def test_sigterm_to_the_ensemble_run_stops_every_member_with_a_checkpoint(prepared_toy: Path,
                                                                           tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO, TOY_CONFIG, toy_train_overrides, wait_until

    run = tmp_path / "run"
    args = [sys.executable, "-m", "mtcli", "train", str(TOY_CONFIG)]
    for item in toy_train_overrides(prepared_toy, run, "train.ensemble=2", "train.num_threads=2",
                                    "train.max_steps=100000", "train.valid_every=100000"):
        args += ["--set", item]
    proc = subprocess.Popen(args, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [run / f"member{i}" / "train.log" for i in (1, 2)]
    wait_until(lambda: all(p.exists() and "| step 3 |" in p.read_text(encoding="utf-8") for p in logs),
               proc, "step 3 in both members' train.log", timeout=90.0)
    proc.send_signal(signal.SIGTERM)  # to the parent only, as a job scheduler would
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert "ensemble member 1" in err and "interrupted by SIGTERM" in err, err
    for i in (1, 2):
        assert load_checkpoint(run / f"member{i}" / "checkpoints" / "checkpoint_last.pt")["step"] >= 3
        assert not (run / f"member{i}" / "train.lock").exists()
