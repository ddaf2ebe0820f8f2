"""Tests of mtcli.data.workers: results in task order, and a pool left on an error only once
the tasks still running have finished (a worker killed while handing back a result would hang
the pool's shutdown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtcli.data.workers import can_fork, forked_pool, in_order

pytestmark = pytest.mark.skipif(not can_fork(), reason="worker pools are forked")


def _slow_square(task: tuple[int, str]) -> int:
    n, marker = task
    if n == 0:
        raise ValueError("the first task fails")
    time.sleep(0.3)
    Path(f"{marker}.{n}").write_text("done")
    return n * n


def test_results_come_in_task_order(tmp_path: Path) -> None:
    with forked_pool(2) as pool:
        assert list(in_order(pool, _slow_square, [(n, str(tmp_path / "m")) for n in (3, 1, 2)], 2)) == [9, 1, 4]


def test_an_error_is_raised_once_the_running_tasks_have_finished(tmp_path: Path) -> None:
    marker = str(tmp_path / "m")
    with pytest.raises(ValueError, match="first task fails"), forked_pool(2) as pool:
        for _ in in_order(pool, _slow_square, [(n, marker) for n in range(3)], 3):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.1", "m.2"]


#: Clean blocks in two workers; after a few blocks, Ctrl-C as a terminal sends it: to every
#: process of the group.
INTERRUPTED = r"""
import os, signal, sys
from pathlib import Path
from mtcli.data.cleaning import PairCleaner, clean_text_blocks

def blocks():
    for i in range(10_000):
        if i == 6:
            os.killpg(0, signal.SIGINT)
        yield b"ein hund\n" * 4000, b"a dog\n" * 4000

out = Path(sys.argv[1])
try:
    clean_text_blocks(blocks(), out / "clean.src", out / "clean.tgt", PairCleaner(250, 3.0, False), 2)
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(130)
"""


def test_ctrl_c_stops_the_parent_at_once_and_no_worker_prints_a_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # hung: take the whole group down, workers included
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130 and stdout.strip() == "interrupted", stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert time.monotonic() - start < 20  # the tasks in flight finish; nothing waits for a dead worker
