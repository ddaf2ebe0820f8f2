"""Tests of mtcli.logs: progress bars off a terminal write plain lines, rarely, or nothing."""

from __future__ import annotations

import pytest

from mtcli import logs


def _run_bar(**kwargs: object) -> None:
    bar = logs.progress(total=5, desc="work", unit="it", **kwargs)
    for _ in range(5):
        bar.update(1)
    bar.close()


def test_bar_off_a_terminal_writes_plain_lines(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(logs, "on_terminal", lambda: False)
    monkeypatch.setattr(logs, "PLAIN_BAR_SECONDS", 0.0)  # a line on every update
    _run_bar()
    err = capsys.readouterr().err
    assert "\r" not in err  # no in-place redraws in a log file
    lines = err.splitlines()
    assert lines and all(line.startswith("work:") for line in lines)
    assert "5/5" in lines[-1]


def test_bar_off_a_terminal_is_quiet_for_short_jobs_and_terminal_only_bars(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(logs, "on_terminal", lambda: False)
    _run_bar()  # the default: nothing before PLAIN_BAR_SECONDS
    monkeypatch.setattr(logs, "PLAIN_BAR_SECONDS", 0.0)
    _run_bar(terminal_only=True)
    assert capsys.readouterr().err == ""


def test_bar_on_a_terminal_redraws_in_place(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(logs, "on_terminal", lambda: True)
    _run_bar(mininterval=0)
    assert "\r" in capsys.readouterr().err


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (-3, "0s"), (44.6, "45s"), (60, "1m00s"), (725, "12m05s"), (3600, "1h00m"),
    (11_520, "3h12m"), (187_200, "2d04h"),
])
def test_duration_text_reads_as_a_person_says_it(seconds: float, text: str) -> None:
    assert logs.duration_text(seconds) == text


def test_a_run_log_that_cannot_be_written_is_one_warning_not_a_traceback_a_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk under train.log printed "--- Logging error ---" and a traceback for every
    line, and its close replaced the run's own error with a nameless ENOSPC."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here (it fails every write with ENOSPC)")
    logs.setup_logging()
    handler = logs.add_file_log("/dev/full")
    try:
        for i in range(3):
            logs.get_logger().info("step %d", i)
    finally:
        logs.remove_log_handler(handler)  # no exception either
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert warnings == [warnings[0]] and warnings[0].endswith(
        "/dev/full: cannot write the log (No space left on device); it stops here, the console goes on")
    assert [line for line in err.splitlines() if "| INFO |" in line] == [
        line for line in err.splitlines() if line.endswith(("step 0", "step 1", "step 2"))]


def test_tensorboard_scalars_that_cannot_be_written_are_one_warning(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """The event writer's thread died with a traceback on the console, and the next scalar
    ended the training with "No space left on device", naming nothing."""
    from mtcli.train.scalars import Scalars

    scalars = Scalars(tmp_path / "tensorboard")
    scalars.add_scalar("train/loss", 1.0, 1)

    class Full:
        def add_scalar(self, *args: object) -> None:
            raise OSError(28, "No space left on device")

    scalars._writer.close()
    scalars._writer = Full()  # type: ignore[assignment]
    for step in (2, 3):
        scalars.add_scalar("train/loss", 1.0, step)
    scalars.flush()
    scalars.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [f"{tmp_path / 'tensorboard'}: cannot write TensorBoard's scalars (No space left on device); "
                    "they stop here, the training goes on"]


def test_a_record_that_cannot_be_formatted_does_not_stop_the_run_log(tmp_path, capsys) -> None:
    """Only a failed write stops the file: a bad format string is logging's own report, and the
    lines after it are still written."""
    import logging

    handler = logs.add_file_log(tmp_path / "t.log")
    try:
        for message, args in (("bad %d", ("x",)), ("after", ())):  # to the file alone (pytest's raises)
            handler.handle(logging.LogRecord("mtcli", logging.INFO, __file__, 0, message, args, None))
    finally:
        logs.remove_log_handler(handler)
    assert (tmp_path / "t.log").read_text(encoding="utf-8").rstrip().endswith("after")
    assert "cannot write the log" not in capsys.readouterr().err


def test_quiet_logs_warnings_only_and_draws_no_bar_while_a_run_log_gets_every_line(tmp_path, capsys) -> None:
    """--verbose was the only knob (and logged one message more): a script had no way to keep
    stderr to what matters."""
    import logging

    log = logs.get_logger()
    level, handlers = log.level, list(log.handlers)
    try:
        log.handlers[:] = [h for h in handlers if not isinstance(h, logs._TqdmHandler)]
        assert not logs.console_quiet()  # no command line: uvicorn's INFO lines stay, as serve() had them
        logs.setup_logging(quiet=True)
        assert logs.console_quiet()
        run_log = logs.add_file_log(tmp_path / "train.log")
        log.info("step 1")
        log.warning("careful")
        bar = logs.progress(range(3), total=3)
        assert bar.disable
        bar.close()
        logs.remove_log_handler(run_log)
        err = capsys.readouterr().err
        assert "careful" in err and "step 1" not in err
        assert "step 1" in (tmp_path / "train.log").read_text() and "careful" in (tmp_path / "train.log").read_text()
        logs.setup_logging()
        assert not logs.console_quiet()
        log.info("loud again")
        assert "loud again" in capsys.readouterr().err
    finally:
        log.handlers[:] = handlers
        log.setLevel(level)
    assert logging.getLogger("mtcli").level == level


def test_a_run_log_puts_back_the_level_a_host_program_set(tmp_path) -> None:
    """train() from a program that set mtcli's logger to WARNING left it at INFO for good."""
    import logging

    log = logs.get_logger()
    level = log.level
    try:
        log.setLevel(logging.WARNING)
        handler = logs.add_file_log(tmp_path / "train.log")
        assert log.level == logging.INFO  # (the run's log gets its lines meanwhile)
        logs.remove_log_handler(handler)
        assert log.level == logging.WARNING
    finally:
        log.setLevel(level)


def test_verbose_says_first_what_a_bug_report_needs(capsys) -> None:
    """-v logged one message in the whole package (an fp16 loss-scale change): it did nothing."""
    log = logs.get_logger()
    level, handlers = log.level, list(log.handlers)
    try:
        logs.setup_logging(verbose=True)
        err = capsys.readouterr().err
        assert "| DEBUG | mtcli " in err and "| Python " in err and "| torch " in err and " cores" in err
        logs.setup_logging()
        assert capsys.readouterr().err == ""
    finally:
        log.handlers[:] = handlers
        log.setLevel(level)
