"""Ensembles at decode time: separately trained models decoded together (``--ensemble``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# ------------------------------------------------------------------------------ decoding

def _mixture_logprob(models: list, src_ids: list[int], tokens: list[int], mode: str = "linear") -> float:
    """log of prod_t (1/M sum_m p_m(y_t | y_<t, x)) by teacher forcing each member (log_linear:
    of prod_t softmax(1/M sum_m log p_m)(y_t))."""
    from test_search import pad_batch

    from mtcli.data.tokenizer import BOS_ID, EOS_ID

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

    from mtcli.infer.ensemble import Ensemble
    from mtcli.infer.search import generate

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

    from mtcli.infer.ensemble import Ensemble
    from mtcli.infer.search import generate

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

    from mtcli.errors import CheckpointError
    from mtcli.infer.ensemble import Ensemble
    from mtcli.model import Transformer

    model = random_model(0)
    listed = Transformer(model.cfg, model.vocab_size, output_ids=list(range(20)))
    with pytest.raises(CheckpointError, match="^ensemble member 2 has another output vocabulary"):
        Ensemble([model, listed])
    with pytest.raises(CheckpointError, match=r"^runs/b/checkpoint_9.pt has another output vocabulary than the first "
                                              r"member \(model.output_vocab: the first member joint, runs/b/"
                                              r"checkpoint_9.pt target\)"):  # as --ensemble gave it; "vocabulary
        Ensemble([model, listed], ["the first member", "runs/b/checkpoint_9.pt"])  # or output vocabulary" before
    other = Transformer(model.cfg, model.vocab_size + 8)
    with pytest.raises(CheckpointError, match="^ensemble member 2 has another vocabulary than ensemble member 1"):
        Ensemble([model, other])


def test_evaluate_and_translate_with_ensemble_members(tiny_run_dir: Path, tmp_path: Path) -> None:
    import shutil

    from conftest import build_tiny_run_dir

    from mtcli.errors import CheckpointError
    from mtcli.evaluate import evaluate
    from mtcli.fileio import sha256_file
    from mtcli.infer.files import translate_files
    from mtcli.infer.quantize import int8_supported

    first = tmp_path / "first"
    shutil.copytree(tiny_run_dir, first)
    other = tmp_path / "other"  # the same SentencePiece model; its checkpoint_10 is another model
    shutil.copytree(tiny_run_dir, other)
    report = evaluate(first, split="val", ensemble=[other / "checkpoints" / "checkpoint_10.pt"],
                      overrides=["decode.beam_size=2"], output_dir=tmp_path / "eval")
    assert report["ensemble"] == [str(other / "checkpoints" / "checkpoint_10.pt")]
    assert Path(report["hypotheses"]).name == "val.best.ensemble2.hyp"
    assert "checkpoint_best.pt" in report["checkpoint"] and "other/checkpoints/checkpoint_10.pt (step 10)" in report["checkpoint"]
    out = tmp_path / "out.txt"
    summary = translate_files(first, [first / "text" / "val.src"], out, ensemble=[other])
    assert summary["lines"] == len(out.read_text(encoding="utf-8").splitlines()) > 0
    if int8_supported() is None:  # int8 decoding quantises each member
        int8 = tmp_path / "int8.txt"
        translate_files(first, [first / "text" / "val.src"], int8, ensemble=[other],
                        overrides=["decode.int8=true"])
        assert len(int8.read_text(encoding="utf-8").splitlines()) == summary["lines"]
    with pytest.raises(CheckpointError, match="not a run directory nor a checkpoint"):
        evaluate(first, split="val", ensemble=[tmp_path / "nowhere.pt"])
    # an average written outside a run (mtcli average -o) is read with the first member's run
    from mtcli.infer.averaging import average_run_checkpoints

    averaged = tmp_path / "avg.pt"
    average_run_checkpoints(other, averaged, last=2)
    report = evaluate(first, split="val", ensemble=[averaged], overrides=["decode.beam_size=2"],
                      output_dir=tmp_path / "eval2")
    assert "avg.pt (average of checkpoint_10.pt, checkpoint_20.pt)" in report["checkpoint"]
    kept = tmp_path / "store" / "checkpoints"  # a folder of that name outside any run
    kept.mkdir(parents=True)
    shutil.copy(averaged, kept / "avg.pt")
    report = evaluate(first, split="val", ensemble=[kept / "avg.pt"], overrides=["decode.beam_size=2"],
                      output_dir=tmp_path / "eval3")
    assert "avg.pt (average of checkpoint_10.pt, checkpoint_20.pt)" in report["checkpoint"]
    # a run whose checkpoints fit its own spm.model, of the same size but another model type
    stranger = build_tiny_run_dir(tmp_path / "stranger", seed=3, spm_model_type="bpe")
    assert sha256_file(stranger / "spm.model") != sha256_file(first / "spm.model")
    with pytest.raises(CheckpointError, match="spm.model differs from the first member's"):
        evaluate(first, split="val", ensemble=[stranger])
    with pytest.raises(CheckpointError, match="vocab"):  # a loose file of another SentencePiece model
        evaluate(first, split="val", ensemble=[shutil.copy(stranger / "checkpoints" / "checkpoint_20.pt",
                                                           tmp_path / "stranger.pt")])


def _reversed_run(run: Path, out: Path) -> Path:
    """A copy of ``run`` whose config and checkpoints say it translates the other way."""
    import shutil

    import yaml

    from mtcli.checkpoint import load_checkpoint, save_checkpoint

    shutil.copytree(run, out)
    config = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    data = config["data"]
    data["src_lang"], data["tgt_lang"] = data["tgt_lang"], data["src_lang"]
    (out / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    for path in (out / "checkpoints").glob("checkpoint_*.pt"):
        if not path.is_symlink():
            state = load_checkpoint(path)
            state["config"]["data"] = data
            save_checkpoint(path, state)
    return out


def test_an_ensembles_weights_sha256_names_all_its_members(tiny_run_dir: Path) -> None:
    """/health and evaluate's report tell an ensemble from its first member alone, and from an
    ensemble of other members."""
    from mtcli.infer.ensemble import add_members
    from mtcli.infer.loading import load_for_inference

    alone = load_for_inference(tiny_run_dir, "best").weights_sha256
    checkpoints = tiny_run_dir / "checkpoints"
    with_10 = add_members(load_for_inference(tiny_run_dir, "best"), [checkpoints / "checkpoint_10.pt"]).weights_sha256
    with_20 = add_members(load_for_inference(tiny_run_dir, "best"), [checkpoints / "checkpoint_20.pt"]).weights_sha256
    again = add_members(load_for_inference(tiny_run_dir, "best"), [checkpoints / "checkpoint_10.pt"]).weights_sha256
    assert len({alone, with_10, with_20}) == 3 and again == with_10 and len(with_10) == 64


def test_an_ensemble_mode_without_members_is_said_to_change_nothing(tiny_run_dir: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """It was accepted without a word, as if it changed the decoding."""
    from mtcli.infer.translator import Translator

    Translator.from_run(tiny_run_dir, device="cpu", overrides=["decode.ensemble_mode=log_linear"])
    assert "decode.ensemble_mode: combines the members of --ensemble; one model: it changes nothing" in caplog.text
    caplog.clear()
    Translator.from_run(tiny_run_dir, device="cpu", overrides=["decode.ensemble_mode=log_linear"],
                        ensemble=[tiny_run_dir / "checkpoints" / "checkpoint_10.pt"])
    assert "ensemble_mode" not in caplog.text


def test_members_checkpoints_and_averages_of_other_directions_are_refused(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A src->tgt model decoded with tgt->src weights (an ensemble member, a checkpoint given by
    path, an average) was accepted: the vocabulary and shapes alone were compared."""
    from mtcli import Translator
    from mtcli.errors import CheckpointError
    from mtcli.infer.averaging import average_checkpoints

    other = _reversed_run(tiny_run_dir, tmp_path / "reverse")
    with pytest.raises(CheckpointError, match="trained for tgt->src, the first member for src->tgt"):
        Translator.from_run(tiny_run_dir, ensemble=[other], device="cpu")
    with pytest.raises(CheckpointError, match=r"a checkpoint trained for tgt->src, not for src->tgt as"):
        Translator.from_run(tiny_run_dir, checkpoint=other / "checkpoints" / "checkpoint_20.pt", device="cpu")
    with pytest.raises(CheckpointError, match="trained for other directions"):
        average_checkpoints([tiny_run_dir / "checkpoints" / "checkpoint_10.pt", other / "checkpoints" / "checkpoint_20.pt"])
    Translator.from_run(other, device="cpu")  # its own run directory decodes it
