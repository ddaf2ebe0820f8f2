"""Ensembles: several models trained side by side and decoded together.

Training. With ``train.ensemble: N`` a run trains N *members* at once, one process each, in
``<run_dir>/member1`` .. ``memberN``: the same recipe with the seeds ``seed .. seed+N-1`` (other
initial weights, batch order and dropout masks) and ``train.num_threads / N`` threads each. On
a small CPU this is the better use of the cores: two single-thread processes of the Multi30k
recipe run ~2,500 target tok/s each (5,000 together) where one two-thread process runs ~4,300
(``bench/NOTES.md``, session 19). Each member is an ordinary run directory: it resumes exactly,
and ``mtcli evaluate``/``translate`` read it like any other.

Decoding. An :class:`Ensemble` of M members gives the next token the mean of their
probabilities (the mixture of the members),

    p(y_t | y_<t, x) = 1/M * sum_m p_m(y_t | y_<t, x),

each member with its own encoder output and key/value cache; the search
(:func:`mtcli.search.generate`) scores, ranks and length-normalises the mixture exactly as it
does one model's distribution. The members must share the tokenizer and the output vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mtcli.errors import CheckpointError, ConfigError, MtcliError, TrainingError
from mtcli.logs import get_logger

if TYPE_CHECKING:
    from mtcli.checkpoint import InferenceModel
    from mtcli.config import Config
    from mtcli.model import Transformer
    from mtcli.train import TrainSummary


# --------------------------------------------------------------------------------- training


def member_dir(run_dir: str | Path, index: int) -> Path:
    """Run directory of member ``index`` (1-based) of the ensemble run in ``run_dir``."""
    return Path(run_dir) / f"member{index}"


def member_dirs(run_dir: str | Path) -> list[Path]:
    """The member run directories present under ``run_dir`` (``member1``, ``member2``, ...)."""
    found = []
    index = 1
    while (member_dir(run_dir, index) / "config.yaml").is_file():
        found.append(member_dir(run_dir, index))
        index += 1
    return found


def member_configs(config: Config) -> list[Config]:
    """The configs of the ``train.ensemble`` members of ``config``'s run: member ``i`` (1-based)
    trains in ``<run_dir>/member<i>`` with seed ``seed + i - 1`` and ``num_threads / N`` threads
    (all the cores when ``num_threads`` is 0), as a one-model run without a progress bar."""
    t = config.train
    n = t.ensemble
    threads = max(1, (t.num_threads or os.cpu_count() or 1) // n)
    run_dir = config.run_path()
    return [
        dataclasses.replace(config, train=dataclasses.replace(
            t, run_dir=str(member_dir(run_dir, i)), seed=t.seed + i - 1, num_threads=threads,
            ensemble=1, progress=False,
        ))
        for i in range(1, n + 1)
    ]


def _train_member(config: Config, tag: str, verbose: bool) -> TrainSummary:
    """Entry point of a member's process: log with ``tag`` and train."""
    from mtcli.logs import setup_logging
    from mtcli.train import train

    setup_logging(verbose, tag=tag)
    try:
        return train(config)
    except MtcliError:
        raise
    except Exception as exc:  # a bug: its traceback goes to the log here, one line to the parent
        get_logger().exception("unexpected error")
        raise TrainingError(f"{type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def _forwarded_stop_signals() -> Iterator[None]:
    """While waiting for the members: pass SIGINT/SIGTERM on to them instead of dying. Each
    member then finishes its step, saves ``checkpoint_last`` and ends with
    :class:`~mtcli.errors.TrainingInterrupted`, which :func:`train_members` raises. (A Ctrl-C
    reaches the members from the terminal too; a second signal changes nothing for them.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for child in multiprocessing.active_children():
            if child.pid is not None:
                os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train_members(config: Config, verbose: bool = False) -> list[TrainSummary]:
    """Train (or resume) the ``train.ensemble`` members of ``config`` side by side, one process
    each, and return their summaries in member order. A failed member does not stop the others;
    once all have ended, the first failure is raised, naming the member."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{config.path}: train.ensemble > 1 cannot run under torchrun "
                          "(each member is its own process): set train.ensemble: 1")
    configs = member_configs(config)
    log = get_logger()
    log.info("training %d ensemble members side by side in %s/member1..%d (seeds %d..%d, %d "
             "threads each; each member logs to its own train.log)", len(configs),
             config.run_path(), len(configs), configs[0].train.seed, configs[-1].train.seed,
             configs[0].train.num_threads)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
    with concurrent.futures.ProcessPoolExecutor(len(configs), mp_context=context) as pool:
        futures = [pool.submit(_train_member, c, f"member {i}", verbose)
                   for i, c in enumerate(configs, 1)]
        with _forwarded_stop_signals():  # members checkpoint and stop; we wait for them
            concurrent.futures.wait(futures)
    summaries = []
    for i, (future, member) in enumerate(zip(futures, configs, strict=True), 1):
        exc = future.exception()
        if isinstance(exc, MtcliError):  # keep its type (and exit code), name the member
            exc.args = (f"ensemble member {i} ({member.run_path()}): {exc}",)
            raise exc
        if exc is not None:
            raise TrainingError(f"ensemble member {i} ({member.run_path()}) failed: "
                                f"{type(exc).__name__}: {exc}")
        summaries.append(future.result())
    return summaries


# --------------------------------------------------------------------------------- decoding


class Ensemble(nn.Module):
    """Transformers decoded together: the next-token distribution is the mean of the members'
    probabilities, ``p(y_t | y_<t, x) = 1/M * sum_m p_m(y_t | y_<t, x)``.

    Only :func:`mtcli.search.generate` uses it (each member encodes the source and keeps its own
    key/value cache); attention pictures show the first member's cross-attention.
    """

    def __init__(self, members: Sequence[Transformer]) -> None:
        super().__init__()
        if not members:
            raise ConfigError("an ensemble needs at least one model")
        first = members[0]
        for i, other in enumerate(members[1:], 2):
            a, b = first.output_ids, other.output_ids
            same_ids = (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b.cpu()))
            if other.vocab_size != first.vocab_size or not same_ids:
                raise CheckpointError(f"ensemble member {i} has another vocabulary or output vocabulary "
                                      "than member 1: members must come from the same prepared data")
        self.members = nn.ModuleList(members)
        self.train(first.training)  # a mode of its own would be set on the members by train()

    @property
    def max_positions(self) -> int:
        """The longest sequence every member accepts."""
        return min(m.cfg.max_positions for m in self.members)

    @property
    def output_size(self) -> int:
        """Size of the (shared) output vocabulary."""
        return self.members[0].output_size


def decoding_members(model: nn.Module) -> list[Transformer]:
    """The Transformers a search runs: an :class:`Ensemble`'s members, or the model itself."""
    return list(model.members) if isinstance(model, Ensemble) else [model]  # type: ignore[list-item]


def _member_location(spec: str | Path) -> tuple[Path, str]:
    """``(run_dir, checkpoint)`` of an ``--ensemble`` argument: a run directory (its best
    checkpoint) or a checkpoint file in a run directory's ``checkpoints/``."""
    path = Path(spec)
    if path.is_dir():
        return path, "best"
    if path.is_file() and path.parent.name == "checkpoints":
        return path.parent.parent, str(path)
    raise CheckpointError(f"{spec}: not a run directory nor a checkpoint in one's checkpoints/ "
                          "(--ensemble takes either)")


def add_members(bundle: InferenceModel, others: Sequence[str | Path]) -> InferenceModel:
    """``bundle`` with its model replaced by the :class:`Ensemble` of it and ``others`` (each a
    run directory or a checkpoint file in one, see :func:`_member_location`), which must use the
    same SentencePiece model. Returns ``bundle`` itself when ``others`` is empty."""
    if not others:
        return bundle
    from mtcli.checkpoint import load_for_inference
    from mtcli.fileio import sha256_file

    models, names = [bundle.model], [bundle.name]
    spm = sha256_file(bundle.tokenizer.model_path)
    for spec in others:
        run_dir, checkpoint = _member_location(spec)
        member = load_for_inference(run_dir, checkpoint)
        if sha256_file(member.tokenizer.model_path) != spm:
            raise CheckpointError(f"{spec}: its spm.model differs from the first member's "
                                  "(ensemble members must share the SentencePiece model)")
        models.append(member.model)
        names.append(f"{run_dir.name}/{member.name}")
    return dataclasses.replace(bundle, model=Ensemble(models), name=" + ".join(names))
