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
#: process of the group. Python's own SIGINT handler first, as a shell in a terminal leaves it:
#: a test run started in the background (``make test &``) hands its children SIGINT ignored.
INTERRUPTED = r"""
import os, signal, sys
from pathlib import Path
from mtcli.data.cleaning import PairCleaner, clean_text_blocks

signal.signal(signal.SIGINT, signal.default_int_handler)

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


#: Two workers each start a long task and write down their pid; then the parent is killed by a
#: signal it cannot handle, as `kill -9` or the out-of-memory killer would.
PARENT_KILLED = r"""
import os, signal, sys, time
from pathlib import Path
from mtcli.data.workers import forked_pool

def long_task(marker):
    Path(f"{marker}.{os.getpid()}").write_text("started")
    time.sleep(60)

out = Path(sys.argv[1])
with forked_pool(2) as pool:
    tasks = [pool.apply_async(long_task, (str(out / f"w{n}"),)) for n in range(2)]
    while len(list(out.glob("w*"))) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_end_with_a_parent_killed_by_sigkill(tmp_path: Path) -> None:
    """Without it, the workers would go on with their tasks for nobody (here 60 s), and then
    die with a BrokenPipeError traceback handing back the result."""
    proc = subprocess.run([sys.executable, "-c", PARENT_KILLED, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(path.suffix[1:]) for path in tmp_path.glob("w*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = [pid for pid in pids if _running(pid)]
    for pid in running:  # the failure's own clean-up
        os.kill(pid, signal.SIGKILL)
    assert not running, "the workers outlived their parent"


#: A launcher (torchrun) that starts a rank and is killed while the rank imports its modules:
#: the rank compared its parent with its parent, a moment later, and trained on for nobody.
RANK_OF_A_GONE_LAUNCHER = """
import os, signal, sys, time
from pathlib import Path
import mtcli
Path(sys.argv[1], "imported").write_text("")
while os.getppid() == mtcli._STARTED[1]:  # the launcher is gone after this
    time.sleep(0.01)
from mtcli.data.workers import end_with_parent
launcher = mtcli.started_by()
Path(sys.argv[1], "checking").write_text(str(launcher))
end_with_parent(launcher, signal.SIGKILL)
Path(sys.argv[1], "survived").write_text("")
time.sleep(60)
"""

#: A process forked from one that had imported mtcli (a notebook's launcher): its launcher is
#: its parent, alive; the grandparent's pid it inherited killed it at once.
FORKED_RANK = """
import os, signal, sys, time
import mtcli
from mtcli.data.workers import end_with_parent
child = os.fork()
if child == 0:
    end_with_parent(mtcli.started_by(), signal.SIGKILL)
    os._exit(7)
print(os.waitpid(child, 0)[1] >> 8)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_a_process_whose_launcher_died_while_it_started_ends(tmp_path: Path) -> None:
    launcher = ("import subprocess, sys, time\nfrom pathlib import Path\n"
                f"print(subprocess.Popen([sys.executable, '-c', {RANK_OF_A_GONE_LAUNCHER!r}, sys.argv[1]]).pid)\n"
                "while not Path(sys.argv[1], 'imported').exists():\n    time.sleep(0.01)")
    rank = int(subprocess.run([sys.executable, "-c", launcher, str(tmp_path)], capture_output=True, text=True,
                              timeout=60).stdout)
    deadline = time.monotonic() + 20
    while _running(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(rank)
    if alive:  # the failure's own clean-up
        os.kill(rank, signal.SIGKILL)
    assert (tmp_path / "checking").is_file() and not (tmp_path / "survived").exists() and not alive
    forked = subprocess.run([sys.executable, "-c", FORKED_RANK], capture_output=True, text=True, timeout=60)
    assert forked.stdout.strip() == "7", forked.stderr  # it ran on


def _run_guarded(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``script`` in a new session; a hang is a failure, its whole group killed."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"hung for {timeout:.0f} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


#: Every worker of an idle pool gets SIGTERM, as `timeout`, SLURM or `kill -TERM -PGID` send it to
#: the whole group; then the parent leaves the pool. An idle worker waits for tasks holding the
#: pool's queue lock: killed at once, it kept it, and leaving the pool waited for it for ever.
GROUP_TERMINATED = r"""
import os, signal, time
from mtcli.data.workers import forked_pool

with forked_pool(2) as pool:
    pool.apply_async(abs, (1,)).get()
    time.sleep(0.3)  # both workers back waiting for a task, one of them holding the lock
    for process in pool._mtcli_started:
        os.kill(process.pid, signal.SIGTERM)
    time.sleep(0.5)
print("left the pool")
"""


def test_a_pool_whose_workers_got_sigterm_is_left_without_hanging() -> None:
    result = _run_guarded(GROUP_TERMINATED, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "left the pool", result.stderr
    assert "Traceback" not in result.stderr, result.stderr


#: A task kills its own worker, as the out-of-memory killer would: the pool drops that task.
WORKER_KILLED = r"""
import os, signal
from mtcli.data.workers import forked_pool, in_order
from mtcli.errors import MtcliError

def task(n):
    if n == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return bytes(8 << 20) if n else n  # large results, as encoding's: still being sent when one worker dies

try:
    with forked_pool(2) as pool:
        print([len(r) if r else r for r in in_order(pool, task, range(8), 4)])
except MtcliError as exc:
    print(exc)
"""


def test_a_worker_killed_mid_task_is_an_error_not_a_wait_for_ever() -> None:
    start = time.monotonic()
    result = _run_guarded(WORKER_KILLED, timeout=40)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("a prepare worker process ended (killed by signal 9); the out-of-memory"), (
        result.stdout)
    assert time.monotonic() - start < 20  # not the 30 s a pool left early waits for its tasks


def test_a_spawned_worker_ignores_ctrl_c_while_it_imports_the_main_module(tmp_path: Path) -> None:
    """Spawned workers (SentencePiece's trainer) import the main module first, before their own
    setup: Ctrl-C there printed a traceback (python -m mtcli.backtranslation imports torch)."""
    script = tmp_path / "main.py"
    out = tmp_path / "seen"
    script.write_text(
        "import os, signal, sys\n"
        "if __name__ == '__mp_main__':\n"
        f"    open({str(out)!r}, 'w').write(str(int(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)))\n"
        "if __name__ == '__main__':\n"
        "    from mtcli.data.workers import forked_pool\n"
        "    with forked_pool(1, start='spawn') as pool:\n"
        "        pool.apply(os.getpid)\n"
        "    print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n", encoding="utf-8")
    # (SIGINT at its default in the child, whatever this test process inherited: Python installs
    # its own handler at start only over the default, and the check below reads that handler)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert res.returncode == 0 and res.stdout == "True\n", res.stderr  # the parent's own handler, back
    assert out.read_text() == "1"  # ignored in the worker from its start


#: A script calling a spawned pool at its top level, with no ``if __name__ == "__main__":``.
UNGUARDED = r"""
import os
from mtcli.data.workers import forked_pool, result_of
from mtcli.errors import MtcliError

try:
    with forked_pool(1, start="spawn") as pool:
        print(result_of(pool, pool.apply_async(os.getpid)))
except MtcliError as exc:
    print(exc)
"""


def test_a_script_without_a_main_guard_is_told_what_it_needs(tmp_path: Path) -> None:
    """A spawned worker imports the main script, which started another pool: the worker ended
    with status 1, and the message blamed the out-of-memory killer."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED, encoding="utf-8")
    result = _run_guarded("import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')", str(script))
    assert result.stdout.startswith("a prepare worker process ended (exit status 1); a script that calls mtcli's "
                                    'prepare or train must do so under `if __name__ == "__main__":`'), result.stdout


#: A pool of new processes, then SIGHUP to the whole group, as a closed ssh session sends it.
HUNG_UP_SPAWNED = r"""
import os, signal, time
from multiprocessing import resource_tracker
from mtcli.data.workers import forked_pool

signal.signal(signal.SIGHUP, lambda signum, frame: print("hung up", flush=True))
with forked_pool(1, start="spawn") as pool:
    assert pool.apply(abs, (-3,)) == 3
    os.killpg(0, signal.SIGHUP)
    time.sleep(0.5)
    gone = os.waitpid(resource_tracker._resource_tracker._pid, os.WNOHANG) != (0, 0)
    print("tracker", "dead" if gone else "alive", flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")
def test_a_hang_up_leaves_the_resource_tracker_of_a_spawned_pool_alive() -> None:
    """prepare hung up while SentencePiece's pool of new processes ran: multiprocessing's resource
    tracker died of the SIGHUP, and leaving the pool printed its warning and six tracebacks
    under `mtcli: error: hung up`."""
    res = _run_guarded(HUNG_UP_SPAWNED)
    assert res.returncode == 0 and res.stdout.split() == ["hung", "up", "tracker", "alive"], res.stdout + res.stderr
    assert res.stderr == "", res.stderr
