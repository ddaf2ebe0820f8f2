"""Checkpoint safety: checksums, atomic writes under a file-size limit, weights-only loading of
malicious pickles, resume fallback, the run lock, resume config checks, index/pruning,
averaging and loading a run directory for inference.
"""

from __future__ import annotations

import copy
import errno
import io
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mtcli import checkpoint as ck
from mtcli import rundir as rd
from mtcli.checkpoint import load_checkpoint, save_checkpoint
from mtcli.config import Config, ConfigError, DataConfig, load_config, save_config
from mtcli.errors import CheckpointError, RunLockedError
from mtcli.infer.averaging import average_checkpoints, average_run_checkpoints
from mtcli.infer.loading import load_for_inference
from mtcli.logs import get_logger
from mtcli.rundir import prune_checkpoints, read_index, update_index
from mtcli.runlock import RunLock
from mtcli.train.resume import check_resume_config, find_resume_checkpoint, remove_stale_temp_files

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


def toy_state(step: int, seed: int = 0, vocab: dict | None = None) -> dict:
    """A checkpoint state with the trainer's layout, on tiny tensors."""
    g = torch.Generator().manual_seed(seed)
    return {
        "format": 1,
        "step": step,
        "epoch": step // 10,
        "model": {
            "layer.weight": torch.randn(4, 3, generator=g),
            "layer.bias": torch.randn(3, generator=g),
            "half": torch.randn(5, generator=g).to(torch.float16),
            "counter": torch.tensor([step, seed], dtype=torch.int64),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(4, 3, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-9, "params": [0]}],
        },
        "scheduler": {"last_epoch": step, "_step_count": step + 1},
        "rng": {"torch": torch.get_rng_state(), "python": (3, tuple(range(5)), None)},
        "data_state": {"epoch": 0, "position": step * 7},
        "train_state": {"best_bleu": 1.5, "bad_validations": 0},
        "config": {"model": {"d_model": 32}},
        "vocab": vocab if vocab is not None else {"size": 64, "spm_sha256": "ab" * 32},
        "valid": {"loss": 2.0, "bleu": None},
    }


def assert_same(a: object, b: object) -> None:
    """Recursive equality with exact tensor comparison."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def log_lines():
    """Messages logged on the mtcli logger during the test (independent of propagation)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = get_logger()
    handler, old_level = _Keep(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lambda: [r.getMessage() for r in records]
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def run_python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs,
    )


# --------------------------------------------------------------------------- save / load


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = toy_state(7, seed=1)
    path = tmp_path / "run" / "checkpoints" / "checkpoint_7.pt"
    save_checkpoint(path, state)
    assert path.read_bytes().startswith(ck.MAGIC + b" 1 sha256=")
    assert_same(state, load_checkpoint(path))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_overwrite_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(1, seed=1))
    save_checkpoint(path, toy_state(2, seed=2))
    assert_same(toy_state(2, seed=2), load_checkpoint(path))


@pytest.mark.parametrize("keep", [0, 10, 40, 0.5, -1])
def test_truncated_checkpoint_is_detected(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(3))
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) - 1)
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    message = one_line(exc)
    expected = "empty (0 bytes), not a checkpoint" if cut == 0 else "checksum mismatch (corrupted or truncated"
    assert str(path) in message and expected in message


def test_bytes_appended_after_the_payload_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(3))
    data = path.read_bytes()
    size = len(data) - data.index(b"\n") - 1
    path.write_bytes(data + b"x")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert f"checksum mismatch (corrupted or truncated: {size + 1} of {size} payload bytes)" in one_line(exc)


def test_a_checkpoint_saved_over_after_loading_is_not_named_as_loaded(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(3, seed=1))
    _, payload_sha256 = ck.load_checkpoint_with_id(path)
    assert ck.sha256_of_loaded(path, payload_sha256) == hashlib.sha256(path.read_bytes()).hexdigest()
    save_checkpoint(path, toy_state(4, seed=2))  # a training run saving over it
    with pytest.raises(CheckpointError, match="c.pt: replaced while it was being read"):
        ck.sha256_of_loaded(path, payload_sha256)


@pytest.mark.parametrize("where", ["payload-start", "payload-middle", "payload-end", "digest"])
def test_bit_flip_is_detected(tmp_path: Path, where: str) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(3))
    data = bytearray(path.read_bytes())
    header_end = data.index(b"\n") + 1
    offset = {
        "payload-start": header_end,
        "payload-middle": (header_end + len(data)) // 2,
        "payload-end": len(data) - 1,
        "digest": data.index(b"sha256=") + 10,
    }[where]
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch") as exc:
        load_checkpoint(path)
    assert str(path) in one_line(exc)


def test_missing_file_and_unheadered_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found") as exc:
        load_checkpoint(tmp_path / "nope.pt")
    assert "nope.pt" in one_line(exc)
    plain = tmp_path / "plain.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, plain)
    with pytest.raises(CheckpointError, match="no checksum header"):
        load_checkpoint(plain)


def test_save_refuses_state_that_weights_only_cannot_load(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "c.pt"
    save_checkpoint(path, toy_state(1))
    bad = toy_state(2)
    bad["rng"]["numpy"] = np.random.get_state()
    with pytest.raises(CheckpointError) as exc:
        save_checkpoint(path, bad)
    assert "state['rng']['numpy']" in one_line(exc) and "numpy.ndarray" in str(exc.value)
    assert_same(toy_state(1), load_checkpoint(path))


# --------------------------------------------------------------------------- untrusted pickles


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_malicious_payload_is_live_when_unpickled_unsafely(tmp_path: Path) -> None:
    # Control: proves the payload used below really runs code under a plain pickle.load.
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps({"model": _Payload(marker)}))
    assert marker.exists()


@pytest.mark.parametrize("container", ["torch.save", "pickle"])
def test_malicious_checkpoint_with_valid_checksum_is_refused(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    state = {"format": 1, "model": {"w": _Payload(marker)}}
    if container == "torch.save":
        torch.save(state, buffer)
    else:
        pickle.dump(state, buffer, protocol=2)
    payload = buffer.getvalue()
    path = tmp_path / "evil.pt"
    path.write_bytes(ck._frame(payload) + payload)  # a correct checksum: integrity is not trust
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    message = one_line(exc)
    assert str(path) in message and "refused" in message and "system" in message
    assert not marker.exists()


@pytest.mark.parametrize("container", ["torch.save", "pickle"])
def test_malicious_file_without_checksum_is_refused(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    state = {"model": {"w": _Payload(marker)}}
    if container == "torch.save":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert str(path) in one_line(exc)
    assert not marker.exists()
    # resume never picks it either
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.replace(path, run / "checkpoints" / rd.LAST_NAME)
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        find_resume_checkpoint(run)
    assert not marker.exists()


def test_yaml_config_with_python_tag_is_rejected_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "yaml-pwned"
    config = tmp_path / "evil.yaml"
    command = f"touch {shlex.quote(str(marker))}"
    config.write_text(
        "data: !!python/object/apply:os.system [" + json.dumps(command) + "]\n", encoding="utf-8"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(config)
    assert exc.value.exit_code == 2 and str(config) in one_line(exc)
    assert not marker.exists()
    # the config module reads YAML with the safe loader only (mtcli.yamlfile's: it refuses repeated keys too)
    import yaml

    from mtcli import yamlfile

    source = (REPO / "mtcli" / "config.py").read_text(encoding="utf-8")
    assert "load_yaml(" in source and "yaml.load(" not in source and "unsafe_load" not in source
    assert issubclass(yamlfile._Loader, yaml.SafeLoader) and "unsafe_load" not in Path(yamlfile.__file__).read_text()


# --------------------------------------------------------------------------- out of space


_SAVE_UNDER_LIMIT = """
import resource, signal, sys
from pathlib import Path
import torch
from mtcli.checkpoint import save_checkpoint
from mtcli.errors import CheckpointError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write must fail with EFBIG, not kill us
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    save_checkpoint(Path(sys.argv[1]), {"model": {"w": torch.ones(200_000)}})
except CheckpointError as exc:
    print(exc)
    sys.exit(3)
sys.exit(0)
"""


def test_write_failure_under_file_size_limit_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / rd.LAST_NAME
    previous = toy_state(5, seed=3)
    save_checkpoint(path, previous)
    proc = run_python(_SAVE_UNDER_LIMIT, str(path), str(64 * 1024))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (out, err)
    assert str(path) in out and "File too large" in out and f"; {rd.LAST_NAME} is unchanged" in out
    assert_same(previous, load_checkpoint(path))
    assert sorted(p.name for p in path.parent.iterdir()) == [rd.LAST_NAME]


def test_unwritable_destination_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(CheckpointError, match="cannot write checkpoint") as exc:
        save_checkpoint(blocker / rd.LAST_NAME, toy_state(1))
    assert str(blocker / rd.LAST_NAME) in one_line(exc)


def test_a_failed_write_names_the_files_left_unchanged_only_when_they_were_there(tmp_path: Path) -> None:
    (tmp_path / "somedir").mkdir()  # `mtcli average -o <a directory>`
    with pytest.raises(CheckpointError, match="cannot write checkpoint") as exc:
        save_checkpoint(tmp_path / "somedir", toy_state(1))
    assert str(tmp_path / "somedir") in one_line(exc) and "unchanged" not in one_line(exc)
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(CheckpointError, match="cannot write checkpoint") as exc:
        save_checkpoint(blocker / rd.LAST_NAME, toy_state(1))
    assert "unchanged" not in one_line(exc)
    last, step_file = tmp_path / rd.LAST_NAME, tmp_path / "checkpoint_7.pt"
    save_checkpoint(last, toy_state(5, seed=2))
    with pytest.raises(CheckpointError, match="cannot write checkpoint") as exc:  # a new step file, a kept last
        save_checkpoint(step_file, toy_state(7), also=[last, blocker / "x.pt"])
    assert str(blocker / "x.pt") in one_line(exc) and one_line(exc).endswith(f"; {rd.LAST_NAME} is unchanged")


def test_also_names_the_same_bytes_and_survives_pruning(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    step_file, last, best = directory / "checkpoint_7.pt", directory / rd.LAST_NAME, directory / "checkpoint_best.pt"
    save_checkpoint(last, toy_state(5, seed=2))  # an older last, replaced
    save_checkpoint(step_file, toy_state(7, seed=1), also=[best, last])
    assert last.samefile(step_file) and best.samefile(step_file)  # written once
    step_file.unlink()  # pruning the step file leaves the other names intact
    assert_same(toy_state(7, seed=1), load_checkpoint(last))
    assert sorted(p.name for p in directory.iterdir()) == sorted([rd.LAST_NAME, best.name])  # no temp file


def test_also_copies_where_hard_links_fail(tmp_path: Path, monkeypatch) -> None:
    def no_links(*_args, **_kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    directory = tmp_path / "checkpoints"
    monkeypatch.setattr(os, "link", no_links)
    save_checkpoint(directory / "checkpoint_3.pt", toy_state(3, seed=4), also=[directory / rd.LAST_NAME])
    assert not (directory / rd.LAST_NAME).samefile(directory / "checkpoint_3.pt")
    assert_same(toy_state(3, seed=4), load_checkpoint(directory / rd.LAST_NAME))


def test_also_failure_names_the_file_and_keeps_the_previous_one(tmp_path: Path, monkeypatch) -> None:
    def no_links(*_args, **_kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    directory = tmp_path / "checkpoints"
    previous = toy_state(2, seed=5)
    save_checkpoint(directory / rd.LAST_NAME, previous)
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(shutil, "copyfileobj", disk_full)  # the copy fallback hits a full disk
    with pytest.raises(CheckpointError, match="No space left on device") as exc:
        save_checkpoint(directory / "checkpoint_4.pt", toy_state(4, seed=6), also=[directory / rd.LAST_NAME])
    assert one_line(exc).startswith(f"{directory / rd.LAST_NAME}: cannot write checkpoint")
    assert_same(previous, load_checkpoint(directory / rd.LAST_NAME))
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint_4.pt", rd.LAST_NAME]


# --------------------------------------------------------------------------- resume


def _write_run(run: Path, steps: list[int], last: int | None = None) -> None:
    for step in steps:
        save_checkpoint(run / "checkpoints" / rd.step_checkpoint_name(step), toy_state(step, seed=step))
    if last is not None:
        save_checkpoint(run / "checkpoints" / rd.LAST_NAME, toy_state(last, seed=last))


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_uses_last_when_intact(tmp_path: Path) -> None:
    assert find_resume_checkpoint(tmp_path / "empty") is None
    _write_run(tmp_path, [10, 20], last=25)
    path, state = find_resume_checkpoint(tmp_path)
    assert path.name == rd.LAST_NAME and state["step"] == 25


def test_a_change_of_process_count_is_said() -> None:
    from mtcli.train.resume import process_change, resume_changes

    assert process_change({"world_size": 2}, 2, 1) is None and process_change({}, 1, 1) is None
    assert process_change({"rng_ranks": [{}, {}]}, 1, 1) == ("processes: 2 -> 1 (each update 1/2 the size; resume "
                                                             "no longer exact)")  # a checkpoint before world_size
    # two processes of one batch each, resumed by one process of two batches: the same update
    new = Config(DataConfig(name="toy", src_lang="en", tgt_lang="de")).to_dict()
    saved = {"world_size": 2, "config": copy.deepcopy(new)}
    new["train"]["update_freq"] = 2
    changes = resume_changes(saved, new, 1, "ckpt")
    assert changes[-1] == ("processes: 2 -> 1 with train.update_freq 1 -> 2: each update as large as before "
                           "(resume no longer exact where dropout is on: each process draws its own masks)")
    assert not any(change.startswith("train.update_freq") for change in changes)
    new["train"]["update_freq"] = 3
    changes = resume_changes(saved, new, 1, "ckpt")
    assert "train.update_freq: 1 -> 3 (resume no longer exact)" in changes
    assert changes[-1] == "processes: 2 -> 1 (each update 3/2 the size; resume no longer exact)"
    # the README's move from one process to two of half the batch: as large (it said "2/1 the size")
    one = {"world_size": 1, "data_state": {"max_tokens": 512}, "config": copy.deepcopy(new)}
    one["config"]["train"].update(update_freq=1, max_tokens=512)
    new["train"].update(update_freq=1, max_tokens=256)
    changes = resume_changes(one, new, 2, "ckpt")
    assert changes[-1] == ("processes: 1 -> 2 with train.max_tokens 512 -> 256: each update as large as before "
                           "(resume no longer exact where dropout is on: each process draws its own masks)")
    assert "train.max_tokens: 512 -> 256 (resume no longer exact)" in changes  # the epoch's rest batched anew
    new["train"]["max_tokens"] = 512
    assert resume_changes(one, new, 2, "ckpt")[-1] == ("processes: 1 -> 2 (each update 2x the size; resume no "
                                                       "longer exact)")
    # packed rows of 128 slots: 1 x 25,000 tokens is 195 rows, 16 x 1,600 is 16 x 12 = 192 rows,
    # a little smaller (by the budgets alone it was "128/125 the size", larger)
    one["config"]["train"].update(max_tokens=25000, pack_length=128)
    new["train"].update(max_tokens=1600, pack_length=128)
    assert resume_changes(one, new, 16, "ckpt")[-1] == ("processes: 1 -> 16 (each update 64/65 the size; resume "
                                                        "no longer exact)")


def test_resume_takes_a_step_checkpoint_newer_than_the_last(tmp_path: Path) -> None:
    """A stop after checkpoint_20.pt was written, before it was linked as checkpoint_last.pt
    (still step 10): 10 steps were trained again."""
    _write_run(tmp_path, [10, 20], last=10)
    path, state = find_resume_checkpoint(tmp_path)
    assert path.name == "checkpoint_20.pt" and state["step"] == 20


def test_resume_falls_back_to_newest_intact_checkpoint(tmp_path: Path, log_lines) -> None:
    _write_run(tmp_path, [10, 20, 30], last=35)
    _corrupt(tmp_path / "checkpoints" / rd.LAST_NAME)
    (tmp_path / "checkpoints" / "checkpoint_30.pt").write_bytes(b"MTCLI-CHECKPOINT 1 sha")  # truncated
    path, state = find_resume_checkpoint(tmp_path)
    assert path.name == "checkpoint_20.pt" and state["step"] == 20
    assert_same(toy_state(20, seed=20), state)
    text = "\n".join(log_lines())
    assert "checkpoint_last.pt" in text and "checkpoint_30.pt" in text
    assert "resuming from checkpoint_20.pt (step 20)" in text


def test_resume_with_every_checkpoint_corrupt_is_an_error(tmp_path: Path) -> None:
    _write_run(tmp_path, [10], last=12)
    _corrupt(tmp_path / "checkpoints" / rd.LAST_NAME)
    _corrupt(tmp_path / "checkpoints" / "checkpoint_10.pt")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as exc:
        find_resume_checkpoint(tmp_path)
    assert "checkpoint_10.pt" in one_line(exc)


def test_remove_stale_temp_files(tmp_path: Path) -> None:
    _write_run(tmp_path, [10], last=10)
    leftover = tmp_path / "checkpoints" / ".checkpoint_last.pt.abc123.tmp"
    leftover.write_bytes(b"half a checkpoint")
    dead = 9_999_999  # above Linux's largest pid (4,194,304): never alive
    (tmp_path / "text").mkdir()
    killed = [tmp_path / f".config.yaml.p{dead}-ab12cd34.tmp", tmp_path / "text" / f".test.src.p{dead}-ab12cd34.tmp"]
    killed.append(tmp_path / "checkpoints" / f".checkpoint_20.pt.p{os.getpid()}-ab12cd34.tmp")  # pid reused: ours
    averaging = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # an average under way
    live = tmp_path / "checkpoints" / f".checkpoint_avg_last2.pt.p{averaging.pid}-ab12cd34.tmp"
    for path in (*killed, live):
        path.write_bytes(b"half a file")
    try:
        assert sorted(remove_stale_temp_files(tmp_path)) == sorted([leftover, *killed])
    finally:
        averaging.kill()
        averaging.wait()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted([rd.LAST_NAME, "checkpoint_10.pt",
                                                                                   live.name])


# --------------------------------------------------------------------------- run lock


def test_lock_holds_pid_host_time_and_is_released(tmp_path: Path) -> None:
    with RunLock(tmp_path) as lock:
        info = json.loads((tmp_path / "train.lock").read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and info["started"]
        with pytest.raises(RunLockedError) as exc:
            RunLock(tmp_path).acquire()
        assert f"pid {os.getpid()}" in one_line(exc) and socket.gethostname() in str(exc.value)
        assert lock.held
    assert not (tmp_path / "train.lock").exists()


_HOLD_LOCK = """
import sys, time
from mtcli.runlock import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_lock_refused_while_live_process_holds_it_then_taken_after_kill(tmp_path: Path, log_lines) -> None:
    proc = run_python(_HOLD_LOCK, str(tmp_path))
    try:
        assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
        with pytest.raises(RunLockedError) as exc:
            with RunLock(tmp_path):
                pass
        message = one_line(exc)
        assert f"pid {proc.pid}" in message and socket.gethostname() in message and "since" in message
        # SIGKILL left the lock behind: it is stale now and is taken over, also while the killed
        # process waits to be reaped (a zombie still answers kill(pid, 0): it was "in use")
        proc.send_signal(signal.SIGKILL)
        stat = Path(f"/proc/{proc.pid}/stat")
        deadline = time.monotonic() + 30
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # (no /proc: reaped or not)
        assert (tmp_path / "train.lock").exists()
        with RunLock(tmp_path):
            assert json.loads((tmp_path / "train.lock").read_text())["pid"] == os.getpid()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert any("stale lock" in m and f"pid {proc.pid} is not running" in m for m in log_lines())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_of_dead_pid_is_taken_over(tmp_path: Path, log_lines) -> None:
    pid = _dead_pid()
    (tmp_path / "train.lock").write_text(
        json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2024-01-01T00:00:00"})
    )
    with RunLock(tmp_path):
        assert json.loads((tmp_path / "train.lock").read_text())["pid"] == os.getpid()
    assert any("stale lock" in m and str(pid) in m for m in log_lines())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_lock_of_reused_pid_is_stale(tmp_path: Path) -> None:
    # The pid is alive (it is us) but its process started at another time: a reused pid.
    (tmp_path / "train.lock").write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "x", "proc_start": 1})
    )
    with RunLock(tmp_path) as lock:
        assert lock.held


def test_lock_from_before_a_reboot_is_stale_though_its_pid_is_alive_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import mtcli.runlock as runlock

    monkeypatch.setattr(runlock, "_boot_id", lambda: "this-boot")
    lock = {"pid": os.getpid(), "host": socket.gethostname(), "started": "x"}  # no proc_start: an older lock
    (tmp_path / "train.lock").write_text(json.dumps({**lock, "boot_id": "this-boot"}))
    with pytest.raises(RunLockedError):  # its pid alive since this boot: held
        RunLock(tmp_path).acquire()
    (tmp_path / "train.lock").write_text(json.dumps({**lock, "boot_id": "an-earlier-boot"}))
    with RunLock(tmp_path) as taken:
        assert taken.held


def test_lock_from_another_host_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.lock").write_text(
        json.dumps({"pid": 4242, "host": "gpu-node-7", "started": "2024-01-01T00:00:00"})
    )
    with pytest.raises(RunLockedError) as exc:
        RunLock(tmp_path).acquire()
    assert "pid 4242 on host gpu-node-7 since 2024-01-01T00:00:00" in one_line(exc)


def test_unreadable_lock_is_refused_while_fresh_and_taken_over_when_old(tmp_path: Path) -> None:
    lock_file = tmp_path / "train.lock"
    lock_file.write_bytes(b"")  # a holder between O_EXCL create and its write
    with pytest.raises(RunLockedError, match="unknown process"):
        RunLock(tmp_path).acquire()
    os.utime(lock_file, (1_000_000, 1_000_000))
    with RunLock(tmp_path):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path: Path) -> None:
    lock = RunLock(tmp_path).acquire()
    other = json.dumps({"pid": 1, "host": "elsewhere", "token": "other"})
    (tmp_path / "train.lock").write_text(other)
    lock.release()
    assert (tmp_path / "train.lock").read_text() == other


# --------------------------------------------------------------------------- resume config


@pytest.fixture
def toy_dict(toy_config_path: Path) -> dict:
    return load_config(toy_config_path).to_dict()


def test_resume_config_identical_and_safe_changes(toy_dict: dict) -> None:
    assert check_resume_config(toy_dict, copy.deepcopy(toy_dict)) == []
    new = copy.deepcopy(toy_dict)
    new["train"]["max_steps"] = toy_dict["train"]["max_steps"] * 2
    new["train"]["log_every"] = 7
    new["train"]["device"] = "cuda"  # as configured: what it runs on is compared as run
    new["decode"]["beam_size"] = 7
    new["train"]["adam_betas"] = tuple(toy_dict["train"]["adam_betas"])  # list vs tuple: same
    new["train"]["run_dir"] = "elsewhere"  # the run resumed was found where it is: not a change to log
    changes = check_resume_config(toy_dict, new)
    assert changes == [
        f"decode.beam_size: {toy_dict['decode']['beam_size']!r} -> 7",
        "train.device: 'auto' -> 'cuda'",
        f"train.log_every: {toy_dict['train']['log_every']} -> 7",
        f"train.max_steps: {toy_dict['train']['max_steps']} -> {new['train']['max_steps']}",
    ]


def test_resume_config_inexact_changes_are_allowed_and_flagged(toy_dict: dict) -> None:
    new = copy.deepcopy(toy_dict)
    new["train"]["update_freq"] = 2
    new["model"]["dropout"] = 0.3
    changes = check_resume_config(toy_dict, new)
    assert changes == [
        f"model.dropout: {toy_dict['model']['dropout']!r} -> 0.3 (resume no longer exact)",
        "train.update_freq: 1 -> 2 (resume no longer exact)",
    ]


def test_a_resume_on_other_threads_or_another_device_is_inexact_as_run_not_as_configured(toy_dict: dict) -> None:
    """num_threads 0 -> 2 on a 2-core machine was labelled inexact and matched to the bit, while
    the default 0 on a machine of another core count was labelled nothing, every tensor apart."""
    import torch

    from mtcli.train.resume import hardware, resume_changes

    here = hardware(torch.device("cpu"))
    assert here == {"device": "cpu", "threads": torch.get_num_threads()}
    new = copy.deepcopy(toy_dict)
    new["train"]["num_threads"], new["train"]["device"] = 2, "cpu"  # said, but the same as run
    state = {"config": toy_dict, "hardware": dict(here)}
    assert resume_changes(state, new, 1, "ckpt", here) == [
        "train.device: 'auto' -> 'cpu'", f"train.num_threads: {toy_dict['train']['num_threads']} -> 2"]
    state["hardware"]["threads"] = here["threads"] + 1  # the same config, other threads
    assert resume_changes(state, toy_dict, 1, "ckpt", here) == [
        f"threads: {here['threads'] + 1} -> {here['threads']} (resume no longer exact)"]
    state["hardware"] = {"device": "cuda (NVIDIA H100 80GB HBM3)"}
    assert resume_changes(state, toy_dict, 1, "ckpt", here) == [
        "device: cuda (NVIDIA H100 80GB HBM3) -> cpu (resume no longer exact)"]
    assert resume_changes({"config": toy_dict}, toy_dict, 1, "ckpt", here) == []  # a checkpoint from before:
    assert resume_changes({"config": toy_dict}, new, 1, "ckpt", here) == [  # the config's word for it
        "train.device: 'auto' -> 'cpu' (resume no longer exact)",
        f"train.num_threads: {toy_dict['train']['num_threads']} -> 2 (resume no longer exact)"]


def test_a_longer_run_under_a_cooldown_is_no_longer_exact(toy_dict: dict) -> None:
    """The cooldown's last updates count back from max_steps: a new max_steps moves them."""
    new = copy.deepcopy(toy_dict)
    new["train"]["max_steps"] = toy_dict["train"]["max_steps"] * 2
    assert check_resume_config(toy_dict, new)[0].endswith(f"-> {new['train']['max_steps']}")
    toy_dict["train"]["cooldown_steps"] = new["train"]["cooldown_steps"] = 5
    assert check_resume_config(toy_dict, new)[0].endswith("(resume no longer exact)")


@pytest.mark.parametrize(("key", "value"), [("subword_alpha", 0.1), ("subword_nbest", 8), ("subword_sides", "source")])
def test_resume_refuses_a_change_of_segmentation_sampling(toy_dict: dict, key: str, value: object) -> None:
    """Sampled segmentations make an epoch's lengths and batches: the saved position would
    repeat some pairs and skip others (728 twice and 645 never, turned on mid-epoch)."""
    new = copy.deepcopy(toy_dict)
    new["train"][key] = value
    with pytest.raises(CheckpointError, match=f"train.{key}"):
        check_resume_config(toy_dict, new)


def test_a_key_the_checkpoint_predates_says_so_and_how_to_resume(toy_dict: dict) -> None:
    """A Chinese-target run trained before data.spm_normalization existed (with nmt_nfkc): its
    unchanged recipe now means identity. Refused, saying the old value came from before the key."""
    saved = copy.deepcopy(toy_dict)
    saved["data"].pop("spm_normalization", None)
    new = copy.deepcopy(toy_dict)
    new["data"]["spm_normalization"] = "identity"
    with pytest.raises(CheckpointError, match=r"data.spm_normalization: 'nmt_nfkc' \(from before the key existed\) "
                                              r"-> 'identity' \(restore them, setting a key from before it existed"):
        check_resume_config(saved, new)
    assert check_resume_config(saved, {**new, "data": {**new["data"], "spm_normalization": "nmt_nfkc"}}) == []


def test_a_key_the_run_had_that_this_mtcli_no_longer_has_is_named_so(toy_dict: dict) -> None:
    """Such a key read "train.bf16: True -> '<unset>'", as if the user had unset it."""
    saved = copy.deepcopy(toy_dict)
    saved["train"]["bf16"] = True
    saved["model"]["gone"] = 1
    with pytest.raises(CheckpointError, match=r"cannot resume: .*: model.gone: 1, a key this mtcli no longer has "
                                              r"\(restore them"):
        check_resume_config(saved, toy_dict)
    del saved["model"]["gone"]
    assert check_resume_config(saved, toy_dict) == [
        "train.bf16: True, a key this mtcli no longer has (resume no longer exact)"]


def test_a_changed_corpus_of_data_sources_is_named_alone(toy_dict: dict) -> None:
    """One corpus's weight changed: the refusal names it, not both lists whole (1,100 characters)."""
    sources = [{"source": "a", "weight": 1.0, "tag": None, "langs": ["en", "de"], "hub_config": None},
               {"source": "b", "weight": 0.5, "tag": "<bt>", "langs": ["en", "de"], "hub_config": None}]
    saved, new = copy.deepcopy(toy_dict), copy.deepcopy(toy_dict)
    saved["data"]["sources"], new["data"]["sources"] = sources, copy.deepcopy(sources)
    new["data"]["sources"][1]["weight"] = 0.6
    with pytest.raises(CheckpointError, match=r"changes keys the checkpoint depends on: data.sources\[1\].weight: "
                                              r"0.5 -> 0.6 \(restore"):
        check_resume_config(saved, new)
    added = copy.deepcopy(new)  # a corpus added: named alone too
    added["data"]["sources"] = [*sources, {"source": "c", "langs": ["de", "en"]}]
    with pytest.raises(CheckpointError, match=r"depends on: data.sources\[2\]: added \{'source': 'c', 'langs': "
                                              r"\['de', 'en'\]\} \(restore"):
        check_resume_config(saved, added)
    with pytest.raises(CheckpointError, match=r"depends on: data.sources\[1\]: removed \{'source': 'b'"):
        check_resume_config(saved, {**new, "data": {**new["data"], "sources": sources[:1]}})
    moved = copy.deepcopy(saved)  # the same corpora read from elsewhere: the pairs' sha256 decides
    moved["data"]["sources"][0]["source"], moved["data"]["source"] = "/copy/a", "/copy"
    assert check_resume_config(saved, moved, content_kept=True) == [
        f"data.source: {saved['data']['source']!r} -> '/copy'", "data.sources[0].source: 'a' -> '/copy/a'"]
    with pytest.raises(CheckpointError, match=r"depends on: data.source: .* -> '/copy'; data.sources\[0\].source"):
        check_resume_config(saved, moved)  # a checkpoint that records no pairs' sha256: refused as before
    moved["data"]["sources"][0]["weight"] = 2.0  # and something more than the place: refused
    with pytest.raises(CheckpointError, match=r"depends on: data.sources\[0\].source: 'a' -> '/copy/a'; data."
                                              r"sources\[0\].weight"):
        check_resume_config(saved, moved, content_kept=True)


def test_resume_config_refuses_shape_vocab_and_data_stream_changes(toy_dict: dict) -> None:
    new = copy.deepcopy(toy_dict)
    new["model"]["d_model"] = 96
    new["data"]["vocab_size"] = 128
    new["data"]["source"] = "elsewhere"
    new["train"]["seed"] = 2
    new["train"]["max_steps"] = 999  # safe, but the refusal wins
    with pytest.raises(CheckpointError) as exc:
        check_resume_config(toy_dict, new, where="data/runs/toy")
    message = one_line(exc)
    assert message.startswith("data/runs/toy: cannot resume")
    for text in ("model.d_model: 64 -> 96", "data.vocab_size: 64 -> 128",
                 "data.source: 'tests/fixtures/toy' -> 'elsewhere'", "train.seed: 1 -> 2"):
        assert text in message
    assert "max_steps" not in message


def test_max_tokens_changes_only_where_the_checkpoint_saved_its_batch_budget(toy_dict: dict) -> None:
    new = copy.deepcopy(toy_dict)
    new["train"]["max_tokens"] //= 2
    with pytest.raises(CheckpointError, match=r"train.max_tokens: 512 -> 256"):
        check_resume_config(toy_dict, new)  # an older checkpoint: its position is a batch index alone
    assert check_resume_config(toy_dict, new, rebatchable=True) == [
        "train.max_tokens: 512 -> 256 (resume no longer exact)"]


def test_resume_config_missing_saved_key_counts_as_default(toy_dict: dict) -> None:
    saved = copy.deepcopy(toy_dict)
    del saved["train"]["max_nonfinite"], saved["model"]["pre_norm"]
    assert check_resume_config(saved, toy_dict) == []
    new = copy.deepcopy(toy_dict)
    new["model"]["pre_norm"] = True
    with pytest.raises(CheckpointError, match=r"model.pre_norm: False \(from before the key existed\) -> True"):
        check_resume_config(saved, new)


# --------------------------------------------------------------------------- index and pruning


def test_index_round_trip_and_recovery(tmp_path: Path, log_lines) -> None:
    assert read_index(tmp_path) == {}
    update_index(tmp_path, 10, {"loss": 3.5, "bleu": 1.25})
    update_index(tmp_path, 20, {"loss": 3.0, "bleu": None})
    update_index(tmp_path, 10, {"loss": 3.4, "bleu": 1.5})
    assert read_index(tmp_path) == {
        10: {"file": "checkpoint_10.pt", "loss": 3.4, "bleu": 1.5},
        20: {"file": "checkpoint_20.pt", "loss": 3.0, "bleu": None},
    }
    index = tmp_path / "checkpoints" / "index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json"):
        read_index(tmp_path)
    update_index(tmp_path, 30, {"loss": 2.0})
    assert list(read_index(tmp_path)) == [30]
    assert any("rebuilding it from the step checkpoints" in m for m in log_lines())


def test_an_unreadable_index_is_rebuilt_and_keep_best_keeps_the_best(tmp_path: Path) -> None:
    """Rebuilt from the next entry on, the index forgot the best step, which keep_best pruned."""
    for step, bleu in [(10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0)]:
        save_checkpoint(tmp_path / "checkpoints" / rd.step_checkpoint_name(step),
                        {**toy_state(step), "valid": {"loss": 1.0, "bleu": bleu, "by": "bleu"}})
        update_index(tmp_path, step, {"loss": 1.0, "bleu": bleu, "by": "bleu"})
    (tmp_path / "checkpoints" / rd.INDEX_NAME).write_text("{cut sh")
    save_checkpoint(tmp_path / "checkpoints" / "checkpoint_50.pt", toy_state(50))
    update_index(tmp_path, 50, {"loss": 1.0, "bleu": 4.0, "by": "bleu"})
    assert {step: entry["bleu"] for step, entry in read_index(tmp_path).items()} == {
        10: 1.0, 20: 9.0, 30: 2.0, 40: 3.0, 50: 4.0}
    prune_checkpoints(tmp_path, keep_last=1, keep_best=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["checkpoint_20.pt", "checkpoint_50.pt"]


def test_averaging_goes_on_past_an_unreadable_index(tmp_path: Path, log_lines) -> None:
    """average --last stopped at a damaged index.json that it reads for a warning only, and
    --best at one the step checkpoints' own scores rebuild (as the next training step does)."""
    from mtcli.rundir import select_checkpoints

    for step, bleu in [(10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0)]:
        save_checkpoint(tmp_path / "checkpoints" / rd.step_checkpoint_name(step),
                        {**toy_state(step), "valid": {"loss": 1.0, "bleu": bleu, "by": "bleu"}})
        update_index(tmp_path, step, {"loss": 1.0, "bleu": bleu, "by": "bleu"})
    (tmp_path / "checkpoints" / rd.INDEX_NAME).write_text("{bad")
    assert [p.name for p in select_checkpoints(tmp_path, last=2)] == ["checkpoint_30.pt", "checkpoint_40.pt"]
    assert [p.name for p in select_checkpoints(tmp_path, best=2)] == ["checkpoint_20.pt", "checkpoint_40.pt"]
    said = [m for m in log_lines() if "unreadable checkpoint index" in m]
    assert len(said) == 2 and said[0].endswith("; the last 2 by their names")
    assert said[1].endswith("; ranking the step checkpoints by the scores each keeps")


@pytest.mark.parametrize(("entry", "said"), [
    ({"file": "checkpoint_10.pt", "bleu": "x"}, "bleu is 'x', not a number"),  # was a ValueError traceback
    ({"file": "checkpoint_10.pt", "loss": 1.0, "by": ["bleu"]}, "by is ['bleu'], not loss, bleu or chrf"),
    ({"file": "../../other/checkpoints/checkpoint_20.pt", "loss": 1.0},  # read a file of another run
     "file is '../../other/checkpoints/checkpoint_20.pt', not a checkpoint_<step>.pt of this directory"),
])
def test_a_hand_edited_index_entry_is_one_line_naming_it(tmp_path: Path, entry: dict, said: str) -> None:
    index = tmp_path / "checkpoints" / "index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"format": 1, "checkpoints": {"10": entry}}))
    with pytest.raises(CheckpointError, match=re.escape(f"index.json: malformed checkpoint index (step 10: {said})")):
        read_index(tmp_path)


def test_prune_keeps_last_k_and_best(tmp_path: Path) -> None:
    _write_run(tmp_path, [10, 20, 30, 40, 50], last=50)
    save_checkpoint(tmp_path / "checkpoints" / rd.BEST_NAME, toy_state(20))
    for step, bleu in [(10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0), (50, 4.0)]:
        update_index(tmp_path, step, {"loss": 1.0, "bleu": bleu})
    prune_checkpoints(tmp_path, keep_last=2, keep_best=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert names == sorted([rd.LAST_NAME, rd.BEST_NAME, "checkpoint_20.pt", "checkpoint_40.pt", "checkpoint_50.pt"])
    prune_checkpoints(tmp_path, keep_last=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert names == sorted([rd.LAST_NAME, rd.BEST_NAME, "checkpoint_50.pt"])


def test_the_step_files_of_checkpoint_best_and_last_are_never_pruned(tmp_path: Path) -> None:
    """They are hard links to checkpoint_best.pt and checkpoint_last.pt: removing them freed no
    space, and `mtcli average --best 1` then averaged another step, the best's file gone."""
    import os

    from mtcli.rundir import select_checkpoints

    _write_run(tmp_path, [10, 20, 30, 40, 50])
    directory = tmp_path / "checkpoints"
    os.link(directory / "checkpoint_20.pt", directory / rd.BEST_NAME)  # as training links them
    os.link(directory / "checkpoint_50.pt", directory / rd.LAST_NAME)
    for step, bleu in [(10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0), (50, 4.0)]:
        update_index(tmp_path, step, {"loss": 1.0, "bleu": bleu})
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in directory.glob("checkpoint_*[0-9].pt")) == ["checkpoint_20.pt", "checkpoint_50.pt"]
    assert [p.name for p in select_checkpoints(tmp_path, best=1)] == ["checkpoint_20.pt"]


def test_the_best_or_last_k_pruned_from_disk_are_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--average-best / --average-last took the best or newest K of the step files still on
    disk without a word when train.keep_last had pruned the ones the index ranks first."""
    from mtcli.rundir import select_checkpoints

    _write_run(tmp_path, [10, 20, 30, 40, 50], last=50)
    for step, bleu in [(10, 1.0), (20, 9.0), (30, 2.0), (40, 3.0), (50, 4.0)]:
        update_index(tmp_path, step, {"loss": 1.0, "bleu": bleu})
    assert [p.name for p in select_checkpoints(tmp_path, best=2)] == ["checkpoint_20.pt", "checkpoint_50.pt"]
    assert [p.name for p in select_checkpoints(tmp_path, last=2)] == ["checkpoint_40.pt", "checkpoint_50.pt"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    prune_checkpoints(tmp_path, keep_last=1, keep_best=2)  # on disk: 20 and 50
    assert [p.name for p in select_checkpoints(tmp_path, last=2)] == ["checkpoint_20.pt", "checkpoint_50.pt"]
    assert "the last 2 checkpoints by the index are steps 40, 50; 40 is not on disk (removed as train.keep_last " \
           "and train.keep_best say, still being saved by a running training, or never written): using " \
           "checkpoint_20.pt, checkpoint_50.pt" in caplog.text
    caplog.clear()
    prune_checkpoints(tmp_path, keep_last=1)  # on disk: 50
    assert [p.name for p in select_checkpoints(tmp_path, best=1)] == ["checkpoint_50.pt"]
    assert "the best 1 checkpoints by the index are steps 20; 20 is not on disk" in caplog.text
    caplog.clear()
    update_index(tmp_path, 60, {"loss": 0.5, "bleu": None})  # indexed, never written, and without a BLEU:
    assert [p.name for p in select_checkpoints(tmp_path, best=1)] == ["checkpoint_50.pt"]  # ranked by loss
    assert "checkpoints by the index" not in caplog.text  # with it, not BLEU as on disk: no warning of that


def test_checkpoints_scored_otherwise_rank_after_those_scored_as_the_newest(tmp_path: Path) -> None:
    """A resume under more label smoothing: the older, unsmoothed losses were lower, so keep_best
    and --average-best kept them over every newer checkpoint."""
    from mtcli.rundir import select_checkpoints

    _write_run(tmp_path, [10, 20, 30, 40], last=40)
    unsmoothed, smoothed = ({"label_smoothing": ls, "valid_max_sentences": 0} for ls in (0.0, 0.3))
    for step, loss, basis in [(10, 3.0, unsmoothed), (20, 2.9, unsmoothed), (30, 3.6, smoothed), (40, 3.5, smoothed)]:
        update_index(tmp_path, step, {"loss": loss, "bleu": None, "by": "loss", "basis": basis})
    assert [p.name for p in select_checkpoints(tmp_path, best=2)] == ["checkpoint_30.pt", "checkpoint_40.pt"]
    for step in (30, 40):  # BLEU does not see the smoothing: ranked together
        update_index(tmp_path, step, {"loss": 1.0, "bleu": step / 10, "by": "bleu", "basis": smoothed})
    for step in (10, 20):
        update_index(tmp_path, step, {"loss": 1.0, "bleu": step, "by": "bleu", "basis": unsmoothed})
    assert [p.name for p in select_checkpoints(tmp_path, best=2)] == ["checkpoint_10.pt", "checkpoint_20.pt"]


# --------------------------------------------------------------------------- averaging


def _mean(states: list[dict], key: str) -> torch.Tensor:
    total = sum(s["model"][key].to(torch.float64) for s in states)
    return (total / len(states)).to(states[0]["model"][key].dtype)


def test_average_of_three_equals_hand_computed_mean(tmp_path: Path) -> None:
    states = [toy_state(step, seed=step) for step in (10, 20, 30)]
    paths = []
    for state in states:
        paths.append(tmp_path / f"checkpoint_{state['step']}.pt")
        save_checkpoint(paths[-1], state)
    out = average_checkpoints(paths)
    for key in ("layer.weight", "layer.bias", "half"):
        expected = _mean(states, key)
        assert out["model"][key].dtype == states[0]["model"][key].dtype
        assert torch.equal(out["model"][key], expected)
    by_hand = (states[0]["model"]["layer.bias"][0].item() + states[1]["model"]["layer.bias"][0].item()
               + states[2]["model"]["layer.bias"][0].item()) / 3
    assert out["model"]["layer.bias"][0].item() == pytest.approx(by_hand, rel=1e-6)
    assert torch.equal(out["model"]["counter"], states[-1]["model"]["counter"])  # int buffer: last
    assert out["step"] == 30 and out["vocab"] == states[0]["vocab"]
    assert "optimizer" not in out and "rng" not in out and "data_state" not in out
    assert [s["step"] for s in out["averaged_from"]] == [10, 20, 30]


def test_average_refuses_mismatched_checkpoints(tmp_path: Path) -> None:
    a = tmp_path / "a.pt"
    save_checkpoint(a, toy_state(1))
    other_shape = toy_state(2)
    other_shape["model"]["layer.bias"] = torch.zeros(4)
    save_checkpoint(tmp_path / "b.pt", other_shape)
    with pytest.raises(CheckpointError, match=r"layer.bias has shape \(3,\) vs \(4,\)"):
        average_checkpoints([a, tmp_path / "b.pt"])
    missing_key = toy_state(3)
    del missing_key["model"]["half"]
    save_checkpoint(tmp_path / "c.pt", missing_key)
    with pytest.raises(CheckpointError, match="different parameters"):
        average_checkpoints([a, tmp_path / "c.pt"])
    save_checkpoint(tmp_path / "d.pt", toy_state(4, vocab={"size": 80, "spm_sha256": "cd" * 32}))
    with pytest.raises(CheckpointError, match="different vocabularies") as exc:
        average_checkpoints([a, tmp_path / "d.pt"])
    assert "size 64" in one_line(exc) and "size 80" in str(exc.value)
    with pytest.raises(CheckpointError):
        average_checkpoints([])
    relu, swish = toy_state(5), toy_state(6)  # the same shapes, another computation: was averaged
    relu["config"], swish["config"] = {"model": {"activation": "relu"}}, {"model": {"activation": "swish"}}
    save_checkpoint(tmp_path / "relu.pt", relu)
    save_checkpoint(tmp_path / "swish.pt", swish)
    with pytest.raises(CheckpointError, match=r"relu.pt and swish.pt: different models \(model.activation relu "
                                              r"and swish\)"):
        average_checkpoints([tmp_path / "relu.pt", tmp_path / "swish.pt"])
    with pytest.raises(CheckpointError, match="the same checkpoint twice"):
        average_checkpoints([a, a])
    os.link(a, tmp_path / "a_link.pt")  # checkpoint_last.pt beside a step's file, say
    for again in (tmp_path / "a_link.pt", tmp_path / ".." / tmp_path.name / a.name):
        with pytest.raises(CheckpointError, match=f"the same checkpoint twice: {a} and {again}"):
            average_checkpoints([a, again])
    with pytest.raises(TypeError, match="not one path"):
        average_checkpoints(str(a))  # was "a: checkpoint not found", a character at a time


def test_average_run_last_and_best(tmp_path: Path) -> None:
    steps = [10, 20, 30, 40]
    _write_run(tmp_path, steps, last=40)
    bleu = {10: 5.0, 20: 9.0, 30: 7.0, 40: 1.0}
    for step in steps:
        update_index(tmp_path, step, {"loss": 10.0 - step / 10, "bleu": bleu[step]})
    states = {s: toy_state(s, seed=s) for s in steps}

    used = average_run_checkpoints(tmp_path, tmp_path / "avg_last.pt", last=2)
    assert [p.name for p in used] == ["checkpoint_30.pt", "checkpoint_40.pt"]
    averaged = load_checkpoint(tmp_path / "avg_last.pt")
    assert torch.equal(averaged["model"]["layer.weight"], _mean([states[30], states[40]], "layer.weight"))

    used = average_run_checkpoints(tmp_path, tmp_path / "avg_best.pt", best=2)
    assert [p.name for p in used] == ["checkpoint_20.pt", "checkpoint_30.pt"]  # BLEU 9 and 7
    average_run_checkpoints(tmp_path, tmp_path / "avg_best.pt", best=2)  # an average replaces its own file
    notes = tmp_path / "notes.yaml"  # -o of a file of one's own: it became a checkpoint, exit 0
    notes.write_text("mine\n")
    with pytest.raises(CheckpointError, match=r"notes.yaml: a file that is not an mtcli checkpoint, which an average "
                                              r"would replace; write it to a new path, say checkpoint_avg_best2.pt"):
        average_run_checkpoints(tmp_path, notes, best=2)
    assert notes.read_text() == "mine\n"
    averaged = load_checkpoint(tmp_path / "avg_best.pt")
    assert torch.equal(averaged["model"]["layer.weight"], _mean([states[20], states[30]], "layer.weight"))

    # without BLEU everywhere, best falls back to the lowest validation loss (the newest here)
    update_index(tmp_path, 40, {"loss": 6.0, "bleu": None})
    assert [p.name for p in rd.select_checkpoints(tmp_path, best=2)] == ["checkpoint_30.pt", "checkpoint_40.pt"]

    for last, best in [(0, 0), (2, 2)]:
        with pytest.raises(CheckpointError, match="exactly one"):
            average_run_checkpoints(tmp_path, tmp_path / "x.pt", last=last, best=best)
    with pytest.raises(CheckpointError, match="last 9 checkpoints, found 4"):
        average_run_checkpoints(tmp_path, tmp_path / "x.pt", last=9)
    assert not (tmp_path / "x.pt").exists()
    (tmp_path / "plain").mkdir()  # a directory without checkpoints/ is not a run
    with pytest.raises(CheckpointError, match=r"plain: not a run directory \(no checkpoints/\)"):
        average_run_checkpoints(tmp_path / "plain", tmp_path / "x.pt", last=1)
    own = tmp_path / "checkpoints"  # an average there under a training's name broke resume and --last
    for name in (rd.LAST_NAME, rd.BEST_NAME, "checkpoint_99.pt"):
        with pytest.raises(CheckpointError, match=f"{name}: a name of the run's own checkpoints.*write it as "
                                                  "checkpoint_avg_last2.pt"):
            average_run_checkpoints(tmp_path, own / name, last=2)
    average_run_checkpoints(tmp_path, own / "checkpoint_avg_last2.pt", last=2)  # the recipes' name
    other = tmp_path / "other"  # another run's files, and this run's own, are not outputs either
    (other / "checkpoints").mkdir(parents=True)
    for run in (tmp_path, other):
        (run / "config.yaml").write_text("data: {}\n", encoding="utf-8")
    (other / "text").mkdir()
    (other / "text" / "test.src").write_text("ein hund\n", encoding="utf-8")  # what evaluate reads
    for path, role in [(tmp_path / "config.yaml", "the run's config"), (own / "index.json", "its checkpoint index"),
                       (other / "checkpoints" / "checkpoint_last.pt", "a checkpoint training resumes from"),
                       (other / "spm.model", "its SentencePiece model"),
                       (other / "learning_curves.png", "its learning curves"),  # was written over
                       (other / "text" / "test.src", "the run's copy of a validation or test text")]:
        with pytest.raises(CheckpointError, match=f"{path.name}: {role}"):
            average_run_checkpoints(tmp_path, path, last=2)
    assert (tmp_path / "config.yaml").read_text(encoding="utf-8") == "data: {}\n"
    average_run_checkpoints(tmp_path, other / "checkpoints" / "checkpoint_avg_last2.pt", last=2)


def test_cli_average(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    _write_run(tmp_path, [10, 20, 30], last=30)
    runner = CliRunner()
    result = runner.invoke(app, ["average", str(tmp_path), "-o", str(tmp_path / "avg.pt"), "--last", "3"])
    assert result.exit_code == 0, result.output
    assert "averaged 3 checkpoints" in result.output and "checkpoint_30.pt" in result.output
    states = [toy_state(s, seed=s) for s in (10, 20, 30)]
    assert torch.equal(load_checkpoint(tmp_path / "avg.pt")["model"]["layer.bias"], _mean(states, "layer.bias"))
    for flags in ([], ["--last", "2", "--best", "2"]):  # the flags' names, not the library's
        result = runner.invoke(app, ["average", str(tmp_path), "-o", str(tmp_path / "x.pt"), *flags])
        assert result.exit_code == 2 and "give one of --last K or --best K, K > 0 (got --last" in result.output
        assert not (tmp_path / "x.pt").exists()


# --------------------------------------------------------------------------- load_for_inference


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two different SentencePiece models trained on the toy corpus (vocab 64 and 48)."""
    from mtcli.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("spm")
    lines = []
    for name in ("train.src", "train.tgt"):
        lines += (REPO / "tests" / "fixtures" / "toy" / name).read_text(encoding="utf-8").splitlines()
    a = Tokenizer.train(lines, root / "a", 64, "unigram", 1.0, 0)
    b = Tokenizer.train(lines, root / "b", 48, "unigram", 1.0, 0)
    return a, b


@pytest.fixture
def run_dir(tmp_path: Path, toy_config_path: Path, spm_models: tuple[Path, Path]) -> Path:
    """A run directory with config.yaml and spm.model but no checkpoints yet."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(toy_config_path), run / "config.yaml")
    shutil.copy(spm_models[0], run / "spm.model")
    return run


def _vocab(run: Path) -> dict:
    from mtcli.data.tokenizer import Tokenizer
    from mtcli.fileio import sha256_file

    return {"size": Tokenizer(run / "spm.model").vocab_size, "spm_sha256": sha256_file(run / "spm.model")}


def _model_state(run: Path, step: int, seed: int) -> dict:
    from mtcli.model import Transformer

    config = load_config(run / "config.yaml")
    torch.manual_seed(seed)
    model = Transformer(config.model, _vocab(run)["size"], pad_id=0)
    return {"format": 1, "step": step, "epoch": 0, "model": model.state_dict(),
            "config": config.to_dict(), "vocab": _vocab(run), "valid": {"loss": 1.0, "bleu": None}}


def test_load_for_inference_errors(tmp_path: Path, run_dir: Path, spm_models) -> None:
    with pytest.raises(CheckpointError, match="run directory not found") as exc:
        load_for_inference(tmp_path / "missing")
    assert "missing" in one_line(exc)
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match=r"not a run directory \(no config.yaml\)"):
        load_for_inference(tmp_path / "plain")
    from mtcli.rundir import select_checkpoints
    from mtcli.runlock import RunLock

    with RunLock(tmp_path / "plain"):  # a training in its first seconds: it has not written config.yaml yet
        with pytest.raises(CheckpointError, match=r"plain: no checkpoint yet; it has just started training \(pid "):
            load_for_inference(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"checkpoint not found .*none\); train it first"):
        load_for_inference(run_dir)
    with RunLock(run_dir):  # a training that has not validated yet: said, where it was only "not found"
        with pytest.raises(CheckpointError, match=r"none\); it is still training \(pid \d+ on host .*valid_every"):
            load_for_inference(run_dir)
        with pytest.raises(CheckpointError, match=r"found 0: none; it is still training \(pid \d+ .*valid_every"):
            select_checkpoints(run_dir, last=1)  # mtcli average --last 1 said only "found 0: none"
    save_checkpoint(run_dir / "checkpoints" / "checkpoint_5.pt", toy_state(5, vocab=_vocab(run_dir)))
    with pytest.raises(CheckpointError, match="checkpoint not found") as exc:
        load_for_inference(run_dir, checkpoint="last")
    assert "checkpoint_last.pt" in one_line(exc) and "checkpoints in" in str(exc.value)
    assert "checkpoint_5.pt" in str(exc.value)
    with pytest.raises(CheckpointError, match=r"checkpoints: is a directory, not a checkpoint file \(checkpoints "
                                              r"in it: checkpoint_5.pt\)"):  # was "checkpoint not found"
        load_for_inference(run_dir, checkpoint=str(run_dir / "checkpoints"))
    with pytest.raises(CheckpointError, match=r"is a directory, not a checkpoint file \(checkpoints in "
                                              r".*checkpoints: checkpoint_5.pt\)"):  # a run's: it said "none"
        load_for_inference(run_dir, checkpoint=str(run_dir))
    with pytest.raises(CheckpointError, match=r"^the checkpoint is empty: give best, last"):  # was '.: is a directory'
        load_for_inference(run_dir, checkpoint="")
    # a checkpoint trained with another SentencePiece model
    from mtcli.fileio import sha256_file

    foreign = {"size": 48, "spm_sha256": sha256_file(spm_models[1])}
    save_checkpoint(run_dir / "checkpoints" / rd.LAST_NAME, toy_state(6, vocab=foreign))
    with pytest.raises(CheckpointError, match="does not match") as exc:
        load_for_inference(run_dir, checkpoint="last")
    message = one_line(exc)
    assert "size 48" in message and "size 64" in message and "spm.model" in message
    assert foreign["spm_sha256"][:12] in message and _vocab(run_dir)["spm_sha256"][:12] in message
    # a corrupted checkpoint
    _corrupt(run_dir / "checkpoints" / "checkpoint_5.pt")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_for_inference(run_dir, checkpoint="checkpoint_5.pt")


def test_load_for_inference_builds_eval_model(run_dir: Path, log_lines) -> None:
    pytest.importorskip("mtcli.model")
    ckpts = run_dir / "checkpoints"
    for step in (10, 20):
        save_checkpoint(ckpts / rd.step_checkpoint_name(step), _model_state(run_dir, step, seed=step))
    save_checkpoint(ckpts / rd.LAST_NAME, _model_state(run_dir, 20, seed=20))

    bundle = load_for_inference(run_dir)  # no best yet: falls back to last, and says so
    assert any("no checkpoint_best.pt" in m for m in log_lines())
    assert bundle.name == "checkpoint_last.pt (step 20)" and not bundle.model.training
    assert bundle.tokenizer.vocab_size == 64 and bundle.config.model.d_model == 64
    expected = _model_state(run_dir, 20, seed=20)["model"]
    for key, value in bundle.model.state_dict().items():
        assert torch.equal(value, expected[key]), key

    bundle = load_for_inference(run_dir, checkpoint=str(ckpts / "checkpoint_10.pt"))
    assert bundle.name.startswith("checkpoint_10.pt")

    # saved from a DistributedDataParallel wrapper: "module." names load too; a bare file name
    # is looked up in checkpoints/
    wrapped = _model_state(run_dir, 15, seed=15)
    wrapped["model"] = {f"module.{k}": v for k, v in wrapped["model"].items()}
    save_checkpoint(ckpts / "ddp.pt", wrapped)
    bundle = load_for_inference(run_dir, checkpoint="ddp.pt")
    for key, value in bundle.model.state_dict().items():
        assert torch.equal(value, wrapped["model"][f"module.{key}"]), key

    bundle = load_for_inference(run_dir, average_last=2)
    assert bundle.name.startswith("avg_last2 (")
    a, b = (_model_state(run_dir, s, seed=s)["model"] for s in (10, 20))
    weight = next(k for k, v in a.items() if v.is_floating_point() and v.dim() == 2)
    mean = ((a[weight].double() + b[weight].double()) / 2).float()
    assert torch.equal(bundle.model.state_dict()[weight], mean)
    with pytest.raises(ConfigError, match="give one of --average-last K or --average-best K, not both"):
        load_for_inference(run_dir, average_last=1, average_best=1)  # the options' names, not the library's

    # parameters of another model shape: one-line error
    wrong = _model_state(run_dir, 30, seed=1)
    wrong["model"] = {k: torch.zeros(3) if k == weight else v for k, v in wrong["model"].items()}
    save_checkpoint(ckpts / rd.BEST_NAME, wrong)
    with pytest.raises(CheckpointError, match="do not fit the model") as exc:
        load_for_inference(run_dir, checkpoint="best")
    assert "\n" not in str(exc.value)


def test_the_best_of_equal_scores_is_the_earliest_as_checkpoint_best_keeps_it(tmp_path: Path) -> None:
    """--average-best and keep_best took the newest of a tie, checkpoint_best the earliest."""
    _write_run(tmp_path, [10, 20, 30])
    for step, bleu in ((10, 5.0), (20, 7.0), (30, 7.0)):
        rd.update_index(tmp_path, step, {"loss": 3.0, "bleu": bleu, "by": "bleu"})
    assert [p.name for p in rd.select_checkpoints(tmp_path, best=1)] == ["checkpoint_20.pt"]


def test_the_best_are_ranked_by_the_metric_the_newest_entry_names(tmp_path: Path) -> None:
    """A resume under train.valid_metric chrf: the newest entry's metric ranks them all, not the
    oldest's (by BLEU step 10 would be the best)."""
    _write_run(tmp_path, [10, 20, 30])
    for step, bleu, chrf, by in ((10, 9.0, 30.0, "bleu"), (20, 1.0, 50.0, "chrf"), (30, 5.0, 40.0, "chrf")):
        rd.update_index(tmp_path, step, {"loss": 3.0, "bleu": bleu, "chrf": chrf, "by": by})
    assert [p.name for p in rd.select_checkpoints(tmp_path, best=1)] == ["checkpoint_20.pt"]


def test_averaging_checkpoints_of_two_seeds_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two trainings from random starts (seeds 1 and 2) average into no model; checkpoints of one
    run, or fine-tunings of one parent, are what averaging is for."""
    states = [toy_state(step) for step in (1, 2, 3)]
    states[0]["config"], states[1]["config"] = {"train": {"seed": 1}}, {"train": {"seed": 2}}
    states[2]["config"] = {"train": {"seed": 1}}
    paths = [tmp_path / f"{i}.pt" for i in range(3)]
    for path, state in zip(paths, states, strict=True):
        save_checkpoint(path, state)
    average_checkpoints([paths[0], paths[2]])
    assert "seed" not in caplog.text
    average_checkpoints(paths[:2])
    assert f"averaging {paths[0]} (seed 1) and {paths[1]} (seed 2): trainings of other seeds" in caplog.text


def test_a_checkpoint_pruned_while_averaging_is_said_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training pruned a checkpoint between the listing and its load: "checkpoint not found"
    read as a mistake of the user's."""
    import mtcli.infer.averaging as averaging

    _write_run(tmp_path, [10, 20])
    paths = [tmp_path / "checkpoints" / rd.step_checkpoint_name(step) for step in (10, 20)]
    real = averaging.load_checkpoint

    def load(path: Path) -> dict:
        if path == paths[0]:
            paths[1].unlink()  # the training saves step 30 and prunes step 20
        return real(path)

    monkeypatch.setattr(averaging, "load_checkpoint", load)
    with pytest.raises(CheckpointError, match=r"checkpoint_20.pt: removed while the average was made \(a training"):
        average_checkpoints(paths)


@pytest.mark.parametrize("where", ["frame", "state"])
def test_a_checkpoint_of_a_newer_format_is_refused_by_name(where: str, tmp_path: Path) -> None:
    """An older mtcli reads neither a newer frame nor a newer state: it says which, in one line."""
    import torch

    from mtcli import checkpoint

    path = tmp_path / "new.pt"
    checkpoint.save_checkpoint(path, {"format": checkpoint.FORMAT + (where == "state"), "w": torch.ones(2)})
    if where == "frame":
        data = path.read_bytes()
        path.write_bytes(data.replace(checkpoint.MAGIC + f" {checkpoint.FORMAT} ".encode(),
                                      checkpoint.MAGIC + f" {checkpoint.FORMAT + 1} ".encode(), 1))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: checkpoint format {checkpoint.FORMAT + 1} "
                                              rf"is newer than this mtcli \({checkpoint.FORMAT}\)$"):
        checkpoint.load_checkpoint(path)


def test_a_checkpoint_that_cannot_be_pruned_is_a_warning_and_the_rest_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Pruning that failed unsaid would fill the disk; one that raised would stop the training."""
    _write_run(tmp_path, [10, 20, 30], last=30)
    stuck = tmp_path / "checkpoints" / "checkpoint_10.pt"
    unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        prune_checkpoints(tmp_path, keep_last=1)
    assert f"cannot remove old checkpoint {stuck} (Permission denied)" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint_*0.pt")) == \
        ["checkpoint_10.pt", "checkpoint_30.pt"]


def test_a_data_change_that_changes_nothing_is_no_change(toy_dict: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume refused a corpus's default langs written out, data.spm_model spelt another way,
    and the keys that would have trained a SentencePiece model where data.spm_model gives one."""
    saved = copy.deepcopy(toy_dict)
    saved["data"].update(source="", sources=[{"source": "a", "weight": 1.0, "tag": None, "langs": None,
                                              "hub_config": None}])
    new = copy.deepcopy(saved)
    new["data"]["sources"][0]["langs"] = [saved["data"]["src_lang"], saved["data"]["tgt_lang"]]
    assert check_resume_config(saved, new) == []
    monkeypatch.chdir(tmp_path)
    saved["data"]["spm_model"], new["data"]["spm_model"] = "parent", str(tmp_path / "parent")
    new["data"].update(vocab_size=400, spm_model_type="bpe")
    assert check_resume_config(saved, new) == []
    new["data"]["sources"][0]["langs"] = [saved["data"]["tgt_lang"], saved["data"]["src_lang"]]  # a change
    with pytest.raises(CheckpointError, match=r"data.sources\[0\].langs"):
        check_resume_config(saved, new)
    new["data"].update(sources=saved["data"]["sources"], spm_model="")  # a model trained here after all
    with pytest.raises(CheckpointError, match=r"data.spm_model"):
        check_resume_config(saved, new)
