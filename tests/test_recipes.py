"""The paper recipes for GPU users run end to end for two steps on the toy corpus, so they cannot rot.

The recipes read the WMT14 hub dataset and use bf16; here the data section points at the toy
corpus (same keys, local source), bf16 and compiling are off (this CPU has no bf16 matmul units,
and compiling takes minutes), while the model, optimiser, schedule, batch packing and decoding
settings are the recipe's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcli.config import load_config

REPO = Path(__file__).resolve().parents[1]
TOY_DIR = REPO / "tests" / "fixtures" / "toy"

TOY_DATA = [
    f"data.source={TOY_DIR}", "data.hub_config=null", "data.src_lang=src", "data.tgt_lang=tgt",
    "data.valid_split=val", "data.test_splits=[test]", "data.vocab_size=64", "data.num_workers=1",
]


def _two_steps(recipe: str, tmp_path: Path) -> None:
    from mtcli.data.prepare import prepare
    from mtcli.train import train

    overrides = TOY_DATA + [
        f"data.prepared_dir={tmp_path / 'prep'}", f"train.run_dir={tmp_path / 'run'}",
        "train.precision=fp32", "train.max_tokens=256", "train.update_freq=1", "train.max_steps=2",
        "train.valid_every=2", "train.valid_bleu=false", "train.keep_last=1", "train.progress=false",
        "train.compile=false",  # compiling the base model takes minutes on a CPU; the compiled step has its own tests
    ]
    config = load_config(REPO / "configs" / recipe, overrides)
    prepare(config)
    summary = train(config)
    assert summary.steps == 2
    assert summary.best_valid_loss is not None and summary.best_valid_loss == summary.best_valid_loss
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_last.pt").is_file()


@pytest.mark.parametrize("recipe", ["wmt14_en_de_base.yaml", "wmt14_en_de_big.yaml"])
def test_paper_recipe_keeps_the_papers_hyperparameters(recipe: str) -> None:
    config = load_config(REPO / "configs" / recipe)
    big = "big" in recipe
    m, t, d = config.model, config.train, config.decode
    assert (m.encoder_layers, m.decoder_layers) == (6, 6)
    assert (m.d_model, m.n_heads, m.d_ff) == ((1024, 16, 4096) if big else (512, 8, 2048))
    assert m.dropout == (0.3 if big else 0.1)
    assert (t.label_smoothing, t.warmup_steps, t.adam_betas, t.adam_eps) == (0.1, 4000, [0.9, 0.98], 1e-9)
    assert 20_000 <= t.max_tokens * t.update_freq <= 30_000  # ~25k tokens per step on one GPU
    assert (d.beam_size, d.length_penalty) == (4, 0.6)
    assert config.data.source == "wmt14" and config.data.hub_config == "de-en"


def test_base_recipe_trains_two_steps(tmp_path: Path) -> None:
    _two_steps("wmt14_en_de_base.yaml", tmp_path)


@pytest.mark.slow
def test_big_recipe_trains_two_steps(tmp_path: Path) -> None:
    _two_steps("wmt14_en_de_big.yaml", tmp_path)
