"""The ``mtcli`` command line's shared options: how a value is read (refused when it is another
option, or an empty path) and the options several commands take alike."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from mtcli.settings import DECODE_RANGES, DecodeConfig


def plain_value(value: str) -> str:
    """An option's value, refused when it is another option: click takes the word after an
    option as its value whatever it is, so ``--seeds $SEEDS --valid-only`` with an empty
    variable read ``--valid-only`` as the seeds."""
    if value.startswith("--"):
        raise typer.BadParameter(f"{value} is an option, not a value (an empty shell variable?); give the value")
    return value


SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--set", help="Override a config key: section.key=value (repeatable)."),
]
DecodeSetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--set", help="Override a decode setting of the run: decode.key=value (repeatable)."),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log debug messages.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Log warnings and errors only; no progress bars.")]
EngineOption = Annotated[str, typer.Option(
    help="torch (ours) or ctranslate2 (the weights converted once, into the run directory or, for a run you "
         "cannot write, ~/.cache/mtcli).")]
TgtLangOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    "--tgt-lang", parser=plain_value, help="Translate into this language (a model trained on several target languages; "
    "default: the run's decode.tgt_lang if set, else its data.tgt_lang).")]
ScoreTgtLangOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    "--tgt-lang", parser=plain_value, help="The targets' language (a model trained on several target languages; "
    "default: the run's decode.tgt_lang if set, else its data.tgt_lang).")]
AverageLast = Annotated[int, typer.Option(min=0, help="Average the last K step checkpoints first.")]
AverageBest = Annotated[int, typer.Option(min=0, help="Average the K best checkpoints first.")]
DeviceOption = Annotated[str, typer.Option(
    help="Decode on auto (the first GPU if there is one; the CPU under decode.int8), cpu, cuda or cuda:N.")]

#: The sampling schemes and the temperature's range, those of the decode config: the command line
#: names its own option when a value is out of them, not a config key.
SAMPLING_SCHEMES: tuple[str, ...] = typing.get_args(typing.get_type_hints(DecodeConfig)["sampling"])
TEMPERATURE_RANGE = DECODE_RANGES["temperature"]


def sampling_scheme(value: str) -> str:
    """``--sampling``'s value, refused unless one of :data:`SAMPLING_SCHEMES`."""
    if value not in SAMPLING_SCHEMES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(SAMPLING_SCHEMES)}")
    return value


SamplingOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    parser=sampling_scheme,
    help="Draw translations instead of searching: topk or topp (decode.topk, decode.topp; back-translation).")]
TemperatureOption = Annotated[Optional[float], typer.Option(  # noqa: UP045
    min=TEMPERATURE_RANGE[0], max=TEMPERATURE_RANGE[1],
    help="Sampling temperature, with --sampling (1: the model's own distribution).")]

def named_path(value: str | Path) -> Path:
    """A path option's value, refused when empty (``Path("")`` is the working directory: an
    unset shell variable wrote into it, over files of the same names) or another option."""
    if not str(value).strip():
        raise typer.BadParameter("an empty path; give a name")
    return Path(plain_value(str(value)))


def output_file(value: str, stdout: str = ", or leave -o out for the output on stdout") -> Path:
    """An output file's name as given: one that ends in ``/`` names a directory, not a file
    (``Path`` would drop the slash and write a file of the directory's name). ``stdout``: what
    ``-o -`` is told of the command's standard output."""
    named_path(value)
    if value.endswith("/") or value.endswith("/."):
        raise typer.BadParameter(f"{value} names a directory; give the output file's name")
    if value == "-":  # stdout to a Unix tool, but a file named "-" to open()
        raise typer.BadParameter(f"- is not a file name here; give one{stdout}")
    return Path(value)


def file_only(value: str) -> Path:
    """:func:`output_file` for an ``-o`` a command needs (its output is no text for stdout)."""
    return output_file(value, stdout="")


def report_file(value: str) -> Path:
    """:func:`output_file` for ``compare -o``, whose report goes to stdout as JSON with --json."""
    return output_file(value, stdout=", or leave -o out and give --json for the report on stdout")


EnsembleOption = Annotated[
    Optional[list[Path]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--ensemble", help="Decode together with another member: a run directory (its best "
                 "checkpoint), a checkpoint file in one, or a file of the same SentencePiece model "
                 "(mtcli average -o) (repeatable)."),
]


CheckpointOption = Annotated[str, typer.Option(parser=plain_value, help="best, last, or a checkpoint path.")]
ResultsOption = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    parser=named_path, help="Results directory (default: results/).")]
ReadmeOption = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    parser=named_path, help="README whose table to refresh (default: README.md; none with --results DIR).")]
DataOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    parser=plain_value, help="Directory of the corpus's <split>.<lang> files.")]


MergedArgument = Annotated[Optional[list[Path]], typer.Argument(  # noqa: UP045
    metavar="RESULTS", show_default=False, help="With --merge: the results directories to combine.")]

__all__ = ["AverageBest", "AverageLast", "CheckpointOption", "DataOption", "DecodeSetOption", "DeviceOption", "EngineOption", "EnsembleOption", "MergedArgument", "Quiet", "ReadmeOption", "ResultsOption", "SetOption", "TgtLangOption", "Verbose", "file_only", "named_path", "output_file", "plain_value"]
