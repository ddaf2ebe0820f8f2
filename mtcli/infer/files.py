"""``mtcli translate`` and ``mtcli score``: files or standard input, streamed, through a :class:`Translator`.

:func:`translate_files` reads every input strictly as UTF-8 (regular files, ``.gz`` files, and the
streams a shell passes: ``<(zcat news.gz)``, named pipes, ``/dev/stdin``), writes stdout line by
line or a file atomically, shows a progress bar for file inputs, and can plot cross-attention
heatmaps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import stat
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from mtcli.config import DecodeConfig
from mtcli.data.textio import ArrivingLines, count_lines, iter_binary_lines, read_lines
from mtcli.data.tokenizer import Tokenizer
from mtcli.errors import DataError
from mtcli.fileio import (
    atomic_write,
    check_directory,
    file_stamp,
    is_stream,
    named_after,
    sha256_file,
    written_path,
)
from mtcli.infer.resumable import PartialOutput, output_locked, resumable_output, translation_key
from mtcli.infer.translate import DEFAULT_WINDOW, Translation, line_windows, override_keys
from mtcli.infer.translator import SAMPLING_ONLY, Translator
from mtcli.logs import get_logger, progress
from mtcli.plots import plot_attention_png
from mtcli.rundir import run_file_role

#: Lines read and decoded together; a file output is committed to disk after each such window
#: (:mod:`mtcli.infer.resumable`), so an interrupted translation goes on from the last one.
WINDOW = DEFAULT_WINDOW

#: Decode settings that only say how a window's lines are batched and run, left out of the key
#: an interrupted output is resumed by: the same command with a lower ``decode.max_tokens``
#: (after running out of memory) or other ``decode.workers`` goes on, since a sentence's
#: translation does not depend on its batch (but for decode.bf16 on a CPU, decode.shortlist and,
#: nearly, decode.int8: docs/decoding.md).
BATCHING_ONLY = ("max_tokens", "workers")


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


def _check_io(inputs: Sequence[str | Path], output: Path | None, plot_attention: Path | None,
              what: str = "translation") -> None:
    """Refuse, before any work: an output that is one of the inputs (its translation would
    replace it), a closed standard input or output that would be read or written, and an
    attention directory that cannot be made. ``what``: the output, in the errors' words."""
    if not inputs and sys.stdin is None:
        raise DataError("<stdin>: closed; give input files, or lines on standard input")
    if output is not None:
        same = _input_at(inputs, os.stat(output)) if Path(output).exists() else None
        if same is not None:
            raise DataError(f"{output}: is the input {same}; write the {what} to another file")
        role = run_file_role(Path(output).resolve())
        if role is not None:
            raise DataError(f"{output}: {role}, a file of a run; write the {what} to another file")
        if Path(output).suffix.lower() == ".gz" and not is_stream(output):  # read back, it would be taken for gzip
            raise DataError(f"{output}: the {what} is written as plain text; name the output without .gz (and gzip "
                            "it after, or pipe it: | gzip > FILE.gz)")
    elif sys.stdout is None:
        raise DataError("<stdout>: closed; give an output file (-o)")
    else:
        _check_stdout_is_no_input(inputs, what)
    if plot_attention is not None:
        check_directory(Path(plot_attention))
        try:
            Path(plot_attention).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"{plot_attention}: cannot make the directory for the attention plots "
                            f"({exc.strerror or exc})") from None


def _input_at(inputs: Sequence[str | Path], written: os.stat_result) -> Path | None:
    """The input that is the file ``written`` describes (the same device and inode), if any."""
    for path in map(Path, inputs):
        try:
            found = path.stat()
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (written.st_dev, written.st_ino):
            return path
    return None


def _check_stdout_is_no_input(inputs: Sequence[str | Path], what: str = "translation") -> None:
    """Refuse standard output that is one of the input files (``translate f >> f``: each
    translated line is read again, and the file grows until the disk is full; ``what``: the
    output, in the error's words)."""
    try:
        out = os.fstat(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no file behind it (a test's buffer)
        return
    same = _input_at(inputs, out) if stat.S_ISREG(out.st_mode) else None
    if same is not None:
        raise DataError(f"{same}: is also standard output (>> {same}); write the {what} to another file")


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The input files as they were when the translation began: each one's size, modification
    time and inode (what shows a rewrite) and sha256 (what an output is keyed on)."""

    paths: list[Path]
    states: list[tuple[int, int, int] | None]
    digests: list[str]

    @classmethod
    def read(cls, paths: Sequence[str | Path]) -> _Inputs:
        return cls([Path(p) for p in paths], [file_stamp(Path(p)) for p in paths], [sha256_file(p) for p in paths])

    def check_unchanged(self, partial: PartialOutput | None, command: str = "translate") -> None:
        """:class:`DataError` naming an input rewritten while ``command`` read it (the lines read
        after it came from the new text, from the middle of a line: neither file's output), and
        nothing of ``partial`` kept for a later run. One touched, or deleted (its open file was
        read to the end), is fine."""
        for path, state, digest in zip(self.paths, self.states, self.digests, strict=True):
            now = file_stamp(path)
            if now is not None and now != state and sha256_file(path) != digest:
                if partial is not None:
                    partial.discard()
                raise DataError(f"{path}: changed while {command} read it; {command} it again once it is written")


def warn_of_unused_sampling(overrides: Sequence[str], decode: DecodeConfig,
                            instead: str = "this translation searches (add --sampling topk or topp)") -> None:
    """A sampling setting ``--set`` gives (a default for when sampling is asked for, as a server's
    requests do) to a decoding that searches changes nothing: said (with what it does
    ``instead``), not silently dropped."""
    unused = sorted(k for k in override_keys(overrides) if k.removeprefix("decode.") in SAMPLING_ONLY)
    if unused and decode.sampling == "none":
        get_logger().warning("%s: for sampling only, and %s: it changes nothing", ", ".join(unused), instead)


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
        if str(path) == "-" and not path.exists():
            raise DataError("-: standard input is read alone (- with no file beside it), or give it as /dev/stdin")
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
    is given (or a ``decode.nbest`` override, or the run's ``decode.nbest`` is above 1), exactly
    ``N`` lines per input line instead, best first,
    each ``score<TAB>text`` with the length-penalised log-probability to 4 decimals (empty input
    lines give ``0.0000<TAB>`` then ``-inf<TAB>`` padding). Stdout gets each line as soon as it
    is ready; a file output grows under another name and is renamed at the end, so it is never
    partial. When files are translated, the output of each finished window is kept on an error
    or an interrupt, and the same call goes on from there (:mod:`mtcli.infer.resumable`).
    ``plot_attention`` writes ``<DIR>/<line:06d>.png`` per non-empty input line (no older ones stay).
    ``ensemble``: more members decoded with the run's model (run directories or checkpoint
    files, see :func:`mtcli.infer.ensemble.add_members`). ``engine``: ``torch`` or ``ctranslate2``.
    Returns a summary dict (lines, checkpoint, seconds, sentences_per_s, output, resumed_after:
    the input lines a resumed run found done).
    """
    overrides = list(overrides or [])
    _check_io(inputs, output, plot_attention)  # before the model is loaded
    translator = Translator.from_run(run_dir, checkpoint, ensemble=ensemble, engine=engine, overrides=overrides,
                                     **settings)
    decode = translator.decode
    warn_of_unused_sampling(overrides, decode)
    _say_the_default_target(translator, settings.get("tgt_lang"), overrides)
    scored = decode.nbest > 1 or settings.get("nbest") is not None or "decode.nbest" in override_keys(overrides)
    stack = contextlib.ExitStack()
    sources = open_inputs(inputs, stack)
    regular = bool(inputs) and not any(isinstance(lines, ArrivingLines) for _, lines in sources)
    files = _Inputs.read(inputs) if regular else None
    counts = [count_lines(p) for p in inputs] if regular else None
    n_lines = 0
    bar = None

    def run(handle: IO[str], flush: bool, partial: PartialOutput | None = None) -> None:
        nonlocal n_lines, bar
        done = partial.done if partial is not None else 0
        bar = progress(total=sum(counts) if counts is not None else None, initial=done, unit="line",
                       enabled=_bar_wanted(inputs, output), desc="translate")
        for name, lines, in_file in _left(sources, counts, done):
            for nbest in translator.stream(lines, name=name, on_done=bar.update, window=WINDOW, offset=in_file,
                                           return_attention=plot_attention is not None):
                n_lines, in_file, done = n_lines + 1, in_file + 1, done + 1
                handle.writelines(text + "\n" for text in format_nbest(nbest, decode.nbest, scored))
                if flush:
                    handle.flush()
                if plot_attention is not None:
                    _plot(translator.bundle.tokenizer, nbest[0], Path(plot_attention) / f"{done:06d}.png")
                if partial is not None and in_file % WINDOW == 0:
                    partial.commit(done)
            if partial is not None:
                partial.commit(done)
        if plot_attention is not None:
            _drop_plots_after(Path(plot_attention), done)
        if files is not None:
            files.check_unchanged(partial)

    start = time.perf_counter()
    searched = {k: v for k, v in dataclasses.asdict(decode).items() if k not in BATCHING_ONLY}
    settings = {"decode": searched, "engine": engine, "scored": scored, "window": WINDOW}
    try:
        with _naming_stdout(output), _opened(output, files, translator, settings) as (handle, partial):
            resumed = partial.done if partial is not None else 0
            run(handle, flush=output is None, partial=partial)
    finally:
        if bar is not None:
            bar.close()
        stack.close()
    return _summary(n_lines, time.perf_counter() - start, translator.name, output, resumed)


def _say_the_default_target(translator: Translator, tgt_lang: str | None, overrides: list[str],
                            scoring: bool = False) -> None:
    """Say which language a model of several target languages translates into when none was
    asked for (a German source into German, silently, looked like a failed translation); with
    ``scoring``, warn that the targets are scored as that language's (wrong numbers look right)."""
    targets = translator.target_languages
    if len(targets) > 1 and tgt_lang is None and "decode.tgt_lang" not in override_keys(overrides):
        if scoring:
            get_logger().warning("scoring the targets as %s, the run's default (--tgt-lang names their language: "
                                 "%s)", targets[0], ", ".join(targets))
        else:
            get_logger().info("translating into %s, the run's default (--tgt-lang chooses: %s)", targets[0],
                              ", ".join(targets))


def _bar_wanted(inputs: Sequence[str | Path], output: Path | None) -> bool:
    """Whether translating ``inputs`` into ``output`` shows a bar: for files (not stdin), and not
    over translations written to the terminal (they show the progress, and each would start on
    the bar's row)."""
    return bool(inputs) and not (output is None and sys.stdout.isatty())


@contextlib.contextmanager
def _naming_stdout(output: Path | None) -> Iterator[None]:
    """A write to standard output (``output`` None) that fails names no file (``> /dev/full``):
    the error names ``<stdout>``. A closed pipe (``| head``) is left as it is."""
    try:
        yield
    except OSError as exc:
        renamed = None if output is not None or isinstance(exc, BrokenPipeError) else named_after(exc, "<stdout>")
        if renamed is None:
            raise
        raise renamed from None


def _summary(lines: int, seconds: float, name: str, output: Path | None, resumed: int) -> dict:
    """What :func:`translate_files` returns, and its log line."""
    summary = {
        "lines": lines,
        "checkpoint": name,
        "seconds": round(seconds, 3),
        "sentences_per_s": round(lines / seconds, 2) if seconds > 0 else None,
        "output": str(output) if output is not None else "<stdout>",
        "resumed_after": resumed,
    }
    get_logger().info("translated %d lines in %.1fs (%s sent/s) with %s", lines, seconds,
                      summary["sentences_per_s"], name)
    return summary


def _left(sources: list[tuple[str, Iterable[str]]], counts: list[int] | None,
          done: int) -> Iterator[tuple[str, Iterable[str], int]]:
    """The inputs without their first ``done`` lines in all (those a resumed run found done):
    each one's name, lines and how many of its lines that leaves out (``counts``: the inputs'
    line counts, None for streams, where ``done`` is 0)."""
    for k, (name, lines) in enumerate(sources):
        skip = min(done, counts[k]) if counts is not None else 0
        done -= skip
        if counts is None or skip < counts[k]:
            yield name, itertools.islice(lines, skip, None) if skip else lines, skip


@contextlib.contextmanager
def _opened(output: Path | None, inputs: _Inputs | None, translator: Translator,
            settings: dict[str, Any]) -> Iterator[tuple[IO[str], PartialOutput | None]]:
    """Where the translations go: stdout; a file written at once (the input is a stream, read
    once); or, for ``inputs`` files, a file a later run goes on with when this one is
    interrupted (:mod:`mtcli.infer.resumable`, keyed on the inputs, the model and ``settings``)."""
    if output is None:
        # UTF-8, as the input is read and -o is written, whatever the locale (Latin-1 could not
        # write most translations, and wrote others in bytes a UTF-8 reader refuses)
        if (sys.stdout.encoding or "").lower().replace("-", "") != "utf8" and hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(encoding="utf-8")
        yield sys.stdout, None
    elif is_stream(output):  # a device or pipe (/dev/null) is written as a stream
        with atomic_write(output, follow=True) as handle:
            yield handle, None
    elif inputs is None:  # a stream's translation, written at once; no other run writes it meanwhile
        with output_locked(written_path(output)), atomic_write(output, follow=True) as handle:
            yield handle, None
    else:
        key = translation_key(translator.bundle.model, inputs.digests, settings)
        with resumable_output(written_path(output), key) as partial:
            yield partial.handle, partial


def _drop_plots_after(directory: Path, lines: int) -> None:
    """Remove the plots an earlier, longer translation left in ``directory`` (``NNNNNN.png``
    numbered past ``lines``): every plot there is then of this input."""
    for path in directory.glob("*.png"):
        if path.stem.isascii() and path.stem.isdigit() and len(path.stem) >= 6 and int(path.stem) > lines:
            path.unlink(missing_ok=True)


def _plot(tokenizer: Tokenizer, best: Translation, path: Path) -> None:
    """The cross-attention heatmap of one translation (:func:`mtcli.plots.plot_attention_png`);
    for an empty line (no attention), no plot: an older one of that number is removed."""
    if best.attention is None:
        path.unlink(missing_ok=True)
        return
    plot_attention_png(path, [tokenizer.id_to_piece(t) for t in best.source_tokens or []],
                       [tokenizer.id_to_piece(t) for t in best.tokens], best.attention)


def score_files(run_dir: str | Path, source: Path, target: Path, output: Path | None, checkpoint: str = "best",
                overrides: list[str] | None = None, *, normalize: bool = False, **settings: Any) -> dict:
    """``mtcli score``: log p(target | source) of each pair of lines of ``source`` and ``target``
    (:meth:`~mtcli.infer.translator.Translator.score`; ``normalize``: a piece's mean), one number
    a line to 4 decimals, into ``output`` or stdout. A target longer than the model can produce
    scores ``-inf``. Files of different line counts are refused before the model is loaded
    (streams when one ends first). A file output is never partial; scored from files, it is kept
    window by window on an interruption, and the same command goes on from there, as
    ``translate`` does (:mod:`mtcli.infer.resumable`). ``settings``: ``max_tokens``,
    ``tgt_lang``, ``device``, ``average_last``, ``average_best`` as :meth:`Translator.from_run`
    takes them. Returns a summary dict (pairs, checkpoint, seconds, pairs_per_s, output, resumed_after)."""
    inputs = [Path(source), Path(target)]
    _check_io(inputs, output, None, "score list")
    _check_two_inputs(*inputs)
    stack = contextlib.ExitStack()
    (src_name, src_lines), (tgt_name, tgt_lines) = open_inputs(inputs, stack)
    regular = all(_is_regular(path) for path in inputs)
    counts = [count_lines(path) for path in inputs] if regular else None
    if counts is not None and counts[0] != counts[1]:
        stack.close()
        raise DataError(f"{source}: {counts[0]} lines but {target}: {counts[1]}; score takes one target line per "
                        "source line")
    files = _Inputs.read(inputs) if regular else None
    try:
        translator = Translator.from_run(run_dir, checkpoint, overrides=list(overrides or []), **settings)
        _say_the_default_target(translator, settings.get("tgt_lang"), list(overrides or []), scoring=True)
        decode = translator.decode
        key = {"command": "score", "normalize": normalize, "tgt_lang": decode.tgt_lang, "bf16": decode.bf16}
        start = time.perf_counter()
        with _naming_stdout(output), _opened(output, files, translator, key) as (handle, partial):
            done = partial.done if partial is not None else 0
            bar = progress(total=counts[0] if counts else None, initial=done, unit="pair",
                           enabled=_bar_wanted(inputs, output), desc="score")
            with bar:
                pairs = done
                if done:  # (files: a stream is never resumed)
                    src_lines, tgt_lines = (itertools.islice(lines, done, None) for lines in (src_lines, tgt_lines))
                for srcs, tgts in _paired_windows(src_lines, tgt_lines, src_name, tgt_name, done):
                    scores = translator.score(srcs, tgts, normalize=normalize, names=(src_name, tgt_name),
                                              first_line=pairs + 1)
                    handle.writelines(f"{value:.4f}\n" for value in scores)
                    pairs += len(scores)
                    if partial is not None:
                        partial.commit(pairs)
                    elif output is None:
                        handle.flush()
                    bar.update(len(scores))
            if files is not None:
                files.check_unchanged(partial, "score")
    finally:
        stack.close()
    seconds = time.perf_counter() - start
    rate = round((pairs - done) / seconds, 2) if seconds > 0 else None
    get_logger().info("scored %d pairs in %.1fs (%s pairs/s) with %s", pairs - done, seconds, rate, translator.name)
    return {"pairs": pairs, "checkpoint": translator.name, "seconds": round(seconds, 3), "pairs_per_s": rate,
            "output": str(output) if output is not None else "<stdout>", "resumed_after": done}


def _check_two_inputs(source: Path, target: Path) -> None:
    """Refuse, before reading: ``-`` (standard input is one of two inputs here: ``/dev/stdin``
    names it), and one stream given as both (``/dev/stdin /dev/stdin``: the two readers would
    share its lines between them and pair lines that are not a pair)."""
    for path in (source, target):
        if str(path) == "-" and not path.exists():
            raise DataError("-: score reads a source and a target file; give standard input as /dev/stdin")
    if _is_regular(source) or _is_regular(target):
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(source, target):
            raise DataError(f"{source} and {target}: one stream given as both; give the sources and the targets "
                            "as two files or streams")


def _paired_windows(sources: Iterable[str], targets: Iterable[str], src_name: str, tgt_name: str,
                    skipped: int = 0) -> Iterator[tuple[list[str], list[str]]]:
    """The lines of two inputs (after their first ``skipped``) as pairs, :data:`WINDOW` at a time,
    or, from a stream (:class:`ArrivingLines`), the pairs whose lines have arrived, as
    ``translate`` answers a stream's lines: a program that writes a pair and waits for its score
    gets it. :class:`DataError` naming the input that ends first (a stream, whose lines were not
    counted before)."""
    swapped = isinstance(targets, ArrivingLines) and not isinstance(sources, ArrivingLines)
    lead, follow = (targets, iter(sources)) if swapped else (sources, iter(targets))
    names = (tgt_name, src_name) if swapped else (src_name, tgt_name)
    line = skipped
    for chunk in line_windows(lead, WINDOW):
        other = list(itertools.islice(follow, len(chunk)))
        if len(other) < len(chunk):
            _unpaired(names[1], line + len(other), names[0])
        line += len(chunk)
        yield (other, chunk) if swapped else (chunk, other)
    if next(follow, None) is not None:
        _unpaired(names[0], line, names[1])


def _unpaired(short: str, lines: int, other: str) -> NoReturn:
    """:class:`DataError`: ``short`` ends after ``lines`` lines while ``other`` goes on."""
    raise DataError(f"{short}: ends at line {lines}, but {other} goes on; score takes one target line per source line")
