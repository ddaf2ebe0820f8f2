"""Tests of mtcli.evaluate: sacreBLEU scoring and ``mtcli evaluate`` on a tiny run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fifo_of, mtcli_here

from mtcli.errors import ConfigError, DataError
from mtcli.metrics import score


def test_score_perfect_and_signatures() -> None:
    refs = ["A dog runs in the snow .", "Two men are playing football ."]
    result = score(list(refs), refs)
    assert result["bleu"] == pytest.approx(100.0)
    assert result["chrf"] == pytest.approx(100.0)
    assert result["bleu_lc"] == pytest.approx(100.0)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]
    assert "case:lc" in result["bleu_lc_signature"]
    assert result["chrf_signature"].startswith("nrefs:1|case:mixed")
    assert result["signatures"]["bleu"] == result["bleu_signature"]


def test_score_case_matters_only_for_cased_bleu() -> None:
    refs = ["A dog runs in the snow near the big red house ."]
    hyps = ["a DOG runs in THE snow near the BIG red house ."]
    result = score(hyps, refs)
    assert result["bleu_lc"] == pytest.approx(100.0)
    assert result["bleu"] < 60.0
    assert result["chrf"] < 100.0


def test_score_matches_sacrebleu_directly() -> None:
    import sacrebleu

    hyps = ["the cat sat on a mat", "a dog barks", ""]
    refs = ["the cat sat on the mat", "the dog barks loudly", "nothing here"]
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert score(hyps, refs)["bleu"] == pytest.approx(expected, abs=1e-3)


def test_every_score_and_detail_is_sacrebleus_own() -> None:
    """On hypotheses longer than their references, with punctuation: BLEU's lengths (hypothesis
    and reference apart), its four precisions in order, chrF (characters only: nw:0, not chrF++)
    and TER (not normalised: a word with its period attached is one token) are sacreBLEU's."""
    import sacrebleu

    hyps = ["The cat sat on the mat.", "A dog, barking loudly!"]
    refs = ["The cat sat on a mat .", "The dog barks"]
    result = score(hyps, refs, metrics=["bleu", "chrf", "ter"])
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    assert (result["sys_len"], result["ref_len"]) == (bleu.sys_len, bleu.ref_len) == (13, 10)
    assert result["bleu_precisions"] == pytest.approx(bleu.precisions)
    assert result["bleu_precisions"][0] > result["bleu_precisions"][-1]  # unigrams first
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert "nw:0" in result["chrf_signature"]
    assert result["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [refs]).score) == pytest.approx(70.0)
    assert "norm:no" in result["ter_signature"]


ZH_REFS = ["一只狗在雪地里奔跑。", "两个男人在踢足球。"]
ZH_HYPS = ["一只狗在雪里跑。", "两个男人在踢球。"]


def test_a_chinese_target_is_scored_by_its_characters_as_sacrebleu_does() -> None:
    """Without spaces, 13a makes each Chinese sentence one word: BLEU 0 for any sentence not
    exactly right. With ``zh`` the score is sacreBLEU's own for ``-l xx-zh``."""
    import sacrebleu

    plain = score(ZH_HYPS, ZH_REFS)
    assert plain["bleu"] == 0.0 and "tok:13a" in plain["bleu_signature"]
    for lang in ("zh", "zh_TW", "zh-Hans", "cmn"):
        chinese = score(ZH_HYPS, ZH_REFS, tgt_lang=lang, metrics=["bleu", "chrf", "ter"])
        assert chinese["bleu"] == pytest.approx(sacrebleu.corpus_bleu(ZH_HYPS, [ZH_REFS], tokenize="zh").score, abs=1e-3)
        assert chinese["bleu"] > 20 and "tok:zh" in chinese["bleu_signature"] and "tok:zh" in chinese["bleu_lc_signature"]
        assert "asian:yes" in chinese["ter_signature"] and chinese["chrf"] == plain["chrf"]
        assert chinese["ter"] < 50 < score(ZH_HYPS, ZH_REFS, metrics=["ter"])["ter"]  # edits per character
    assert "tok:13a" in score(ZH_HYPS, ZH_REFS, tgt_lang="de")["bleu_signature"]


@pytest.mark.parametrize("lang", ["ja", "ko"])
def test_japanese_and_korean_need_mecab_and_say_which_extra(lang: str, tmp_path: Path) -> None:
    from conftest import toy_train_config

    from mtcli.errors import MtcliError
    from mtcli.train import train

    module = {"ja": "MeCab", "ko": "mecab_ko"}[lang]
    try:
        __import__(module)
    except ImportError:
        with pytest.raises(MtcliError, match=rf"pip install 'sacrebleu\[{lang}\]>=[\d.]+'"):
            score(["a"], ["a"], tgt_lang=lang)
        chrf = score(["a b"], ["a b"], tgt_lang=lang, metrics=["chrf"])  # chrF alone needs no tokeniser
        assert chrf["chrf"] == 100.0 and "bleu" not in chrf and list(chrf["signatures"]) == ["chrf"]
        config = toy_train_config(tmp_path / "prepared", tmp_path / "run", f"data.tgt_lang={lang}",
                                  "train.valid_bleu=true")
        with pytest.raises(MtcliError, match=rf"pip install 'sacrebleu\[{lang}\]>=[\d.]+' \(or train.valid_bleu=false"):
            train(config)  # before anything else: not at the first validation
        assert not (tmp_path / "run").exists()
        return
    result = score(["犬が走る。"], ["犬が雪の中を走る。"], tgt_lang=lang)  # with the extra installed
    assert f"tok:{lang}-mecab" in result["bleu_signature"]


def test_a_corpus_scored_in_blocks_scores_as_sacrebleu_scores_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 3 lines over 10 (the last one short), two reference streams: every score,
    detail and signature is sacreBLEU's ``corpus_score`` of the whole corpus at once."""
    import sacrebleu

    import mtcli.metrics

    monkeypatch.setattr(mtcli.metrics, "SCORE_BLOCK", 3)
    words = "the a cat dog sat ran on under mat tree big red".split()
    first = [" ".join(words[(i * 5 + j) % 12] for j in range(4 + i % 5)) for i in range(10)]
    second = [" ".join(reversed(line.split())) for line in first]
    hyps = [" ".join(line.split()[1:] + ["tree"]) if i % 3 else line.upper() for i, line in enumerate(first)]
    result = score(hyps, first, more_references=[second], metrics=["bleu", "chrf", "ter"])
    for name, metric in (("bleu", sacrebleu.BLEU()), ("bleu_lc", sacrebleu.BLEU(lowercase=True)),
                         ("chrf", sacrebleu.CHRF()), ("ter", sacrebleu.TER())):
        whole = metric.corpus_score(hyps, [first, second])
        assert result[name] == pytest.approx(whole.score, abs=1e-9), name
        assert result[f"{name}_signature"] == str(metric.get_signature())
        if name == "bleu":
            assert (result["sys_len"], result["ref_len"]) == (whole.sys_len, whole.ref_len)
            assert result["bleu_precisions"] == pytest.approx(whole.precisions) and result["bleu_bp"] == whole.bp
    assert 0 < result["bleu"] < result["bleu_lc"] < 100 and "nrefs:2" in result["bleu_signature"]


def test_tokenised_hypotheses_are_warned_of_once_a_corpus(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """sacreBLEU's warning said once, by mtcli, for the corpus: not once per BLEU (cased and
    lowercased) and per block of lines, and not below sacreBLEU's 100 lines."""
    import mtcli.metrics

    monkeypatch.setattr(mtcli.metrics, "SCORE_BLOCK", 120)
    tokenised = [f"line {i} ends with a space ." for i in range(250)]
    with caplog.at_level("WARNING"):
        score(tokenised, tokenised)
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said == [("mtcli", "hypotheses: 250 of 250 lines end in a tokenised period (' .'); BLEU is of detokenised "
                              "text: detokenise them (and their references) for a score others can compare")]
    caplog.clear()
    with caplog.at_level("WARNING"):
        score(tokenised[:99] + ["done."], tokenised[:100])
    assert not caplog.records


def test_score_count_mismatch() -> None:
    with pytest.raises(DataError, match="2 hypotheses but 1 references"):
        score(["a", "b"], ["a"])
    with pytest.raises(DataError, match="no hypotheses to score"):
        score([], [])


# ---------------------------------------------------------------------------------------------
# The library function and CLI on a tiny run directory
# ---------------------------------------------------------------------------------------------


def test_evaluate_split_writes_report(tiny_run_dir: Path, tmp_path: Path) -> None:
    from mtcli.evaluate import evaluate

    out = tmp_path / "eval"
    report = evaluate(
        tiny_run_dir, split=None, src_file=None, ref_file=None, checkpoint="best",
        average_last=0, average_best=0, overrides=["decode.beam_size=2"], output_dir=out,
    )
    for key in (
        "bleu", "chrf", "bleu_lc", "bleu_signature", "chrf_signature", "bleu_lc_signature",
        "checkpoint", "decode", "sentences", "sentences_per_second", "target_tokens_per_second",
        "device", "peak_memory_mb",
    ):
        assert key in report, key
    assert report["split"] == "test" and report["decode"]["beam_size"] == 2
    hyp = Path(report["hypotheses"])
    refs = (tiny_run_dir / "text" / "test.tgt").read_text(encoding="utf-8").splitlines()
    hyps = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    assert report["sentences"] == len(refs) == len(hyps)
    assert score(hyps, refs)["bleu"] == pytest.approx(report["bleu"])
    on_disk = json.loads(Path(report["report"]).read_text(encoding="utf-8"))
    assert on_disk["bleu_signature"] == report["bleu_signature"]
    assert Path(report["report"]).parent == out
    # compare finds the language beside the hypotheses (BLEU's tokeniser follows it)
    from mtcli.compare import recorded_language

    assert recorded_language([hyp]) == report["tgt_lang"] == "tgt"  # the toy recipe's data.tgt_lang
    # ... and which reference they were scored against, by content
    from mtcli.fileio import sha256_file

    assert on_disk["reference_sha256"] == sha256_file(tiny_run_dir / "text" / "test.tgt")


def test_a_runs_test_text_cut_short_within_a_line_is_refused(prepared_toy: Path, tmp_path: Path) -> None:
    """Its line count unchanged, it was scored as the reference it no longer is."""
    from conftest import toy_train_config

    from mtcli.evaluate import evaluate
    from mtcli.train import train

    run = tmp_path / "run"
    train(toy_train_config(prepared_toy, run, "train.max_steps=1"))
    ref = run / "text" / "test.tgt"
    text = ref.read_text(encoding="utf-8")
    ref.write_text(text[:-3] + "\n", encoding="utf-8")  # the last line's last characters
    assert len(ref.read_text(encoding="utf-8").splitlines()) == len(text.splitlines())
    with pytest.raises(DataError, match=rf"{ref}: not the text the run was prepared with .* give the files as --src"):
        evaluate(run, split=None, src_file=None, ref_file=None, checkpoint="best", average_last=0,
                 average_best=0, overrides=[], output_dir=tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_a_reference_mended_and_prepared_again_since_the_run_is_warned_of(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The run's copy of its test text is scored; a reference mended in the corpus and prepared
    again was scored as the old one without a word."""
    import logging
    import shutil

    from conftest import TOY_DIR, toy_train_config

    from mtcli.data.prepare import prepare
    from mtcli.evaluate import evaluate
    from mtcli.train import train

    corpus, prepared, run = tmp_path / "corpus", tmp_path / "prepared", tmp_path / "run"
    shutil.copytree(TOY_DIR, corpus)
    config = toy_train_config(prepared, run, f"data.source={corpus}", "train.max_steps=1")
    prepare(config)
    train(config)
    ref = corpus / "test.tgt"
    ref.write_text("a mended first line\n" + ref.read_text(encoding="utf-8").split("\n", 1)[1], encoding="utf-8")
    prepare(config)
    short = ["decode.beam_size=1", "decode.max_len_a=0", "decode.max_len_b=4"]  # (an untrained model's outputs)
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        report = evaluate(run, output_dir=tmp_path / "eval", overrides=short)
    assert report["reference"] == str(run / "text" / "test.tgt")
    assert (f"{prepared}: test prepared again since this run began, with other text (test.tgt.txt); scoring the run's "
            f"copy, {run / 'text' / 'test.src'} and {run / 'text' / 'test.tgt'} (to score the new text: --src "
            f"{prepared / 'test.src.txt'} --ref {prepared / 'test.tgt.txt'})") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        evaluate(run, split="val", output_dir=tmp_path / "eval", overrides=short)  # a split as it was: unsaid
    assert "prepared again" not in caplog.text


def test_a_config_given_for_the_run_directory_is_said_to_be_one(tmp_path: Path) -> None:
    """``mtcli evaluate recipe.yaml`` (prepare and train take the config) was told that
    recipe.yaml/eval could not be made."""
    from conftest import TOY_CONFIG

    for command in ("evaluate", "translate"):
        res = mtcli_here(command, str(TOY_CONFIG), stdin=b"")
        assert res.returncode == 1 and res.stderr.decode().strip() == (
            f"mtcli: error: {TOY_CONFIG}: a config file, not a run directory; give the run directory its training "
            "wrote (its train.run_dir)")


def test_no_metric_and_standard_input_as_dash_are_refused_before_decoding(tiny_run_dir: Path, tmp_path: Path) -> None:
    """--metrics "" decoded the test set and wrote a report of no score, exit 0; --src - was a
    file not found."""
    res = mtcli_here("evaluate", str(tiny_run_dir), "--metrics", "", "--output", str(tmp_path / "ev"))
    assert res.returncode == 2 and res.stderr.decode().strip() == \
        "mtcli: error: no metric given: name at least one of bleu, chrf, ter"
    ref = tiny_run_dir / "text" / "test.tgt"
    res = mtcli_here("evaluate", str(tiny_run_dir), "--src", "-", "--ref", str(ref), "--output", str(tmp_path / "ev"))
    assert res.returncode == 2 and res.stderr.decode().strip() == ("mtcli: error: -: evaluate reads a source and its "
                                                                   "references as files; give standard input as /dev/stdin")
    assert not (tmp_path / "ev").exists()


def test_cli_evaluate_src_ref_pair(tiny_run_dir: Path, tmp_path: Path) -> None:
    src, ref = tmp_path / "a.src", tmp_path / "a.ref"
    src.write_text("eine katze spielt\n\nrot\n", encoding="utf-8")
    ref.write_text("a cat plays\n\nred\n", encoding="utf-8")
    res = mtcli_here("evaluate", str(tiny_run_dir), "--src", str(src), "--ref", str(ref), "--beam", "1",
                 "--output", str(tmp_path / "ev"))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["sentences"] == 3 and "nrefs:1" in report["bleu_signature"]
    assert (tmp_path / "ev" / f"a.src.{Path(report['hypotheses']).name.split('.')[2]}.hyp").exists()
    assert "for sampling only" not in res.stderr.decode()
    # a sampling setting beside a search is said, as translate says it (it passed without a word)
    res = mtcli_here("evaluate", str(tiny_run_dir), "--src", str(src), "--ref", str(ref), "--beam", "1",
                     "--output", str(tmp_path / "ev"), "--set", "decode.temperature=0.5", "--set", "decode.topk=3")
    assert res.returncode == 0, res.stderr
    assert ("decode.temperature, decode.topk: for sampling only, and evaluate decodes by search: it changes "
            "nothing") in res.stderr.decode()


def test_a_report_of_another_test_set_of_the_same_name_is_warned_of_before_it_is_replaced(
        tiny_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``--src odd/test.en`` then ``--src c1/test.en``: the second report replaced the first unsaid."""
    import logging

    from mtcli.evaluate import evaluate

    for folder, lines in (("odd", ["rot", "blau"]), ("c1", ["grün", "rot", "gelb"])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test.src").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        (tmp_path / folder / "test.ref").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")

    def run(folder: str) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            evaluate(tiny_run_dir, src_file=tmp_path / folder / "test.src", ref_file=tmp_path / folder / "test.ref",
                     output_dir=tmp_path / "eval", overrides=["decode.beam_size=1"])
        return caplog.text

    assert "which this evaluation replaces" not in run("odd")
    assert "which this evaluation replaces" not in run("odd")  # the same test set again
    said = run("c1")
    assert f"test.src.best.report.json: holds the scores of source {tmp_path / 'odd' / 'test.src'}, which this " \
           "evaluation replaces (give --output DIR to keep both)" in said


def test_evaluate_average_last(tiny_run_dir: Path, tmp_path: Path) -> None:
    from mtcli.evaluate import evaluate

    report = evaluate(
        tiny_run_dir, split="val", src_file=None, ref_file=None, checkpoint="best",
        average_last=2, average_best=0, overrides=["decode.beam_size=1"], output_dir=tmp_path,
    )
    assert Path(report["hypotheses"]).name == "val.avg_last2.hyp"
    assert report["average_last"] == 2
    assert json.loads(Path(report["report"]).read_text()) == report  # the file holds what is printed
    assert "checkpoint_10.pt" in report["checkpoint"] and "checkpoint_20.pt" in report["checkpoint"]
    assert report["sentences"] == len((tiny_run_dir / "text" / "val.src").read_text().splitlines())
    from mtcli.checkpoint import weights_sha256
    from mtcli.infer.averaging import average_checkpoints
    from mtcli.rundir import select_checkpoints

    averaged = average_checkpoints(select_checkpoints(tiny_run_dir, last=2))["model"]
    assert report["weights_sha256"] == weights_sha256(averaged)  # an average's weights are named too


def test_an_averaged_checkpoint_file_is_named_as_an_average(tiny_run_dir: Path, tmp_path: Path) -> None:
    """evaluate --checkpoint avg.pt (written by mtcli average) reported "avg.pt (step 20)", as if
    it were one step's weights."""
    from mtcli.evaluate import evaluate
    from mtcli.infer.averaging import average_run_checkpoints

    averaged = tmp_path / "avg.pt"
    average_run_checkpoints(tiny_run_dir, averaged, last=2)
    report = evaluate(tiny_run_dir, split="val", src_file=None, ref_file=None, checkpoint=str(averaged),
                      average_last=0, average_best=0, overrides=["decode.beam_size=1"], output_dir=tmp_path)
    assert report["checkpoint"] == "avg.pt (average of checkpoint_10.pt, checkpoint_20.pt)"


def test_evaluate_names_another_runs_checkpoint_by_its_run_and_records_its_weights(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint from outside the run's checkpoints/ wrote over the run's own report of that
    name, and the report could not tell which weights it scored."""
    import shutil

    from mtcli.checkpoint import load_checkpoint_with_id, weights_sha256
    from mtcli.evaluate import evaluate

    other = shutil.copytree(tiny_run_dir, tmp_path / "other")
    given = other / "checkpoints" / "checkpoint_10.pt"
    settings = {"split": "val", "src_file": None, "ref_file": None, "average_last": 0, "average_best": 0,
                "overrides": ["decode.beam_size=1"], "output_dir": tmp_path / "eval"}
    own = evaluate(tiny_run_dir, checkpoint="checkpoint_10.pt", **settings)
    foreign = evaluate(tiny_run_dir, checkpoint=str(given), **settings)
    assert Path(own["report"]).name == "val.10.report.json" and Path(foreign["report"]).name == "val.other.10.report.json"
    assert foreign["weights_sha256"] == weights_sha256(load_checkpoint_with_id(given)[0]["model"]) == \
        own["weights_sha256"]  # a copy


@pytest.mark.parametrize("case", ["missing_run", "missing_checkpoint", "count_mismatch", "bad_split", "output_a_file",
                                  "empty", "blank", "untrained_source", "empty_source_language", "src_alone",
                                  "split_and_files"])
def test_cli_evaluate_bad_input(case: str, tiny_run_dir: Path, tmp_path: Path) -> None:
    src, ref, empty = tmp_path / "a.src", tmp_path / "a.ref", tmp_path / "empty.src"
    src.write_text("eine katze\nrot\n", encoding="utf-8")
    ref.write_text("a cat\n", encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    blank = tmp_path / "blank.src"
    blank.write_text("\n \n\t\n", encoding="utf-8")
    args = {
        "empty": ["evaluate", str(tiny_run_dir), "--src", str(empty), "--ref", str(empty)],
        "blank": ["evaluate", str(tiny_run_dir), "--src", str(blank), "--ref", str(blank)],
        "src_alone": ["evaluate", str(tiny_run_dir), "--src", str(src)],  # else the test split would be scored
        "split_and_files": ["evaluate", str(tiny_run_dir), "--split", "val", "--src", str(src), "--ref", str(src)],
        "untrained_source": ["evaluate", str(tiny_run_dir), "--src", str(src), "--ref", str(src), "--src-lang", "zz"],
        "empty_source_language": ["evaluate", str(tiny_run_dir), "--src-lang", ""],
        "missing_run": ["evaluate", str(tmp_path / "nope")],
        "missing_checkpoint": ["evaluate", str(tiny_run_dir), "--checkpoint", str(tmp_path / "x.pt")],
        "count_mismatch": ["evaluate", str(tiny_run_dir), "--src", str(src), "--ref", str(ref)],
        "bad_split": ["evaluate", str(tiny_run_dir), "--split", "nosuchsplit"],
        "output_a_file": ["evaluate", str(tiny_run_dir), "-o", str(src)],  # (-o as --output)
    }[case]
    res = mtcli_here(*args)
    assert res.returncode != 0
    err = res.stderr.decode().strip()
    assert "Traceback" not in err and err.startswith("mtcli: error:"), err
    assert len(err.splitlines()) == 1
    if case == "count_mismatch":
        assert str(src) in err and str(ref) in err
    if case == "bad_split":
        assert "nosuchsplit" in err and "--src FILE --ref FILE" in err
    if case == "output_a_file":  # said before the decoding, not after it
        assert err == f"mtcli: error: {src}: exists and is not a directory"
    if case == "untrained_source":  # was scored, and reported as zz->tgt
        assert "no direction zz->* among those it was trained on" in err
    if case == "empty_source_language":  # was "no direction *->*": any source
        assert err == "mtcli: error: --src-lang '': not a language code (letters, digits, _ or -: de, pt_BR, zh-Hans)"
    if case == "empty":  # was sacreBLEU's IndexError
        assert err == f"mtcli: error: {empty}: empty; there is nothing to translate and score"
    if case == "src_alone":
        assert err == "mtcli: error: --src and --ref must be given together"
    if case == "split_and_files":
        assert err == "mtcli: error: give either --split or --src/--ref, not both"
    if case == "blank":  # was scored 0, without a word
        assert err == f"mtcli: error: {blank}: blank lines only; there is nothing to translate and score"


def test_score_several_references_and_ter() -> None:
    import sacrebleu

    hyps, first, second = ["the cat sat on the mat", "a dog barks"], ["a cat sits on a mat", "the dog barks"], \
        ["the cat sat on the mat", "a dog barks loudly"]
    result = score(hyps, first, more_references=[second], metrics=["bleu", "chrf", "ter"])
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [first, second]).score, abs=1e-3)
    assert result["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [first, second]).score, abs=1e-3)
    assert result["bleu_signature"].startswith("nrefs:2") and "tok:tercom" in result["ter_signature"]
    assert "chrf" not in score(hyps, first, metrics=["bleu"])
    with pytest.raises(ConfigError, match="unknown metric 'meteor'"):
        score(hyps, first, metrics=["meteor"])
    with pytest.raises(DataError, match="2 hypotheses but 1 references"):
        score(hyps, first, more_references=[second[:1]])


def test_evaluate_without_a_split_scores_the_first_of_the_test_splits(tiny_run_dir: Path) -> None:
    import dataclasses

    from mtcli.config import load_config
    from mtcli.evaluate import _test_files

    config = load_config(tiny_run_dir / "config.yaml")
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, test_splits=["val", "test"]))
    direction = (config.data.src_lang, config.data.tgt_lang)
    src, ref, name, split = _test_files(tiny_run_dir, config, None, None, None, direction)
    assert (split, name, src.name, ref.name) == ("val", "val", "val.src", "val.tgt")


def test_evaluate_several_references_and_metrics(tiny_run_dir: Path, tmp_path: Path) -> None:
    """The model's own output as a second reference: BLEU 100 and TER 0, whatever the first."""
    from mtcli.evaluate import evaluate

    src, ref = tiny_run_dir / "text" / "test.src", tiny_run_dir / "text" / "test.tgt"
    own = evaluate(tiny_run_dir, src_file=src, ref_file=ref, beam=1, output_dir=tmp_path / "one")["hypotheses"]
    report = evaluate(tiny_run_dir, src_file=src, ref_file=ref, more_refs=[own], metrics=["bleu", "chrf", "ter"],
                      beam=1, output_dir=tmp_path / "two")
    assert report["bleu"] == pytest.approx(100.0) and report["ter"] == pytest.approx(0.0)
    assert report["references"] == [str(ref), own] and report["bleu_signature"].startswith("nrefs:2")
    assert report["split"] is None  # given files, not a split of the run
    short = tmp_path / "short.txt"
    short.write_text("one\n")
    bad = mtcli_here("evaluate", str(tiny_run_dir), "--src", str(src), "--beam", "1", "--ref", str(ref),
                     "--ref", str(short), "--metrics", "bleu,ter")
    assert bad.returncode != 0 and "short.txt has 1" in bad.stderr.decode()


def test_evaluate_records_the_checksum_of_a_reference_read_from_a_pipe(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A stream gives its bytes once: the reference was hashed after it was read, the checksum
    of nothing (so compare could never find these hypotheses again)."""
    from mtcli.evaluate import evaluate
    from mtcli.fileio import sha256_file

    ref = tiny_run_dir / "text" / "test.tgt"
    fifo_of(ref, tmp_path / "ref.fifo")
    report = evaluate(tiny_run_dir, src_file=tiny_run_dir / "text" / "test.src", ref_file=tmp_path / "ref.fifo",
                      beam=1, output_dir=tmp_path / "ev")
    assert report["reference_sha256"] == sha256_file(ref)
    assert report["sentences"] == len(ref.read_text(encoding="utf-8").splitlines())


def test_evaluate_names_a_process_substitution_by_its_text(tiny_run_dir: Path, tmp_path: Path) -> None:
    """`--src <(zcat a.gz)` is /dev/fd/63 in every such call: the outputs were 63.best.*, each
    evaluation writing over the one before."""
    import os
    import threading

    from mtcli.evaluate import evaluate

    def descriptor(text: str) -> str:
        read, write = os.pipe()
        threading.Thread(target=lambda: (os.write(write, text.encode()), os.close(write)), daemon=True).start()
        return f"/dev/fd/{read}"

    src = (tiny_run_dir / "text" / "test.src").read_text(encoding="utf-8").splitlines(keepends=True)
    ref = (tiny_run_dir / "text" / "test.tgt").read_text(encoding="utf-8").splitlines(keepends=True)
    names = []
    for count in (4, 5):
        report = evaluate(tiny_run_dir, src_file=descriptor("".join(src[:count])),
                          ref_file=descriptor("".join(ref[:count])), beam=1, output_dir=tmp_path / "ev")
        assert report["sentences"] == count
        names.append(sorted(p.name for p in (tmp_path / "ev").glob("*.hyp")))
    assert len(names[0]) == 1 and names[0][0].startswith("stream-") and len(names[1]) == 2, names


def test_evaluate_refuses_to_write_over_a_file_it_reads(tiny_run_dir: Path, tmp_path: Path) -> None:
    """Another system's hypotheses as the reference, in the output directory under the name
    evaluate writes: they were overwritten by the new hypotheses after scoring."""
    from mtcli.evaluate import evaluate

    out = tmp_path / "ev"
    out.mkdir()
    src = tmp_path / "a.src"
    src.write_text((tiny_run_dir / "text" / "test.src").read_text(encoding="utf-8"), encoding="utf-8")
    other = out / "a.src.best.hyp"
    other.write_text((tiny_run_dir / "text" / "test.tgt").read_text(encoding="utf-8"), encoding="utf-8")
    before = other.read_bytes()
    with pytest.raises(ConfigError, match=r"a\.src\.best\.hyp: evaluate would write its output over .*--output"):
        evaluate(tiny_run_dir, src_file=src, ref_file=other, beam=1, output_dir=out)
    assert other.read_bytes() == before


def test_a_run_it_cannot_write_is_refused_before_decoding(tiny_run_dir: Path, tmp_path: Path,
                                                          read_only: list[Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A model shared read-only: the hypotheses go to RUN/eval by default, and evaluate decoded and
    scored the whole test set before it found it could not write them."""
    import shutil

    import mtcli.evaluate
    from mtcli.evaluate import evaluate

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    read_only.append(run)
    decoded = []
    real_decode = mtcli.evaluate._decode
    monkeypatch.setattr(mtcli.evaluate, "_decode", lambda *a, **k: decoded.append(1) or real_decode(*a, **k))
    test = {"src_file": run / "text" / "test.src", "ref_file": run / "text" / "test.tgt", "beam": 1}
    real_load = mtcli.evaluate.Translator.from_run
    monkeypatch.setattr(mtcli.evaluate.Translator, "from_run", lambda *a, **k: decoded.append("loaded"))
    with pytest.raises(ConfigError, match=r"run/eval: .*: evaluate writes the hypotheses and the report there; "
                                          r"give --output DIR"):
        evaluate(run, **test)
    with pytest.raises(OSError, match="ro-out"):  # an --output it cannot write
        evaluate(run, output_dir=run / "ro-out", **test)
    assert not decoded and not (run / "eval").exists()  # before the model loaded (or was converted)
    monkeypatch.setattr(mtcli.evaluate.Translator, "from_run", real_load)
    report = evaluate(run, output_dir=tmp_path / "out", **test)  # somewhere it can
    assert decoded and Path(report["hypotheses"]).parent == tmp_path / "out"


def test_references_the_model_cannot_write_are_warned_of(tiny_run_dir: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """prepare warned of a split's references that do not come back as written through the
    tokenizer (NFKC's rewrites), but evaluate never did: files given with --ref, or a user who
    missed prepare's line, saw scores capped without a word."""
    import logging

    from mtcli.evaluate import evaluate

    src, plain, wide = tmp_path / "test.src", tmp_path / "plain.tgt", tmp_path / "wide.tgt"
    src.write_text((tiny_run_dir / "text" / "test.src").read_text(encoding="utf-8"), encoding="utf-8")
    lines = (tiny_run_dir / "text" / "test.tgt").read_text(encoding="utf-8").splitlines()
    plain.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    wide.write_text("".join(line.replace("a", "ａ") + "\n" for line in lines), encoding="utf-8")  # NFKC: "a"
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        evaluate(tiny_run_dir, src_file=src, ref_file=plain, beam=1, output_dir=tmp_path / "a")
        assert "come back as written" not in caplog.text
        evaluate(tiny_run_dir, src_file=src, ref_file=plain, more_refs=[wide], beam=1, output_dir=tmp_path / "b")
    said = [r.getMessage() for r in caplog.records if "come back as written" in r.getMessage()]
    changed = sum("a" in line for line in lines)
    assert len(said) == 1 and said[0].startswith(f"{wide}: {changed} of {len(lines)} lines do not come back"), said
    assert "'ａ' (U+FF41) becomes 'a' (U+0061)" in said[0] and "data.spm_normalization: identity" in said[0]


def test_the_change_shown_of_a_long_line_is_found_near_where_it_is() -> None:
    """difflib over whole lines: a 200,000-character reference took minutes (prepare's fuzz test hung)."""
    from mtcli.data.coverage import _change

    assert _change("x" * 100_000 + "ａ" + "y" * 100_000, "x" * 100_000 + "a" + "y" * 100_000) == \
        "'xxxxxxxx' then 'ａ' (U+FF41) becomes 'a' (U+0061)"
    assert _change("ทำงาน", "ทํางาน") == "'ท' then 'ำ' (U+0E33) becomes 'ํา' (U+0E4D U+0E32)"
    assert _change("abc", "abcd") == "'abc' then '' (nothing) becomes 'd' (U+0064)"


def test_the_weights_sha256_is_the_same_for_the_same_weights_under_a_prefix(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint saved with DDP's or torch.compile's name prefix loads the same weights: it
    named them otherwise than the same file without it."""
    import shutil

    from mtcli.checkpoint import load_checkpoint, save_checkpoint
    from mtcli.infer.loading import load_for_inference

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    plain = load_for_inference(run, "checkpoint_20.pt").weights_sha256
    state = load_checkpoint(run / "checkpoints" / "checkpoint_20.pt")
    state["model"] = {f"module._orig_mod.{key}": value for key, value in state["model"].items()}
    save_checkpoint(tmp_path / "prefixed.pt", state)
    assert load_for_inference(run, str(tmp_path / "prefixed.pt")).weights_sha256 == plain


def test_a_ctrl_c_between_the_two_renames_leaves_both_outputs_new(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The report was renamed into place before the hypotheses: a stop in between left the new
    report beside the old hypotheses (which `compare` then scored as this evaluation's)."""
    import os
    import signal

    import mtcli.fileio as fileio
    from mtcli.evaluate import _write_outputs

    hyp, report = tmp_path / "test.best.hyp", tmp_path / "test.best.report.json"
    hyp.write_text("old\n", encoding="utf-8")
    report.write_text('{"beam_size": 1}\n', encoding="utf-8")
    synced = fileio.fsync_dir

    def interrupted_after_the_first_rename(path: Path) -> None:
        synced(path)
        monkeypatch.setattr(fileio, "fsync_dir", synced)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, right after the report's rename

    monkeypatch.setattr(fileio, "fsync_dir", interrupted_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        _write_outputs(hyp, report, ["new"], {"beam_size": 2})
    assert hyp.read_text(encoding="utf-8") == "new\n" and json.loads(report.read_text(encoding="utf-8")) == {
        "beam_size": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [hyp.name, report.name]  # no temporary file left


def test_two_evaluations_into_one_directory_write_their_pairs_one_after_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation renaming its pair while another renamed its own could leave one's hypotheses
    beside the other's report: the pair's writes hold a lock on the directory."""
    import fcntl
    import os

    import mtcli.fileio as fileio
    from mtcli.evaluate import _write_outputs

    synced, blocked = fileio.fsync_dir, []

    def another_evaluation_tries(path: Path) -> None:  # between the pair's renames
        synced(path)
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            blocked.append(path)
        finally:
            os.close(fd)

    monkeypatch.setattr(fileio, "fsync_dir", another_evaluation_tries)
    _write_outputs(tmp_path / "test.best.hyp", tmp_path / "test.best.report.json", ["new"], {"beam_size": 2})
    assert blocked, "the directory was not locked while the pair was renamed"


def test_a_missing_optional_package_is_named_with_its_own_pip_line(monkeypatch: pytest.MonkeyPatch,
                                                                   tiny_run_dir: Path, tmp_path: Path) -> None:
    """The advice was `pip install 'mtcli[hf]'`, which fetches PyPI's mtcli, another project's:
    it names the extra's packages, as pyproject lists them."""
    import importlib.metadata
    import sys

    from mtcli.errors import MtcliError, install_advice
    from mtcli.infer.export import require_ctranslate2
    from mtcli.infer.hf import require_transformers

    assert install_advice("serve").startswith("pip install 'fastapi>=") and "mtcli[" not in install_advice("serve")
    for require, package in ((require_transformers, "transformers"), (require_ctranslate2, "ctranslate2")):
        monkeypatch.setitem(sys.modules, package, None)  # (its import fails)
        with pytest.raises(MtcliError, match=rf": pip install '{package}>=[\d.]+'$"):
            require()
    import shutil

    from mtcli.infer.translator import Translator  # said before the model is loaded or converted

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    with pytest.raises(MtcliError, match=r"^--engine ctranslate2 needs the optional 'ctranslate2' package"):
        Translator.from_run(run, engine="ctranslate2", checkpoint="checkpoint_10.pt")
    assert not (run / "ctranslate2").exists()

    def never_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", never_installed)
    assert install_advice("hf") == "pip install -e '.[hf]' in mtcli's checkout"


def test_links_planted_in_a_run_are_replaced_not_written_through(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A run directory from someone else, its eval/ outputs links to the user's files: evaluate
    overwrote them; and a resumed training appended to whatever train.log pointed at."""
    import shutil

    from mtcli.errors import MtcliError
    from mtcli.evaluate import evaluate
    from mtcli.logs import add_file_log

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    victim = tmp_path / "precious.txt"
    victim.write_text("mine\n", encoding="utf-8")
    (run / "eval").mkdir(exist_ok=True)
    for name in ("val.10.hyp", "val.10.report.json"):
        (run / "eval" / name).unlink(missing_ok=True)
        (run / "eval" / name).symlink_to(victim)
    report = evaluate(run, split="val", src_file=None, ref_file=None, checkpoint="checkpoint_10.pt",
                      average_last=0, average_best=0, overrides=["decode.beam_size=1"], output_dir=None)
    assert victim.read_text(encoding="utf-8") == "mine\n"
    assert not Path(report["hypotheses"]).is_symlink() and not Path(report["report"]).is_symlink()
    (run / "train.log").unlink(missing_ok=True)
    (run / "train.log").symlink_to(victim)
    with pytest.raises(MtcliError, match="train.log: a symbolic link, where a run keeps its log as a file of its own"):
        add_file_log(run / "train.log")
