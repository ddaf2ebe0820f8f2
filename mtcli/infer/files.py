"""``mtcli translate``: translate files or standard input, streamed, through a :class:`Translator`.

:func:`translate_files` reads every input strictly as UTF-8 (regular files, ``.gz`` files, and the
streams a shell passes: ``<(zcat news.gz)``, named pipes, ``/dev/stdin``), writes stdout line by
line or a file atomically, shows a progress bar for file inputs, and can plot cross-attention
heatmaps.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from mtcli.data.textio import ArrivingLines, count_lines, iter_binary_lines, read_lines
from mtcli.data.tokenizer import Tokenizer
from mtcli.errors import DataError
from mtcli.fileio import atomic_write, check_directory
from mtcli.infer.translate import Translation
from mtcli.infer.translator import Translator
from mtcli.logs import get_logger, progress
from mtcli.plots import plot_attention_png


def format_nbest(nbest: list[Translation], n: int, scored: bool) -> list[str]:
    """Output lines for one input: the best text, or exactly ``n`` ``score<TAB>text`` lines.

    With scores, lines come best first with the score printed to 4 decimals; an empty input (or
    a search that found fewer than ``n`` hypotheses) is padded with ``-inf<TAB>`` lines, except
    that an empty input's first line reads ``0.0000<TAB>``.
    """
    if not scored:
        return [nbest[0].text if nbest else ""]
    out = [f"{t.score:.4f}\t{t.text}" for t in nbest[:n]]
    out.extend("-inf\t" for _ in range(n - len(out)))
    return out


def _stdin_lines() -> Iterable[str]:
    """Standard input's lines: a redirected file read straight through, a pipe or terminal as its
    lines arrive (each translated without waiting for a full window, see :class:`ArrivingLines`)."""
    stdin = sys.stdin.buffer
    try:
        regular = stat.S_ISREG(os.fstat(stdin.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's stand-in stream)
        regular = True
    return iter_binary_lines(stdin, "<stdin>") if regular else ArrivingLines(stdin, "<stdin>")


def _is_regular(path: Path) -> bool:
    """A regular file (read straight through, counted for the progress bar), not a stream."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_inputs(inputs: Sequence[str | Path], stack: contextlib.ExitStack) -> list[tuple[str, Iterable[str]]]:
    """``(name, lines)`` of each input, or of standard input when there is none; every input is
    checked before any is read, with one line naming it (not found, a directory).

    A regular file is read as text (``.gz`` gunzipped); anything else a shell can name is read as
    the stream it is, its lines handed over as they arrive (:class:`ArrivingLines`): ``<(zcat
    news.gz)``, a named pipe, ``/dev/stdin``, ``/dev/null``. Streams are opened here (a named
    pipe's open waits for its writer) and closed by ``stack``."""
    for path in map(Path, inputs):
        if path.is_dir():
            raise DataError(f"{path}: is a directory, expected a text file")
        if not path.exists():
            raise DataError(f"{path}: input file not found")
    if not inputs:
        return [("<stdin>", _stdin_lines())]
    opened: list[tuple[str, Iterable[str]]] = []
    for path in map(Path, inputs):
        if _is_regular(path):
            opened.append((str(path), read_lines(path)))
            continue
        try:
            handle = stack.enter_context(open(path, "rb", buffering=0))
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
        opened.append((str(path), ArrivingLines(handle, str(path))))
    return opened


def translate_files(
    run_dir: str | Path,
    inputs: list[Path],
    output: Path | None,
    checkpoint: str = "best",
    overrides: list[str] | None = None,
    plot_attention: Path | None = None,
    ensemble: Sequence[str | Path] = (),
    engine: str = "torch",
    **settings: Any,
) -> dict:
    """Translate files (or stdin when ``inputs`` is empty) to ``output`` (or stdout).

    ``settings``: typed decode settings (``beam``, ``nbest``, ``max_tokens``, ... as
    :class:`~mtcli.infer.translator.Translator` takes them); ``overrides``: ``--set decode.*``
    strings. Output format: one line per input line with the best translation; when ``nbest``
    is given (or a ``decode.nbest`` override), exactly ``N`` lines per input line instead, best first,
    each ``score<TAB>text`` with the length-penalised log-probability to 4 decimals (empty input
    lines give ``0.0000<TAB>`` then ``-inf<TAB>`` padding). Stdout gets each line as soon as it
    is ready; a file output is written to a temporary name and renamed at the end, so an error
    (e.g. invalid UTF-8 at some input line: :class:`DataError` naming file and line) leaves no
    partial file. ``plot_attention`` writes ``<DIR>/<line:06d>.png`` per non-empty input line.
    ``ensemble``: more members decoded with the run's model (run directories or checkpoint
    files, see :func:`mtcli.infer.ensemble.add_members`). ``engine``: ``torch`` or ``ctranslate2``.
    Returns a summary dict (lines, checkpoint, seconds, sentences_per_s, output).
    """
    overrides = list(overrides or [])
    if plot_attention is not None:
        check_directory(Path(plot_attention))  # before the model is loaded
    translator = Translator.from_run(run_dir, checkpoint, ensemble=ensemble, engine=engine, overrides=overrides,
                                     **settings)
    decode = translator.decode
    scored = settings.get("nbest") is not None or any(o.split("=", 1)[0].strip() == "decode.nbest" for o in overrides)
    stack = contextlib.ExitStack()
    sources = open_inputs(inputs, stack)
    regular = bool(inputs) and not any(isinstance(lines, ArrivingLines) for _, lines in sources)
    total = sum(count_lines(p) for p in inputs) if regular else None
    bar = progress(total=total, enabled=bool(inputs), unit="line", desc="translate")
    n_lines = 0
    start = time.perf_counter()

    def run(handle: IO[str], flush: bool) -> None:
        nonlocal n_lines
        for name, lines in sources:
            for nbest in translator.stream(lines, name=name, on_done=bar.update,
                                           return_attention=plot_attention is not None):
                n_lines += 1
                handle.writelines(text + "\n" for text in format_nbest(nbest, decode.nbest, scored))
                if flush:
                    handle.flush()
                if plot_attention is not None and nbest[0].attention is not None:
                    _plot(translator.bundle.tokenizer, nbest[0], Path(plot_attention) / f"{n_lines:06d}.png")

    try:
        if output is None:
            run(sys.stdout, flush=True)
        else:
            with atomic_write(output) as handle:
                run(handle, flush=False)
    finally:
        bar.close()
        stack.close()
    seconds = time.perf_counter() - start
    summary = {
        "lines": n_lines,
        "checkpoint": translator.name,
        "seconds": round(seconds, 3),
        "sentences_per_s": round(n_lines / seconds, 2) if seconds > 0 else None,
        "output": str(output) if output is not None else "<stdout>",
    }
    get_logger().info("translated %d lines in %.1fs (%s sent/s) with %s", n_lines, seconds,
                      summary["sentences_per_s"], translator.name)
    return summary


def _plot(tokenizer: Tokenizer, best: Translation, path: Path) -> None:
    """The cross-attention heatmap of one translation (:func:`mtcli.plots.plot_attention_png`)."""
    plot_attention_png(path, [tokenizer.id_to_piece(t) for t in best.source_tokens or []],
                       [tokenizer.id_to_piece(t) for t in best.tokens], best.attention)
