"""Tests of mtcli.infer.export: CTranslate2 export reproduces our greedy search token for token."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import mtcli_here
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.errors import ConfigError, MtcliError

MAX_LEN = 12


def _randomised_run(tiny_run_dir: Path, tmp_path: Path, pre_norm: bool, tied: bool,
                    shortlist: bool = False, swish: bool = False) -> Path:
    """A copy of the tiny run whose every parameter is drawn at random, large enough that the
    output depends on the input (a freshly initialised model mostly repeats one token);
    ``shortlist``: with an output vocabulary of the specials and every other piece; ``swish``:
    swish feed-forwards and a random output bias (as an OPUS-MT import has)."""
    from mtcli.checkpoint import load_checkpoint, save_checkpoint
    from mtcli.config import load_config, save_config
    from mtcli.model import Transformer

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    config = load_config(run / "config.yaml", [f"model.pre_norm={pre_norm}", f"model.tie_embeddings={tied}",
                                               *(["model.activation=swish", "model.output_bias=true"] if swish else [])])
    save_config(config, run / "config.yaml")
    path = run / "checkpoints" / "checkpoint_best.pt"
    state = load_checkpoint(path)
    shapes = Transformer(config.model, state["vocab"]["size"]).state_dict()
    gen = torch.Generator().manual_seed(7)
    state["model"] = {
        k: torch.randn(v.shape, generator=gen) * (0.5 if v.dim() > 1 else 0.2)
        + (1.0 if k.endswith("norm.weight") else 0.0)
        for k, v in shapes.items()
    }
    if shortlist:
        state["model"]["output_ids"] = torch.tensor([0, 1, 2, 3, *range(5, state["vocab"]["size"], 2)])
    state["config"] = config.to_dict()  # the checkpoint of this model, as a training would write it
    save_checkpoint(path, state)
    return run


@pytest.mark.parametrize(("pre_norm", "tied", "shortlist", "swish"),
                         [(False, True, False, False), (True, True, False, False), (False, False, False, False),
                          (False, True, True, False), (False, True, True, True)])
def test_ctranslate2_greedy_equals_ours(
    tiny_run_dir: Path, tmp_path: Path, pre_norm: bool, tied: bool, shortlist: bool, swish: bool
) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    from mtcli.data.batching import collate_sources
    from mtcli.infer.export import export_model
    from mtcli.infer.loading import load_for_inference
    from mtcli.infer.search import generate

    run = _randomised_run(tiny_run_dir, tmp_path, pre_norm, tied, shortlist, swish)
    out = export_model(run, tmp_path / "ct2", checkpoint="best")
    assert (out / "model.bin").is_file() and (out / "spm.model").is_file()
    bundle = load_for_inference(run, "best")
    record = json.loads((out / "mtcli_export.json").read_text(encoding="utf-8"))
    assert record["decode"] == bundle.config.to_dict()["decode"]  # the beam and length penalty to decode with

    tok = bundle.tokenizer
    lines = (run / "text" / "test.src").read_text(encoding="utf-8").splitlines()[:8]
    ids = [tok.encode(line) for line in lines]
    with torch.inference_mode():
        ours = [
            generate(bundle.model, collate_sources([s], "cpu"), beam_size=1, max_len_a=0.0,
                     max_len_b=MAX_LEN)[0][0].tokens
            for s in ids
        ]
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    results = translator.translate_batch(
        [[tok.id_to_piece(i) for i in s] for s in ids], beam_size=1, max_decoding_length=MAX_LEN,
        min_decoding_length=0, suppress_sequences=[["<blank>"], ["<s>"]],  # ours never emits them
    )
    ours_pieces = [[tok.id_to_piece(i) for i in seq] for seq in ours]
    assert [r.hypotheses[0] for r in results] == ours_pieces
    assert len({tuple(t) for t in ours_pieces}) > 1, "degenerate test: every output is the same"
    if shortlist:
        assert all(i == 1 or i % 2 for seq in ours for i in seq)  # unk or an odd id: listed


def test_export_without_ctranslate2_says_how_to_install(
    tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mtcli.infer.export import export_model

    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    with pytest.raises(MtcliError, match=r"pip install 'ctranslate2>="):
        export_model(tiny_run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_unknown_format(tiny_run_dir: Path, tmp_path: Path) -> None:
    from mtcli.infer.export import export_model

    with pytest.raises(ConfigError, match=r"unknown export format \(known: ctranslate2, hf\)"):
        export_model(tiny_run_dir, tmp_path / "out", fmt="onnx")  # hf too: `mtcli export --format hf` writes it
    with pytest.raises(ConfigError, match=r"unknown export format \(known here: ctranslate2; hf is mtcli.infer.hf"):
        export_model(tiny_run_dir, tmp_path / "out", fmt="hf")  # was "unknown ... (known: ctranslate2, hf)"


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf"])
def test_export_refuses_a_directory_of_other_files_before_converting(
        tiny_run_dir: Path, tmp_path: Path, fmt: str) -> None:
    """``mtcli export run docs`` once replaced the user's ``docs`` with the model."""
    pytest.importorskip("ctranslate2" if fmt == "ctranslate2" else "transformers")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.tex").write_text("mine")
    res = CliRunner().invoke(app, ["export", str(tiny_run_dir), str(docs), "--format", fmt])
    assert res.exit_code == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (f"mtcli: error: {docs}: a directory of other files (it has no mtcli_export.json); give a new "
                               "or empty directory, mtcli replaces only what it wrote there")
    assert [p.name for p in docs.iterdir()] == ["thesis.tex"]
    assert CliRunner().invoke(app, ["export", str(tiny_run_dir), str(tmp_path / "out"), "--format", fmt]).exit_code == 0
    assert CliRunner().invoke(app, ["export", str(tiny_run_dir), str(tmp_path / "out"), "--format", fmt]).exit_code == 0
    other = "hf" if fmt == "ctranslate2" else "ctranslate2"  # an export of the other format is kept
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    res = CliRunner().invoke(app, ["export", str(tiny_run_dir), str(tmp_path / "out"), "--format", other])
    assert res.exit_code == 1 and res.stderr.strip() == (
        f"mtcli: error: {tmp_path / 'out'}: holds a --format {fmt} export, which this --format {other} export would "
        "replace; give another directory (or remove this one first)")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_cli_export(tiny_run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    out = tmp_path / "exported"
    res = mtcli_here("export", str(tiny_run_dir), str(out))
    assert res.returncode == 0, res.stderr
    assert {"model.bin", "config.json", "spm.model"} <= {p.name for p in out.iterdir()}
    res = mtcli_here("translate", str(out), stdin=b"ein hund\n")  # said only "not a run directory"
    assert res.returncode != 0 and res.stderr.decode().strip() == (
        f"mtcli: error: {out}: an mtcli export, not a run directory; give the run it was exported from "
        f"({tiny_run_dir.resolve()}), or load it with CTranslate2 or transformers")
    res = mtcli_here("export", str(tmp_path / "missing"), str(tmp_path / "o2"))
    err = res.stderr.decode().strip()
    assert res.returncode != 0 and err.startswith("mtcli: error:") and len(err.splitlines()) == 1
    assert not (tmp_path / "o2").exists()


def test_an_export_while_training_replaces_the_checkpoint_loads_it_again(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training run saving a new best between the weights' read and the file's hash failed the
    export ("replaced while it was being read"), which holds a complete copy of the weights."""
    pytest.importorskip("ctranslate2")
    import mtcli.infer.export as export
    from mtcli.checkpoint import sha256_of_loaded
    from mtcli.errors import CheckpointError

    replaced = [1]

    def once_replaced(path: Path, payload_sha256: str | None) -> str:
        if replaced:
            replaced.pop()
            raise CheckpointError(f"{path}: replaced while it was being read")
        return sha256_of_loaded(path, payload_sha256)

    monkeypatch.setattr(export, "sha256_of_loaded", once_replaced)
    export.export_model(tiny_run_dir, tmp_path / "out")
    assert not replaced and (tmp_path / "out" / "model.bin").is_file()
