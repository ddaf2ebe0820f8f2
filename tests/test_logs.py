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
