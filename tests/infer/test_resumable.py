"""Tests of mtcli.infer.resumable: ``translate -o`` interrupted goes on from its last window, to
the output an uninterrupted run writes; another input, model or setting starts over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mtcli.infer.files as files
from mtcli.cli import app
from mtcli.infer.resumable import partial_paths
from mtcli.infer.translator import Translator

WORDS = ["ein Hund", "zwei Hunde", "drei Katzen", "rot", "ein Haus", "", "Kinder spielen", "die Frau",
         "ein Mann läuft", "der Ball", "ein roter Ball", "vier Hunde laufen", "eine Katze", "blau"]


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Two input files (10 and 4 lines); windows of 3 lines."""
    monkeypatch.setattr(files, "WINDOW", 3)
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("".join(f"{w}\n" for w in WORDS[:10]), encoding="utf-8")
    second.write_text("".join(f"{w}\n" for w in WORDS[10:]), encoding="utf-8")
    return [first, second]


def interrupt_after(monkeypatch: pytest.MonkeyPatch, lines: int) -> None:
    """Ctrl-C once ``lines`` lines have been translated."""
    real = Translator.stream
    done = {"n": 0}

    def stream(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        for nbest in real(self, *args, **kwargs):
            if done["n"] == lines:
                raise KeyboardInterrupt
            done["n"] += 1
            yield nbest

    monkeypatch.setattr(Translator, "stream", stream)


def translate(run: Path, inputs: list[Path], out: Path, **settings) -> dict:  # noqa: ANN003
    return files.translate_files(run, inputs, out, beam=2, device="cpu", **settings)


def interrupted(run: Path, inputs: list[Path], out: Path, monkeypatch: pytest.MonkeyPatch, lines: int) -> None:
    """``translate`` to ``out``, stopped by Ctrl-C after ``lines`` lines (windows of 3 again after)."""
    interrupt_after(monkeypatch, lines)
    with pytest.raises(KeyboardInterrupt):
        translate(run, inputs, out)
    monkeypatch.undo()
    monkeypatch.setattr(files, "WINDOW", 3)


def test_an_interrupted_translation_goes_on_from_its_last_window_to_the_same_output(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = tmp_path / "whole.txt"
    translate(tiny_run_dir, inputs, whole)
    for stop, kept in ((7, 6), (12, 10)):  # in the first file; in the second, before its first window ends
        out = tmp_path / f"out{stop}.txt"
        interrupted(tiny_run_dir, inputs, out, monkeypatch, stop)
        data, record = partial_paths(out)
        assert not out.exists() and json.loads(record.read_text())["lines"] == kept
        assert data.read_text(encoding="utf-8").splitlines() == whole.read_text(encoding="utf-8").splitlines()[:kept]
        summary = translate(tiny_run_dir, inputs, out)
        assert summary["resumed_after"] == kept and summary["lines"] == 14 - kept
        assert out.read_bytes() == whole.read_bytes()
        assert not data.exists() and not record.exists()


def test_bytes_written_after_the_last_record_are_cut_off(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed mid-window (SIGKILL, a power cut) wrote lines its record does not hold."""
    whole, out = tmp_path / "whole.txt", tmp_path / "out.txt"
    translate(tiny_run_dir, inputs, whole)
    interrupted(tiny_run_dir, inputs, out, monkeypatch, 4)
    data, _ = partial_paths(out)
    with open(data, "a", encoding="utf-8") as handle:
        handle.write("half a line of a window never record")
    assert translate(tiny_run_dir, inputs, out)["resumed_after"] == 3
    assert out.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("change", ["settings", "input"])
def test_another_input_or_setting_starts_over(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    out = tmp_path / "out.txt"
    interrupted(tiny_run_dir, inputs, out, monkeypatch, 7)
    settings = {"length_penalty": 0.5} if change == "settings" else {}
    if change == "input":
        inputs[0].write_text("ein Hund\n" * 10, encoding="utf-8")
    whole = tmp_path / "whole.txt"
    translate(tiny_run_dir, inputs, whole, **settings)
    summary = translate(tiny_run_dir, inputs, out, **settings)
    assert summary["resumed_after"] == 0 and summary["lines"] == 14
    assert out.read_bytes() == whole.read_bytes()


def test_a_byte_that_is_not_utf8_keeps_nothing_for_the_mended_input_starts_over(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path) -> None:
    """The input must change, and changed input starts over: the partial output kept said that
    the same command went on from there."""
    out = tmp_path / "out.txt"
    inputs[1].write_bytes(b"ein roter Ball\nvier Hunde \xff laufen\n")
    argv = ["translate", str(tiny_run_dir), *map(str, inputs), "-o", str(out), "--beam", "2", "--device", "cpu"]
    result = CliRunner().invoke(app, argv)  # windows of 3: the first file's 9 lines are done by then
    assert result.exit_code == 1 and result.stderr.endswith(f"{inputs[1]}:2: invalid UTF-8 (byte 0xff at column "
                                                             "12)\n"), result.stderr
    assert "kept" not in result.stderr and "goes on" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_a_lower_max_tokens_or_other_workers_go_on(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings that only batch the lines do not start over: a user who lowers ``--max-tokens``
    after running out of memory keeps what was translated."""
    whole, out = tmp_path / "whole.txt", tmp_path / "out.txt"
    translate(tiny_run_dir, inputs, whole)
    interrupted(tiny_run_dir, inputs, out, monkeypatch, 7)
    summary = translate(tiny_run_dir, inputs, out, max_tokens=16, workers=2)
    assert summary["resumed_after"] == 6 and summary["lines"] == 8
    assert out.read_bytes() == whole.read_bytes()


def test_ctrl_c_says_where_the_lines_are_and_the_same_command_finishes(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.txt"
    argv = ["translate", str(tiny_run_dir), *map(str, inputs), "-o", str(out), "--beam", "2", "--device", "cpu"]
    interrupt_after(monkeypatch, 7)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 130 and result.stderr.endswith("mtcli: error: interrupted\n"), result.stderr
    assert (f"{out}: the output of the first 6 input lines is kept in .out.txt.partial; the same command goes on "
            "from there") in result.stderr
    monkeypatch.undo()
    monkeypatch.setattr(files, "WINDOW", 3)
    again = CliRunner().invoke(app, argv)
    assert again.exit_code == 0, again.stderr
    assert f"{out}: resuming after input line 6" in again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out.txt"]


def test_a_second_run_on_an_output_being_written_is_refused_and_leaves_it_alone(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path) -> None:
    """Both would append to one partial file (and the first to finish would rename it away)."""
    import fcntl

    out = tmp_path / "out.txt"
    data, _ = partial_paths(out)
    data.write_text("the other run's lines\n", encoding="utf-8")
    with open(data, "a", encoding="utf-8") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the run writing it holds it
        result = CliRunner().invoke(app, ["translate", str(tiny_run_dir), *map(str, inputs), "-o", str(out)])
    assert result.exit_code == 1
    assert result.stderr == f"mtcli: error: {out}: another mtcli command is writing this output now\n"
    assert data.read_text(encoding="utf-8") == "the other run's lines\n" and not out.exists()


def test_a_run_whose_partial_file_was_just_finished_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run opened the partial file just before the first renamed it to the output and
    took the lock after: it truncated the finished output and wrote under the final name."""
    import fcntl
    import os

    import mtcli.infer.resumable as resumable

    output = tmp_path / "out.txt"
    data, _ = resumable.partial_paths(output)
    data.write_text("finished\n")
    real = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        os.replace(data, output)  # the run that held the lock finishes meanwhile
        real(fd, operation)

    monkeypatch.setattr(resumable.fcntl, "flock", flock)
    with pytest.raises(BlockingIOError, match="has just finished this output"), resumable.resumable_output(output, "k"):
        pass
    assert output.read_text() == "finished\n"


def test_an_output_name_too_long_for_its_record_is_refused_before_the_work(tmp_path: Path) -> None:
    """A 240-character name: its hidden record beside it could not be written, found after a
    whole window and named by its temporary name; now refused first, naming the output."""
    import errno

    from mtcli.infer.resumable import resumable_output

    output = tmp_path / ("o" * 240)
    with pytest.raises(OSError, match="too long a name") as caught, resumable_output(output, "k"):
        pytest.fail("began the work")
    assert caught.value.errno == errno.ENAMETOOLONG and caught.value.filename == str(output)
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_without_locks_still_gets_its_output(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out.txt"
    assert translate(tiny_run_dir, inputs, out)["lines"] == 14 and len(out.read_text().splitlines()) == 14


def test_a_stream_translated_to_an_output_being_written_is_refused(tiny_run_dir: Path, tmp_path: Path) -> None:
    """`cat more.txt | mtcli translate RUN -o out.txt` beside a file run writing out.txt: both
    finished, the last one's output replacing the other's, unsaid."""
    import fcntl
    import subprocess
    import sys

    out = tmp_path / "out.txt"
    data, _ = partial_paths(out)
    command = [sys.executable, "-m", "mtcli.cli", "translate", str(tiny_run_dir), "-o", str(out), "--beam", "1"]
    with open(data, "a", encoding="utf-8") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the run writing it holds it
        refused = subprocess.run(command, input=b"ein hund\n", capture_output=True, timeout=300, check=False)
    assert refused.returncode == 1 and not out.exists()
    assert refused.stderr.decode() == f"mtcli: error: {out}: another mtcli command is writing this output now\n"
    data.write_text("")  # as a stream run killed left it: nothing to resume, removed after
    done = subprocess.run(command, input=b"ein hund\n", capture_output=True, timeout=300, check=False)
    assert done.returncode == 0 and len(out.read_text().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no lock file left


def test_an_output_keeps_its_mode_and_a_write_protected_one_is_refused(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chmod 600 output came back 644; a 444 one was replaced (a rename needs only the
    directory's permission): the shell's > refuses it."""
    import os

    from mtcli.fileio import atomic_write

    out = tmp_path / "out.txt"
    out.write_text("old\n")
    out.chmod(0o600)
    translate(tiny_run_dir, inputs, out)
    assert len(out.read_text().splitlines()) == 14 and out.stat().st_mode & 0o777 == 0o600
    with atomic_write(out) as handle:  # (a stream's translation, written at once)
        handle.write("new\n")
    assert out.stat().st_mode & 0o777 == 0o600
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == out else real(path, mode, **kw))
    with pytest.raises(PermissionError, match="write-protected"):  # (root may write any file: os.access says so)
        translate(tiny_run_dir, inputs, out)
    assert out.read_text() == "new\n" and not partial_paths(out)[0].exists()


def test_a_gz_output_and_a_damaged_gz_input_are_one_line(tiny_run_dir: Path, tmp_path: Path) -> None:
    """-o out.gz wrote plain text, which mtcli then read as gzip; a cut-short .gz input gave
    "Aborted!", a damaged one a zlib traceback."""
    import gzip

    src = tmp_path / "in.txt.gz"
    src.write_bytes(gzip.compress(b"ein hund\nrot\n" * 50)[:30])
    result = CliRunner().invoke(app, ["translate", str(tiny_run_dir), str(src)])
    assert result.exit_code == 1 and result.stderr.startswith(f"mtcli: error: {src}: corrupt gzip data (")
    src.write_bytes(gzip.compress(b"ein hund\n"))
    result = CliRunner().invoke(app, ["translate", str(tiny_run_dir), str(src), "-o", str(tmp_path / "out.gz")])
    assert result.exit_code == 1 and result.stderr.startswith(
        f"mtcli: error: {tmp_path / 'out.gz'}: the translation is written as plain text; name the output without .gz")


def test_a_stream_run_whose_lock_file_went_meanwhile_is_refused(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream run opened the lock file just before the run holding it removed it, then locked
    the removed file: two runs went on writing one output."""
    import fcntl

    import mtcli.infer.resumable as resumable

    output = tmp_path / "out.txt"
    data, _ = resumable.partial_paths(output)
    data.write_text("")
    real = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        data.unlink()  # the run that held the lock finishes meanwhile
        real(fd, operation)

    monkeypatch.setattr(resumable.fcntl, "flock", flock)
    with pytest.raises(BlockingIOError, match="has just finished this output"), resumable.output_locked(output):
        pass


def test_an_output_whose_directory_went_mid_run_says_nothing_is_kept(
        tiny_run_dir: Path, inputs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The output's directory removed while it was written: the warning said the first lines were
    kept in the partial file (gone with it), and the error named that hidden file."""
    import shutil

    out = tmp_path / "gone" / "out.txt"
    real = Translator.stream

    def stream(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        for n, nbest in enumerate(real(self, *args, **kwargs)):
            if n == 7:
                shutil.rmtree(out.parent)
            yield nbest

    monkeypatch.setattr(Translator, "stream", stream)
    with pytest.raises(FileNotFoundError) as raised:
        translate(tiny_run_dir, inputs, out)
    assert raised.value.filename == str(out) and "nothing of it is kept" in raised.value.strerror
    assert "kept in" not in caplog.text and not out.parent.exists()
