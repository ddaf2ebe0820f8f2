"""Pictures: a run's learning curves, and cross-attention heatmaps of translations.

``write_learning_curves(run_dir)`` writes ``learning_curves.png`` beside ``tensorboard/``:
train loss and valid loss over steps (left axis) and valid BLEU (right panel), read back from
the run's TensorBoard scalars. ``plot_attention_png`` draws ``mtcli translate --plot-attention``.
matplotlib and TensorBoard's reader are imported when a picture is drawn (they are slow to import
and no other command needs them).
"""

from __future__ import annotations

import functools
import io
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from mtcli.fileio import atomic_write
from mtcli.logs import get_logger

TRAIN_LOSS, VALID_LOSS, VALID_BLEU, VALID_CHRF = "train/loss", "valid/loss", "valid/bleu", "valid/chrf"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _not_a_restart(record: logging.LogRecord) -> bool:
    """Leave out TensorBoard's note that it drops the steps a resumed run trains again (it
    takes the resume for "a TensorFlow restart"): expected, not news. Its other warnings stay."""
    return "TensorFlow restart" not in record.getMessage()


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series in a TensorBoard log directory as ``tag -> [(step, value), ...]``.

    When a run was resumed, a step logged twice keeps its last value.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    said = logging.getLogger("tensorboard")
    said.addFilter(_not_a_restart)
    try:
        acc.Reload()
    finally:
        said.removeFilter(_not_a_restart)
    series: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        by_step = {event.step: float(event.value) for event in acc.Scalars(tag)}
        series[tag] = sorted(by_step.items())
    return series


def plot_learning_curves(series: dict[str, list[tuple[int, float]]], title: str = "") -> bytes:
    """Render train/valid loss, and valid BLEU and chrF, against steps; returns PNG bytes."""
    plt = _pyplot()
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(11, 4))
    for tag, label in ((TRAIN_LOSS, "train loss"), (VALID_LOSS, "valid loss")):
        if series.get(tag):
            steps, values = zip(*series[tag], strict=True)
            ax_loss.plot(steps, values, label=label, marker="." if tag == VALID_LOSS else None)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("label-smoothed loss per token")
    ax_loss.grid(alpha=0.3)
    if ax_loss.lines:
        ax_loss.legend()
    for tag, label, color in ((VALID_BLEU, "valid BLEU (greedy)", "tab:green"),
                              (VALID_CHRF, "valid chrF (greedy)", "tab:purple")):
        if series.get(tag):
            steps, values = zip(*series[tag], strict=True)
            ax_bleu.plot(steps, values, marker="o", color=color, label=label)
    if ax_bleu.lines:
        ax_bleu.legend()
    else:
        ax_bleu.text(0.5, 0.5, "no validation BLEU logged", ha="center", va="center")
    ax_bleu.set_xlabel("step")
    ax_bleu.set_ylabel("BLEU / chrF" if series.get(VALID_CHRF) else "BLEU")
    ax_bleu.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def write_learning_curves(run_dir: str | Path) -> Path | None:
    """Write ``<run_dir>/learning_curves.png`` from ``<run_dir>/tensorboard``; None if no scalars."""
    run_dir = Path(run_dir)
    series = read_scalars(run_dir / "tensorboard")
    if not any(series.get(tag) for tag in (TRAIN_LOSS, VALID_LOSS, VALID_BLEU)):
        return None
    out = run_dir / "learning_curves.png"
    with atomic_write(out, "wb") as handle:
        handle.write(plot_learning_curves(series, title=run_dir.name))
    return out


def plot_attention_png(
    path: Path, src_pieces: list[str], tgt_pieces: list[str], attention: torch.Tensor
) -> None:
    """Write a PNG heatmap of cross-attention: one panel per decoder layer, head-averaged.

    ``attention`` is ``[layers, T, S]``; rows are target pieces (the output, then ``</s>``),
    columns source pieces (then ``</s>``); batch padding beyond them is dropped.
    """
    plt = _pyplot()
    att = attention.float().cpu().numpy()
    # Drop batch padding columns (and rows) beyond the pieces plus </s>.
    att = att[:, : len(tgt_pieces) + 1, : len(src_pieces) + 1]
    layers, t_len, s_len = att.shape
    xs = (src_pieces + ["</s>"] * s_len)[:s_len]
    ys = (tgt_pieces + ["</s>"] * t_len)[:t_len]
    fig, axes = plt.subplots(
        1, layers, figsize=(max(3.0, 0.35 * s_len + 1.5) * layers, max(2.5, 0.35 * t_len + 1.5)),
        squeeze=False,
    )
    for layer, ax in enumerate(axes[0]):
        image = ax.imshow(att[layer], aspect="auto", cmap="viridis", vmin=0.0)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(f"decoder layer {layer + 1}")
        ax.set_xticks(range(s_len), xs, rotation=90, fontsize=7)
        ax.set_yticks(range(t_len), ys, fontsize=7)
        ax.set_xlabel("source")
        if layer == 0:
            ax.set_ylabel("target")
    # (the labels are drawn when the figure is: a glyph no font has warns then, once each)
    with warnings.catch_warnings(record=True) as caught, plt.rc_context({"font.family": _font_families()}):
        warnings.simplefilter("always")
        fig.tight_layout()
        with atomic_write(path, "wb", encoding=None) as handle:
            fig.savefig(handle, format="png", dpi=100)
    plt.close(fig)
    if any("missing from font" in str(w.message) for w in caught):
        _say_missing_glyphs()
    for other in (w for w in caught if "missing from font" not in str(w.message)):
        text = str(other.message)
        if text not in _WARNED:
            _WARNED.add(text)
            get_logger().warning("attention plots: %s", text)


#: Fonts whose glyphs a label takes where matplotlib's own (DejaVu Sans) has none, when installed.
FALLBACK_FONTS = ("Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans Arabic", "Noto Sans Hebrew",
                  "Noto Sans Devanagari", "Noto Sans Thai")
_WARNED: set[str] = set()  # matplotlib's other warnings, each said once a process


@functools.cache
def _font_families() -> tuple[str, ...]:
    """DejaVu Sans, then the :data:`FALLBACK_FONTS` installed: matplotlib draws each glyph in
    the first of them that has it."""
    from matplotlib import font_manager

    installed = {font.name for font in font_manager.fontManager.ttflist}
    return ("DejaVu Sans", *(name for name in FALLBACK_FONTS if name in installed))


@functools.cache
def _say_missing_glyphs() -> None:
    """One warning a process: the pieces of a script no font at hand has show as boxes."""
    get_logger().warning("attention plots: no font at hand has glyphs for some pieces, which show as boxes (install "
                         "one of %s: Debian's fonts-noto-cjk for Chinese and Japanese, fonts-noto-core for others)",
                         ", ".join(FALLBACK_FONTS))
