"""One model for several directions: the target-language tag put before each source by
translate, Translator, evaluate and serve, and refused where the model has no such language."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import TOY_CONFIG, toy_train_config, train_trilingual
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.config import load_config, save_config, with_changes
from mtcli.data.cache import PreparedCorpus
from mtcli.errors import ConfigError, DataError
from mtcli.evaluate import evaluate_directions
from mtcli.infer.translator import Translator

SOURCES = ["hund katze mann", "die frau sieht ein kind", "der ball ist rot"]


@pytest.fixture(scope="module")
def multi_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy model of three directions (src->tgt, tgt->src, src->xx) trained briefly."""
    return train_trilingual(tmp_path_factory.mktemp("multilingual"), 250, "train.lr_factor=1.0", "train.num_threads=1")


def test_the_tag_of_the_asked_language_goes_before_each_source(multi_run: Path) -> None:
    translator = Translator.from_run(multi_run, beam=1)
    tags = PreparedCorpus.open(multi_run.parent / "prepared").tags
    into_tgt = translator.nbest(SOURCES, 1)
    into_xx = translator.nbest(SOURCES, 1, tgt_lang="xx")
    assert {n[0].source_tokens[0] for n in into_tgt} == {tags["<2tgt>"]}  # data.tgt_lang by default
    assert {n[0].source_tokens[0] for n in into_xx} == {tags["<2xx>"]}
    assert [n[0].source_tokens[1:] for n in into_tgt] == [n[0].source_tokens[1:] for n in into_xx]
    # the model learned what the tag asks for: xx's words end in "o", tgt's mostly do not
    xx_words = " ".join(n[0].text for n in into_xx).split()
    tgt_words = " ".join(n[0].text for n in into_tgt).split()
    assert sum(w.endswith("o") for w in xx_words) > 0.8 * len(xx_words)
    assert sum(w.endswith("o") for w in tgt_words) < 0.5 * len(tgt_words)
    with pytest.raises(ConfigError, match="target language fr: this model translates into tgt, src, xx"):
        translator.translate(SOURCES, tgt_lang="fr")
    with pytest.raises(ConfigError, match="target language fr"):  # refused when loaded, not at the first line
        Translator.from_run(multi_run, tgt_lang="fr")


def test_a_model_of_one_target_language_refuses_another(tiny_run_dir: Path) -> None:
    translator = Translator.from_run(tiny_run_dir, beam=1)
    assert translator.translate(["hund"], tgt_lang="tgt") == translator.translate(["hund"])
    with pytest.raises(ConfigError, match="target language fr: this model translates into tgt only"):
        translator.translate(["hund"], tgt_lang="fr")


def test_translate_cli_takes_the_target_language(multi_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    runner = CliRunner()
    out = runner.invoke(app, ["translate", str(multi_run), str(source), "--tgt-lang", "xx", "--beam", "1"])
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == Translator.from_run(multi_run, beam=1).translate(SOURCES, tgt_lang="xx")
    assert "translating into" not in out.stderr
    # asked nothing, it says which language it chose (a German line came back German, unsaid)
    default = runner.invoke(app, ["translate", str(multi_run), str(source), "--beam", "1"])
    assert "translating into tgt, the run's default (--tgt-lang chooses: tgt, src, xx)" in default.stderr
    bad = runner.invoke(app, ["translate", str(multi_run), str(source), "--tgt-lang", "fr"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "target language fr: this model translates into tgt, src, xx" in bad.output
    assert "--tgt-lang" in runner.invoke(app, ["translate", "--help"]).output
    assert "read as text" not in out.stderr + default.stderr


def test_score_cli_warns_which_language_it_scores_the_targets_as(multi_run: Path, tmp_path: Path) -> None:
    """Targets scored as the run's default target language, unsaid: the numbers of targets in
    another language were wrong without a sign (translate at least shows its output)."""
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    target.write_text("\n".join(Translator.from_run(multi_run, beam=1).translate(SOURCES, tgt_lang="xx")) + "\n",
                      encoding="utf-8")
    runner = CliRunner()
    default = runner.invoke(app, ["score", str(multi_run), str(source), str(target)])
    assert default.exit_code == 0, default.output
    assert "scoring the targets as tgt, the run's default (--tgt-lang names their language: tgt, src, xx)" \
        in default.stderr
    named = runner.invoke(app, ["score", str(multi_run), str(source), str(target), "--tgt-lang", "xx"])
    assert named.exit_code == 0 and "scoring the targets as" not in named.stderr
    assert named.stdout != default.stdout  # scored as xx text, which they are, not as tgt


@pytest.mark.parametrize("typed", ["<2xx>", ">>xx<<"])
def test_a_tag_typed_into_a_source_is_warned_of_as_text(multi_run: Path, tmp_path: Path, typed: str) -> None:
    """The tokenizer makes text of a typed tag, and the default language came back without a word."""
    source = tmp_path / "in.txt"
    source.write_text(f"{SOURCES[0]}\n {typed} {SOURCES[1]}\n{typed} {SOURCES[2]}\n", encoding="utf-8")
    out = CliRunner().invoke(app, ["translate", str(multi_run), str(source), "--beam", "1"])
    assert out.exit_code == 0, out.output
    assert out.stderr.count("read as text") == 1  # once a window
    assert (f"{source}: line 2 starts with {typed}, which is read as text: the target language is chosen by "
            "--tgt-lang") in out.stderr


def test_evaluate_scores_each_direction(multi_run: Path, tmp_path: Path) -> None:
    reports = evaluate_directions(multi_run, beam=1, output_dir=tmp_path)
    assert [r["direction"] for r in reports] == ["src-tgt", "tgt-src", "src-xx"]
    for report in reports:
        src, tgt = report["direction"].split("-")
        assert report["source"].endswith(f"text/test.{src}") and report["reference"].endswith(f"text/test.{tgt}")
        assert report["decode"]["tgt_lang"] == tgt and report["sentences"] == 40
    assert sorted(p.name for p in tmp_path.glob("*.hyp")) == ["test.best.hyp", "test.src-xx.best.hyp",
                                                              "test.tgt-src.best.hyp"]
    only = evaluate_directions(multi_run, beam=1, output_dir=tmp_path, tgt_lang="src")
    assert [r["direction"] for r in only] == ["tgt-src"]
    by_set = evaluate_directions(multi_run, beam=1, output_dir=tmp_path, overrides=["decode.tgt_lang=src"])
    assert [r["direction"] for r in by_set] == ["tgt-src"]  # as --tgt-lang (it scored every direction)
    with pytest.raises(ConfigError, match=r"no direction xx->\* among those it was trained on \(src->tgt, "):
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path, src_lang="xx")
    with pytest.raises(ConfigError, match="target language fr: this model translates into tgt, src, xx"):
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path, tgt_lang="fr")
    with pytest.raises(ConfigError, match=r"no direction tgt->xx among .*; a direction it was not trained on is scored "
                                          r"zero-shot on files: --src FILE --ref FILE$"):  # (it gave no way on)
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path, src_lang="tgt", tgt_lang="xx")
    assert all(r["src_lang"] + "-" + r["tgt_lang"] == r["direction"] for r in reports)


def test_evaluate_on_files_warns_which_direction_it_scores(
        multi_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = multi_run.parent / "tri"
    files = {"src_file": text / "test.src", "ref_file": text / "test.xx", "output_dir": tmp_path}
    (default,) = evaluate_directions(multi_run, beam=1, **files)
    assert default["direction"] == "src-tgt"
    assert "translates into tgt, src, xx: scoring into tgt, its default (--tgt-lang chooses)" in caplog.text
    # a file's language cannot be told: a German file was reported as en->fr, unsaid
    assert (f"{text / 'test.src'}: scored as src->tgt (the run translates from src, tgt; --src-lang names the "
            "file's language)") in caplog.text
    caplog.clear()
    evaluate_directions(multi_run, beam=1, src_lang="src", **files)
    assert "--src-lang names" not in caplog.text
    # only src was trained into xx, but a tgt file into xx is zero-shot: the file's language is said
    # (a French file was labelled en->de, unsaid)
    evaluate_directions(multi_run, beam=1, tgt_lang="xx", **files)
    assert f"{text / 'test.src'}: scored as src->xx (the run translates from src, tgt;" in caplog.text
    caplog.clear()
    (zero_shot,) = evaluate_directions(multi_run, beam=1, src_lang="tgt", tgt_lang="xx",
                                       **{**files, "src_file": text / "test.tgt"})  # was refused: untrained
    assert zero_shot["direction"] == "tgt-xx" and "tgt->xx was not trained (zero-shot)" in caplog.text
    caplog.clear()
    (into_xx,) = evaluate_directions(multi_run, beam=1, tgt_lang="xx", **files)
    assert into_xx["direction"] == "src-xx" and "its default" not in caplog.text
    # decode.tgt_lang by --set asks for a target as --tgt-lang does (it was said to be the default)
    caplog.clear()
    (by_set,) = evaluate_directions(multi_run, beam=1, overrides=["decode.tgt_lang=xx"], **files)
    assert by_set["direction"] == "src-xx" and by_set["bleu"] == into_xx["bleu"]
    assert "its default" not in caplog.text
    # the default target is the model's, its decode.tgt_lang where the run sets it (it was data.tgt_lang)
    run = shutil.copytree(multi_run, tmp_path / "run")
    save_config(with_changes(load_config(run / "config.yaml"), "decode", tgt_lang="xx"), run / "config.yaml")
    (by_config,) = evaluate_directions(run, beam=1, **{**files, "output_dir": tmp_path / "own"})
    assert by_config["direction"] == "src-xx" and "scoring into xx, its default" in caplog.text
    # a default target that data.src_lang was not trained into: the one direction into it
    (into_src,) = evaluate_directions(multi_run, beam=1, overrides=["decode.tgt_lang=src"], **files)
    assert into_src["direction"] == "tgt-src"  # was "several trained directions fit"
    # each direction's outputs under a name of their own: the second did overwrite the first
    assert [Path(r["hypotheses"]).name for r in (default, into_xx)] == ["test.src.best.hyp", "test.src.src-xx.best.hyp"]


def test_evaluate_on_files_takes_the_trained_direction_the_languages_given_name(
        multi_run: Path, tmp_path: Path) -> None:
    """Files of tgt sentences scored against src: --src-lang tgt alone was refused (tgt->tgt
    was not trained) and --tgt-lang src alone was reported as src->src; each names the one
    trained direction, tgt->src."""
    text = multi_run.parent / "tri"
    files = {"src_file": text / "test.tgt", "ref_file": text / "test.src", "output_dir": tmp_path}
    (by_source,) = evaluate_directions(multi_run, beam=1, src_lang="tgt", **files)
    (by_target,) = evaluate_directions(multi_run, beam=1, tgt_lang="src", **files)
    assert by_source["direction"] == by_target["direction"] == "tgt-src"
    assert by_source["bleu"] == by_target["bleu"]


def test_evaluate_scores_the_directions_that_have_test_text(
        multi_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A corpus without test sets (back-translations, an extra pair): its direction is left out
    with a warning and the others are scored (every direction failed); alone, it is the error."""
    import mtcli.evaluate as evaluate_module

    real = evaluate_module._split_files

    def split_files(run_dir: Path, config: object, split: str, direction: tuple[str, str]) -> tuple[Path, Path]:
        if direction == ("src", "xx"):
            raise evaluate_module.NoTestText(f"split '{split}': no text for src->xx")
        return real(run_dir, config, split, direction)

    monkeypatch.setattr(evaluate_module, "_split_files", split_files)
    reports = evaluate_directions(multi_run, beam=1, output_dir=tmp_path)
    assert [r["direction"] for r in reports] == ["src-tgt", "tgt-src"]
    assert "src->xx: not scored (split 'test': no text for src->xx)" in caplog.text
    with pytest.raises(DataError, match="no text for src->xx"):
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path, tgt_lang="xx")


def test_evaluate_leaves_out_an_empty_test_split_and_says_how_to_score_the_others(
        multi_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mtcli.evaluate as evaluate_module
    from mtcli.errors import MtcliError

    real, real_scorer = evaluate_module._split_files, evaluate_module.scorer
    empty = tmp_path / "test.empty"
    empty.write_text("")

    def split_files(run_dir: Path, config: object, split: str, direction: tuple[str, str]) -> tuple[Path, Path]:
        return (empty, empty) if direction == ("src", "xx") else real(run_dir, config, split, direction)

    monkeypatch.setattr(evaluate_module, "_split_files", split_files)
    reports = evaluate_directions(multi_run, beam=1, output_dir=tmp_path)
    assert [r["direction"] for r in reports] == ["src-tgt", "tgt-src"]
    assert f"src->xx: not scored ({empty}: empty; there is nothing to translate and score)" in caplog.text
    monkeypatch.setattr(evaluate_module, "_split_files", real)

    def scorer(name: str, tgt_lang: str | None = None, instead: str = "", **kw: object) -> object:
        if tgt_lang == "xx":
            raise MtcliError(f"BLEU of 'xx' needs a package{instead}")
        return real_scorer(name, tgt_lang, instead=instead, **kw)

    monkeypatch.setattr(evaluate_module, "scorer", scorer)
    with pytest.raises(MtcliError, match=r"a package \(or --tgt-lang: score the directions into another language; or "
                                         r"--metrics chrf: chrF needs no tokeniser\)$"):
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path)
    with pytest.raises(MtcliError, match=r"a package \(or --metrics chrf: chrF needs no tokeniser\)$"):  # xx alone
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path, tgt_lang="xx")


def test_evaluate_checks_every_direction_before_decoding_any(
        multi_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A direction that cannot be scored (here: xx's BLEU tokeniser missing, as Japanese's is
    without MeCab) stops evaluate before the first direction is decoded, not after it."""
    import mtcli.evaluate as evaluate_module
    from mtcli.errors import MtcliError

    def scorer(name: str, tgt_lang: str | None = None, **kw: object) -> object:
        if tgt_lang == "xx":
            raise MtcliError("BLEU of 'xx' text tokenises it with MeCab")
        return real(name, tgt_lang, **kw)

    real = evaluate_module.scorer
    monkeypatch.setattr(evaluate_module, "scorer", scorer)
    monkeypatch.setattr(evaluate_module, "_decode", lambda *a, **k: pytest.fail("decoded before the check"))
    with pytest.raises(MtcliError, match="MeCab"):
        evaluate_directions(multi_run, beam=1, output_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown metric 'foo'"):  # before the model is even loaded
        evaluate_directions(tmp_path / "no run here", metrics=["ter", "foo"])


def test_serve_takes_the_target_language_per_request(multi_run: Path) -> None:
    pytest.importorskip("fastapi", reason="mtcli serve needs the serve extra")
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(multi_run, beam=1)
    with TestClient(create_app(translator)) as client:
        good = client.post("/translate", json={"text": SOURCES, "tgt_lang": "xx"})
        assert good.status_code == 200
        assert good.json()["translations"] == translator.translate(SOURCES, tgt_lang="xx")
        bad = client.post("/translate", json={"text": SOURCES, "tgt_lang": "fr"})
        assert bad.status_code == 422 and "target language fr" in bad.json()["error"]
        assert client.post("/translate", json={"text": SOURCES}).json()["translations"] == translator.translate(SOURCES)
        assert client.get("/health").json()["target_languages"] == ["tgt", "src", "xx"]  # the default first
    into_xx = Translator.from_run(multi_run, beam=1, tgt_lang="xx")
    with TestClient(create_app(into_xx)) as client:
        assert client.get("/health").json()["target_languages"] == ["xx", "tgt", "src"]


def test_the_ctranslate2_engine_puts_the_same_tag(multi_run: Path) -> None:
    pytest.importorskip("ctranslate2")
    fast = Translator.from_run(multi_run, beam=1, engine="ctranslate2")
    ours = Translator.from_run(multi_run, beam=1)
    for lang in ("tgt", "xx"):
        assert fast.translate(SOURCES, tgt_lang=lang) == ours.translate(SOURCES, tgt_lang=lang)


def test_an_export_names_the_tags_its_sources_start_with(multi_run: Path, tmp_path: Path) -> None:
    """Decoded as the export's record says, with the tag put first, the export gives our output."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    import json

    from mtcli.data.tokenizer import Tokenizer
    from mtcli.infer.export import export_model

    out = export_model(multi_run, tmp_path / "ct2")
    record = json.loads((out / "mtcli_export.json").read_text(encoding="utf-8"))
    assert "target_tags[target language]" in record["usage"]
    tokenizer, model = Tokenizer(out / "spm.model"), ctranslate2.Translator(str(out))
    ours = Translator.from_run(multi_run, beam=1)
    positions = record["model"]["max_positions"]
    sources = [*SOURCES, " ".join(["hund"] * 2 * positions)]  # cut, with its tag, as docs/decoding.md says
    for lang, tag in record["target_tags"].items():
        pieces = [([tag] + [tokenizer.id_to_piece(i) for i in tokenizer.encode(line)])[: positions - 1]
                  for line in sources]
        found = model.translate_batch(pieces, beam_size=1, suppress_sequences=[["<blank>"], ["<s>"]],
                                      max_decoding_length=16, min_decoding_length=0)
        expected = ours.translate(sources, tgt_lang=lang, max_len_a=0.0, max_len_b=16)
        assert [tokenizer.decode([tokenizer.piece_to_id(p) for p in r.hypotheses[0]]) for r in found] == expected


def test_an_hf_export_records_the_tags_and_import_hf_refuses_it(multi_run: Path, tmp_path: Path) -> None:
    """MarianTokenizer cannot write a tag: the export says which id to put before a source for
    each language; a run of one direction made of it would translate without one, so import-hf
    refuses it (it made a run labelled src->tgt that wrote another language)."""
    import json

    from transformers import MarianTokenizer

    from mtcli.infer.hf import export_hf
    from mtcli.infer.hf_import import import_hf

    exported = export_hf(multi_run, tmp_path / "hf")
    record = json.loads((exported / "mtcli_export.json").read_text())
    # a source cut by the tokenizer leaves room for its tag
    positions = record["model"]["max_positions"]
    cut = MarianTokenizer.from_pretrained(exported)(" ".join(["tgt"] * 2 * positions), truncation=True)
    assert len(cut.input_ids) == positions - 1 and "truncation=True" in record["usage"]
    tags = PreparedCorpus.open(multi_run.parent / "prepared").tags
    assert {lang: t["id"] for lang, t in record["target_tags"].items()} == {
        lang: tags[f"<2{lang}>"] for lang in ("tgt", "src", "xx")}
    with pytest.raises(ConfigError, match="the export of a multilingual run .* is not imported"):
        import_hf(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    (exported / "mtcli_export.json").unlink()  # the HF files shared without mtcli's record: its vocabulary says
    with pytest.raises(ConfigError, match=r"vocab.json: holds target-language tags \(<2src>, <2tgt>, <2xx>\)"):
        import_hf(exported, tmp_path / "back")


def test_validation_decodes_into_the_references_language(multi_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import torch

    from mtcli.train import validation

    bundle = Translator.from_run(multi_run, beam=1).bundle
    config = bundle.config
    asks_xx = dataclasses.replace(config, decode=dataclasses.replace(config.decode, tgt_lang="xx"))
    asked: list[str | None] = []

    def decoded(model, sources, decode, device, name):  # noqa: ANN001, ANN202
        asked.append(decode.tgt_lang)
        return [""] * len(sources)

    monkeypatch.setattr(validation, "translate_texts", decoded)
    corpus = PreparedCorpus.open(multi_run.parent / "prepared")
    validation.validation_scores(bundle.model, corpus, asks_xx, torch.device("cpu"))
    assert asked == [config.data.tgt_lang]  # the references are tgt's, whatever translate is told
    validation.check_validation(asks_xx)  # xx is one of the targets
    with pytest.raises(ConfigError, match="decode.tgt_lang fr: no corpus of the data translates into it "
                                          r"\(they translate into tgt, src, xx\)"):
        validation.check_validation(dataclasses.replace(config, decode=dataclasses.replace(config.decode,
                                                                                            tgt_lang="fr")))


def test_a_child_of_one_target_language_keeps_the_tag_its_parent_read(multi_run: Path, tmp_path: Path) -> None:
    """A run fine-tuned from a multilingual one into one of its languages (data.spm_model and
    train.init_from the parent) dropped the tag: it started from weights that had never read an
    untagged source, and wrote other languages. Its sources keep the tag, so it starts where the
    parent translates into that language."""
    from mtcli.config import load_config
    from mtcli.data.corpora import plan_corpora
    from mtcli.data.prepare import prepare
    from mtcli.train.run import train

    tri, prepared = multi_run.parent / "tri", tmp_path / "prepared"
    data = ["data.source=", f"data.sources=[{{source: {tri}, langs: [src, xx]}}]", "data.tgt_lang=xx",
            f"data.spm_model={multi_run}", f"data.prepared_dir={prepared}"]
    assert plan_corpora(load_config(TOY_CONFIG, data).data).target_tags == {"xx": "<2xx>"}
    prepare(load_config(TOY_CONFIG, data))
    assert PreparedCorpus.open(prepared).manifest["target_tags"] == {"xx": "<2xx>"}
    child = tmp_path / "child"
    train(toy_train_config(prepared, child, *data, f"train.init_from={multi_run}", "train.max_steps=1",
                           "train.valid_every=1", "train.valid_bleu=false", "train.lr_factor=1e-9"))
    tags = PreparedCorpus.open(prepared).tags
    ours = Translator.from_run(child, beam=1)
    assert {n[0].source_tokens[0] for n in ours.nbest(SOURCES, 1)} == {tags["<2xx>"]}
    assert ours.translate(SOURCES) == Translator.from_run(multi_run, beam=1).translate(SOURCES, tgt_lang="xx")
    # without the parent's model there is one target language and no tag, as before
    assert plan_corpora(load_config(TOY_CONFIG, [*data[:3], f"data.prepared_dir={tmp_path}"]).data).target_tags == {}
    # a data.source gets none, and is warned of
    single = plan_corpora(load_config(TOY_CONFIG, [f"data.source={tri}", *data[2:]]).data)
    assert single.target_tags == {} and "list the corpus under data.sources" in single.notes[0]
