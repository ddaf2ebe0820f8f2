"""Export to Hugging Face Transformers (mtcli.infer.hf): the exported MarianMTModel computes our
logits, and transformers' translation pipeline gives our greedy translations."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOY_DIR

from mtcli.errors import ConfigError
from mtcli.infer.loading import load_for_inference
from mtcli.infer.translator import Translator

transformers = pytest.importorskip("transformers", reason="the hf export needs the hf extra (pip install -e '.[hf]')")

from mtcli.infer.hf import export_hf, model_permutation  # noqa: E402

LINES = [line for line in (TOY_DIR / "test.src").read_text(encoding="utf-8").splitlines() if line][:12]


@pytest.fixture(scope="module")
def exported(tiny_run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(tiny_run_dir, tmp_path_factory.mktemp("hf") / "model")


def test_the_permutation_turns_our_positions_into_marians() -> None:
    d, positions = 8, torch.arange(5, dtype=torch.float32)[:, None]
    angle = positions / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ours = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # sin, cos interleaved
    marian = torch.cat([angle.sin(), angle.cos()], dim=1)  # the sines, then the cosines
    assert torch.equal(ours[:, model_permutation(d)], marian)


def test_the_marian_model_computes_our_logits(tiny_run_dir: Path, exported: Path) -> None:
    bundle = load_for_inference(tiny_run_dir, "best", device="cpu")
    tokenizer, ours = bundle.tokenizer, bundle.model.eval()
    theirs = transformers.MarianMTModel.from_pretrained(exported).eval()
    src = torch.tensor([tokenizer.encode(LINES[1]) + [3]])
    tgt_in = torch.tensor([[2] + tokenizer.encode(LINES[2])[:9]])
    with torch.inference_mode():
        expected = ours.widen(ours(src, tgt_in))
        got = theirs(input_ids=src, decoder_input_ids=tgt_in).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def _translate_with_transformers(model_dir: Path, lines: list[str]) -> list[str]:
    """Greedy translations by transformers: its translation pipeline where it has one (before
    version 5), else the model's generate and the tokenizer's decode, which that pipeline ran."""
    from transformers.pipelines import SUPPORTED_TASKS

    if "translation" in SUPPORTED_TASKS:
        translate = transformers.pipeline("translation", model=str(model_dir), device="cpu")
        return [out["translation_text"] for out in translate(lines, num_beams=1, max_new_tokens=21)]
    tokenizer = transformers.MarianTokenizer.from_pretrained(model_dir)
    model = transformers.MarianMTModel.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = model.generate(**tokenizer(lines, return_tensors="pt", padding=True), num_beams=1,
                             do_sample=False, max_new_tokens=21)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def test_transformers_gives_our_greedy_output(tiny_run_dir: Path, exported: Path) -> None:
    ours = Translator.from_run(tiny_run_dir, device="cpu", beam=1, max_len_a=0.0, max_len_b=20)
    assert _translate_with_transformers(exported, LINES) == ours.translate(LINES)
    tokenizer = transformers.MarianTokenizer.from_pretrained(exported)
    ids = tokenizer(LINES[3])["input_ids"]
    assert ids == ours.bundle.tokenizer.encode(LINES[3]) + [3]  # the same pieces, then </s>


def test_the_export_carries_the_runs_beam_and_length_penalty(tiny_run_dir: Path, tmp_path: Path) -> None:
    """generate() took the run's beam but transformers' length penalty 1.0: a run tuned to 0 came
    out of transformers unlike mtcli's on a line in seven (with alpha 0 both rank alike)."""
    from mtcli.config import load_config, save_config, with_changes

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    config = load_config(run / "config.yaml")
    save_config(with_changes(config, "decode", beam_size=4, length_penalty=0.0, max_len_a=0.0, max_len_b=20),
                run / "config.yaml")
    exported = export_hf(run, tmp_path / "hf")
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert (generation.num_beams, generation.length_penalty, generation.max_length) == (4, 0.0, 22)


def test_a_pre_norm_run_is_refused(tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mtcli.infer.hf as hf

    real = hf.load_for_inference

    def pre_norm(*args, **kwargs):
        bundle = real(*args, **kwargs)
        bundle.model.cfg = dataclasses.replace(bundle.model.cfg, pre_norm=True)
        return bundle

    monkeypatch.setattr(hf, "load_for_inference", pre_norm)
    with pytest.raises(ConfigError, match="pre-norm"):
        export_hf(tiny_run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_exports_hf(tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    assert "hf" in CliRunner().invoke(app, ["export", "--help"]).output
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["export", "run", str(tmp_path / "out"), "--format", "hf"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "vocab.json").is_file()
    record = json.loads((tmp_path / "out" / "mtcli_export.json").read_text(encoding="utf-8"))
    assert record["run_dir"] == str(run)  # as given, "run": advice naming it held only from here


def test_every_exported_file_has_the_mode_of_a_new_file(tiny_run_dir: Path, tmp_path: Path) -> None:
    """model.safetensors was 0600 (safetensors' own): an export made by one account (CI, a
    container build) could not be served by another."""
    import os

    old = os.umask(0o022)
    try:
        exported = export_hf(tiny_run_dir, tmp_path / "model")
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in exported.iterdir() if path.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_an_export_short_of_memory_says_so_and_leaves_no_output(tiny_run_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed allocation while writing was "cannot write the export": read as a disk's fault."""
    def save_pretrained(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise MemoryError()

    monkeypatch.setattr(transformers.MarianMTModel, "save_pretrained", save_pretrained)
    with pytest.raises(MemoryError, match=r": writing the export \(MemoryError\)$"):
        export_hf(tiny_run_dir, tmp_path / "model")
    assert not (tmp_path / "model").exists()
