"""make reproduce-bt on the toy corpus: halves, a reverse model, two back-translations (beam and
sampling) tagged <bt>, four forward runs, and the share of the real pairs' gain recovered."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TOY_CONFIG, TOY_DIR, mtcli_status

from mtcli.backtranslation import ROWS, TABLE, TAG, render, run_bt, split_halves
from mtcli.config import load_config
from mtcli.data.cache import PreparedCorpus
from mtcli.data.textio import read_lines
from mtcli.results import markers, refresh_readme

FAST = ["train.max_steps=12", "train.valid_every=6", "train.valid_bleu=false", "train.keep_last=1",
        "train.num_threads=1"]


def test_halves_keep_every_other_pair_and_the_rest_as_monolingual(tmp_path: Path) -> None:
    data = load_config(TOY_CONFIG, [f"data.source={TOY_DIR}"]).data
    parallel, mono = split_halves(data, tmp_path)
    src, tgt = list(read_lines(TOY_DIR / "train.src")), list(read_lines(TOY_DIR / "train.tgt"))
    assert list(read_lines(parallel / "train.src")) == src[0::2]
    assert list(read_lines(parallel / "train.tgt")) == tgt[0::2]
    assert list(read_lines(mono / "train.tgt")) == tgt[1::2]
    assert not (mono / "train.src").exists()
    assert (parallel / "val.src").read_text() == (TOY_DIR / "val.src").read_text()


def test_backtranslation_pipeline_on_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (the full-data row trains on the recipe's own cache: here under tmp_path, not the checkout's data/)
    forward = load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={tmp_path / 'full'}", *FAST])
    reverse = load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", "data.src_lang=tgt", "data.tgt_lang=src",
                                       f"data.prepared_dir={tmp_path / 'full'}", *FAST])
    table = run_bt(forward, reverse, tmp_path)
    # run again (a restart): the finished runs and back-translations are kept, nothing runs twice
    import mtcli.backtranslation as bt

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ran again")

    monkeypatch.setattr(bt, "run_recipe", refuse)
    monkeypatch.setattr(bt.Translator, "from_run", refuse)
    # the reverse model's average removed meanwhile (a full model's disk space): made again, the same file
    averaged = tmp_path / "runs" / "reverse_half" / "checkpoints" / "checkpoint_avg_last1.pt"
    averaged.unlink()
    assert run_bt(forward, reverse, tmp_path) == table
    assert averaged.is_file()
    assert set(ROWS) < set(table)
    beam = list(read_lines(tmp_path / "data" / "bt_beam" / "train.src"))
    sampled = list(read_lines(tmp_path / "data" / "bt_sampling" / "train.src"))
    assert len(beam) == len(sampled) == 300 and beam != sampled
    assert (tmp_path / "data" / "bt_beam" / "train.tgt").read_text() == (tmp_path / "data" / "mono" / "train.tgt").read_text()
    tagged = PreparedCorpus.open(tmp_path / "prepared" / "bt_beam")
    assert tagged.corpora[1]["tag"] == TAG and tagged.corpora[1]["prefix"] == [TAG]
    assert tagged.array("train.1", "src")[0][0] == tagged.tags[TAG]
    for name in ROWS[1:3]:
        half, full = table[ROWS[0]]["bleu_lc"], table[ROWS[3]]["bleu_lc"]
        expected = None if full <= half else (table[name]["bleu_lc"] - half) / (full - half)
        assert table[name]["recovered"] == expected
    text = render(table)
    assert all(f"| {name} |" in text for name in ROWS)
    assert all(f"| {row['device']} | {row['commit']} |" in text for row in table.values())
    assert f"- BLEU `{table[ROWS[0]]['bleu_signature']}`" in text and "- chrF `nrefs:1|" in text
    older = {name: {k: v for k, v in row.items() if k not in ("bleu_signature", "chrf_signature")}
             for name, row in table.items()}
    assert "- chrF: its signature was not kept with these rows" in render(older)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{markers(TABLE)[0]}\nold table\n{markers(TABLE)[1]}\nend\n", encoding="utf-8")
    refresh_readme(readme, TABLE, text)
    assert readme.read_text(encoding="utf-8") == f"intro\n{markers(TABLE)[0]}\n{text}{markers(TABLE)[1]}\nend\n"


def test_a_kept_row_is_not_used_once_its_input_corpora_change(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Its data rewritten (or back-translated by another reverse model), a finished variant kept
    the scores of the old data, while its files and its back-translations were new: it now stops
    with one line, and trains again once its run is removed. A config that trains otherwise is
    refused once its run has a config.yaml and a checkpoint (the fake run_recipe here writes neither)."""
    import shutil

    import mtcli.backtranslation as bt
    from mtcli.errors import DataError

    data = tmp_path / "data"
    shutil.copytree(TOY_DIR, data)
    runs: list[int] = []

    def run_recipe(config: object) -> dict:
        run_dir = config.run_path()  # type: ignore[attr-defined]
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        runs.append(config.train.max_steps)  # type: ignore[attr-defined]
        return {"run": len(runs)}

    monkeypatch.setattr(bt, "run_recipe", run_recipe)
    run = tmp_path / "runs" / "half"
    config = load_config(TOY_CONFIG, [f"data.source={data}", f"train.run_dir={run}", *FAST])
    assert bt.recipe_row(config) == {"run": 1}
    assert bt.recipe_row(config) == {"run": 1}  # kept
    longer = load_config(TOY_CONFIG, [f"data.source={data}", f"train.run_dir={run}", *FAST, "train.max_steps=20"])
    assert bt.recipe_row(longer) == {"run": 2}  # another config: run (resumed) again
    (data / "train.src").write_text("other\n" * 300, encoding="utf-8")
    with pytest.raises(DataError, match=r"half: trained on other data than its corpora hold now .* remove it"):
        bt.recipe_row(longer)
    assert run.is_dir()  # nothing removed
    shutil.rmtree(run)
    assert bt.recipe_row(longer) == {"run": 3}
    from mtcli.config import save_config, with_changes
    from mtcli.errors import ConfigError

    save_config(with_changes(longer, "train", lr_factor=2.0), run / "config.yaml")  # its run trained at another
    (run / "checkpoints" / "checkpoint_20.pt").write_bytes(b"")  # rate: refused, not resumed and filed as its row
    record = run.with_name("half.row.json").read_text(encoding="utf-8")
    with pytest.raises(ConfigError, match=r"half: trained to another recipe \(train.lr_factor: 2.0 -> 0.5\)"):
        bt.recipe_row(config)
    assert run.with_name("half.row.json").read_text(encoding="utf-8") == record  # its finished row kept


def test_the_real_row_is_reused_only_when_it_read_the_same_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "all pairs real" row kept by its recipe alone: with DATA= another copy (a subset),
    back-translation was measured against a model trained on other data."""
    import json

    import mtcli.backtranslation as bt
    from mtcli.config import ConfigError, save_config, with_changes
    from mtcli.pipeline import seed_config
    from mtcli.reproduce import reads
    from mtcli.results import recipe_fingerprint

    reverse = tmp_path / "reverse.yaml"
    save_config(with_changes(load_config(TOY_CONFIG), "data", src_lang="tgt", tgt_lang="src"), reverse)
    args = ["--forward", str(TOY_CONFIG), "--reverse", str(reverse), "--results", str(tmp_path),
            "--set", f"data.source={TOY_DIR}", "--work", str(tmp_path / "bt")]
    forward = seed_config(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}"]), 1)
    given: list[object] = []

    def run_bt(forward: object, reverse: object, work: object, real: object) -> None:
        given.append(real)
        raise ConfigError("stop here")

    monkeypatch.setattr(bt, "run_bt", run_bt)
    rows = [{"recipe": recipe_fingerprint(forward), "data": "0" * 16, "bleu_lc": 30.0},
            {"recipe": recipe_fingerprint(forward), "data": reads(forward), "bleu_lc": 30.0},
            {"recipe": "f" * 16, "data": reads(forward), "bleu_lc": 30.0},
            {"bleu_lc": 30.0}]  # a row from before the fingerprints: the recipe's, as a merge takes it (was retrained)
    for row in rows:
        (tmp_path / "multi30k.json").write_text(json.dumps({"en-de": {"seeds": {"1": row}}}), encoding="utf-8")
        assert mtcli_status("reproduce-bt", *args) == 2
    assert given == [None, rows[1], None, rows[3]]


def test_a_reverse_recipe_of_the_forward_direction_is_refused(tmp_path: Path, capsys) -> None:
    """Its "back-translations" of the target half were read as source text: hours of training for a
    row labelled de-en that was not."""
    args = ["--forward", str(TOY_CONFIG), "--reverse", str(TOY_CONFIG), "--results", str(tmp_path),
            "--set", f"data.source={TOY_DIR}", "--work", str(tmp_path / "bt")]
    assert mtcli_status("reproduce-bt", *args) == 2
    assert capsys.readouterr().err == (f"mtcli: error: --reverse {TOY_CONFIG}: translates src->tgt; it must "
                                       "translate tgt->src (the --forward recipe's target into its source)\n")
    assert not (tmp_path / "bt").exists()


def test_back_translation_keeps_the_lines_of_its_text(tiny_run_dir: Path, tmp_path: Path) -> None:
    """Lines end at newlines only: a sentence holding U+2028, NEL or a form feed (WMT's news text
    has NELs) stays one sentence, beside its own back-translation."""
    from mtcli.backtranslation import back_translate

    data = load_config(TOY_CONFIG, [f"data.source={TOY_DIR}"]).data
    mono = tmp_path / "mono"
    mono.mkdir()
    lines = ["ein hund\u2028läuft", "die frau\x85sieht", "ein\x0cball", "der mann"]
    (mono / "train.tgt").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    out = back_translate(tiny_run_dir, tiny_run_dir / "checkpoints" / "checkpoint_best.pt", mono, tmp_path / "bt",
                         data, 1.0, beam=1)
    assert list(read_lines(out / "train.tgt")) == lines
    assert len(list(read_lines(out / "train.src"))) == len(lines)
