"""The ``mtcli`` command line: parse arguments, call library functions, print results.

Every library error (:class:`mtcli.errors.MtcliError`) becomes one line on stderr and a
non-zero exit code (:mod:`mtcli.cli_errors`); nothing here holds logic a library function could
hold. The library is imported inside each command, so ``mtcli --help`` answers without loading
torch; commands that train or decode first set the process-wide allocator policy
(:mod:`mtcli.allocator`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mtcli import cli_recipes
from mtcli.cli_errors import Commands, fail, handle_errors, say
from mtcli.cli_options import (
    AverageBest,
    AverageLast,
    CheckpointOption,
    DecodeSetOption,
    DeviceOption,
    EngineOption,
    EnsembleOption,
    Quiet,
    SamplingOption,
    ScoreTgtLangOption,
    SetOption,
    TemperatureOption,
    TgtLangOption,
    Verbose,
    file_only,
    named_path,
    output_file,
    plain_value,
    report_file,
)
from mtcli.errors import ConfigError, MtcliError, TrainingInterrupted, install_advice

app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    help="mtcli: prepare a parallel corpus, train a Transformer, evaluate and translate.",
)


def _version(value: bool) -> None:
    if value:
        from mtcli.version import __version__

        say(f"mtcli {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """mtcli: prepare a parallel corpus, train a Transformer, evaluate and translate."""
    try:  # a removed one: relative paths, torch's own libraries and worker processes fail on it
        os.getcwd()
    except FileNotFoundError:
        fail("the current directory no longer exists (removed since the shell entered it): cd into one that does", 1)


@app.command()
@handle_errors
def prepare(
    config: Annotated[Path, typer.Argument(help="Recipe YAML (see configs/).")],
    set_: SetOption = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if the cache is current.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Read, clean, train SentencePiece and binarise a parallel corpus."""
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare as run_prepare
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    report = run_prepare(load_config(config, set_), force=force)
    say(report.summary())


@app.command()
@handle_errors
def train(
    config: Annotated[Path, typer.Argument(help="Recipe YAML (see configs/).")],
    set_: SetOption = None,
    init_from: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--init-from", parser=plain_value, help="Start from this run directory's (or checkpoint's) weights "
                            "(train.init_from; a new run directory, fresh optimizer).")] = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Train a Transformer; re-running on an existing run directory resumes it exactly."""
    from mtcli.allocator import keep_freed_memory
    from mtcli.config import load_config, with_changes
    from mtcli.logs import setup_logging
    from mtcli.train import train as run_train

    setup_logging(verbose, quiet=quiet)
    keep_freed_memory()
    try:
        loaded = load_config(config, list(set_ or []))
        if init_from is not None and loaded.train.init_from not in (None, init_from):
            raise ConfigError(f"--init-from {init_from} and train.init_from {loaded.train.init_from} name two parents; "
                              "give one")
        summary = run_train(with_changes(loaded, "train", init_from=init_from))
    except MtcliError as exc:  # (a stop by a signal is the same on every rank: said once)
        _leave_torchrun(exc.exit_code, f"mtcli: error: {exc}", every_rank=not isinstance(exc, TrainingInterrupted))
        raise
    if summary.is_main:  # under torchrun, one summary: rank 0's
        say(summary.summary())
    _leave_torchrun(0)


def _leave_torchrun(code: int, message: str | None = None, every_rank: bool = True) -> None:
    """Under torchrun, end this rank now (after ``message`` on stderr, from rank 0 only unless
    ``every_rank``), skipping the interpreter's
    teardown: every rank has left the process group by then, but the C++ destructors of gloo's
    threads that run at exit can still abort a finished rank ("terminate called without an
    active exception", exit -6), failing a run that succeeded. One process returns normally."""
    from mtcli.train.distributed import DistInfo

    info = DistInfo.from_env()
    if not info.distributed:
        return
    if message is not None and (every_rank or info.is_main):
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@app.command()
@handle_errors
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    split: Annotated[Optional[str], typer.Option(parser=plain_value, help="Prepared split to score (default: first test split).")] = None,  # noqa: UP045
    src: Annotated[Optional[Path], typer.Option(help="Source text file (with --ref) instead of a split.")] = None,  # noqa: UP045
    ref: Annotated[Optional[list[Path]], typer.Option(  # noqa: UP045
        help="Reference text file (with --src; repeatable: several references per sentence).")] = None,
    metrics: Annotated[str, typer.Option(help="Comma-separated: bleu (BLEU and lowercased BLEU), chrf, "
                                              "ter.")] = "bleu,chrf",
    checkpoint: CheckpointOption = "best",
    average_last: AverageLast = 0,
    average_best: AverageBest = 0,
    beam: Annotated[Optional[int], typer.Option(min=1, help="Beam size (1 = greedy; default: the run's decode.beam_size).")] = None,  # noqa: UP045
    src_lang: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--src-lang", parser=plain_value, help="A model of several directions: score those from this language only.")] = None,
    tgt_lang: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--tgt-lang", parser=plain_value, help="A model of several directions: score those into this language only.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=named_path, help="Directory for the hypotheses (NAME.CHECKPOINT.hyp) and report (NAME.CHECKPOINT.report.json); default: RUN_DIR/eval.")] = None,  # noqa: UP045
    ensemble: EnsembleOption = None,
    engine: EngineOption = "torch",
    device: DeviceOption = "auto",
    set_: DecodeSetOption = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Decode a test set and score it with sacreBLEU (BLEU, chrF, signatures); a model of several
    directions is scored in each (one report each). Stdout: the report as JSON, or a list of
    them when several directions are scored."""
    from mtcli.allocator import bound_onednn_cache, keep_freed_memory
    from mtcli.evaluate import evaluate_directions
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    keep_freed_memory()
    bound_onednn_cache()
    reports = evaluate_directions(
        run_dir,
        split=split,
        src_file=src,
        ref_file=ref[0] if ref else None,
        more_refs=list(ref or [])[1:],
        metrics=[m.strip() for m in metrics.split(",") if m.strip()],
        checkpoint=checkpoint,
        average_last=average_last,
        average_best=average_best,
        overrides=list(set_ or []),
        output_dir=output,
        ensemble=list(ensemble or []),
        engine=engine,
        beam=beam,
        src_lang=src_lang,
        tgt_lang=tgt_lang,
        device=device,
    )
    say(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, ensure_ascii=False))


@app.command()
@handle_errors
def compare(
    systems: Annotated[list[str], typer.Argument(help="Hypothesis files or run directories (their newest "
                                                      "eval/*.hyp scored against --ref); the first is the baseline.")],
    ref: Annotated[list[Path], typer.Option("--ref", help="Reference file (repeatable: several references).")],
    metrics: Annotated[str, typer.Option(help="Comma-separated: bleu, chrf, ter.")] = "bleu,chrf,ter",
    test: Annotated[str, typer.Option(help="bs (paired bootstrap), ar (approximate randomization) or both.")] = "both",
    samples: Annotated[Optional[int], typer.Option(help="Resamples or swaps (default 1000 for bs, 10000 for ar).")] = None,  # noqa: UP045
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=report_file, help="Write the report (JSON) here.")] = None,  # noqa: UP045
    tgt_lang: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--tgt-lang", parser=plain_value, help="The references' language: BLEU tokenises zh, ja and ko text as sacreBLEU does for "
        "them (default: the language mtcli evaluate recorded beside the hypotheses; else 13a).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (what -o writes), not as a table.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Paired significance tests between systems (sacreBLEU): scores, 95% intervals, p-values."""
    from mtcli.compare import compare as run_compare
    from mtcli.compare import render
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    tests = ("bs", "ar") if test == "both" else (test,)
    report = run_compare(systems, ref, metrics=[m.strip() for m in metrics.split(",") if m.strip()],
                         tests=tests, samples=samples, output=output, tgt_lang=tgt_lang)
    say(json.dumps(report, indent=2, ensure_ascii=False) if as_json else render(report))


@app.command()
@handle_errors
def translate(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    files: Annotated[Optional[list[Path]], typer.Argument(help="Input files (default, or - alone: stdin).")] = None,  # noqa: UP045
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=output_file, help="Output file (default: stdout).")] = None,  # noqa: UP045
    checkpoint: CheckpointOption = "best",
    average_last: AverageLast = 0,
    average_best: AverageBest = 0,
    beam: Annotated[Optional[int], typer.Option(min=1, help="Beam size (1 = greedy; default: the run's decode.beam_size).")] = None,  # noqa: UP045
    nbest: Annotated[Optional[int], typer.Option(min=1, help="Print N lines per input, best first: score<TAB>text "  # noqa: UP045
                                                      "(with --sampling: N samples, in draw order).")] = None,
    sampling: SamplingOption = None,
    temperature: TemperatureOption = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed: the same seed gives the same samples.")] = None,  # noqa: UP045
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help="Token budget per batch.")] = None,  # noqa: UP045
    tgt_lang: TgtLangOption = None,
    plot_attention: Annotated[Optional[Path], typer.Option(parser=named_path, help="Write cross-attention heatmaps here.")] = None,  # noqa: UP045
    ensemble: EnsembleOption = None,
    engine: EngineOption = "torch",
    device: DeviceOption = "auto",
    set_: DecodeSetOption = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Translate text files or stdin to stdout (or --output), streamed."""
    from mtcli.allocator import bound_onednn_cache, keep_freed_memory
    from mtcli.infer.files import translate_files
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    keep_freed_memory()
    bound_onednn_cache()
    translate_files(
        run_dir,
        inputs=[] if [str(f) for f in files or []] == ["-"] else list(files or []),
        output=output,
        checkpoint=checkpoint,
        overrides=list(set_ or []),
        plot_attention=plot_attention,
        ensemble=list(ensemble or []),
        engine=engine,
        average_last=average_last, average_best=average_best,
        beam=beam, nbest=nbest, max_tokens=max_tokens,
        sampling=sampling, temperature=temperature, seed=seed,
        tgt_lang=tgt_lang, device=device,
    )


@app.command()
@handle_errors
def score(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    source: Annotated[Path, typer.Argument(help="Source sentences, one a line.")],
    target: Annotated[Path, typer.Argument(help="Their target sentences, line by line.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", parser=output_file, help="Output file (default: stdout).")] = None,  # noqa: UP045
    normalize: Annotated[bool, typer.Option(help="The mean log-probability a target piece (</s> counted), "
                                                 "not the sum: comparable across lengths.")] = False,
    checkpoint: CheckpointOption = "best",
    average_last: AverageLast = 0,
    average_best: AverageBest = 0,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help="Token budget per batch.")] = None,  # noqa: UP045
    tgt_lang: ScoreTgtLangOption = None,
    device: DeviceOption = "auto",
    set_: DecodeSetOption = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Score sentence pairs: log p(target | source) under the model, one number a line (for
    filtering a corpus, or reranking)."""
    from mtcli.allocator import bound_onednn_cache, keep_freed_memory
    from mtcli.infer.files import score_files
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    keep_freed_memory()
    bound_onednn_cache()
    score_files(run_dir, source, target, output, checkpoint, list(set_ or []), normalize=normalize,
                average_last=average_last, average_best=average_best, max_tokens=max_tokens, tgt_lang=tgt_lang,
                device=device)


@app.command()
@handle_errors
def average(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    output: Annotated[Path, typer.Option("--output", "-o", parser=file_only, help="Averaged checkpoint path.")],
    last: Annotated[int, typer.Option(help="Average the last K step checkpoints.")] = 0,
    best: Annotated[int, typer.Option(help="Average the K best checkpoints by the run's train.valid_metric.")] = 0,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Average the parameters of the last or best K checkpoints into one."""
    from mtcli.infer.averaging import average_run_checkpoints
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    if (last > 0) == (best > 0):
        raise ConfigError(f"give one of --last K or --best K, K > 0 (got --last {last} --best {best})")
    used = average_run_checkpoints(run_dir, output, last=last, best=best)
    say(f"averaged {len(used)} checkpoints into {output}: " + ", ".join(p.name for p in used))


@app.command()
@handle_errors
def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    output: Annotated[Path, typer.Argument(help="Output directory.")],
    format: Annotated[str, typer.Option("--format", help="Export format: ctranslate2, or hf (a Hugging Face "
                                                         "MarianMTModel with its MarianTokenizer).")] = "ctranslate2",
    checkpoint: CheckpointOption = "best",
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Export a trained model for another runtime (CTranslate2, Hugging Face Transformers)."""
    from mtcli.infer.export import export_model
    from mtcli.infer.hf import export_hf
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    out = export_hf(run_dir, output, checkpoint) if format == "hf" else export_model(
        run_dir, output, fmt=format, checkpoint=checkpoint)
    say(f"exported {format} model to {out}")


@app.command("import-hf")
@handle_errors
def import_hf(
    model_dir: Annotated[Path, typer.Argument(help="A Hugging Face MarianMTModel directory (OPUS-MT style: config.json, "
                                                   "weights, source.spm, target.spm, vocab.json).")],
    run_dir: Annotated[Path, typer.Argument(help="The run directory to write (new).")],
    src_lang: Annotated[Optional[str], typer.Option(help="Source language (default: tokenizer_config.json's, "  # noqa: UP045
                                                         "else the directory name's, opus-mt-SRC-TGT).")] = None,
    tgt_lang: Annotated[Optional[str], typer.Option(help="Target language (as --src-lang).")] = None,  # noqa: UP045
    force: Annotated[bool, typer.Option("--force", help="Replace an existing run directory.")] = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Make a run of a Hugging Face MarianMTModel (an OPUS-MT model) for translate, evaluate and serve."""
    from mtcli.infer.hf_import import import_hf as run_import
    from mtcli.logs import setup_logging

    setup_logging(verbose, quiet=quiet)
    report = run_import(model_dir, run_dir, src_lang=src_lang, tgt_lang=tgt_lang, force=force)
    say(f"imported {model_dir} into {report.run_dir}: {report.src_lang}->{report.tgt_lang}, "
          f"{report.parameters:,} parameters, vocabulary {report.vocab_size} ({report.tokenizer})")


# the recipes' commands (mtcli/cli_recipes.py), listed here in --help
app.command()(cli_recipes.reproduce)
app.command("reproduce-multilingual")(cli_recipes.reproduce_multilingual)
app.command("reproduce-bt")(cli_recipes.reproduce_bt)


@app.command()
@handle_errors
def serve(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `mtcli train`.")],
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 to accept other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    checkpoint: CheckpointOption = "best",
    average_last: AverageLast = 0,
    average_best: AverageBest = 0,
    ensemble: EnsembleOption = None,
    beam: Annotated[Optional[int], typer.Option(min=1, help="Default beam size (a request may set its own).")] = None,  # noqa: UP045
    tgt_lang: TgtLangOption = None,
    device: DeviceOption = "auto",
    api_key: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--api-key", envvar="MTCLI_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /translate and /score.")] = None,
    max_lines: Annotated[int, typer.Option(min=1, help="Most lines a request may send.")] = 64,
    max_chars: Annotated[int, typer.Option(min=1, help="Most characters a line may have.")] = 2000,
    max_request_chars: Annotated[int, typer.Option(min=1, help="Most characters a request may have in all.")] = 20_000,
    batch_wait_ms: Annotated[float, typer.Option(min=0, max=10_000, help="How long to gather requests into one "
                                                                         "batch (at most 10000 ms).")] = 5.0,
    shutdown_grace_s: Annotated[float, typer.Option(
        min=0, max=86_400, help="On SIGTERM, how long the requests in flight may take; those unanswered then get "
                                "a 503.")] = 60.0,
    engine: EngineOption = "torch",
    set_: DecodeSetOption = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Serve a trained model over HTTP: POST /translate and /score, GET /health, a page at /,
    docs at /docs.
    SIGHUP loads the checkpoint again (the newest checkpoint_best, or the newest K averaged)
    without stopping."""
    # a SIGHUP while the server starts (imports, the model loading) would end it: it is noted
    # instead, and the server loads the model again once it serves (its terminal hanging up
    # still ends it, as the server's own handler does)
    from mtcli.hangup import act_or_hang_up

    hangups: list[int] = []
    before = signal.signal(signal.SIGHUP, act_or_hang_up(hangups.append)) if hasattr(signal, "SIGHUP") else None
    try:
        try:
            from mtcli.serve import Limits, check_api_key, check_listening
            from mtcli.serve import serve as run_server
        except ImportError as exc:
            fail(f"mtcli serve needs {exc.name}: {install_advice('serve')}", 1)
        from mtcli.allocator import bound_onednn_cache
        from mtcli.infer.translator import Translator
        from mtcli.logs import setup_logging

        setup_logging(verbose, quiet=quiet)
        limits = Limits(max_lines=max_lines, max_chars=max_chars, max_total_chars=max_request_chars,
                        batch_wait_ms=batch_wait_ms)
        bound_onednn_cache()
        if api_key is None and os.environ.get("MTCLI_API_KEY") == "":  # click reads an empty variable as unset
            api_key = ""
        if api_key is not None:
            check_api_key(api_key)
        check_listening(host, port)  # a port in use, or a key no client could send, is said before the model loads

        def load() -> Translator:  # again on SIGHUP
            return Translator.from_run(run_dir, checkpoint, device=device, engine=engine,
                                       average_last=average_last, average_best=average_best,
                                       ensemble=list(ensemble or []), overrides=list(set_ or []), beam=beam,
                                       tgt_lang=tgt_lang)

        still_decoding = run_server(load(), host=host, port=port, limits=limits, api_key=api_key, load=load,
                                    shutdown_grace_s=shutdown_grace_s, sighup_received=lambda: bool(hangups))
        if still_decoding:  # the interpreter's exit under a thread inside torch would abort (status 134)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    finally:
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, signal.SIG_DFL if before is None else before)


if __name__ == "__main__":  # pragma: no cover
    app()
