"""mtcli.Translator: the Python API equals the command line, streams in order, n-best lists
with scores, teacher-forced scoring, and clear errors for wrong arguments."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TOY_DIR, mtcli_here

import mtcli
from mtcli.errors import CheckpointError, ConfigError, DataError
from mtcli.infer.translator import Translator

LINES = ["eine katze spielt", "", "ein hund läuft im park", "rot", "zwei kleine kinder spielen im garten"]


@pytest.fixture(scope="module")
def translator(tiny_run_dir: Path) -> Translator:
    return Translator.from_run(tiny_run_dir, beam=2, device="cpu")


def test_public_name_and_lazy_import() -> None:
    assert "Translator" in mtcli.__all__ and mtcli.Translator is Translator
    fresh = subprocess.run([sys.executable, "-c", "import sys, mtcli; print('Translator' in dir(mtcli), 'torch' in "
                            "sys.modules)"], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "True False"  # offered (tab completion), yet not loaded, nor torch


def test_translate_equals_the_command_line(translator: Translator, tiny_run_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{line}\n" for line in LINES), encoding="utf-8")
    cli = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "2")
    assert cli.returncode == 0, cli.stderr
    assert translator.translate(LINES) == cli.stdout.decode().split("\n")[:-1]
    assert translator.translate(LINES)[1] == ""


def test_translate_iter_streams_in_order(translator: Translator) -> None:
    pulled: list[int] = []

    def source():
        for i, line in enumerate(LINES * 3):
            pulled.append(i)
            yield line

    outputs = translator.translate_iter(source())
    assert pulled == []  # nothing is read before the first output is asked for
    assert list(outputs) == translator.translate(LINES * 3)


def test_translate_iter_of_window_1_answers_a_producer_that_waits_for_each_answer(translator: Translator) -> None:
    answers: list[str] = []

    def chat():  # gives the next text only once the last one is answered
        for i, line in enumerate(LINES):
            assert len(answers) == i, f"text {i} asked for with {len(answers)} answers given"
            yield line

    for answer in translator.translate_iter(chat(), window=1):
        answers.append(answer)
    assert answers == translator.translate(LINES)
    with pytest.raises(ConfigError, match="window must be an int >= 1, got 0"):
        translator.translate_iter(LINES, window=0)


def test_translate_iter_yields_what_it_read_before_its_input_failed(translator: Translator) -> None:
    def broken():
        yield from LINES[:3]
        raise OSError("the connection dropped")

    answers = translator.translate_iter(broken())
    assert [next(answers) for _ in range(3)] == translator.translate(LINES[:3])
    with pytest.raises(OSError, match="the connection dropped"):
        next(answers)


def test_nbest_lists_are_ranked_and_widen_the_beam(translator: Translator) -> None:
    lists = translator.nbest(LINES, n=3)
    assert len(lists) == len(LINES)
    for line, hyps in zip(LINES, lists, strict=True):
        if not line:
            continue
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert [hyps[0].text for hyps in translator.nbest(LINES, n=2)] == translator.translate(LINES)


def test_score_is_the_searchs_log_probability_and_batching_does_not_change_it(translator: Translator) -> None:
    sources = [line for line in LINES if line] * 4
    hyps = [h for nbest in translator.nbest(sources, n=2) for h in nbest]
    tokenizer = translator.bundle.tokenizer
    canonical = [(src, h) for src, nbest in zip(sources, translator.nbest(sources, n=2), strict=True)
                 for h in nbest if tokenizer.encode(h.text) == h.tokens]
    assert len(hyps) == 2 * len(sources) and canonical
    scores = translator.score([s for s, _ in canonical], [h.text for _, h in canonical])
    assert scores == pytest.approx([h.logprob for _, h in canonical], abs=1e-4)
    targets = ["a cat plays", "", "red", "two small children"] * 4
    batched = translator.score(sources, targets)
    one_by_one = [translator.score([s], [t], max_tokens=1)[0] for s, t in zip(sources, targets, strict=True)]
    assert batched == pytest.approx(one_by_one, abs=1e-4)
    assert all(s < 0 for s in batched)


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_score_refuses_a_max_tokens_below_1(translator: Translator, max_tokens: int) -> None:
    """0 fell back to the run's batch size and -5 was used as given, where every other setting
    below its range is a ConfigError."""
    with pytest.raises(ConfigError, match=f"decode.max_tokens={max_tokens}: decode.max_tokens must be > 0"):
        translator.score(["rot"], ["red"], max_tokens=max_tokens)


def test_score_warns_of_a_source_it_truncates(translator: Translator, caplog: pytest.LogCaptureFixture) -> None:
    """As translating does: the log-probability returned is of the source cut short."""
    long = " ".join(["hund"] * 400)
    translator.score([long, "rot"], ["dog", "red"])
    assert "sources[0]: " in caplog.text and "truncated to the model limit of" in caplog.text
    assert "sources[1]" not in caplog.text


def test_truncated_lines_are_said_three_by_three_then_counted(translator: Translator,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A file of long lines logged one warning a line: 300 lines, 300 warnings."""
    long = " ".join(["hund"] * 400)
    translator.translate([long] * 15 + ["rot", long], beam=1, max_len_a=0.0, max_len_b=2)
    said = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert [m.split(": source has")[0] for m in said[:3]] == ["input: line 1", "input: line 2", "input: line 3"]
    assert said[3:] == ["input: 13 more lines truncated to the model limit of 127 pieces (lines 4, 5, 6, 7, 8, 9, 10, "
                        "11, 12, 13, ...)"]


def test_a_truncated_line_of_a_later_window_is_named_by_its_line_in_the_input(translator: Translator,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    long = " ".join(["hund"] * 400)
    list(translator.stream(["rot", "rot", "rot", long], window=2, name="in.txt", offset=10,
                           decode=translator.settings(beam=1, max_len_a=0.0, max_len_b=2)))
    said = [r.getMessage().split(": source has")[0] for r in caplog.records if "truncated" in r.getMessage()]
    assert said == ["in.txt: line 14"]


def test_overrides_given_as_one_string_are_a_type_error(tiny_run_dir: Path) -> None:
    """It was read a character at a time: "--set 'd': expected section.key=value"."""
    with pytest.raises(TypeError, match="overrides must be a list of 'decode.key=value' strings, not one"):
        Translator.from_run(tiny_run_dir, device="cpu", overrides="decode.beam_size=3")  # type: ignore[arg-type]


def test_a_call_with_a_narrower_beam_narrows_the_translators_nbest(tiny_run_dir: Path) -> None:
    """A translator (or a server) made with nbest 3: a call asking for beam 1 is greedy search,
    not a ConfigError about decode.nbest."""
    translator = Translator.from_run(tiny_run_dir, beam=3, nbest=3, device="cpu")
    assert translator.translate(LINES, beam=1) == Translator.from_run(tiny_run_dir, beam=1, device="cpu").translate(LINES)
    assert [len(hyps) for hyps in translator.nbest(LINES[:2], n=1, beam=1)] == [1, 1]


def test_an_nbest_wider_than_the_runs_beam_widens_it_as_translate_and_serve_say(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    """The run searches with beam 2: nbest 4 given alone (translate --nbest 4) widens the beam to
    4, as Translator.nbest and serve do; a beam set beside it (--set or beam) is refused. A run
    whose own decode.nbest is 2 prints its two hypotheses a line."""
    import shutil

    import yaml

    from mtcli.infer.files import translate_files

    wide = Translator.from_run(tiny_run_dir, nbest=4, device="cpu")
    assert (wide.decode.beam_size, wide.decode.nbest) == (4, 4)
    by_set = Translator.from_run(tiny_run_dir, overrides=["decode.nbest=4"], device="cpu")  # --set decode.nbest=4
    assert (by_set.decode.beam_size, by_set.decode.nbest) == (4, 4)  # (refused: nbest past the run's beam)
    with pytest.raises(ConfigError, match="nbest"):
        Translator.from_run(tiny_run_dir, overrides=["decode.nbest=4", "decode.beam_size=2"], device="cpu")
    for fixed in ({"overrides": ["decode.beam_size=2"]}, {"beam": 2}):
        with pytest.raises(ConfigError, match="nbest"):
            Translator.from_run(tiny_run_dir, nbest=4, device="cpu", **fixed)
    with pytest.raises(ConfigError, match="nbest"):  # (--beam 2 --set decode.nbest=4 printed 2 a line, unsaid)
        Translator.from_run(tiny_run_dir, overrides=["decode.nbest=4"], beam=2, device="cpu")
    narrower = Translator.from_run(tiny_run_dir, overrides=["decode.nbest=2"], beam=4, device="cpu")
    assert (narrower.decode.beam_size, narrower.decode.nbest) == (4, 2)
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["decode"]["nbest"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("eine katze\nrot\n", encoding="utf-8")
    translate_files(run, [source], out, device="cpu")
    rows = out.read_text(encoding="utf-8").splitlines()
    assert len(rows) == 4 and all("\t" in row for row in rows)


@pytest.mark.parametrize("int8", [True, False])
def test_decoding_copy_is_made_once(tiny_run_dir: Path, int8: bool) -> None:
    # int8, or fp32 with packed weights on the CPU: the copy is made on first use and kept
    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    first = translator.translate(LINES, int8=int8)
    copy = translator._prepared[(int8, False)]
    assert copy.model is not translator.bundle.model
    assert translator.translate(LINES, int8=int8) == first
    assert translator._prepared[(int8, False)] is copy


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda t: t.translate("ein satz"), TypeError, "not one string"),
    (lambda t: t.translate(["ok", 3]), TypeError, r"texts\[1\] is a int"),
    (lambda t: t.translate(["ok"], beam=0), ConfigError, "decode.beam_size must be >= 1"),
    (lambda t: t.translate(["ok"], beam_width=3), TypeError, "unknown decode setting"),
    (lambda t: t.score(["a"], ["b", "c"]), DataError, "1 sources but 2 targets"),
    (lambda t: t.score(["a"], ["b"], normalize="no"), TypeError, "normalize must be a bool, got 'no'"),
    (lambda t: t.nbest(["a"], n=10_000), ConfigError, "^nbest 10000 widens the beam"),
    (lambda t: list(t.translate_iter([b"bytes"])), TypeError, r"texts\[0\] is a bytes"),
    (lambda t: t.translate(["ok", "lone \ud800"]), DataError,
     r"^texts\[1\]: not valid Unicode \(lone surrogate at column 6\)$"),
    (lambda t: list(t.translate_iter(["\udc80 x"])), DataError, r"texts\[0\]: not valid Unicode"),
    (lambda t: t.nbest(["a\udfffb"]), DataError, r"column 2"),
    (lambda t: t.score(["ok"], ["\ud800"]), DataError, r"targets\[0\]: not valid Unicode"),
    (lambda t: list(t.stream(["a", None])), TypeError, r"input\[1\] is a NoneType"),  # was an AttributeError
    (lambda t: list(t.stream(["\ud800"])), DataError, r"input\[0\]: not valid Unicode"),
    (lambda t: list(t.stream("a line")), TypeError, "not one string"),
    (lambda t: list(t.stream(["a"], decode="beam")), TypeError, "decode is a str, expected a DecodeConfig"),
    (lambda t: t.translate(["a"], seed=3), ConfigError, "seed: for sampling only"),  # was silently ignored
    (lambda t: t.translate(["a"], sampling="topk", beam=4), ConfigError, "beam 4: sampling draws each token"),
    (lambda t: t.translate(["a"], tgt_lang=""), ConfigError, "must name a language"),  # was the default one
    (lambda t: t.translate({"ein satz": 1}), TypeError, "not a dict"),  # translated its keys
    (lambda t: t.nbest(["a"], n=2.7), TypeError, "n must be an int, got 2.7"),  # was 2
    (lambda t: t.nbest(["a"], n="3"), TypeError, "n must be an int, got '3'"),
    (lambda t: Translator.from_run(".", ensemble="run2"), TypeError, "not one"),  # read as runs 'r', 'u', ...
    (lambda t: Translator.from_run(".", device=None), TypeError, "got None"),  # torch's multi-line TypeError
    (lambda t: Translator.from_run(".", overrides=[5]), TypeError, r"overrides must be a list of 'decode.key=value' "
                                                                   r"strings, got \[5\]"),  # 'int' is not iterable
    (lambda t: t.translate(None), TypeError, "texts must be a list of strings, not a NoneType"),  # named nothing
    (lambda t: t.score(None, None), TypeError, "sources must be a list of strings, not a NoneType"),
    (lambda t: t.translate_iter(None), TypeError, "texts must be an iterable of strings, not a NoneType"),  # at next()
    (lambda t: t.translate_iter({"ein satz": 1}), TypeError, "not a dict"),  # translated its keys
    (lambda t: t.stream(5), TypeError, "lines must be an iterable of strings, not an int"),
    (lambda t: Translator.from_run(".", average_last=2.0), TypeError, "average_last must be an int .* got 2.0"),
    (lambda t: Translator.from_run(".", average_best=True), TypeError, "average_best must be an int"),  # averaged 1
    (lambda t: Translator.from_run(".", average_last="1"), TypeError, "average_last must be an int"),
])
def test_wrong_arguments_say_what_is_wrong(translator: Translator, call, error, message: str) -> None:
    with pytest.raises(error, match=message):
        call(translator)


def test_a_beam_set_beside_sampling_is_refused_however_it_is_given(tiny_run_dir: Path) -> None:
    """--set decode.beam_size=4 with --sampling topk was silently ignored (only --beam was refused)."""
    with pytest.raises(ConfigError, match="beam 4: sampling draws each token"):
        Translator.from_run(tiny_run_dir, sampling="topk", nbest=3, overrides=["decode.beam_size=4"])
    Translator.from_run(tiny_run_dir, sampling="topk", nbest=3)  # the run's own beam: not asked for, not refused
    Translator.from_run(tiny_run_dir, overrides=["decode.sampling=topk", "decode.topk=3", "decode.beam_size=1"])
    # --set decode.topk beside a search is a default for when sampling is asked for (a server's
    # requests, as docs/decoding.md says), not refused
    defaults = Translator.from_run(tiny_run_dir, overrides=["decode.topk=3", "decode.temperature=0.5"])
    assert len(defaults.nbest(["ein hund"], n=2, sampling="topk")[0]) == 2


def test_a_search_asked_of_a_translator_that_samples_several_fits_its_beam(tiny_run_dir: Path) -> None:
    """A translator (or server) that samples more a text by default than the run's beam holds:
    a search asked per call was refused ("nbest must be between 1 and beam"), translate() too."""
    searched = Translator.from_run(tiny_run_dir)
    beam = searched.decode.beam_size
    sampler = Translator.from_run(tiny_run_dir, sampling="topk", nbest=beam + 1)
    assert sampler.translate(LINES, sampling="none") == searched.translate(LINES)
    two = [line for line in LINES if line.strip()][:2]
    assert [len(n) for n in sampler.nbest(two, sampling="none")] == [beam, beam]  # the beam's n-best
    assert [len(n) for n in sampler.nbest(two, beam + 1, sampling="none")] == [beam + 1] * 2  # widened
    with pytest.raises(ConfigError, match="seed: for sampling only"):  # the real refusal, not the n-best's
        sampler.translate(LINES, sampling="none", seed=9)


def test_ctranslate2_samples_cut_at_the_length_limit_stay_sorted_by_score(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A sample cut at the length limit is scored again, with its end token: its list was left
    in CTranslate2's order, which the docs say is by score, and no longer was."""
    pytest.importorskip("ctranslate2")
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    theirs = Translator.from_run(run, device="cpu", engine="ctranslate2", sampling="topp", temperature=2.0,
                                 max_len_a=0.0, max_len_b=4)
    lists = [n for _ in range(8) for n in theirs.nbest(LINES, 4)]  # (unseeded: other samples each call)
    assert all([t.score for t in n] == sorted((t.score for t in n), reverse=True) for n in lists)


def test_ctranslate2_engine_converts_once_and_equals_ours_for_greedy(tiny_run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer.ct2 import CT2_DIR

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    ours = Translator.from_run(run, beam=1, device="cpu")
    theirs = Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")
    assert theirs.translate(LINES) == ours.translate(LINES)
    assert len({line for line in ours.translate(LINES) if line}) > 1, "degenerate: every output alike"
    longest = {"beam": 1, "device": "cpu", "max_len_b": 3000}  # past the model's positions: capped as ours
    assert Translator.from_run(run, engine="ctranslate2", **longest).translate(LINES) == Translator.from_run(
        run, **longest).translate(LINES)  # was CTranslate2's RuntimeError on a position past the table
    converted = sorted((run / CT2_DIR).iterdir())
    assert len(converted) == 1 and (converted[0] / "model.bin").is_file()
    stamp = (converted[0] / "model.bin").stat().st_mtime_ns
    Translator.from_run(run, engine="ctranslate2", device="cpu")  # the same checkpoint: reused
    assert (converted[0] / "model.bin").stat().st_mtime_ns == stamp
    best = run / "checkpoints" / "checkpoint_best.pt"  # another checkpoint behind the same name
    best.unlink()
    shutil.copyfile(run / "checkpoints" / "checkpoint_10.pt", best)
    again = Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")
    kept = again.engine.model_dir
    assert kept != converted[0] and sorted((run / CT2_DIR).iterdir()) == sorted([converted[0], kept])  # both kept
    assert again.translate(LINES) == Translator.from_run(run, beam=1, device="cpu").translate(LINES)
    beam = theirs.nbest(LINES, n=2, beam=2)  # beam search runs; its ranking may differ (docstring)
    assert all(len(hyps) == 2 for line, hyps in zip(LINES, beam, strict=True) if line)
    from mtcli.infer.export import export_model

    # another checkpoint exported over the kept conversion
    export_model(run, kept, checkpoint=str(run / "checkpoints" / "checkpoint_last.pt"))
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == again.translate(
        LINES)  # decoded with checkpoint_last's weights under checkpoint_best's name before
    damaged = kept / "model.bin"
    damaged.write_bytes(b"a conversion cut short")  # was CTranslate2's RuntimeError, a traceback
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == again.translate(
        LINES)
    assert damaged.stat().st_size > 1000  # converted again
    vocabulary = kept / "shared_vocabulary.json"
    vocabulary.write_text('["a"]')  # loads, then failed at the first line: "<blank> is not in the vocabulary"
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == again.translate(
        LINES)
    assert len(json.loads(vocabulary.read_text())) > 1  # converted again
    flipped = bytearray(damaged.read_bytes())  # one weight's byte: CTranslate2 read it, decoded empty lines
    flipped[-100] ^= 0xFF
    damaged.write_bytes(bytes(flipped))
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == again.translate(
        LINES)
    assert damaged.read_bytes() != bytes(flipped)  # converted again



def test_an_average_is_converted_once_and_decodes_as_ours(tiny_run_dir: Path, tmp_path: Path) -> None:
    """--average-last with --engine ctranslate2 was refused: write the average to a file first."""
    pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer.ct2 import CT2_DIR

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    ours = Translator.from_run(run, beam=1, device="cpu", average_last=2)
    theirs = Translator.from_run(run, beam=1, device="cpu", average_last=2, engine="ctranslate2")
    assert theirs.translate(LINES) == ours.translate(LINES)
    assert theirs.translate(LINES) != Translator.from_run(run, beam=1, device="cpu").translate(LINES)
    (converted,) = (run / CT2_DIR).iterdir()
    assert converted.name == ours.bundle.weights_sha256[:16]
    stamp = (converted / "model.bin").stat().st_mtime_ns
    again = Translator.from_run(run, beam=1, device="cpu", average_last=2, engine="ctranslate2")
    assert again.translate(LINES) == ours.translate(LINES)
    assert (converted / "model.bin").stat().st_mtime_ns == stamp  # the same average: not converted again


def test_a_run_this_user_cannot_write_is_converted_into_the_user_cache(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_only: list[Path]) -> None:
    """A model shared read-only (another user's run, a container's read-only volume): the
    conversion went into the run directory, so --engine ctranslate2 ended in "Read-only file
    system" where --engine torch decodes."""
    pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer.ct2 import CT2_DIR, user_conversions

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    read_only.append(run)
    ours = Translator.from_run(run, beam=1, device="cpu").translate(LINES)
    theirs = Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")
    assert theirs.translate(LINES) == ours
    assert not (run / CT2_DIR).exists()
    cached = user_conversions(run)
    assert cached.parent == tmp_path / "cache" / "mtcli" / CT2_DIR and theirs.engine.model_dir.parent == cached
    assert user_conversions(tmp_path / "another") != cached  # each run's conversions apart
    stamp = (theirs.engine.model_dir / "model.bin").stat().st_mtime_ns
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == ours
    assert (theirs.engine.model_dir / "model.bin").stat().st_mtime_ns == stamp  # found there: not converted again
    import copy

    copied = copy.deepcopy(theirs)  # its run was taken to be the cache's parent: converted again, into it
    assert copied.engine.model_dir == theirs.engine.model_dir and copied.translate(LINES) == ours
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]
    read_only.append(tmp_path / "read-only")
    (tmp_path / "read-only").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "read-only" / "cache"))
    with pytest.raises(ConfigError, match="XDG_CACHE_HOME to a writable directory, or decode with --engine torch"):
        Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")


def test_the_conversions_used_last_are_kept(tmp_path: Path) -> None:
    """Each conversion removed every other: two servers of one run's best and last checkpoints
    converted again at every start, or removed the other's while it was opened."""
    from mtcli.infer.ct2 import KEPT_CONVERSIONS, _remove_old_conversions
    from mtcli.infer.export import EXPORT_RECORD

    keys = [f"{age:x}" * 16 for age in range(5)]
    for age, key in enumerate(keys):
        (tmp_path / key).mkdir()
        (tmp_path / key / EXPORT_RECORD).write_text(json.dumps({"checkpoint_payload_sha256": key * 4}))
        os.utime(tmp_path / key, (1000 - age, 1000 - age))
    (tmp_path / ".key9.tmp").mkdir()  # a conversion being written: not counted, not removed
    older = tmp_path / ("e" * 16)  # an older mtcli's conversion, its record without the digest: removed
    older.mkdir()
    (older / EXPORT_RECORD).write_text(json.dumps({"format": "ctranslate2"}))
    os.utime(older, (2, 2))
    (tmp_path / "mine").mkdir()  # `mtcli export RUN RUN/ctranslate2/mine`, the oldest: not one to remove
    os.utime(tmp_path / "mine", (1, 1))
    _remove_old_conversions(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".key9.tmp", "mine", *keys[:KEPT_CONVERSIONS]])


def test_a_checkpoint_replaced_while_it_is_converted_is_not_mixed_up(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training run saving a new best while a translator loads the old one: the conversion was
    made from the file read again (the new weights) under the name of the weights loaded, and kept
    for them, so later translators decoded other weights than they named."""
    pytest.importorskip("ctranslate2")
    import shutil

    import mtcli.infer.export as export
    import mtcli.infer.translator as translator_module
    from mtcli.errors import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    best, other = run / "checkpoints" / "checkpoint_best.pt", run / "checkpoints" / "checkpoint_10.pt"
    original = best.read_bytes()
    want = Translator.from_run(run, beam=1, device="cpu").translate(LINES)
    assert want != Translator.from_run(run, other, beam=1, device="cpu").translate(LINES)
    real = translator_module.load_for_inference

    def loaded_then_replaced(*args, **kwargs):  # the new best lands right after the old was read
        bundle = real(*args, **kwargs)
        best.write_bytes(other.read_bytes())
        return bundle

    monkeypatch.setattr(translator_module, "load_for_inference", loaded_then_replaced)
    racing = Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")
    assert racing.translate(LINES) == want  # the weights it names
    monkeypatch.undo()
    best.write_bytes(original)
    assert Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2").translate(LINES) == want
    flips = [other.read_bytes(), original] * 2

    def replaced_at_every_load(*args, **kwargs):  # a best saved again at every load: the export gives up
        bundle = real(*args, **kwargs)
        best.write_bytes(flips.pop(0))
        return bundle

    monkeypatch.setattr(export, "load_for_inference", replaced_at_every_load)
    with pytest.raises(CheckpointError, match="checkpoint_best.pt: replaced while it was being read"):
        export.export_model(run, tmp_path / "out")
    best.write_bytes(original)
    monkeypatch.setattr(export, "load_for_inference", lambda *a, **k: loaded_then_replaced(*a, **k))
    export.export_model(run, tmp_path / "out")  # replaced once: loaded again, and named as loaded
    record = json.loads((tmp_path / "out" / "mtcli_export.json").read_text(encoding="utf-8"))
    assert record["checkpoint_sha256"] == hashlib.sha256(best.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ct2_pair(tiny_run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Translator, Translator]:
    """Our translator and CTranslate2's on a copy of the toy run (converted once)."""
    pytest.importorskip("ctranslate2")
    import shutil

    run = tmp_path_factory.mktemp("ct2") / "run"
    shutil.copytree(tiny_run_dir, run)
    return Translator.from_run(run, device="cpu"), Translator.from_run(run, device="cpu", engine="ctranslate2")


@pytest.mark.parametrize("settings", [{}, {"length_penalty": 0.6}, {"length_penalty": 0.0},
                                      {"max_len_a": 1.0, "max_len_b": 1}], ids=["alpha1", "alpha0.6", "alpha0", "cut"])
def test_ctranslate2_logprob_is_the_log_probability(ct2_pair: tuple[Translator, Translator], settings: dict) -> None:
    """CTranslate2's score is normalised by length^alpha: ``logprob`` was that score (-3.6
    where ours said -64.6). Greedy, both engines pick the same pieces, so their log-probabilities
    must agree, for outputs cut at a line's own limit too (CTranslate2 has one per batch)."""
    ours, theirs = ct2_pair
    mine, other = ours.nbest(LINES, n=1, beam=1, **settings), theirs.nbest(LINES, n=1, beam=1, **settings)
    compared = 0
    for line, a, b in zip(LINES, mine, other, strict=True):
        if line:
            assert b[0].tokens == a[0].tokens
            assert b[0].logprob == pytest.approx(a[0].logprob, abs=1e-3)
            alpha = settings.get("length_penalty", theirs.decode.length_penalty)  # CTranslate2's score: over the
            assert b[0].score == pytest.approx(b[0].logprob / (len(b[0].tokens) + 1) ** alpha)  # length, end too
            compared += 1
    assert compared == 4


def test_ctranslate2_says_it_returns_no_attention(ct2_pair: tuple[Translator, Translator]) -> None:
    """--plot-attention with --engine ctranslate2 was refused naming int8/bf16, never asked for."""
    _, theirs = ct2_pair
    with pytest.raises(ConfigError, match=r"returns no attention \(--plot-attention\)"):
        list(theirs.stream(["ein hund"], return_attention=True))


def test_ctranslate2_beam_output_of_a_line_is_the_same_in_any_batch(ct2_pair: tuple[Translator, Translator]) -> None:
    """CTranslate2 has one output limit a call: with the batch's longest, a short line's beam
    kept hypotheses past its own limit, so its translation changed with the lines beside it,
    and its n-best list, cut afterwards, came out of order with repeats."""
    _, theirs = ct2_pair
    lines = [line for line in LINES if line]
    together = theirs.nbest(lines, n=4, beam=4)
    for line, found in zip(lines, together, strict=True):
        alone = theirs.nbest([line], n=4, beam=4)[0]
        assert [t.tokens for t in alone] == [t.tokens for t in found]
        assert [t.score for t in alone] == pytest.approx([t.score for t in found], abs=1e-4)
        scores = [translation.score for translation in found]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(translation.tokens) for translation in found}) == len(found)


def test_ctranslate2_best_translation_does_not_depend_on_how_many_are_asked_for(
        ct2_pair: tuple[Translator, Translator]) -> None:
    """CTranslate2 ranks a hypothesis cut at the length limit without its end; scored with it, a
    cut best fell behind another hypothesis, which only an n-best list of two or more held: the
    1-best of --nbest 2 was not the translation of the same command without it."""
    _, theirs = ct2_pair
    lines = [line for line in TOY_DIR.joinpath("test.src").read_text(encoding="utf-8").splitlines() if line][:40]
    for beam in (2, 4):
        best = theirs.translate(lines, beam=beam, max_len_a=0.0, max_len_b=6)
        for n in range(2, beam + 1):
            found = theirs.nbest(lines, n=n, beam=beam, max_len_a=0.0, max_len_b=6)
            assert [hyps[0].text for hyps in found] == best
            assert all(len(hyps) == n for hyps in found)  # the whole beam is searched, n of it kept


def test_ctranslate2_engine_refuses_what_it_cannot_do(tiny_run_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        Translator.from_run(tiny_run_dir, engine="onnx")
    with pytest.raises(ConfigError, match=r"not an ensemble \(an ensemble: decode with --engine torch\)$"):
        Translator.from_run(tiny_run_dir, engine="ctranslate2", ensemble=[tiny_run_dir])
    # a shortlist: refused when loading, before any conversion
    converted = tiny_run_dir / "ctranslate2"
    before = sorted(converted.rglob("*")) if converted.exists() else None
    with pytest.raises(ConfigError, match=r"decode.shortlist is not available .*=0"):
        Translator.from_run(tiny_run_dir, engine="ctranslate2", overrides=["decode.shortlist=50"])
    assert (sorted(converted.rglob("*")) if converted.exists() else None) == before


def test_cli_translate_and_evaluate_take_the_engine(tiny_run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{line}\n" for line in LINES), encoding="utf-8")
    outputs = {}
    for engine in ("torch", "ctranslate2"):
        cli = mtcli_here("translate", str(run), str(src), "--beam", "1", "--engine", engine)
        assert cli.returncode == 0, cli.stderr
        outputs[engine] = cli.stdout
    assert outputs["torch"] == outputs["ctranslate2"]
    cli = mtcli_here("evaluate", str(run), "--beam", "1", "--engine", "ctranslate2")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["engine"] == "ctranslate2"


def test_the_decoding_device_is_chosen_and_a_bad_one_is_one_line(tiny_run_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    assert Translator.from_run(tiny_run_dir, device="cpu").device.type == "cpu"
    for bad, says in (("gpu", "--device='gpu': not a device (auto, cpu, cuda or cuda:N)"),
                      ("mps", "--device='mps': mtcli runs on cpu or cuda")):
        with pytest.raises(ConfigError) as exc:
            Translator.from_run(tiny_run_dir, device=bad)
        assert str(exc.value) == says
    source = tmp_path / "in.txt"
    source.write_text("ein Hund\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    good = CliRunner().invoke(app, ["translate", str(tiny_run_dir), str(source), "-o", str(out), "--device", "cpu"])
    assert good.exit_code == 0 and len(out.read_text(encoding="utf-8").splitlines()) == 1
    scored = CliRunner().invoke(app, ["evaluate", str(tiny_run_dir), "--device", "cpu", "--output", str(tmp_path)])
    assert scored.exit_code == 0 and '"device": "cpu"' in scored.stdout
    for command in (["translate", str(tiny_run_dir), str(source)], ["evaluate", str(tiny_run_dir)]):
        bad = CliRunner().invoke(app, [*command, "--device", "gpu"])
        assert bad.exit_code == 2 and bad.stderr.strip() == (
            "mtcli: error: --device='gpu': not a device (auto, cpu, cuda or cuda:N)"), bad.stderr


def test_a_checkpoint_of_another_model_is_refused_not_decoded_wrongly(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint of a run with another activation has the same shapes: it loaded into this
    run's model and decoded with the wrong feed-forward, without a word."""
    from mtcli.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(tiny_run_dir / "checkpoints" / "checkpoint_best.pt")
    other = {**state["config"]["model"], "activation": "swish" if state["config"]["model"]["activation"] == "relu"
             else "relu"}
    foreign = tmp_path / "foreign.pt"
    save_checkpoint(foreign, {**state, "config": {**state["config"], "model": other}})
    with pytest.raises(CheckpointError, match=r"foreign.pt: a checkpoint of another model: its model.activation "
                                              r"\w+ vs \w+ in .*config.yaml; decode it with its own run directory"):
        Translator.from_run(tiny_run_dir, checkpoint=str(foreign), device="cpu")


def test_a_negative_average_is_refused(tiny_run_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--average-last/--average-best must be 0 \(no average\) or > 0, got -1"):
        Translator.from_run(tiny_run_dir, device="cpu", average_last=-1)


def test_a_checkpoint_beside_an_average_is_refused(tiny_run_dir: Path) -> None:
    """The checkpoint named was ignored, even a missing one, when an average was asked for."""
    with pytest.raises(ConfigError, match=r"give --checkpoint \(nonexistent.pt\) or --average-last/--average-best"):
        Translator.from_run(tiny_run_dir, "nonexistent.pt", average_best=2)
    Translator.from_run(tiny_run_dir, average_last=2)


def test_a_translator_that_has_translated_pickles_and_copies(translator: Translator) -> None:
    """Its decoding copy, packed for oneDNN, cannot be pickled: it is made again after."""
    import copy
    import pickle

    expected = translator.translate(LINES)
    for clone in (pickle.loads(pickle.dumps(translator)), copy.deepcopy(translator)):
        assert clone.translate(LINES) == expected


def test_a_ctranslate2_translator_pickles_and_copies(tiny_run_dir: Path, tmp_path: Path) -> None:
    """CTranslate2's translator cannot be pickled: a copy opens the conversion again (it was a
    TypeError, where Translator's docstring promises pickle and deepcopy)."""
    pytest.importorskip("ctranslate2")
    import copy
    import pickle
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    fast = Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2")
    expected = fast.translate(LINES)
    for clone in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        assert clone.engine is not None and clone.engine.translator is not fast.engine.translator
        assert clone.translate(LINES) == expected
    Translator.from_run(run, "checkpoint_10.pt", device="cpu", engine="ctranslate2")  # removes fast's conversion
    assert copy.deepcopy(fast).translate(LINES) == expected  # made again from the weights in hand


def test_a_compute_type_ctranslate2_lacks_is_named_not_taken_for_a_damaged_conversion(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode.bf16 on a CPU without CTranslate2's bf16 kernels: its error was read as a damaged
    conversion, converted again, and ended 'cannot read the conversion'."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    import shutil

    from mtcli.infer.ct2 import CT2_DIR

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", lambda *a, **k: {"float32", "int8"})
    with pytest.raises(ConfigError, match=r"^decode.bf16: CTranslate2 cannot compute in bfloat16 on this cpu \(it "
                                          r"can in float32, int8\); set decode.bf16=false"):
        Translator.from_run(run, device="cpu", engine="ctranslate2", bf16=True)
    assert not (run / CT2_DIR).exists()  # nothing converted for it
    Translator.from_run(run, device="cpu", engine="ctranslate2", int8=True)  # a type it has

    def unusable(*args, **kwargs):
        raise RuntimeError("CUDA failed with error CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", unusable)  # was a traceback
    with pytest.raises(ConfigError, match=r"^--engine ctranslate2 cannot use cpu \(CUDA failed .*--engine torch"):
        Translator.from_run(run, device="cpu", engine="ctranslate2", int8=True)


def test_an_nbest_setting_where_it_means_nothing_is_refused(tiny_run_dir: Path) -> None:
    """translate(nbest=3) widened the beam to 3, unsaid (the same as beam=3), and nbest(n=2,
    nbest=4) left the 4 out."""
    translator = Translator.from_run(tiny_run_dir, device="cpu")
    for call, said in ((lambda: translator.translate(LINES[:1], nbest=3), r"translate\(\) takes no nbest setting"),
                       (lambda: list(translator.translate_iter(LINES[:1], nbest=3)), r"translate_iter\(\) takes no"),
                       (lambda: translator.nbest(LINES[:1], n=2, nbest=4), r"nbest\(\) takes no nbest setting \(its n")):
        with pytest.raises(ConfigError, match=said):
            call()


def test_threads_opening_one_unconverted_checkpoint_share_one_conversion(
        tiny_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Threads of a web app making translators at once: one raised a bare OSError (the old
    conversion moved aside under one name per process), others warned of a damaged conversion
    (another thread's, still being built) and converted again."""
    pytest.importorskip("ctranslate2")
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from mtcli.infer.ct2 import CT2_DIR

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    for _ in range(4):
        shutil.rmtree(run / CT2_DIR, ignore_errors=True)
        with ThreadPoolExecutor(4) as pool:
            made = list(pool.map(lambda _: Translator.from_run(run, beam=1, device="cpu", engine="ctranslate2"),
                                 range(4)))
        assert len({t.engine.model_dir for t in made}) == 1 and len(list((run / CT2_DIR).iterdir())) == 1
    assert "cannot read this conversion" not in caplog.text


def test_loading_a_translator_leaves_the_callers_random_numbers_alone(tiny_run_dir: Path) -> None:
    """A notebook that seeds and then loads a translator drew other random numbers after: the
    model's first weights, replaced by the checkpoint's, were drawn from the global generator."""
    import torch

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Translator.from_run(tiny_run_dir, device="cpu")
    assert torch.equal(torch.rand(3), expected)
    from mtcli.infer.quantize import int8_supported

    if int8_supported() is None:  # the int8 copy's check of its kernels drew from it too
        translator = Translator.from_run(tiny_run_dir, device="cpu", int8=True)
        torch.manual_seed(0)
        translator.translate(["ein hund"])
        assert torch.equal(torch.rand(3), expected)


def test_a_beam_wider_than_half_the_vocabulary_is_refused_by_either_engine(
        ct2_pair: tuple[Translator, Translator]) -> None:
    """The torch engine refused such a beam; CTranslate2 decoded it."""
    for engine in ct2_pair:
        size = engine.bundle.model.output_size
        wide = size // 2 + 1
        with pytest.raises(ConfigError, match=rf"decode.beam_size={wide} needs an output vocabulary of at least "
                                              rf"{2 * wide} pieces \(this model has {size}: a beam of at most {size // 2}\)"):
            engine.translate(["ein hund"], beam=wide)


_FORKED = """
import multiprocessing, sys, torch
from mtcli import Translator
torch.set_num_threads(2)
translator = Translator.from_run(sys.argv[1], device="cpu")
lines = ["eine katze spielt", "ein hund läuft im park"]
expected = translator.translate(lines)  # OpenMP runs in the parent first
with multiprocessing.get_context("fork").Pool(1) as pool:
    assert pool.apply_async(translator.translate, (lines,)).get(timeout=60) == expected
print("ok")
"""


def test_a_process_forked_after_decoding_decodes_too(tiny_run_dir: Path) -> None:
    """A pool under fork (gunicorn --preload, Celery's prefork workers) hung on its first
    translation once the parent had translated: GNU OpenMP after a fork."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _FORKED, str(tiny_run_dir)], capture_output=True, text=True,
                          env=env, timeout=180)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-2000:]


_LOADED = """
import sys
from mtcli import Translator
Translator.from_run(sys.argv[1], device="cpu").translate(["eine katze spielt"], beam=2)
print(sorted(name for name in sys.modules if name in ("torch._dynamo", "sympy")))
"""


def test_loading_and_decoding_leave_torch_dynamo_unimported(tiny_run_dir: Path) -> None:
    """The shape check built the model on the meta device, where PyTorch fills tensors through
    Python reference ops that import torch._dynamo and sympy: 2 s and 74 MB of every
    translate, evaluate and serve start, for values nobody read."""
    done = subprocess.run([sys.executable, "-c", _LOADED, str(tiny_run_dir)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0 and done.stdout == "[]\n", (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("recipe", ["toy.yaml", "multi30k_en_de.yaml", "multi30k_multi.yaml"])
def test_the_shape_check_sees_the_shapes_of_a_real_build(recipe: str) -> None:
    """The check builds the model with its initialisers skipped and its ``arange`` on the host:
    the parameters it names must be those of the model built for real, shape for shape."""
    import torch

    from mtcli.config import load_config
    from mtcli.infer.loading import _ShapesOnly
    from mtcli.model import Transformer

    config = load_config(REPO / "configs" / recipe)
    with torch.device("meta"), _ShapesOnly():
        shaped = Transformer(config.model, 1000, 0).state_dict()
    real = Transformer(config.model, 1000, 0).state_dict()
    assert {k: v.shape for k, v in shaped.items()} == {k: v.shape for k, v in real.items()}
    assert {v.device.type for v in shaped.values()} == {"meta"}


def test_numpy_numbers_are_taken_as_settings(tiny_run_dir: Path) -> None:
    """A beam or an n out of a numpy or pandas pipeline (np.int64) was refused: "key
    'decode.beam_size' must be int, got np.int64(2)"."""
    import numpy as np

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    lines = ["eine katze spielt"]
    assert translator.translate(lines, beam=np.int64(2), length_penalty=np.float32(1.0)) == translator.translate(
        lines, beam=2, length_penalty=1.0)
    assert [h.text for h in translator.nbest(lines, n=np.int64(2))[0]] == [h.text for h in translator.nbest(lines, 2)[0]]
    with pytest.raises(ConfigError, match="must be int"):
        translator.translate(lines, beam=np.bool_(True))


@pytest.mark.parametrize("default", ["float64", "bfloat16"])
def test_a_host_programs_default_dtype_changes_nothing(tiny_run_dir: Path, default: str) -> None:
    """A notebook's torch.set_default_dtype(torch.float64) built the model in float64 (int8
    then failed: "expected scalar type Float but found Double"); set after loading, the first
    translation failed in oneDNN's probe ("Float did not match Double")."""
    import torch

    lines = ["eine katze spielt", "ein hund läuft im park"]
    expected = Translator.from_run(tiny_run_dir, device="cpu")
    settings = ({}, {"int8": True}, {"bf16": True}, {"sampling": "topk", "seed": 1})
    wanted = [expected.translate(lines, **kw) for kw in settings] + [expected.score(lines, lines)]
    loaded_before = Translator.from_run(tiny_run_dir, device="cpu")
    try:
        torch.set_default_dtype(getattr(torch, default))
        for translator in (loaded_before, Translator.from_run(tiny_run_dir, device="cpu")):
            got = [translator.translate(lines, **kw) for kw in settings] + [translator.score(lines, lines)]
            assert got[:-1] == wanted[:-1] and got[-1] == pytest.approx(wanted[-1], abs=1e-5)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_stream_of_decoding_threads_left_open_ends_quietly_with_the_program(tiny_run_dir: Path) -> None:
    """Its pool was shut down at the interpreter's exit, after the modules it needs were gone: a
    traceback ("Exception ignored in: <generator ...>") at the end of a program that was fine."""
    program = ("import itertools, sys; from mtcli import Translator; "
               "t = Translator.from_run(sys.argv[1], device='cpu', beam=1, overrides=['decode.workers=2']); "
               "it = t.translate_iter(itertools.repeat('frau')); print(next(it) is not None)")
    done = subprocess.run([sys.executable, "-c", program, str(tiny_run_dir)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")


@pytest.mark.parametrize("tags", [{"x": 5}, ["a"], "abc"])
def test_a_manifest_of_malformed_tags_is_one_line(tags: object, tiny_run_dir: Path, tmp_path: Path) -> None:
    """A run's manifest.json with target_tags of another shape was a TypeError or AttributeError
    traceback; one nested past Python's limit, a RecursionError."""
    import json
    import shutil

    from mtcli.errors import DataError

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    (run / "manifest.json").write_text(json.dumps({"target_tags": tags}), encoding="utf-8")
    with pytest.raises(DataError, match=r"manifest.json: target_tags is not a mapping of languages to tags, but "):
        Translator.from_run(run, checkpoint="checkpoint_10.pt")
    (run / "manifest.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert Translator.from_run(run, checkpoint="checkpoint_10.pt", beam=1).translate(["hund"])  # as if it had none


def test_a_run_whose_config_asks_for_another_model_is_refused_before_it_is_built(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's config.yaml asking for a model of many gigabytes, beside small weights, had that
    model allocated (and memory run out) before the weights were found not to fit."""
    import shutil

    import torch
    import yaml

    from mtcli.infer import loading

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    config["model"].update(d_ff=65536, encoder_layers=12, decoder_layers=12)  # ~1.6 GB of float32
    (run / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    from mtcli.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(run / "checkpoints" / "checkpoint_10.pt")  # its own record says the same
    state["config"]["model"].update(d_ff=65536, encoder_layers=12, decoder_layers=12)
    save_checkpoint(run / "checkpoints" / "checkpoint_10.pt", state)
    built: list[str] = []
    real = loading.Transformer

    def recorded(*args: object, **kwargs: object) -> torch.nn.Module:
        built.append(torch.empty(0).device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "Transformer", recorded)
    with pytest.raises(CheckpointError, match=r"checkpoint_10.pt: parameters do not fit the model of .*config.yaml "
                                              r"\(decoder.layers.0.feed_forward.w_1.bias: \(\d+,\) in the checkpoint, "
                                              r"\(65536,\) in the model; "):
        Translator.from_run(run, checkpoint="checkpoint_10.pt")
    assert built == ["meta"]


def test_a_huge_line_is_encoded_from_its_start_only(translator: Translator, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A 190 MB line (a 450 KB .gz) was encoded whole, in some forty times its size, to keep
    127 pieces of it: the process was killed."""
    from mtcli.infer import translate

    monkeypatch.setattr(translate, "HUGE_LINE_CHARS", 1000)
    seen: list[int] = []
    encode = type(translator.bundle.tokenizer).encode_batch
    monkeypatch.setattr(type(translator.bundle.tokenizer), "encode_batch",
                        lambda self, texts: seen.extend(map(len, texts)) or encode(self, texts))
    huge = "hund " * 40_000  # 200,000 characters
    cap = max(1000, 64 * translator.bundle.model.cfg.max_positions)
    assert len(huge) > cap
    whole = translator.translate([huge[:cap], "rot"])
    assert translator.translate([huge, "rot"]) == whole
    assert max(seen) <= cap and f"line 1: source has {len(huge):,} characters, truncated to the model limit" in caplog.text


def test_the_memory_a_checkpoint_took_to_read_is_given_back_once_loaded(tiny_run_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With freed memory kept (the decoding commands), a 44M-parameter model's checkpoint read
    kept 1.85 GB resident through the decoding, where 0.49 GB are the model (docs/performance.md)."""
    import platform

    from mtcli import allocator
    from mtcli.infer import translator as module

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert allocator.release_freed_memory() in (True, False)  # (malloc_trim: 1 when it gave some back)
    released: list[str] = []
    monkeypatch.setattr(module, "release_freed_memory", lambda: released.append("now"))
    monkeypatch.setattr(module, "add_members", lambda bundle, *a: released.append("loaded") or bundle)
    Translator.from_run(tiny_run_dir, checkpoint="checkpoint_10.pt")
    assert released == ["loaded", "now"]


@pytest.mark.parametrize("units", [False, True])
def test_bf16_decoding_without_bf16_units_is_warned_of(tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture, units: bool) -> None:
    """decode.bf16 on a CPU without bf16 units decoded 4x slower than fp32 without a word
    (train.precision bf16 there is warned of)."""
    import mtcli.infer.translator as translator_module

    monkeypatch.setattr(translator_module, "device_has_bf16_units", lambda device: units)
    caplog.set_level(logging.WARNING, logger="mtcli")
    Translator.from_run(tiny_run_dir, device="cpu", overrides=["decode.bf16=true"])
    said = [r.getMessage() for r in caplog.records if "decode.bf16" in r.getMessage()]
    assert said == ([] if units else ["decode.bf16 on a cpu without bf16 matrix units: expect decoding several "
                                      "times slower than fp32 (--set decode.bf16=false)"])
