"""Learning curves are read back from real TensorBoard event files and drawn as a PNG."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from mtcli.plots import VALID_CHRF, plot_learning_curves, read_scalars, write_learning_curves


def _write_events(logdir: Path) -> None:
    writer = SummaryWriter(str(logdir))
    for step in range(1, 21):
        writer.add_scalar("train/loss", 10.0 / step, step)
        if step % 5 == 0:
            writer.add_scalar("valid/loss", 8.0 / step, step)
            writer.add_scalar("valid/bleu", 2.0 * step, step)
    writer.add_scalar("valid/bleu", 99.0, 20)  # a resumed run re-logging step 20
    writer.close()


def test_read_scalars_keeps_last_value_per_step(tmp_path: Path) -> None:
    _write_events(tmp_path / "tensorboard")
    series = read_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in series["valid/bleu"]] == [5, 10, 15, 20]
    assert series["valid/bleu"][-1] == (20, 99.0)
    assert len(series["train/loss"]) == 20


def test_write_learning_curves_png(tmp_path: Path) -> None:
    _write_events(tmp_path / "tensorboard")
    out = write_learning_curves(tmp_path)
    assert out == tmp_path / "learning_curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chrf_is_drawn_beside_bleu(tmp_path: Path) -> None:
    _write_events(tmp_path / "tensorboard")
    series = read_scalars(tmp_path / "tensorboard")
    without = plot_learning_curves(series)
    assert plot_learning_curves(series) == without  # the same series draw the same picture
    assert plot_learning_curves({**series, VALID_CHRF: [(5, 30.0), (10, 35.0)]}) != without


def test_no_scalars_no_picture(tmp_path: Path) -> None:
    (tmp_path / "tensorboard").mkdir()
    assert write_learning_curves(tmp_path) is None
    assert not (tmp_path / "learning_curves.png").exists()


def test_a_resumed_run_reads_its_curves_without_tensorboards_purge_message(tmp_path: Path, caplog) -> None:
    """Resumed from an older checkpoint, a run's events restart at its step: TensorBoard drops
    the steps trained again (right) and printed a note about a TensorFlow restart to stderr."""
    import time

    logdir = tmp_path / "tensorboard"
    with SummaryWriter(str(logdir)) as writer:
        for step in range(1, 8):
            writer.add_scalar("train/loss", float(step), step)
    time.sleep(1.1)  # another event file (they are named by the second)
    with SummaryWriter(str(logdir), purge_step=4) as writer:
        for step in (4, 5):
            writer.add_scalar("train/loss", 10.0 + step, step)
    assert read_scalars(logdir)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]
    assert "TensorFlow" not in caplog.text


def test_pieces_the_font_lacks_are_one_logged_warning(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """matplotlib printed a UserWarning for each Chinese glyph its font lacked, outside mtcli's log
    (a private-use character here: no font has it)."""
    import warnings

    import torch

    from mtcli.plots import _say_missing_glyphs, plot_attention_png

    _say_missing_glyphs.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none escapes
        for name in ("a.png", "b.png"):
            plot_attention_png(tmp_path / name, ["▁\ue000", "\ue001"], ["▁a", "▁cat"], torch.rand(1, 3, 3))
    said = [r.getMessage() for r in caplog.records if "has glyphs for some pieces" in r.getMessage()]
    assert len(said) == 1 and (tmp_path / "b.png").stat().st_size > 0, said


def test_matplotlibs_other_warnings_are_logged_once(tmp_path: Path, caplog, monkeypatch) -> None:  # noqa: ANN001
    """A matplotlib warning other than a missing glyph goes to mtcli's log, once a process, not to
    stderr in Python's warning format."""
    import warnings

    import torch
    from matplotlib.figure import Figure

    import mtcli.plots
    from mtcli.plots import plot_attention_png

    monkeypatch.setattr(mtcli.plots, "_WARNED", set())  # (once a process: a test before may have had it said)

    def tight_layout(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        warnings.warn("Tight layout not applied", UserWarning, stacklevel=1)

    monkeypatch.setattr(Figure, "tight_layout", tight_layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none escapes as a Python warning
        for name in ("a.png", "b.png"):
            plot_attention_png(tmp_path / name, ["▁a"], ["▁b"], torch.rand(1, 1, 1))
    said = [r.getMessage() for r in caplog.records if "Tight layout" in r.getMessage()]
    assert said == ["attention plots: Tight layout not applied"]
