"""`mtcli compare`: sacreBLEU's paired bootstrap and approximate randomization between systems,
with scores, 95% intervals, p-values and signatures in a report; run directories resolve to their
newest hypotheses; bad input is one line naming the file."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from conftest import TOY_DIR, fifo_of
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.compare import compare, hypothesis_file, render
from mtcli.errors import ConfigError, DataError
from mtcli.fileio import sha256_file


@pytest.fixture
def systems(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The toy test references, a system that drops every other sentence's last words, and one
    that gets all but one sentence right."""
    ref = tmp_path / "ref.txt"
    lines = (TOY_DIR / "test.tgt").read_text(encoding="utf-8").splitlines()
    ref.write_text("\n".join(lines) + "\n", encoding="utf-8")
    weak = [" ".join(line.split()[: max(1, len(line.split()) // 2)]) if i % 2 else line for i, line in enumerate(lines)]
    strong = ["wrong"] + lines[1:]
    (tmp_path / "weak.hyp").write_text("\n".join(weak) + "\n", encoding="utf-8")
    (tmp_path / "strong.hyp").write_text("\n".join(strong) + "\n", encoding="utf-8")
    return ref, tmp_path / "weak.hyp", tmp_path / "strong.hyp"


def test_both_tests_find_the_better_system(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    ref, weak, strong = systems
    out = tmp_path / "report.json"
    report = compare([weak, strong], [ref], samples=200, names=["weak", "strong"], output=out)
    assert json.loads(out.read_text()) == report
    boot, rand = report["tests"]["bs"], report["tests"]["ar"]
    for metric in ("bleu", "chrf", "ter"):
        base, better = boot["scores"][metric]["weak"], boot["scores"][metric]["strong"]
        assert base["p_value"] is None and better["p_value"] < 0.05
        assert better["ci"] > 0 and base["mean"] is not None
        assert rand["scores"][metric]["strong"]["p_value"] < 0.05
        assert rand["scores"][metric]["strong"]["mean"] is None  # no intervals from randomization
    assert boot["scores"]["bleu"]["strong"]["score"] > boot["scores"]["bleu"]["weak"]["score"]
    assert boot["scores"]["ter"]["strong"]["score"] < boot["scores"]["ter"]["weak"]["score"]  # lower is better
    assert "bs:200" in boot["signatures"]["bleu"] and "ar:200" in rand["signatures"]["chrf"]


def test_each_test_draws_its_own_default_number_of_samples(tmp_path: Path) -> None:
    """1,000 bootstrap resamples and 10,000 randomization swaps, as the docs and sacreBLEU say."""
    (tmp_path / "ref.txt").write_text("a small dog runs .\nthe cat sleeps .\ntwo men talk .\n", encoding="utf-8")
    (tmp_path / "a.hyp").write_text("a dog runs .\nthe cat sleeps .\nmen talk .\n", encoding="utf-8")
    (tmp_path / "b.hyp").write_text("a small dog runs .\nthe cat is sleeping .\ntwo men talk .\n", encoding="utf-8")
    report = compare([tmp_path / "a.hyp", tmp_path / "b.hyp"], [tmp_path / "ref.txt"], metrics=["chrf"])
    assert {test: body["samples"] for test, body in report["tests"].items()} == {"bs": 1000, "ar": 10000}
    assert "|bs:1000|" in report["tests"]["bs"]["signatures"]["chrf"]
    assert "|ar:10000|" in report["tests"]["ar"]["signatures"]["chrf"]


def test_scores_and_p_values_are_sacrebleus_unrounded(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Scores were rounded to 4 places, then shown to 2: 44.555015 showed as 44.55 where sacreBLEU
    shows 44.56; and a p-value of 1/(samples + 1) below 0.00005 was stored and shown as 0."""
    from sacrebleu.metrics import BLEU

    from mtcli.compare import _p_text
    from mtcli.metrics import score

    ref, weak, strong = systems
    refs, hyps = (p.read_text(encoding="utf-8").splitlines() for p in (ref, weak))
    exact = BLEU().corpus_score(hyps, [refs])
    assert score(hyps, refs)["bleu"] == exact.score and score(hyps, refs)["bleu_bp"] == exact.bp
    report = compare([strong, weak], [ref], samples=20, tests=("bs",), metrics=("bleu",), names=["s", "w"])
    assert report["tests"]["bs"]["scores"]["bleu"]["w"]["score"] == exact.score
    assert [_p_text(p) for p in (1 / 100_001, 0.0123456, 0.0, 1e-4)] == ["1.0e-05", "0.0123", "0.0000", "0.0001"]


def test_a_file_that_opens_with_a_byte_order_mark_is_warned_of(systems: tuple[Path, Path, Path],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """mtcli drops a byte-order mark, sacreBLEU's command line keeps it (in the first word):
    scores that sacreBLEU alone could not reproduce, without a word of why."""
    ref, weak, strong = systems
    ref.write_bytes(b"\xef\xbb\xbf" + ref.read_bytes())
    compare([weak, strong], [ref], samples=5, tests=("bs",), metrics=("bleu",), names=["w", "s"])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{ref}: opens with a byte-order mark, which mtcli drops; sacreBLEU's command line keeps "
                      "it, in the first word: strip it (sed -i '1s/^\\xEF\\xBB\\xBF//') to get these scores there"]


def test_a_byte_order_mark_inside_a_joined_reference_is_dropped_and_warned_of(
        systems: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    """``cat a.txt b.txt`` of two files that open with a byte-order mark leaves one inside the
    text, opening a line: kept, it was part of that line's first word, which no system writes."""
    ref, weak, strong = systems
    clean = compare([weak, strong], [ref], samples=5, tests=("bs",), metrics=("bleu",), names=["w", "s"])
    lines = ref.read_bytes().split(b"\n")
    lines[2] = b"\xef\xbb\xbf" + lines[2]
    lines[4] = b"\xef\xbb\xbf" + lines[4]
    ref.write_bytes(b"\n".join(lines))
    caplog.clear()
    joined = compare([weak, strong], [ref], samples=5, tests=("bs",), metrics=("bleu",), names=["w", "s"])
    assert joined["tests"]["bs"]["scores"] == clean["tests"]["bs"]["scores"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(f"{ref}:3 (and 1 more): a byte-order mark opens the line")


def test_a_tokenised_system_is_warned_of_by_its_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A system of tokenised text (100 lines or more end in " .", sacreBLEU's rule) is named once."""
    lines = [f"sentence {i} , with words" for i in range(120)]
    (tmp_path / "ref.txt").write_text("".join(f"{line}.\n" for line in lines), encoding="utf-8")
    (tmp_path / "tok.hyp").write_text("".join(f"{line} .\n" for line in lines), encoding="utf-8")
    (tmp_path / "detok.hyp").write_text("".join(f"{line}.\n" for line in lines[::-1]), encoding="utf-8")
    compare([tmp_path / "detok.hyp", tmp_path / "tok.hyp"], [tmp_path / "ref.txt"], samples=5, tests=("bs",),
            metrics=("bleu",))
    warned = [(r.name, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [("mtcli", f"{tmp_path / 'tok.hyp'}: 120 of 120 lines end in a tokenised period (' .'); BLEU is "
                                "of detokenised text: detokenise them (and their references) for a score others can compare")]


def test_systems_of_equal_quality_are_not_told_apart(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """One system truncates the odd sentences, the other the even ones."""
    ref, weak, _ = systems
    refs = ref.read_text(encoding="utf-8").splitlines()
    other = [" ".join(line.split()[: max(1, len(line.split()) // 2)]) if i % 2 == 0 else line
             for i, line in enumerate(refs)]
    close = tmp_path / "other.hyp"
    close.write_text("\n".join(other) + "\n", encoding="utf-8")
    report = compare([weak, close], [ref, ref], metrics=["bleu"], samples=200, names=["a", "b"])
    assert report["tests"]["ar"]["scores"]["bleu"]["b"]["p_value"] > 0.05
    assert report["tests"]["bs"]["scores"]["bleu"]["b"]["p_value"] > 0.05


def test_a_run_directory_gives_its_newest_hypotheses(tmp_path: Path) -> None:
    old, new = tmp_path / "run" / "eval" / "test.old.hyp", tmp_path / "run" / "eval" / "lp1" / "test.new.hyp"
    for i, path in enumerate((old, new)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
        os.utime(path, (time.time() + i, time.time() + i))
    assert hypothesis_file(tmp_path / "run") == new
    with pytest.raises(DataError, match="run mtcli evaluate"):
        hypothesis_file(tmp_path)


def test_a_run_directory_gives_the_hypotheses_scored_against_the_reference(systems: tuple[Path, Path, Path],
                                                                           tmp_path: Path) -> None:
    """A run holds hypotheses of other splits and directions: the newest one's are scored only
    when they were scored against this reference (French hypotheses against German references
    were compared without a word)."""
    ref, weak, strong = systems
    other_ref = tmp_path / "other.ref"
    other_ref.write_text("something else\n" * len(ref.read_text().splitlines()))
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    for i, (name, hyp, against) in enumerate([("test.best", weak, ref), ("test.en-fr.best", strong, other_ref)]):
        (run / "eval" / f"{name}.hyp").write_bytes(hyp.read_bytes())
        copy = tmp_path / f"copy{i}.ref"  # the run's own text/ copy: another path, the same content
        copy.write_bytes(against.read_bytes())
        (run / "eval" / f"{name}.report.json").write_text(json.dumps({"reference": str(copy),
                                                                     "reference_sha256": sha256_file(copy)}))
        os.utime(run / "eval" / f"{name}.hyp", (time.time() + i, time.time() + i))
    assert hypothesis_file(run, ref) == run / "eval" / "test.best.hyp"  # not the newest
    assert hypothesis_file(run, other_ref) == run / "eval" / "test.en-fr.best.hyp"
    unrelated = tmp_path / "unrelated.ref"
    unrelated.write_text("x\n")
    with pytest.raises(DataError, match=r"none of its hypotheses was scored against .*unrelated.ref \(its newest: "
                                        r"eval/test.en-fr.best.hyp, eval/test.best.hyp\)"):
        hypothesis_file(run, unrelated)
    report = compare([run, strong], [ref], metrics=["bleu"], tests=["bs"], samples=50)
    assert report["systems"][str(run)] == str(run / "eval" / "test.best.hyp")
    assert render(report).splitlines()[0] == f"{run}: {run / 'eval' / 'test.best.hyp'}"  # said, not only in -o
    older = json.loads((run / "eval" / "test.best.report.json").read_text())
    del older["reference_sha256"]  # an older mtcli's report: matched by its reference's content
    (run / "eval" / "test.best.report.json").write_text(json.dumps(older))
    assert hypothesis_file(run, ref) == run / "eval" / "test.best.hyp"


def test_a_system_identical_to_the_baseline_is_not_significant(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """sacreBLEU gives a copy of the baseline p of about 1/samples (it counts differences larger
    than the real one, 0): read as significant. It gets p = 1 and says why."""
    ref, weak, strong = systems
    copy = tmp_path / "copy.hyp"
    copy.write_bytes(weak.read_bytes())
    report = compare([weak, copy, strong], [ref], metrics=["bleu", "ter"], samples=100, names=["a", "b", "c"])
    for test in ("bs", "ar"):
        scores = report["tests"][test]["scores"]
        assert scores["bleu"]["b"]["p_value"] == scores["ter"]["b"]["p_value"] == 1.0
        assert scores["bleu"]["b"]["identical_to_baseline"] and "identical_to_baseline" not in scores["bleu"]["c"]
        assert scores["bleu"]["c"]["p_value"] < 0.05
        assert "p_floor" not in scores["bleu"]["b"]  # (p = 1 already: no floor raised it)
    assert "p = 1.0000 (the baseline's output, line for line)" in render(report)
    assert "few lines differ" not in render(report)
    twice = compare([weak, weak], [ref], metrics=["bleu"], tests=["bs"], samples=10)  # was refused: same name
    assert twice["tests"]["bs"]["scores"]["bleu"][f"{weak} (2)"]["identical_to_baseline"]


def test_a_different_output_of_the_same_score_is_not_significant(tmp_path: Path) -> None:
    """Two different outputs that score 0 on every sentence: sacreBLEU's samples all differ by 0,
    as the real difference does, and it reports p = 1/(samples+1). A difference of 0 is no
    evidence: p = 1, and the report says the scores are equal."""
    ref = tmp_path / "ref.txt"
    ref.write_text("a small dog runs\nthe red car stops\ntwo people walk\n", encoding="utf-8")
    (tmp_path / "a.hyp").write_text("xx\nxx\nxx\n", encoding="utf-8")
    (tmp_path / "b.hyp").write_text("yy\nyy\nyy\n", encoding="utf-8")
    report = compare([tmp_path / "a.hyp", tmp_path / "b.hyp"], [ref], metrics=["bleu", "chrf"], samples=50,
                     names=["a", "b"])
    for test in ("bs", "ar"):
        for metric in ("bleu", "chrf"):
            result = report["tests"][test]["scores"][metric]["b"]
            assert result["p_value"] == 1.0 and result["same_score_as_baseline"], (test, metric, result)
            assert "identical_to_baseline" not in result
    assert "p = 1.0000 (the baseline's score: no difference to test)" in render(report)


def test_randomization_gives_few_differing_lines_no_smaller_p_than_they_can(systems: tuple[Path, Path, Path],
                                                                             tmp_path: Path) -> None:
    """One line changed of 40 read as p = 0.0001 under approximate randomization: swapping that
    line gives the real difference again, which sacreBLEU does not count. Of k differing lines'
    2^k swaps, two give it: p >= 2^(1-k)."""
    ref, weak, _ = systems
    lines = weak.read_text(encoding="utf-8").splitlines()
    for changed, floor in ((1, 1.0), (3, 0.25)):
        other = tmp_path / f"changed{changed}.hyp"
        other.write_text("\n".join(["a man runs"] * changed + lines[changed:]) + "\n", encoding="utf-8")
        report = compare([weak, other], [ref], metrics=["bleu", "chrf"], tests=["ar"], samples=500, names=["a", "b"])
        for metric in ("bleu", "chrf"):
            result = report["tests"]["ar"]["scores"][metric]["b"]
            assert result["p_value"] == floor and result["p_floor"] == floor, (changed, metric, result)
        assert "(few lines differ: no smaller p is possible)" in render(report)
    # lines whose text differs only in what a metric does not see are no difference to it: BLEU's 13a
    # tokeniser splits "dog." as "dog ."; three lines so, one really changed: the floor of one line
    dotted, spaced = tmp_path / "dotted.hyp", tmp_path / "spaced.hyp"
    dotted.write_text("".join(f"{line}.\n" for line in lines), encoding="utf-8")
    spaced.write_text("".join(f"{line}\n" for line in ["a man runs.", *(f"{line} ." for line in lines[1:3]),
                                                          *(f"{line}." for line in lines[3:])]), encoding="utf-8")
    report = compare([dotted, spaced], [ref], metrics=["bleu"], tests=["ar"], samples=500, names=["a", "b"])
    assert report["tests"]["ar"]["scores"]["bleu"]["b"]["p_floor"] == 1.0  # was 0.25, as for three changed lines
    many = compare([weak, systems[2]], [ref], metrics=["bleu"], tests=["ar"], samples=500, names=["a", "b"])
    assert many["tests"]["ar"]["scores"]["bleu"]["b"]["p_value"] < 0.05  # 20 lines differ: no floor reached


def test_bleu_of_a_thai_target_is_said_to_count_phrases(systems: tuple[Path, Path, Path],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    ref, weak, strong = systems
    said = "BLEU of 'th' text splits it into words at its spaces (13a), which part phrases in it"
    for metrics, warned in ((["bleu"], True), (["chrf"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            compare([weak, strong], [ref], metrics=metrics, tests=["bs"], samples=5, tgt_lang="th")
        assert (said in caplog.text) == warned, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        compare([weak, strong], [ref], metrics=["bleu"], tests=["bs"], samples=5, tgt_lang="en")
    assert "BLEU of" not in caplog.text and "langcodes" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="mtcli"):  # zn for zh: scored by 13a, unsaid
        compare([weak, strong], [ref], metrics=["bleu"], tests=["bs"], samples=5, tgt_lang="zn")
    assert "--tgt-lang zn: no language code langcodes knows (a typo?)" in caplog.text


def test_unspaced_references_with_no_language_are_said_to_need_one(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Chinese hypotheses with no --tgt-lang and none recorded were scored by 13a: BLEU 0.00 of
    whole sentences as words, without a word."""
    from mtcli.compare import unspaced_script

    lines = ["一只猫在草地上玩。", "两个孩子在公园里跑步。", "一个男人在骑自行车。", "女人在看书。"] * 5
    ref, a, b = tmp_path / "ref.txt", tmp_path / "a.hyp", tmp_path / "b.hyp"
    ref.write_text("\n".join(lines) + "\n", encoding="utf-8")
    a.write_text("\n".join(line[:-2] + "。" for line in lines) + "\n", encoding="utf-8")
    b.write_text("\n".join(lines[1:] + lines[:1]) + "\n", encoding="utf-8")
    said = "ref.txt: no --tgt-lang, nor a language recorded beside the hypotheses, so BLEU splits words at spaces " \
           "(13a), but it looks like Chinese text: give --tgt-lang zh"
    for given, warned in ((None, True), ("zh", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            report = compare([a, b], [ref], metrics=["bleu"], tests=["bs"], samples=5, tgt_lang=given)
        assert (said in caplog.text) == warned, caplog.text
    assert "tok:zh" in report["tests"]["bs"]["signatures"]["bleu"]
    assert unspaced_script(["今日はいい天気ですね。"] * 3) == ("Japanese", "ja")
    assert unspaced_script(["오늘 날씨가 좋네요."]) == ("Korean", "ko")
    assert unspaced_script(["วันนี้อากาศร้อนมาก"]) == ("Thai", "th")
    assert unspaced_script(["A dog runs in the park.", "", "Un chien court."]) is None


def test_a_test_that_needs_more_memory_than_there_is_is_refused_before_it_runs(
        systems: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """sacreBLEU holds every sample of every line at once: approximate randomization over
    200,000 lines needs about 20 GB, and the process was killed without a word, after minutes."""
    import mtcli.compare
    from mtcli.compare import paired_test_bytes

    ref, weak, strong = systems
    lines = len(ref.read_text(encoding="utf-8").splitlines())
    assert paired_test_bytes("ar", 200_000, ["bleu"], 10_000) / 2**30 == pytest.approx(18.6, abs=0.1)
    assert paired_test_bytes("bs", 200_000, ["bleu", "chrf"], 1_000) > paired_test_bytes("bs", 200_000, ["bleu"], 1_000)
    need = paired_test_bytes("ar", lines, ["bleu"], 10_000)
    monkeypatch.setattr(mtcli.compare, "available_host_bytes", lambda: need)
    with pytest.raises(ConfigError, match=rf"^--test ar over {lines:,} lines with 10,000 samples needs about 4 MiB "
                                          r"at once .*: give --samples 8,333 or fewer, or compare a part of the lines$"):
        compare([weak, strong], [ref], metrics=["bleu"], tests=["bs", "ar"])
    compare([weak, strong], [ref], metrics=["bleu"], tests=["ar"], samples=8_333)  # fits
    monkeypatch.setattr(mtcli.compare, "available_host_bytes", lambda: None)  # not known: run
    compare([weak, strong], [ref], metrics=["bleu"], tests=["bs"], samples=10)


def test_bad_input_is_one_line(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    ref, weak, strong = systems
    short = tmp_path / "short.hyp"
    short.write_text("one line\n")
    with pytest.raises(DataError, match=r"short.hyp has 1 lines but the reference .* has \d+"):
        compare([weak, short], [ref])
    with pytest.raises(ConfigError, match="at least two systems"):
        compare([weak], [ref])
    with pytest.raises(ConfigError, match=r"^--metrics 'meteor': unknown \(known: bleu, chrf, ter\)$"):
        compare([weak, strong], [ref], metrics=["meteor"])
    with pytest.raises(ConfigError, match=r"^--test '', 'xx': unknown \(known: bs, ar, both\)$"):  # (named neither option)
        compare([weak, strong], [ref], tests=["", "bs", "xx"])
    with pytest.raises(ConfigError, match=r"at least one metric .* got metrics \[\]"):  # printed two empty tables
        compare([weak, strong], [ref], metrics=[])
    for own in (strong, ref):  # the report written over an input: the reference was gone
        with pytest.raises(ConfigError, match="is one of the files compared"):
            compare([weak, strong], [ref], output=own)
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):  # before the tests (a traceback once, after them)
        compare([weak, strong], [ref], output=tmp_path, samples=10**9)
    once = compare([weak, strong], [ref], metrics=["bleu", "bleu"], tests=["bs", "bs"], samples=10)  # a traceback once
    assert list(once["tests"]) == ["bs"] and list(once["tests"]["bs"]["scores"]) == ["bleu"]
    with pytest.raises(DataError, match=r"short.hyp has 1 lines but the first reference .* has \d+"):
        compare([weak, strong], [ref, short])
    empty = tmp_path / "empty.ref"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.ref: empty; there is nothing to compare"):  # was an IndexError
        compare([weak, strong], [empty])
    with pytest.raises(ConfigError, match=r"--tgt-lang '!!': not a language code"):  # was taken, as 13a's
        compare([weak, strong], [ref], tgt_lang="!!")
    with pytest.raises(ConfigError, match=r"--tgt-lang 'en-zh': the target's language alone, not a pair .*give zh$"):
        compare([weak, strong], [ref], tgt_lang="en-zh")  # sacreBLEU's -l en-zh: was scored as English, by 13a
    for given in ([weak, Path("-")], [Path("-"), strong]):  # (translate and score said to use /dev/stdin)
        with pytest.raises(ConfigError, match=r"^-: compare reads .* give standard input as /dev/stdin$"):
            compare(given, [ref])
    with pytest.raises(ConfigError, match=r"^-: compare reads .* give standard input as /dev/stdin$"):
        compare([weak, strong], [Path("-")])
    for seed in ("0", "None", "-1", "x"):  # 0, None: unseeded under a signature naming a seed; -1: numpy's traceback
        os.environ["SACREBLEU_SEED"] = seed  # 0: p-values that could not be repeated, the signature saying seed:0
        try:
            with pytest.raises(ConfigError, match=f"^SACREBLEU_SEED={seed}: give a seed from 1 to 2"):
                compare([weak, strong], [ref], samples=5)
        finally:
            del os.environ["SACREBLEU_SEED"]
    result = CliRunner().invoke(app, ["compare", str(weak), str(short), "--ref", str(ref)])
    assert result.exit_code != 0 and "short.hyp has 1 lines" in result.output
    assert "Traceback" not in result.output


def test_the_command_prints_a_table(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    ref, weak, strong = systems
    result = CliRunner().invoke(app, ["compare", str(weak), str(strong), "--ref", str(ref), "--test", "bs",
                                      "--samples", "100", "--metrics", "bleu", "-o", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "paired bootstrap resampling (100 samples)" in result.output and "p = " in result.output
    assert (tmp_path / "r.json").is_file()


def test_chinese_references_are_tokenised_as_chinese(tmp_path: Path) -> None:
    """The language given, or the one ``mtcli evaluate`` recorded beside a run's hypotheses,
    picks BLEU's tokeniser: 13a would score these unspaced sentences 0 whatever they say."""
    ref = tmp_path / "ref.zh"
    ref.write_text("一只狗在雪地里奔跑。\n两个男人在踢足球。\n一个女孩在读书。\n", encoding="utf-8")
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "test.best.hyp").write_text("一只狗在雪里跑。\n两个男人在踢球。\n一个女孩在看书。\n", encoding="utf-8")
    other = tmp_path / "other.hyp"
    other.write_text("一只狗在跑。\n两个人在踢球。\n女孩读书。\n", encoding="utf-8")

    def bleu(report: dict) -> tuple[str, float]:
        body = report["tests"]["bs"]
        return body["signatures"]["bleu"], body["scores"]["bleu"][str(run)]["score"]

    plain = compare([run, other], [ref], metrics=["bleu"], tests=["bs"], samples=10)
    assert plain["tgt_lang"] is None and "tok:13a" in bleu(plain)[0] and bleu(plain)[1] == 0.0
    given = compare([run, other], [ref], metrics=["bleu"], tests=["bs"], samples=10, tgt_lang="zh")
    assert "tok:zh" in bleu(given)[0] and bleu(given)[1] > 20
    (run / "eval" / "test.best.report.json").write_text(json.dumps({"direction": "en-zh", "tgt_lang": "zh"}))
    recorded = compare([run, other], [ref], metrics=["bleu"], tests=["bs"], samples=10)
    assert recorded["tgt_lang"] == "zh" and bleu(recorded) == bleu(given)


def test_a_reference_and_a_system_given_as_streams(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """``compare <(cat b.hyp) --ref <(cat ref)``: a hypothesis stream was "no such file", and a
    reference stream was used up by its checksum, then called empty."""
    ref, weak, strong = systems
    pipes = {"ref": tmp_path / "ref.fifo", "strong": tmp_path / "strong.fifo"}
    fifo_of(ref, pipes["ref"])
    fifo_of(strong, pipes["strong"])
    report = compare([weak, pipes["strong"]], [pipes["ref"]], tests=["bs"], samples=50, names=["weak", "strong"])
    assert report == compare([weak, strong], [ref], tests=["bs"], samples=50, names=["weak", "strong"]) | {
        "references": [str(pipes["ref"])], "systems": {"weak": str(weak), "strong": str(pipes["strong"])}}
    # a run directory's hypotheses are found by the checksum of the reference stream's bytes
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "test.best.hyp").write_bytes(strong.read_bytes())
    (run / "eval" / "test.best.report.json").write_text(json.dumps({"reference_sha256": sha256_file(ref)}))
    fifo_of(ref, tmp_path / "again.fifo")
    assert compare([weak, run], [tmp_path / "again.fifo"], tests=["bs"], samples=50)["systems"][str(run)] == str(
        run / "eval" / "test.best.hyp")


def test_a_run_scored_against_a_gz_reference_is_found_by_its_plain_text(tiny_run_dir: Path, tmp_path: Path) -> None:
    """The report's reference_sha256 is of the bytes read: a run evaluated against ref.gz (or a
    CRLF copy) was not found for ref.txt, the same lines."""
    import gzip
    import shutil

    from mtcli.evaluate import evaluate

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    text = (run / "text" / "test.tgt").read_text(encoding="utf-8")
    packed, crlf = tmp_path / "ref.txt.gz", tmp_path / "ref.crlf.txt"
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    crlf.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    evaluate(run, src_file=run / "text" / "test.src", ref_file=packed, beam=1)
    for reference in (run / "text" / "test.tgt", crlf):
        assert hypothesis_file(run, reference) == run / "eval" / "test.src.best.hyp"
        report = compare([run, run], [reference], metrics=["bleu"], tests=["bs"], samples=10)
        assert report["sentences"] == len(text.splitlines())


def test_json_puts_the_report_on_stdout_as_o_writes_it(systems: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Stdout had only the table, and -o - was refused with advice to leave -o out."""
    ref, weak, strong = systems
    args = ["compare", str(weak), str(strong), "--ref", str(ref), "--test", "bs", "--samples", "50"]
    result = CliRunner().invoke(app, [*args, "--json", "-o", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
