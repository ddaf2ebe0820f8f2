"""DistributedDataParallel on CPU: 2 gloo processes == 1 process on the union of their batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import MTCLI, REPO, TOY_CONFIG, ForkedPython, forkserver, toy_train_overrides

from mtcli.checkpoint import load_checkpoint
from mtcli.config import load_config
from mtcli.train import train


@pytest.fixture(autouse=True)
def _own_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun leaves a torchelastic_* directory in $TMPDIR: the test's own, not /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def worker_env() -> dict[str, str]:
    # one thread per rank; a rank that dies on a signal prints its Python stack (faulthandler)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


def overrides(prepared: Path, run_dir: Path) -> list[str]:
    # gloo on the CPU, also on a machine with a GPU (where "auto" would pick CUDA)
    return toy_train_overrides(prepared, run_dir, "train.max_steps=1", "train.warmup_steps=1",
                               "train.max_tokens=256", "train.device=cpu")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_gloo_processes_under_torchrun_match_one_process(tmp_path: Path, prepared_toy: Path) -> None:
    ddp_run = tmp_path / "ddp"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "mtcli.cli", "train", str(TOY_CONFIG)]
    for item in overrides(prepared_toy, ddp_run):
        args += ["--set", item]
    proc = subprocess.run(args, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "processes 2" in (ddp_run / "train.log").read_text(encoding="utf-8")
    assert proc.stdout.count("run dir:") == 1, proc.stdout  # one summary on the console, rank 0's
    _assert_one_process_on_both_batches_matches(ddp_run, prepared_toy, tmp_path)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_gloo_processes_of_packed_rows_match_one_process(tmp_path: Path, prepared_toy: Path) -> None:
    ddp_run = tmp_path / "ddp"
    _ddp_train(ddp_run, prepared_toy, "train.max_steps=1", "train.warmup_steps=1", "train.pack_length=64")
    _assert_one_process_on_both_batches_matches(ddp_run, prepared_toy, tmp_path, "train.pack_length=64")


def _assert_one_process_on_both_batches_matches(ddp_run: Path, prepared: Path, tmp_path: Path, *packing: str) -> None:
    """One process, the same two batches accumulated into one update (update_freq=2), gives the
    parameters of the two-rank run ``ddp_run``; one batch alone gives others."""
    single_run = tmp_path / "single"
    train(load_config(TOY_CONFIG, overrides(prepared, single_run) + [*packing, "train.update_freq=2"]))

    a = load_checkpoint(ddp_run / "checkpoints" / "checkpoint_last.pt")
    b = load_checkpoint(single_run / "checkpoints" / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 1
    assert a["data_state"]["batch"] == b["data_state"]["batch"] == 2
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    # The update really happened and used both batches: a one-batch step lands elsewhere.
    one_batch = tmp_path / "one"
    train(load_config(TOY_CONFIG, overrides(prepared, one_batch) + list(packing)))
    c = load_checkpoint(one_batch / "checkpoints" / "checkpoint_last.pt")
    assert any(not torch.allclose(c["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
               for k in b["model"])


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_fp16_processes_match_one_process_bit_for_bit(tmp_path: Path, prepared_toy: Path) -> None:
    """The ranks' gradients are summed (train.distributed.sum_gradients), each rank's loss over
    the step's tokens, as one process accumulating both batches computes them. Averaged, they
    needed each loss scaled by the process count, which fp16's loss scaling rounds apart: the
    parameters drifted from the one-process run's within a few steps."""
    steps = ("train.max_steps=12", "train.precision=fp16", "train.valid_every=100000")
    ddp_run, single_run = tmp_path / "ddp", tmp_path / "single"
    _ddp_train(ddp_run, prepared_toy, *steps)
    train(load_config(TOY_CONFIG, toy_train_overrides(prepared_toy, single_run, "train.max_tokens=256", *steps,
                                                      "train.device=cpu", "train.update_freq=2")))
    a = load_checkpoint(ddp_run / "checkpoints" / "checkpoint_last.pt")
    b = load_checkpoint(single_run / "checkpoints" / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 12 and a["scaler"] == b["scaler"]
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def _forked_ranks(run_dir: Path, prepared: Path, *extra: str, script: str = MTCLI) -> list[tuple[int, str]]:
    """``mtcli train`` of the toy recipe on two gloo ranks, started as torchrun starts them (its
    environment variables) but without its launcher process, and forked (:class:`ForkedPython`)
    rather than started; ``script``: what each rank runs with the command line. Each rank's exit
    status and standard error. The tests of the launcher itself run torchrun."""
    args = ["train", str(TOY_CONFIG)]
    for item in toy_train_overrides(prepared, run_dir, "train.max_tokens=256", "train.device=cpu", *extra):
        args += ["--set", item]
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    ranks = [ForkedPython(script, args, run_dir.parent / f"{run_dir.name}-rank{rank}.err",
                          env=dict(worker_env(), **group, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in range(2)]
    try:
        errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return [(rank.returncode, err) for rank, err in zip(ranks, errors, strict=True)]


def _ddp_train(run_dir: Path, prepared: Path, *extra: str) -> None:
    """:func:`_forked_ranks`, each rank ending well."""
    for returncode, err in _forked_ranks(run_dir, prepared, *extra):
        assert returncode == 0, err[-8000:]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_gloo_processes_with_dropout_resume_exactly(tmp_path: Path, prepared_toy: Path) -> None:
    """Each rank draws its own dropout masks; a checkpoint keeps every rank's RNG states, so a
    run resumed from its step-2 checkpoint (as after a stop at step 3) gives at step 4 the
    parameters of 4 steps straight."""
    import shutil

    dropout = ("model.dropout=0.3", "model.attention_dropout=0.2", "train.valid_every=2", "train.keep_last=2")
    straight = tmp_path / "straight"
    _ddp_train(straight, prepared_toy, "train.max_steps=4", *dropout)
    split = shutil.copytree(straight, tmp_path / "split")
    checkpoints = split / "checkpoints"
    (checkpoints / "checkpoint_4.pt").unlink()
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):  # the step-2 checkpoint as the last and best
        shutil.copyfile(checkpoints / "checkpoint_2.pt", checkpoints / name)
    saved = load_checkpoint(checkpoints / "checkpoint_last.pt")
    assert saved["step"] == 2 and len(saved["rng_ranks"]) == 2
    assert not torch.equal(saved["rng_ranks"][0]["torch"], saved["rng_ranks"][1]["torch"])
    _ddp_train(split, prepared_toy, "train.max_steps=4", *dropout)
    assert f"resumed from {checkpoints / 'checkpoint_last.pt'} at step 2," in (split / "train.log").read_text(
        encoding="utf-8")
    a = load_checkpoint(straight / "checkpoints" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(split / "checkpoints" / "checkpoint_last.pt")["model"]
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_nodes_of_one_process_match_one_process(tmp_path: Path, prepared_toy: Path) -> None:
    """`torchrun --nnodes 2 --nproc-per-node 1` started twice, as on two machines (a c10d
    rendezvous on 127.0.0.1, gloo): the same parameters as one process on both batches."""
    run = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{_free_port()}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=mtcli-test",
                "-m", "mtcli.cli", "train", str(TOY_CONFIG)]
    for item in overrides(prepared_toy, run):
        launcher += ["--set", item]
    env = worker_env()
    nodes = [subprocess.Popen(launcher, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-8000:]
    assert "processes 2" in (run / "train.log").read_text(encoding="utf-8")
    single = tmp_path / "single"
    train(load_config(TOY_CONFIG, overrides(prepared_toy, single) + ["train.update_freq=2"]))
    a = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    b = load_checkpoint(single / "checkpoints" / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 1 and a["data_state"]["batch"] == 2
    for key, value in a["model"].items():
        assert torch.allclose(value, b["model"][key], rtol=1e-5, atol=1e-6), key


SIGNAL_ONE_RANK = '''
import os, signal, sys
from mtcli.train.trainer import Trainer
from mtcli.cli import app

train_step = Trainer.train_step


def signalled_after_step_2(self, *args, **kwargs):
    counted = train_step(self, *args, **kwargs)
    if self.info.rank == 1 and self.step + (self._pending is not None) == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # this rank alone, after its step's sums were reduced
    return counted


Trainer.train_step = signalled_after_step_2
sys.argv[0] = "mtcli"
app()
'''


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, prepared_toy: Path) -> None:
    """SIGTERM to rank 1 alone, between steps: the ranks agree on the stop through the next
    step's summed flag, so both save at one step and exit as interrupted, instead of rank 1
    leaving the collectives while rank 0 waits in them."""
    run = tmp_path / "run"
    ranks = _forked_ranks(run, prepared_toy, "train.max_steps=30", "train.log_every=100", "train.valid_every=100000",
                          script=SIGNAL_ONE_RANK)
    stderr = "".join(err for _, err in ranks)
    assert all(returncode != 0 for returncode, _ in ranks), "the run should stop as interrupted"
    assert stderr.count("training interrupted by SIGTERM") == 1, stderr[-8000:]  # (rank 0 says it)
    saved = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert 2 <= saved["step"] <= 4, saved["step"]
    assert f"training interrupted by SIGTERM at step {saved['step']}" in stderr


FAIL_ON_RANK_1 = '''
import os, sys
import mtcli.train.run as run
from mtcli.cli import app
from mtcli.errors import DataError

opened = run.open_prepared


def open_prepared(config, check_inputs=True, resuming=False):
    if os.environ["RANK"] == "1":  # as a machine whose cache is missing, or other
        raise DataError("rank 1's cache: no prepared cache here")
    return opened(config, check_inputs, resuming)


run.open_prepared = open_prepared
sys.argv[0] = "mtcli"
app()
'''


def _train_two_ranks(tmp_path: Path, prepared: Path, script_text: str, *extra: str) -> subprocess.CompletedProcess:
    """``mtcli train`` of the toy recipe in ``tmp_path/run`` under torchrun, two ranks, each
    running ``script_text`` (it patches mtcli, then runs its command line)."""
    script = tmp_path / "patched_mtcli.py"
    script.write_text(script_text, encoding="utf-8")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(script), "train", str(TOY_CONFIG)]
    for item in overrides(prepared, tmp_path / "run") + list(extra):
        args += ["--set", item]
    return subprocess.run(args, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_a_rank_that_fails_before_training_stops_the_others_with_one_line(tmp_path: Path, prepared_toy: Path) -> None:
    """Rank 1's cache refused: rank 0 waited 30 s to form the group with it, ignoring torchrun's
    SIGTERM, until torchrun killed it, saying nothing (on two machines: gloo's traceback of 110-160
    lines). Now the group forms first, and rank 0 ends with one line of its own."""
    proc = _train_two_ranks(tmp_path, prepared_toy, FAIL_ON_RANK_1)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mtcli: error: ")]
    assert len(errors) == 2 and "mtcli: error: rank 1's cache: no prepared cache here" in errors, proc.stderr[-4000:]
    errors.remove("mtcli: error: rank 1's cache: no prepared cache here")  # rank 0: stopped by torchrun, or
    assert errors[0] == "mtcli: error: terminated" or errors[0].startswith(  # its collective with rank 1 failed
        "mtcli: error: rank 0: a collective failed: another process of this run stopped"), errors


FAIL_IN_TRAINING_ON_RANK_1 = '''
import os, sys
import mtcli.train.run as run
from mtcli.cli import app
from mtcli.errors import DataError

trains = run.Trainer.run


def fails_on_rank_1(self):
    if os.environ["RANK"] == "1":  # as a batch only this rank reads, or this rank's device
        raise DataError("rank 1's batch: something only rank 1 met")
    return trains(self)


run.Trainer.run = fails_on_rank_1
sys.argv[0] = "mtcli"
app()
'''


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_why_another_rank_stopped_is_in_the_runs_log_and_a_warning_every_rank_meets_is_said_once(
        tmp_path: Path, prepared_toy: Path) -> None:
    """train.log said only that a collective failed: the reason was on rank 1's console. And
    every rank warned alike (8 GPUs: 8 copies of each skipped step's warning)."""
    ranks = _forked_ranks(tmp_path / "run", prepared_toy, "train.max_steps=1", "train.warmup_steps=1",
                          "train.precision=fp16", script=FAIL_IN_TRAINING_ON_RANK_1)  # fp16: warned of on a CPU
    assert all(returncode != 0 for returncode, _ in ranks)
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert "| ERROR | rank 1 stopped: rank 1's batch: something only rank 1 met" in log, log
    stderr = "".join(err for _, err in ranks)
    assert stderr.count("train.precision fp16 on a CPU") == 1, stderr[-4000:]


def test_a_rank_stopped_by_another_ranks_signal_names_that_signal() -> None:
    """Ctrl-C on one machine: the ranks elsewhere said "interrupted by SIGTERM" (and exited 143)."""
    import signal

    from mtcli.train.signals import TERM_FLAG, StopSignals

    for flags, expected in (([1.0, 0.0], signal.SIGINT), ([TERM_FLAG, 0.0], signal.SIGTERM),
                            ([TERM_FLAG, 1.0, 0.0], signal.SIGINT)):
        ranks = [StopSignals() for _ in flags]
        for rank, flag in zip(ranks, flags, strict=True):  # as the signal handler records it
            rank.signum = {1.0: signal.SIGINT, TERM_FLAG: signal.SIGTERM}.get(flag)
        assert [rank.flag() for rank in ranks] == flags
        stopped = ranks[-1]  # a rank no signal reached
        assert not stopped.stop_now(distributed=True)
        stopped.agree(sum(flags))
        assert stopped.agreed and stopped.signum == expected and stopped.stop_now(distributed=True)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_a_one_process_run_resumes_on_two_with_half_the_batch_each(tmp_path: Path, prepared_toy: Path) -> None:
    """A run moved to more processes keeps its update size by halving train.max_tokens: the
    resume takes it (inexactly: the pairs the epoch has not seen are batched anew)."""
    run = tmp_path / "run"
    train(load_config(TOY_CONFIG, toy_train_overrides(prepared_toy, run, "train.max_tokens=512", "train.max_steps=2",
                                                      "train.device=cpu")))
    before = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")["data_state"]
    assert before["max_tokens"] == 512 and before["batch"] > 0 and before["segments"] == []
    _ddp_train(run, prepared_toy, "train.max_steps=4", "train.device=cpu")
    log = (run / "train.log").read_text(encoding="utf-8")
    assert "config change on resume: train.max_tokens: 512 -> 256 (resume no longer exact)" in log
    assert "processes 2" in log and "stopped at step 4" in log
    after = load_checkpoint(run / "checkpoints" / "checkpoint_last.pt")
    assert after["step"] == 4 and after["data_state"]["max_tokens"] == 256
    assert after["data_state"]["segments"] == [[512, before["batch"]]]  # the epoch's batches under 512
    assert after["data_state"]["batch"] > before["batch"]


def _rank_main(rank: int, init: str, results: dict) -> None:
    """Two gloo ranks: they found different checkpoints; then rank 0 stops and rank 1 waits for it."""
    from mtcli.errors import TrainingError
    from mtcli.train.distributed import DistInfo, agree_on_data, agree_on_resume, peer_failures

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2)
    try:
        agree_on_resume(20 if rank == 0 else None, info)
    except TrainingError as exc:
        results[f"resume{rank}"] = str(exc)
    agree_on_data(("key", "spm"), info)  # the same cache: nothing said
    try:
        agree_on_data(("key", "spm" if rank == 0 else "other spm"), info)
    except TrainingError as exc:
        results[f"data{rank}"] = str(exc)
    if rank == 0:
        os._exit(0)  # gone, as a rank that failed on its own
    try:
        with peer_failures(info):
            dist.barrier()
    except TrainingError as exc:
        results["peer"] = str(exc)
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_ranks_refuse_different_resume_points_and_a_gone_peer_is_one_line(tmp_path: Path) -> None:
    """A run directory seen by one machine only: every rank stops, naming what each found,
    instead of one resuming and the other starting afresh. A rank whose peer has gone says so
    in one line, not with gloo's traceback."""
    context = forkserver()
    with context.Manager() as manager:
        results = manager.dict()
        init = f"file://{tmp_path / 'rendezvous'}"
        procs = [context.Process(target=_rank_main, args=(rank, init, results)) for rank in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        found = dict(results)
    for rank in range(2):
        assert "different checkpoints to resume from (rank 0: step 20, rank 1: none)" in found[f"resume{rank}"]
        # caches of their own on two machines trained one model on different data and piece ids
        assert found[f"data{rank}"].startswith("rank 1: another prepared cache than rank 0's")
    assert found["peer"].startswith("rank 1: a collective failed: another process of this run stopped (its own "
                                    "error, on its console, and in train.log once the run has one, says why) or the "
                                    "connection to it failed (")
    assert "\n" not in found["peer"]


def test_a_cuda_device_is_made_current_in_one_process_too_and_ranks_wait_half_an_hour(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """train.device cuda:1 in one process: CUDA events and streams defaulted to GPU 0, so the
    step's values copied from GPU 1 were read before their copy had landed. And the ranks
    waiting while rank 0 validates were cut off by NCCL's 10-minute default."""
    from mtcli.train.distributed import DistInfo, init_distributed

    made_current: list[torch.device] = []
    joined: list[dict] = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.append(kwargs))
    init_distributed(DistInfo(), torch.device("cuda:1"))
    assert made_current == [torch.device("cuda:1")] and joined == []
    init_distributed(DistInfo(), torch.device("cpu"))
    assert made_current == [torch.device("cuda:1")]
    init_distributed(DistInfo(rank=1, world_size=2), torch.device("cuda:1"))
    assert [j["backend"] for j in joined] == ["nccl"] and joined[0]["timeout"].total_seconds() == 1800


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="reading a second GPU's values needs two GPUs")
def test_values_copied_from_a_second_gpu_are_read_after_their_copy() -> None:
    from mtcli.train.step import HostValues

    with torch.cuda.device(0):
        values = torch.arange(1 << 20, dtype=torch.float64, device="cuda:1").sum().view(1)
        assert HostValues(values).read() == [float((1 << 20) * ((1 << 20) - 1) // 2)]
