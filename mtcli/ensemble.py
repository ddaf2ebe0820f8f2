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
import dataclasses
import multiprocessing
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mtcli.errors import ConfigError, MtcliError, TrainingError
from mtcli.logs import get_logger

if TYPE_CHECKING:
    from mtcli.config import Config
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
    return train(config)


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
