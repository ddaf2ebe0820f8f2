"""Tests of mtcli.data.workers: results in task order, and a pool left on an error only once
the tasks still running have finished (a worker killed while handing back a result would hang
the pool's shutdown)."""

from __future__ import annotations

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
