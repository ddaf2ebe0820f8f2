"""Shared fixtures: the repo paths, the toy corpus, and the shared WMT data (skipped if absent)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from forked_child import python_c

REPO = Path(__file__).resolve().parents[1]
TOY_DIR = REPO / "tests" / "fixtures" / "toy"
TOY_CONFIG = REPO / "configs" / "toy.yaml"
SHARED_DATA = REPO.parent / "shared" / "data"

# Small models on a 2-core machine: one intra-op thread keeps tests deterministic and lets
# pytest-level parallelism (if any) not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _torch_threads() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)


_torch_threads()


def mtcli_here(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """``mtcli ARGS`` run in this process (typer's CliRunner), returned as a subprocess's result
    (bytes) without the ~2 s a new Python spends importing torch. An exception the command
    line does not turn into its one-line error is raised here, as a traceback would show.
    Checks of what only a process has (signals, closed or redirected descriptors, a pipe
    read line by line) keep a real ``python -m mtcli.cli``."""
    from typer.testing import CliRunner

    from mtcli.cli import app

    res = CliRunner().invoke(app, list(args), input=stdin)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout_bytes, res.stderr_bytes)


def mtcli_status(*args: str) -> int:
    """:func:`mtcli_here`'s exit status, its stdout and stderr written to this process's (where
    ``capsys`` reads them)."""
    done = mtcli_here(*args)
    sys.stdout.write(done.stdout.decode("utf-8"))
    sys.stderr.write(done.stderr.decode("utf-8"))
    return done.returncode


@pytest.fixture
def toy_dir(tmp_path: Path) -> Path:
    """A private copy of the toy corpus (tests may damage it)."""
    dst = tmp_path / "toy"
    shutil.copytree(TOY_DIR, dst)
    return dst


@pytest.fixture
def toy_config_path() -> Path:
    """Path of configs/toy.yaml."""
    return TOY_CONFIG


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (the bench folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_corpus(name: str) -> Path:
    """``../shared/data/<name>``, or skip the test with a clear reason."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"shared corpus {path} not found (tests that need real data read ../shared/data)")
    return path


def build_tiny_run_dir(run_dir: Path, seed: int = 0, spm_model_type: str | None = None) -> Path:
    """Write a run directory with a random toy-shaped Transformer, without training.

    Layout as ``mtcli train`` leaves it: ``config.yaml`` (configs/toy.yaml with
    ``data.source``/``prepared_dir``/``run_dir`` pointed here), ``spm.model`` trained on the toy
    training text, ``text/{val,test}.{src,tgt}``, and ``checkpoints/`` holding
    ``checkpoint_10.pt``, ``checkpoint_20.pt`` (indexed in ``index.json``), ``checkpoint_best.pt``
    and ``checkpoint_last.pt``. ``spm_model_type`` overrides the toy config's (another model
    type gives another ``spm.model`` of the same size: training the same one again is
    byte-identical).
    """
    import torch

    from mtcli.checkpoint import save_checkpoint
    from mtcli.config import load_config, save_config
    from mtcli.data.tokenizer import Tokenizer
    from mtcli.fileio import sha256_file
    from mtcli.model import Transformer
    from mtcli.rundir import update_index

    run_dir = Path(run_dir)
    config = load_config(
        TOY_CONFIG,
        [f"data.source={TOY_DIR}", f"data.prepared_dir={run_dir / 'prepared'}", f"train.run_dir={run_dir}"]
        + ([f"data.spm_model_type={spm_model_type}"] if spm_model_type else []),
    )
    (run_dir / "text").mkdir(parents=True, exist_ok=True)
    for split in ("val", "test"):
        for lang in ("src", "tgt"):
            shutil.copyfile(TOY_DIR / f"{split}.{lang}", run_dir / "text" / f"{split}.{lang}")
    sentences = []
    for lang in ("src", "tgt"):
        sentences += (TOY_DIR / f"train.{lang}").read_text(encoding="utf-8").splitlines()
    spm_model = Tokenizer.train(
        sentences, run_dir / "spm", config.data.vocab_size, config.data.spm_model_type,
        config.data.character_coverage, config.data.spm_max_sentences, seed=1,
    )
    if spm_model != run_dir / "spm.model":
        shutil.copyfile(spm_model, run_dir / "spm.model")
    tokenizer = Tokenizer(run_dir / "spm.model")
    save_config(config, run_dir / "config.yaml")
    vocab = {"size": tokenizer.vocab_size, "spm_sha256": sha256_file(run_dir / "spm.model")}
    ckpt_dir = run_dir / "checkpoints"
    for k, step in enumerate((10, 20)):
        torch.manual_seed(seed + k)
        model = Transformer(config.model, tokenizer.vocab_size)
        state = {
            "format": 1, "step": step, "epoch": 1, "model": model.state_dict(),
            "config": config.to_dict(), "vocab": vocab, "valid": {"loss": 5.0 - k, "bleu": float(k)},
        }
        save_checkpoint(ckpt_dir / f"checkpoint_{step}.pt", state)
        update_index(run_dir, step, state["valid"])
    shutil.copyfile(ckpt_dir / "checkpoint_20.pt", ckpt_dir / "checkpoint_best.pt")
    shutil.copyfile(ckpt_dir / "checkpoint_20.pt", ckpt_dir / "checkpoint_last.pt")
    return run_dir


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Directories (append to the list) that ``os.access`` says cannot be written, as on a
    read-only file system, which holds for root too (the suite may run as root, which chmod does
    not stop)."""
    real_access, tops = os.access, []

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        if mode & os.W_OK and any(Path(os.fsdecode(path)).is_relative_to(top) for top in tops):
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    return tops


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random (untrained) toy-config run directory, shared by the session: do not modify it
    (copy it with shutil.copytree first). See :func:`build_tiny_run_dir`."""
    return build_tiny_run_dir(tmp_path_factory.mktemp("tiny_run") / "run")


@pytest.fixture(scope="session")
def prepared_toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy corpus prepared once per session (read-only for tests: copy it before damaging)."""
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare

    out = tmp_path_factory.mktemp("prepared") / "toy"
    prepare(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={out}"]))
    return out


def prepare_for_run(run_dir: Path, out: Path) -> Path:
    """The toy corpus prepared into ``out`` with ``run_dir``'s own tokenizer (``data.spm_model``):
    a cache the run could have been trained on (a decoding shortlist is built from one)."""
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare

    prepare(load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={out}", f"data.spm_model={run_dir}"]))
    return out


def respell_run_spm(run: Path, edit: Callable[[Any], None]) -> str:
    """Make ``run``'s spm.model the SentencePiece ``ModelProto`` that ``edit`` changes, and every
    checkpoint of the run name it (as an older mtcli's run: the same model in other bytes, when
    ``edit`` changes how it was trained only); its sha256."""
    from sentencepiece import sentencepiece_model_pb2

    from mtcli.checkpoint import load_checkpoint, save_checkpoint
    from mtcli.fileio import sha256_file

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((run / "spm.model").read_bytes())
    edit(proto)
    (run / "spm.model").write_bytes(proto.SerializeToString())
    own = sha256_file(run / "spm.model")
    for path in (run / "checkpoints").glob("checkpoint_*.pt"):
        state = load_checkpoint(path)
        state["vocab"]["spm_sha256"] = own
        save_checkpoint(path, state)
    return own


def toy_train_overrides(prepared: Path, run_dir: Path, *extra: str) -> list[str]:
    """``--set`` overrides for a fast, quiet toy training run in ``run_dir`` (extra ones last)."""
    return [
        f"data.source={TOY_DIR}",
        f"data.prepared_dir={prepared}",
        f"train.run_dir={run_dir}",
        "train.valid_bleu=false",
        "train.num_threads=1",
        "train.log_every=1",
        *extra,
    ]


def toy_train_config(prepared: Path, run_dir: Path, *extra: str):
    """The toy recipe with :func:`toy_train_overrides` applied."""
    from mtcli.config import load_config

    return load_config(TOY_CONFIG, toy_train_overrides(prepared, run_dir, *extra))


def logged_losses(run_dir: Path) -> dict[int, str]:
    """step -> the loss/nll text last logged for it in ``train.log`` (a resumed step logs again)."""
    import re

    found = {}
    for line in (run_dir / "train.log").read_text(encoding="utf-8").splitlines():
        m = re.search(r"\| step (\d+) \| epoch \d+ \| loss (\S+) \| nll (\S+)", line)
        if m:
            found[int(m.group(1))] = f"{m.group(2)} {m.group(3)}"
    return found


def assert_same_params(a: dict, b: dict) -> None:
    """Two state dicts hold bit-identical tensors under the same names."""
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def wait_until(ready, proc, what: str, timeout: float = 120.0) -> None:
    """Poll ``ready()`` while the subprocess ``proc`` runs; fail if it exits first or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.005)


def fifo_of(source: Path, fifo: Path, seconds: float = 30.0) -> None:
    """Make ``fifo`` a named pipe that gives ``source``'s bytes once, as ``<(cat source)`` does.
    A reader that opens it again within ``seconds`` reads it empty at once, not waiting forever
    for a writer: a test of code that reads a stream twice fails instead of hanging."""
    import errno
    import threading
    import time

    os.mkfifo(fifo)

    def feed() -> None:
        fifo.write_bytes(source.read_bytes())
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a waiting reader sees its end
            except OSError as exc:
                if exc.errno not in (errno.ENXIO, errno.ENOENT):
                    return
            time.sleep(0.01)

    threading.Thread(target=feed, daemon=True).start()


#: Modules that every ``python -c`` of :class:`ForkedPython` finds imported: a new Python that
#: trains spends 4-5 s of CPU importing them (torch, and torch._dynamo, which torch.optim imports).
PRELOADED = ["torch", "torch._dynamo", "torch.optim", "torch.distributed", "mtcli.cli", "mtcli.train.run",
             "mtcli.infer.translator", "mtcli.serve"]


#: ``ForkedPython(MTCLI, ARGS, ...)`` is ``mtcli ARGS``.
MTCLI = "import sys\nfrom mtcli.cli import app\nsys.argv[0] = 'mtcli'\napp()\n"


#: The processes :class:`ForkedPython` started, which this process kills at its exit: multiprocessing
#: would wait there for a child a failed test left running (a server), and the run would hang.
_FORKED: list[Any] = []


def _kill_forked_left_running() -> None:
    for process in _FORKED:
        if process.exitcode is None:
            process.kill()
            process.join(10)


def forkserver() -> Any:
    """``multiprocessing``'s forkserver context, its server importing :data:`PRELOADED`."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


class ForkedPython:
    """``subprocess.Popen([sys.executable, "-c", script, *args], stderr=PIPE, stdout=DEVNULL)``
    (``stdout=True``: ``stderr=STDOUT``, both in ``stderr_path``) for tests that start many
    Pythons which import torch and mtcli: each is forked from one
    server process per test worker that imported them once (``multiprocessing``'s forkserver),
    which saves those seconds of every start. Its standard error is kept in ``stderr_path``.
    What needs the real start of an interpreter (``python -m mtcli.cli``'s own exit, a
    terminal, inherited descriptors) keeps a real subprocess."""

    def __init__(self, script: str, args: list[str], stderr_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = REPO, stdout: bool = False) -> None:
        context = forkserver()
        self.stderr_path = Path(stderr_path)
        self._process = context.Process(target=python_c, args=(
            script, [str(a) for a in args], dict(os.environ if env is None else env), str(cwd), str(stderr_path),
            stdout))
        self._process.start()
        self.pid = self._process.pid
        if not _FORKED:
            import atexit

            atexit.register(_kill_forked_left_running)  # (after multiprocessing's own: run before it)
        _FORKED.append(self._process)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    @property
    def stderr(self) -> Any:
        import io

        return io.StringIO(self.stderr_text())

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace") if self.stderr_path.exists() else ""

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["python", "-c", "..."], timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.wait(timeout)
        return None, self.stderr_text()


#: The start of a ``python -c`` script (argv: CONFIG MARKER) that runs ``prepare`` paused once its
#: SentencePiece model is trained: it writes MARKER and waits, so a test can signal or kill it there.
PREPARE_PAUSED_AFTER_SPM = """
import sys, time
from pathlib import Path
import mtcli.data.prepare as prep
original = prep._train_spm
def train_then_wait(*args, **kwargs):
    path = original(*args, **kwargs)
    Path(sys.argv[2]).write_text("in the middle")
    time.sleep(120)
    return path
prep._train_spm = train_then_wait
"""


def _read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def make_trilingual(root: Path) -> Path:
    """The toy corpus plus a third language ``xx`` (the target's words reversed, each + "o"),
    line-aligned in every split, and a second corpus ``extra`` holding only a training split."""
    tri = root / "tri"
    tri.mkdir(parents=True)
    for split in ("train", "val", "test"):
        src = list(_read_lines(TOY_DIR / f"{split}.src"))
        tgt = list(_read_lines(TOY_DIR / f"{split}.tgt"))
        (tri / f"{split}.src").write_text("".join(f"{line}\n" for line in src), encoding="utf-8")
        (tri / f"{split}.tgt").write_text("".join(f"{line}\n" for line in tgt), encoding="utf-8")
        xx = [" ".join(w + "o" for w in reversed(line.split())) for line in tgt]
        (tri / f"{split}.xx").write_text("".join(f"{line}\n" for line in xx), encoding="utf-8")
    extra = root / "extra"
    extra.mkdir()
    for lang in ("src", "tgt"):
        lines = list(_read_lines(TOY_DIR / f"train.{lang}"))[:100]
        lines += lines[:10]  # duplicates: cleaned away in this corpus only
        (extra / f"train.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return root


def multi_overrides(root: Path, prepared: Path, extra_weight: float = 1.0) -> list[str]:
    """``--set`` overrides turning the toy recipe into three directions plus a tagged corpus."""
    sources = (f"[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {root}/tri, langs: [tgt, src]}}, "
               f"{{source: {root}/tri, langs: [src, xx]}}, "
               f"{{source: {root}/extra, tag: '<bt>', weight: {extra_weight}}}]")
    return ["data.source=", f"data.sources={sources}", f"data.prepared_dir={prepared}", "data.dedup=true",
            "data.vocab_size=96"]


def train_trilingual(root: Path, max_steps: int, *more: str) -> Path:
    """The toy model of three directions (src->tgt, tgt->src, src->xx) and a tagged corpus
    (:func:`make_trilingual`, :func:`multi_overrides`) prepared and trained for ``max_steps``
    in ``root`` (``more``: further overrides); its run directory, ``root/run``."""
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare
    from mtcli.train.run import train

    make_trilingual(root)
    overrides = [*multi_overrides(root, root / "prepared"), f"train.run_dir={root / 'run'}",
                 f"train.max_steps={max_steps}", f"train.valid_every={max_steps}", "train.valid_bleu=false", *more]
    config = load_config(TOY_CONFIG, overrides)
    prepare(config)
    train(config)
    return root / "run"


class FakeArray:
    """A TokenArray-like list of id arrays (what batching and packing read sentences from)."""

    def __init__(self, rows: list[list[int]]) -> None:
        import numpy as np

        self.rows = [np.asarray(r, dtype=np.int32) for r in rows]
        self.lengths = np.asarray([len(r) for r in rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]
