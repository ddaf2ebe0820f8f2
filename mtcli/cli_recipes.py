"""The recipes' commands of the CLI: ``reproduce``, ``reproduce-multilingual`` and
``reproduce-bt``, each a pipeline of prepare, train, average and evaluate that writes a table
(registered on :data:`mtcli.cli.app`, which lists them in its own order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from mtcli.cli_errors import handle_errors, kept_results, say
from mtcli.cli_options import (
    DataOption,
    MergedArgument,
    Quiet,
    ReadmeOption,
    ResultsOption,
    SetOption,
    Verbose,
    named_path,
    plain_value,
)


def _merged(merge: bool, merged: list[Path] | None) -> list[Path]:
    """The results to merge: given after ``--merge``, and only with it."""
    if merge and not merged:
        raise typer.BadParameter("give the results directories to combine after it", param_hint="--merge")
    if merged and not merge:
        raise typer.BadParameter(f"{merged[0]}: results to combine go after --merge", param_hint="RESULTS")
    return list(merged or [])


def _readme(readme: Path | None, results: Path | None) -> Path | None:
    """The README whose table a reproduction refreshes: the one given; else README.md, unless
    the results go to a directory of their own (``--results DIR``), whose rows alone would
    replace the README's table."""
    from mtcli.results import README

    if readme is not None:
        return readme
    return README if results is None else None


def _pipeline_setup(verbose: bool, quiet: bool) -> None:
    """What a reproduction pipeline's command sets up first: the log, the allocator's policy."""
    from mtcli.allocator import keep_freed_memory
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    keep_freed_memory()


@handle_errors
def reproduce(
    direction: Annotated[str, typer.Argument(help="The recipe of a row of the README's tables: de_en, en_de, en_fr, "
                                                  "fr_en, en_cs, cs_en, wmt_news_en_de or wmt_news_en_de_adapt.")],
    data: DataOption = None,
    config: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        parser=named_path, help="A recipe to run instead of the direction's.")] = None,
    results: ResultsOption = None,
    readme: ReadmeOption = None,
    set_: SetOption = None,
    seeds: Annotated[Optional[str], typer.Option(parser=plain_value, help="Train and score each of these seeds (e.g. 1,2,3), each in "  # noqa: UP045
                                                      "RUN_DIR-seed<N>; the row holds their mean, standard deviation "
                                                      "and each seed's scores.")] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Train nothing: combine the seed rows of the RESULTS "
                                        "directories (or <table>.json files) written by separate runs, e.g. one "
                                        "seed per machine.")] = False,
    merged: MergedArgument = None,
    valid_only: Annotated[bool, typer.Option("--valid-only", help="A tuning run: choose on val and stop; the test "
                                             "split is not decoded and no table is written (val scores go to "
                                             "RUN_DIR/tuning.json).")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Prepare, train, average and evaluate a recipe, then write its row of the results table
    (and the README's)."""
    from mtcli.reproduce import reproduce as run_reproduce
    from mtcli.results import RESULTS_DIR

    _pipeline_setup(verbose, quiet)
    done = kept_results(lambda: run_reproduce(
        direction, data=data, config_path=config, results=results or RESULTS_DIR, readme=_readme(readme, results),
        overrides=list(set_ or []), seeds=seeds, merge=_merged(merge, merged), valid_only=valid_only))
    say(json.dumps(done.row, indent=2) if done.markdown is None else done.markdown)


@handle_errors
def reproduce_multilingual(
    data: Annotated[Optional[str], typer.Option(  # noqa: UP045
        parser=plain_value, help="Directory of Multi30k's <split>.<lang> files, read by every corpus of the recipe.")] = None,
    config: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        parser=named_path, help="The multilingual recipe (default: configs/multi30k_multi.yaml).")] = None,
    seeds: Annotated[str, typer.Option(parser=plain_value, help="Seeds to train and score, e.g. 1,2,3.")] = "1,2,3",
    results: ResultsOption = None,
    readme: ReadmeOption = None,
    set_: SetOption = None,
    merge: Annotated[bool, typer.Option("--merge", help="Train nothing: add the seeds of the RESULTS directories "
                                        "(or multilingual.json files), e.g. one per GPU process, to the "
                                        "table.")] = False,
    merged: MergedArgument = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """One model for six Multi30k directions, trained and scored per seed, beside the bilingual
    rows: the multilingual table."""
    from mtcli.multilingual import RECIPE
    from mtcli.multilingual import reproduce_multilingual as run_multilingual
    from mtcli.results import RESULTS_DIR

    _pipeline_setup(verbose, quiet)
    say(kept_results(lambda: run_multilingual(
        config_path=config or RECIPE, data=data, seeds=seeds, results=results or RESULTS_DIR,
        readme=_readme(readme, results), overrides=list(set_ or []), merge=_merged(merge, merged))))


@handle_errors
def reproduce_bt(
    forward: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        parser=named_path, help="The en->de recipe (default: configs/multi30k_en_de.yaml).")] = None,
    reverse: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        parser=named_path, help="The de->en recipe that back-translates (default: configs/multi30k_de_en.yaml).")] = None,
    seed: Annotated[int, typer.Option(help="The seed of every run.")] = 1,
    work: Annotated[Path, typer.Option(parser=named_path, help="Where the halves and the runs go.")] = Path("data/bt"),
    results: ResultsOption = None,
    readme: ReadmeOption = None,
    set_: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--set", help="Override a config key of both recipes: section.key=value (repeatable).")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Back-translation end to end on Multi30k: half the pairs as parallel data, the other half's
    German back-translated by beam and by sampling; the back-translation table."""
    from mtcli.backtranslation import FORWARD, REVERSE
    from mtcli.backtranslation import reproduce_bt as run_bt
    from mtcli.results import RESULTS_DIR

    _pipeline_setup(verbose, quiet)
    say(kept_results(lambda: run_bt(
        forward=forward or FORWARD, reverse=reverse or REVERSE, seed=seed, work=work,
        results=results or RESULTS_DIR, readme=_readme(readme, results), overrides=list(set_ or []))))
