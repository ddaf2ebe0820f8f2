"""`mtcli serve` as users run it: a real uvicorn server on 127.0.0.1 in a subprocess, talked to
with httpx. Answers equal Translator.translate; bad requests get their 4xx and the server keeps
serving; the API key is enforced; SIGTERM answers the request in flight and exits 0."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[dev]')")
pytest.importorskip("fastapi", reason="mtcli serve needs the serve extra (pip install -e '.[serve]')")

from conftest import MTCLI, ForkedPython, mtcli_here, prepare_for_run  # noqa: E402

from mtcli.infer.translator import Translator  # noqa: E402

LINES = ["eine katze spielt", "", "ein hund läuft im park", "rot"]
KEY = "s3cret-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`mtcli serve RUN_DIR` in a process of its own (``script``: what ``python -c`` runs with
    the arguments), ready when /health answers. It is forked (:class:`ForkedPython`), its
    output in a file (:meth:`log`); the tests of what only a new interpreter shows start one."""

    def __init__(self, run_dir: Path, *args: str, env: dict[str, str] | None = None, script: str = MTCLI,
                 beam: int | None = 2) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = tempfile.mkdtemp(prefix="mtcli-serve-")
        weakref.finalize(self, shutil.rmtree, folder, True)
        output = Path(folder) / "output.txt"
        self.proc = ForkedPython(
            script, ["serve", str(run_dir), "--port", str(self.port), *(["--beam", str(beam)] if beam else []),
                     "--max-lines", "8", "--max-chars", "200", "--max-request-chars", "1000", *args],
            output, env={**os.environ, **(env or {})}, stdout=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError("server did not start within 120 s")

    def post(self, body: object = None, content: bytes | None = None, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if content is not None:
            headers["Content-Type"] = "application/json"
            return httpx.post(f"{self.url}/translate", content=content, headers=headers, timeout=120)
        return httpx.post(f"{self.url}/translate", json=body, headers=headers, timeout=120)

    def log(self) -> str:
        """What the server has written so far, its standard output and error."""
        return self.proc.stderr_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_run_dir: Path) -> Iterator[Server]:
    running = Server(tiny_run_dir)
    yield running
    assert running.stop() == 0


def test_answers_equal_the_python_api(server: Server, tiny_run_dir: Path) -> None:
    expected = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    answer = server.post({"text": LINES})
    assert answer.status_code == 200, answer.text
    assert answer.json()["translations"] == expected.translate(LINES)
    greedy = server.post({"text": LINES, "beam": 1, "length_penalty": 0.6})
    assert greedy.json()["translations"] == expected.translate(LINES, beam=1, length_penalty=0.6)
    shorter = server.post({"text": LINES, "beam": 2, "length_penalty": -0.5})  # the config's range, not only >= 0
    assert shorter.json()["translations"] == expected.translate(LINES, beam=2, length_penalty=-0.5)
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == expected.name
    assert health["target_languages"] == [expected.bundle.config.data.tgt_lang]
    assert "<textarea" in httpx.get(server.url).text
    assert httpx.get(f"{server.url}/openapi.json").json()["paths"]["/translate"]["post"]


def test_concurrent_clients_each_get_their_own_lines(server: Server, tiny_run_dir: Path) -> None:
    expected = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    requests = [[f"{line} {i}" for line in LINES if line] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda text: server.post({"text": text}), requests))
    assert all(a.status_code == 200 for a in answers)
    assert [a.json()["translations"] for a in answers] == [expected.translate(t) for t in requests]


@pytest.mark.parametrize(("body", "content", "status", "needle"), [
    (None, b'{"text": ["unclosed"', 400, "malformed JSON"),
    (None, b"\xff\xfe", 400, "malformed JSON"),
    (None, b'{"text": ["caf\xe9"]}', 400, "malformed JSON: There was an error parsing the body (send it in UTF-8)"),
    ({"text": "not a list"}, None, 422, 'text: a list of lines, not one string (wrap it: {"text": ["..."]})'),
    ({"text": [1, 2]}, None, 422, "text[0]: Input should be a valid string"),
    ({"text": ["ok"], "beam": "5"}, None, 422, "beam"),
    ({"text": ["ok"], "beam": 0}, None, 422, "beam must be between 1 and 16"),
    ({"text": ["ok"], "beam": 17}, None, 422, "beam must be between 1 and 16"),
    ({"text": ["ok"], "length_penalty": -6}, None, 422, "length_penalty"),
    ({"text": ["ok"], "sampling": "topk", "temperature": 1e-300}, None, 422, "temperature"),
    ({"text": ["ok"], "colour": "red"}, None, 422, "colour"),
    ({}, None, 422, "text"),
    ({"text": ["x"] * 9}, None, 413, "too many lines: 9 (at most 8"),
    ({"text": ["x" * 201]}, None, 413, "text[0] has 201 characters (at most 200)"),
    ({"text": ["x" * 190] * 6}, None, 413, "1140 characters in the request (at most 1000)"),
    (None, b'{"text": ["ok", "bad \\ud800 text"]}', 422, "text[1]: not valid Unicode (lone surrogate at column 5)"),
    (None, b'{"text": ["\\udfff"]}', 422, "text[0]: not valid Unicode (lone surrogate at column 1)"),
    ({"text": ["q x z j " * 25]}, None, 413, "text[0] encodes to"),
    (None, b'{"text": ["ok"], "length_penalty": NaN}', 422, "length_penalty: Input should be a finite number"),
    (None, b'{"text": ["ok"], "length_penalty": Infinity}', 422, "length_penalty: Input should be a finite number"),
    ({"text": ["ok"], "beam": 2.5}, None, 422, "beam"),
    ({"text": ["ok"], "sampling": "topk", "beam": 4}, None, 422, "beam 4: sampling draws each token"),
    ({"text": ["ok"], "seed": 3}, None, 422, "seed: for sampling only"),
    ({"text": ["ok"], "tgt_lang": ""}, None, 422, "tgt_lang '': tgt_lang must name a language, not be empty"),
    ({"text": ["ok"], "length_penalty": "1"}, None, 422, "length_penalty: Input should be a valid number"),
    ({"text": ["ok"], "beam": 2, "nbest": 4}, None, 422, "nbest 4 with beam 2: nbest must be between 1 and beam"),
    ({"text": ["ok"], "beam": 1, "nbest": 2}, None, 422, "nbest 2 with beam 1: nbest must be between 1 and beam"),
])
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server: Server, body: object, content: bytes | None,
                                                             status: int, needle: str) -> None:
    answer = server.post(body, content)
    assert answer.status_code == status, answer.text
    assert needle in answer.json()["error"]
    assert "decode." not in answer.json()["error"]  # the request's own words, not the config's
    assert "command line" not in answer.json()["error"] and "--" not in answer.json()["error"]
    assert server.post({"text": ["rot"]}).status_code == 200


@pytest.mark.parametrize(("content", "error"), [
    (b"[" * 5000 + b"]" * 5000, "malformed JSON: nested too deeply"),
    (b'{"text": ["ok"], "beam": ' + b"1" * 5000 + b"}", "malformed JSON: a number with too many digits"),
    (b'{"text": ["caf\xe9"]}', "malformed JSON: There was an error parsing the body (send it in UTF-8)"),
])
def test_json_that_cannot_be_parsed_is_a_400_saying_why(server: Server, content: bytes, error: str) -> None:
    """Only a body that is not UTF-8 is told to send UTF-8."""
    answer = server.post(content=content)
    assert answer.status_code == 400 and answer.json() == {"error": error}


def test_nbest_up_to_the_beam_or_with_sampling_is_answered(server: Server) -> None:
    for body in ({"text": ["rot"], "beam": 3, "nbest": 3}, {"text": ["rot"], "nbest": 4},
                 {"text": ["rot"], "sampling": "topk", "beam": 1, "nbest": 3, "seed": 1}):
        answer = server.post(body)
        assert answer.status_code == 200, (body, answer.text)
        assert len(answer.json()["nbest"][0]) == body["nbest"]


def test_a_body_too_large_or_not_json_is_refused_and_other_paths_answer_in_the_same_shape(
        server: Server) -> None:
    """A client cannot make the server read a huge body into memory: over ``max_body_bytes``
    it gets a 413 at once, whether the body declares its length or arrives in chunks."""
    huge = b'{"text": ["' + b"a" * 400_000 + b'"]}'
    declared = server.post(content=huge)
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"].startswith("the request body is over ")

    def chunks() -> Iterator[bytes]:
        yield huge[:200_000]
        yield huge[200_000:]

    chunked = httpx.post(f"{server.url}/translate", content=chunks(), headers={"Content-Type": "application/json"},
                         timeout=60)
    assert chunked.status_code == 413, chunked.text
    assert server.post({"text": ["rot"]}).status_code == 200
    form = httpx.post(f"{server.url}/translate", data={"text": "rot"}, timeout=60)  # curl -d's default
    assert form.status_code == 415 and form.json()["error"] == (
        "Content-Type application/x-www-form-urlencoded: send the request as JSON (Content-Type: application/json)")
    packed = httpx.post(f"{server.url}/translate", content=gzip.compress(b'{"text": ["rot"]}'), timeout=60,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert packed.status_code == 415 and packed.json() == {  # was 400 "malformed JSON"
        "error": "Content-Encoding gzip: send the body uncompressed"}
    missing = httpx.get(f"{server.url}/nothing", timeout=60)
    assert missing.status_code == 404 and missing.json() == {"error": "GET /nothing: Not Found"}
    wrong = httpx.get(f"{server.url}/translate", timeout=60)
    assert wrong.status_code == 405 and wrong.json() == {"error": "GET /translate: Method Not Allowed"}


@pytest.mark.parametrize("text", [
    [],  # an empty request
    ["", "   ", "\t"],  # blank lines
    ["ein \x00 hund", "\x00"],  # NULs
    ["\u200b\u200d\ufeff", "\u0301\u0301 rot", "\U0010ffff \U0001f408", "\x85\u2028\u2029 katze", "\ufffd\x7f"],
])
def test_odd_text_that_is_valid_unicode_is_translated(server: Server, tiny_run_dir: Path, text: list[str]) -> None:
    answer = server.post({"text": text})
    assert answer.status_code == 200, answer.text
    expected = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    assert answer.json()["translations"] == expected.translate(text)


def test_a_bad_request_batched_with_good_ones_fails_alone(tiny_run_dir: Path) -> None:
    """Seven clients at once, gathered into one batch (300 ms): six good requests get their
    translations, the one with a lone surrogate a 422 naming its line, then the server serves on."""
    expected = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    server = Server(tiny_run_dir, "--batch-wait-ms", "300")
    good = [[f"ein hund läuft im park {i}", "eine katze spielt"] for i in range(6)]
    bad = b'{"text": ["rot", "eine \\ud800 katze"]}'
    try:
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            pending = [pool.submit(server.post, {"text": text}) for text in good[:3]]
            pending.append(pool.submit(server.post, None, bad))
            pending += [pool.submit(server.post, {"text": text}) for text in good[3:]]
            answers = [p.result(timeout=120) for p in pending]
        refused = answers.pop(3)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"] == "text[1]: not valid Unicode (lone surrogate at column 6)"
        assert [a.status_code for a in answers] == [200] * 6
        assert [a.json()["translations"] for a in answers] == [expected.translate(t) for t in good]
        assert server.post({"text": ["rot"]}).json()["translations"] == expected.translate(["rot"])
    finally:
        assert server.stop() == 0


def test_api_key_is_required_when_set(tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MTCLI_API_KEY (or --api-key) reaches the app, which then refuses /translate without it
    (what the app does with a key: test_the_api_key_is_checked_before_the_body_and_must_be_sendable)."""
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    import mtcli.serve
    from mtcli.cli import app

    handed: list[str | None] = []
    monkeypatch.setattr(mtcli.serve, "serve", lambda translator, **kwargs: handed.append(kwargs["api_key"]) or False)
    for args, env in (([], {"MTCLI_API_KEY": KEY}), (["--api-key", KEY], {}), ([], {})):
        result = CliRunner().invoke(app, ["serve", str(tiny_run_dir), "--device", "cpu", *args], env=env)
        assert result.exit_code == 0, result.output
    assert handed == [KEY, KEY, None]
    with TestClient(mtcli.serve.create_app(Translator.from_run(tiny_run_dir, device="cpu"), api_key=KEY)) as keyed:
        assert keyed.post("/translate", json={"text": ["rot"]}).status_code == 401
        wrong = keyed.post("/translate", json={"text": ["rot"]}, headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]
        assert keyed.post("/translate", json={"text": ["rot"]}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert keyed.get("/health").status_code == 200  # health stays open


def test_sigterm_answers_the_request_in_flight_then_exits_0(tiny_run_dir: Path) -> None:
    server = Server(tiny_run_dir, "--max-lines", "2000", "--max-request-chars", "20000", "--batch-wait-ms", "300")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, {"text": ["ein hund läuft im park"] * 400, "beam": 4})
        time.sleep(0.5)  # the request is being gathered or decoded
        server.proc.send_signal(signal.SIGTERM)
        answer = pending.result(timeout=120)
    assert answer.status_code == 200 and len(answer.json()["translations"]) == 400
    assert server.proc.wait(timeout=60) == 0


def test_a_failure_while_decoding_is_a_500_and_the_server_keeps_serving(
        tiny_run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    real = translator.translate

    def flaky(lines: list[str], **settings: object) -> list[str]:
        if "explode" in lines:
            raise RuntimeError("out of memory\nwhile decoding")
        return real(lines, **settings)

    translator.translate = flaky  # type: ignore[method-assign]
    with TestClient(create_app(translator)) as client:
        broken = client.post("/translate", json={"text": ["explode"]})
        assert broken.status_code == 500
        request_id = broken.json()["request_id"]
        assert broken.headers["x-request-id"] == request_id
        assert broken.json()["error"] == f"translation failed (request id {request_id}; the server log has the cause)"
        assert "out of memory" not in broken.text and "Traceback" not in broken.text
        fine = client.post("/translate", json={"text": ["rot"]})
        assert fine.status_code == 200 and fine.json()["translations"] == real(["rot"])
        translator.score = lambda *args, **kwargs: flaky(["explode"])  # type: ignore[method-assign]
        scoring = client.post("/score", json={"source": ["rot"], "target": ["red"]})  # said it was a translation
        assert scoring.status_code == 500 and scoring.json()["error"].startswith("scoring failed (request id ")
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None
    assert logged[0].getMessage() == f"request {request_id}: decoding failed: RuntimeError: out of memory while decoding"


def _reload_until(server: Server, name: str) -> None:
    """SIGHUP until the server serves ``name`` (again every few seconds, should a signal be lost)."""
    deadline = time.monotonic() + 60
    sent = 0.0
    while httpx.get(f"{server.url}/health", timeout=10).json()["model"] != name:
        assert time.monotonic() < deadline, f"still serving {httpx.get(f'{server.url}/health').json()['model']}"
        if time.monotonic() - sent > 5:
            server.proc.send_signal(signal.SIGHUP)
            sent = time.monotonic()
        time.sleep(0.2)


def test_an_average_and_an_ensemble_are_served_as_translate_decodes_them(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve takes --average-last/--average-best and --ensemble as translate does (a README row
    scored with an average is served without writing the average first), and SIGHUP's load
    averages the newest again. The server itself is left out: what it is handed is compared."""
    from typer.testing import CliRunner

    import mtcli.serve
    from mtcli.cli import app

    handed: dict[str, Any] = {}

    def run_server(translator: Translator, **kwargs: Any) -> bool:
        handed.update(translator=translator, load=kwargs["load"])
        return False

    monkeypatch.setattr(mtcli.serve, "serve", run_server)
    result = CliRunner().invoke(app, ["serve", str(tiny_run_dir), "--beam", "2", "--device", "cpu",
                                      "--average-last", "2", "--ensemble", str(tiny_run_dir)])
    assert result.exit_code == 0, result.output
    expected = Translator.from_run(tiny_run_dir, average_last=2, ensemble=[tiny_run_dir], beam=2, device="cpu")
    for served in (handed["translator"], handed["load"]()):
        assert (served.name, served.translate(LINES)) == (expected.name, expected.translate(LINES))


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is a POSIX signal")
def test_sighup_serves_the_newest_checkpoint_without_stopping_and_a_bad_one_changes_nothing(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    """After more training, SIGHUP swaps in the new checkpoint_best while the old model serves;
    a checkpoint that cannot be loaded leaves the old model serving, with one log line."""
    import shutil

    from mtcli.checkpoint import load_checkpoint, save_checkpoint

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    best = run / "checkpoints" / "checkpoint_best.pt"
    state = load_checkpoint(best)
    running = Server(run)
    try:
        first = httpx.get(f"{running.url}/health", timeout=10).json()["model"]
        assert first == f"checkpoint_best.pt (step {state['step']})"
        weights = httpx.get(f"{running.url}/health", timeout=10).json()["weights_sha256"]
        trained = {key: value + 0.01 if value.is_floating_point() else value  # (as after more training)
                   for key, value in state["model"].items()}
        save_checkpoint(best, {**state, "step": state["step"] + 1000, "model": trained})
        _reload_until(running, f"checkpoint_best.pt (step {state['step'] + 1000})")
        assert httpx.get(f"{running.url}/health", timeout=10).json()["weights_sha256"] != weights
        summary = httpx.get(f"{running.url}/openapi.json", timeout=10).json()["info"]["summary"]
        assert summary.endswith(f"(step {state['step'] + 1000})")  # /docs named the model loaded at start
        answer = running.post({"text": LINES})
        assert answer.status_code == 200 and answer.json()["model"].endswith(f"(step {state['step'] + 1000})")
        best.write_bytes(b"not a checkpoint")
        running.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert running.post({"text": LINES}).status_code == 200
        save_checkpoint(best, {**state, "step": state["step"] + 2000})
        _reload_until(running, f"checkpoint_best.pt (step {state['step'] + 2000})")
    finally:
        assert running.stop() == 0
    log = running.log()
    assert f"reloaded: serving checkpoint_best.pt (step {state['step'] + 1000}) (was {first})" in log
    assert f"reload failed, still serving checkpoint_best.pt (step {state['step'] + 1000}): " in log
    assert "Traceback" not in log


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is a POSIX signal")
def test_a_hang_up_of_the_servers_terminal_still_ends_it(tiny_run_dir: Path) -> None:
    """SIGHUP reloads, but the SIGHUP of a closed terminal (an ssh session gone) ends the server
    as before, instead of leaving it serving with nowhere to log."""
    import fcntl
    import pty
    import select
    import termios
    import threading

    master, slave = pty.openpty()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtcli.cli", "serve", str(tiny_run_dir), "--port", str(port)],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # the pty is its terminal
    os.close(slave)
    seen: list[bytes] = []
    hang_up = threading.Event()

    def drain() -> None:  # the terminal's screen, read so that the server's writes never block
        with contextlib.suppress(OSError):
            while not hang_up.is_set():
                if select.select([master], [], [], 0.1)[0]:
                    seen.append(os.read(master, 4096))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while b"Uvicorn running" not in b"".join(seen):
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(seen).decode(errors="replace")
            time.sleep(0.2)
        hang_up.set()
        reader.join()
        os.close(master)  # the terminal hangs up: the kernel sends its session leader SIGHUP
        assert proc.wait(timeout=60) == -signal.SIGHUP
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Poisoned:
    """A translator whose batch fails when it holds the line "poison" (as a batch failed before
    mtcli checked for lone surrogates), and otherwise upper-cases."""

    name, device = "poisoned", "cpu"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def translate(self, lines: list[str], **settings: object) -> list[str]:
        self.calls.append(list(lines))
        if "poison" in lines:
            raise TypeError("List elements must be str or bytes")
        return [line.upper() for line in lines]


def test_the_batcher_decodes_a_failed_batch_again_one_request_at_a_time() -> None:
    from mtcli.serve import Batcher, Limits

    translator = Poisoned()
    batcher = Batcher(translator, Limits(batch_wait_ms=500))  # type: ignore[arg-type]
    try:
        futures = [batcher.submit([f"a{i}", f"b{i}"], f"id{i}") for i in range(3)]
        futures.append(batcher.submit(["x", "poison"], "bad"))
        futures += [batcher.submit([f"c{i}"], f"id{i + 3}") for i in range(3)]
        results = [f.exception(timeout=30) or f.result() for f in futures]
    finally:
        batcher.close()
    assert len(translator.calls[0]) == 11  # all seven requests were one batch
    assert isinstance(results[3], TypeError)
    assert results[:3] == [("poisoned", [f"A{i}", f"B{i}"]) for i in range(3)]
    assert results[4:] == [("poisoned", [f"C{i}"]) for i in range(3)]


def test_a_port_in_use_or_a_host_not_here_is_one_line_before_the_model_loads(tiny_run_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for option, value, expected in (
                ("--port", str(port), f"127.0.0.1:{port}: cannot listen there (Address already in use); another "
                                      "process is listening there: give another --port"),
                ("--host", "999.1.1.1", "--host 999.1.1.1: not an address to listen on")):
            res = mtcli_here("serve", str(tiny_run_dir), option, value)
            err = res.stderr.decode()
            assert res.returncode == 2 and err.startswith(f"mtcli: error: {expected}"), err
            assert len(err.splitlines()) == 1 and b"Uvicorn" not in res.stderr + res.stdout


@pytest.mark.parametrize(("option", "value"), [("--port", "99999"), ("--max-lines", "0"), ("--max-chars", "0"),
                                               ("--batch-wait-ms", "-1"), ("--batch-wait-ms", "1e300"),
                                               ("--batch-wait-ms", "inf"), ("--batch-wait-ms", "10001"),
                                               ("--shutdown-grace-s", "-1"), ("--shutdown-grace-s", "inf")])
def test_a_serve_option_out_of_range_is_a_usage_error(tiny_run_dir: Path, option: str, value: str) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    result = CliRunner().invoke(app, ["serve", str(tiny_run_dir), option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    assert "Traceback" not in result.output  # the port was bind()'s OverflowError


def test_a_batch_wait_that_is_not_a_number_is_one_line() -> None:
    from mtcli.errors import ConfigError
    from mtcli.serve import Limits

    for wait in (float("nan"), float("inf"), 1e300, -1.0):
        with pytest.raises(ConfigError, match=r"^--batch-wait-ms .*: must be between 0 and 10000 "):
            Limits(batch_wait_ms=wait)


def test_the_batcher_survives_a_failure_of_its_own() -> None:
    """A failure outside the model's translate call (a wait the thread cannot make, as
    --batch-wait-ms 1e300 once gave) fails that batch only: the worker serves the next one."""
    from mtcli.serve import Batcher, Limits

    limits = Limits(batch_wait_ms=5)
    batcher = Batcher(Poisoned(), limits)  # type: ignore[arg-type]
    try:
        limits.batch_wait_ms = 1e300  # past Limits' check: queue.get(timeout=...) overflows
        assert isinstance(batcher.submit(["a"], "id0").exception(timeout=30), OverflowError)
        limits.batch_wait_ms = 5
        assert batcher.submit(["b"], "id1").result(timeout=30) == ("poisoned", ["B"])
        assert batcher.alive
    finally:
        batcher.close()


def test_closing_the_batcher_does_not_wait_out_a_batch_nobody_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    """After SIGTERM's grace period every request has its 503, yet the shutdown waited for the
    batch in progress to end (23 s after a 1 s grace): it now waits a bounded time."""
    import threading

    from mtcli.serve import Batcher, Limits

    release = threading.Event()

    class Slow(Poisoned):
        def translate(self, lines: list[str], **settings: object) -> list[str]:
            release.wait(30)
            return super().translate(lines, **settings)

    batcher = Batcher(Slow(), Limits(batch_wait_ms=1))  # type: ignore[arg-type]
    batcher.submit(["long"], "id0")
    time.sleep(0.2)  # decoding now
    start = time.monotonic()
    batcher.close(timeout=0.3)
    assert time.monotonic() - start < 5
    assert any("left unfinished" in r.getMessage() for r in caplog.records)
    release.set()


def test_a_job_cancelled_before_its_turn_is_not_decoded() -> None:
    """A request whose client task was cancelled (uvicorn's shutdown grace period ended) is
    skipped, and the worker goes on with the others instead of dying on InvalidStateError."""
    from mtcli.serve import Batcher, Limits

    translator = Poisoned()
    batcher = Batcher(translator, Limits(batch_wait_ms=300))  # type: ignore[arg-type]
    try:
        gone = batcher.submit(["gone"], "id0")
        assert gone.cancel()
        kept = batcher.submit(["kept"], "id1")
        assert kept.result(timeout=30) == ("poisoned", ["KEPT"])
    finally:
        batcher.close()
    assert translator.calls == [["kept"]]


def test_a_failed_batch_is_a_500_and_a_dead_worker_makes_the_server_unhealthy(tiny_run_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from mtcli.serve import STOPPED, Limits, create_app

    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    limits = Limits()
    with TestClient(create_app(translator, limits)) as client:
        limits.batch_wait_ms = float("inf")
        broken = client.post("/translate", json={"text": ["rot"]})
        assert broken.status_code == 500 and "request id" in broken.json()["error"], broken.text
        limits.batch_wait_ms = 5
        assert client.post("/translate", json={"text": ["rot"]}).status_code == 200
        assert client.get("/health").json()["status"] == "ok"
        client.app.state.batcher.close()  # as if the worker had died
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert health.json()["error"] == STOPPED
        refused = client.post("/translate", json={"text": ["rot"]})
        assert refused.status_code == 503 and refused.json() == {"error": STOPPED}


def test_a_seed_is_refused_when_ctranslate2_samples(tiny_run_dir: Path, tmp_path: Path) -> None:
    """CTranslate2's samples cannot be seeded: a request's seed would be ignored, so it is refused."""
    import shutil

    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    pytest.importorskip("ctranslate2")
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)  # the engine converts the checkpoint into the run directory
    translator = Translator.from_run(run, beam=2, device="cpu", engine="ctranslate2")
    with TestClient(create_app(translator)) as client:
        seeded = client.post("/translate", json={"text": ["rot"], "sampling": "topk", "seed": 3})
        assert seeded.status_code == 422
        assert seeded.json()["error"].startswith("seed: this server decodes with --engine ctranslate2, whose "
                                                 "samples cannot be seeded")
        assert client.post("/translate", json={"text": ["rot"], "sampling": "topk"}).status_code == 200


def test_requests_still_waiting_when_the_shutdown_grace_ends_get_a_503_and_the_log_says_so(
        tiny_run_dir: Path) -> None:
    """SIGTERM with work queued past --shutdown-grace-s: uvicorn cancels the request, which is
    answered 503 JSON (not decoded), and the last log line says one was dropped."""
    server = Server(tiny_run_dir, "--batch-wait-ms", "5000", "--shutdown-grace-s", "0.5")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, {"text": ["ein hund läuft im park"]})
        time.sleep(0.5)  # the request waits for others to join its batch
        server.proc.send_signal(signal.SIGTERM)
        answer = pending.result(timeout=60)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"].startswith("the server stopped before translating this request (request id ")
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert ("stopped by SIGTERM: 1 request(s) still unanswered after the 0.5 s shutdown grace period "
            "(--shutdown-grace-s) were answered 503, untranslated") in log
    assert "after answering the requests in flight" not in log and "Traceback" not in log


def test_a_batch_still_decoding_after_the_grace_period_ends_the_process_with_0(tiny_run_dir: Path) -> None:
    """SIGTERM while a long batch decodes, past the grace period and the close wait: the process
    aborted (status 134, "terminate called without an active exception") as the interpreter
    exited beneath the decoding thread; it now ends with 0, as the README promises."""
    server = Server(tiny_run_dir, "--max-lines", "2000", "--max-request-chars", "60000", "--shutdown-grace-s", "0.2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, {"text": ["ein hund läuft im park"] * 2000, "beam": 8})
        time.sleep(1.0)  # decoding now: a random model writes to its length limit
        server.proc.send_signal(signal.SIGTERM)
        assert pending.result(timeout=60).status_code == 503
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert "left unfinished" in log and "terminate called" not in log


def test_a_body_still_arriving_when_the_grace_period_ends_gets_a_503(tiny_run_dir: Path) -> None:
    """A slow client's body half sent at SIGTERM: uvicorn's cancellation reached the body's read,
    which answered a plain-text 500 and logged a traceback."""
    server = Server(tiny_run_dir, "--shutdown-grace-s", "0.3")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as client:
        client.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 500\r\n\r\n" + b'{"text": ["rot')
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
        "error": "the server stopped before this request had arrived: send it again"}
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert "Traceback" not in log and "1 request(s) still unanswered" in log, log


def test_a_request_whose_client_left_is_dropped_from_the_queue(tiny_run_dir: Path) -> None:
    """A client that timed out and left kept its lines in the queue: they were decoded anyway,
    ahead of the clients still waiting."""
    server = Server(tiny_run_dir, "--batch-wait-ms", "3000")
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/translate", json={"text": ["ein hund läuft im park"]}, timeout=0.5)
        time.sleep(1.0)
        assert server.post({"text": ["rot"]}).status_code == 200  # the server goes on
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "the client has gone; its lines are dropped unless their decoding had begun" in log
    assert "Traceback" not in log


SIGHUP_WHILE_LOADING = """
import os, signal
from mtcli.infer.translator import Translator
from mtcli.cli import app
load = Translator.from_run.__func__
loads = []
def from_run(cls, *args, **kwargs):  # a SIGHUP arrives while the model loads (after more training)
    loads.append(1)
    if len(loads) == 1:
        os.kill(os.getpid(), signal.SIGHUP)
    return load(cls, *args, **kwargs)
Translator.from_run = classmethod(from_run)
app(prog_name="mtcli")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is a POSIX signal")
def test_a_sighup_while_the_server_starts_is_a_reload_once_it_serves(tiny_run_dir: Path) -> None:
    """Before, the SIGHUP's default action ended the starting server (exit 129, no message)."""
    server = Server(tiny_run_dir, script=SIGHUP_WHILE_LOADING)
    try:
        deadline = time.monotonic() + 60
        while "reloaded: serving" not in (log := server.log()):
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        assert server.post({"text": ["rot"]}).status_code == 200
    finally:
        assert server.stop() == 0


def test_port_0_logs_the_port_the_server_listens_on(tiny_run_dir: Path) -> None:
    """And every log line, a request's access line included, goes to stderr: standard output
    stays empty (a closed pipe there gave a traceback a request)."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "mtcli.cli", "serve", str(tiny_run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1"})
    try:
        for line in proc.stderr:
            if match := re.search(r"serving .* on http://127\.0\.0\.1:(\d+) ", line):
                break
        else:
            raise AssertionError(f"exited {proc.wait()} without saying where it serves")
        port = int(match[1])
        assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        assert httpx.post(f"http://127.0.0.1:{port}/translate", json={"text": ["a b"]}, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "" and '"POST /translate HTTP/1.1" 200' in err and "\x1b[" not in err


def test_quiet_leaves_out_uvicorn_info_and_access_lines(tiny_run_dir: Path) -> None:
    """--quiet is warnings and errors only: uvicorn logged its start and an access line a request
    all the same."""
    server = Server(tiny_run_dir, "--quiet")
    try:
        assert server.post({"text": ["rot"]}).status_code == 200
        assert server.post({"text": "rot"}).status_code == 422
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "POST /translate" not in log and "Uvicorn running" not in log and "serving" not in log, log


def test_settling_a_job_its_client_cancelled_is_no_error() -> None:
    from mtcli.serve_batching import _Job, _settle

    job = _Job(["rot"], (), "id0")
    assert job.future.cancel()
    _settle(job, ("model", ["ROT"]))  # no InvalidStateError, which would end the worker
    _settle(job, error=RuntimeError("late"))
    assert job.future.cancelled()


def test_sampling_from_a_server_with_a_shortlist_is_a_422(tiny_run_dir: Path, tmp_path: Path) -> None:
    """It failed inside the batch, a 500: the shortlist decodes over a few pieces, sampling over all."""
    import shutil

    import yaml
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    run = shutil.copytree(tiny_run_dir, tmp_path / "run")  # its shortlist is built from a toy cache of its own
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["prepared_dir"] = str(prepare_for_run(run, tmp_path / "prepared"))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    translator = Translator.from_run(run, device="cpu", overrides=["decode.shortlist=20"])
    with TestClient(create_app(translator)) as client:
        answer = client.post("/translate", json={"text": ["ein hund"], "sampling": "topk"})
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"].startswith("sampling: this server decodes over a lexical shortlist")


def test_the_api_key_is_checked_before_the_body_and_must_be_sendable(tiny_run_dir: Path) -> None:
    """A client without the key got the server's 400/422 answers about its body; a key no HTTP
    header can carry as it is (non-ASCII, a space) was taken, and then no client could use it."""
    from fastapi.testclient import TestClient

    from mtcli.errors import ConfigError
    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, beam=2, device="cpu")
    with TestClient(create_app(translator, api_key=KEY)) as client:
        for body in (b'{"text":', b'{"text": "one string"}'):
            refused = client.post("/translate", content=body, headers={"Content-Type": "application/json"})
            assert refused.status_code == 401 and "API key" in refused.json()["error"], refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
        keyed = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        assert client.post("/translate", content=b'{"text":', headers=keyed).status_code == 400
        assert client.post("/translate", json={"text": ["rot"]}, headers=keyed).status_code == 200
        assert client.get("/health").status_code == 200  # health stays open
    for key in ("ключ", "clé", "two words"):
        with pytest.raises(ConfigError, match="visible ASCII characters only"):
            create_app(translator, api_key=key)
    with pytest.raises(ConfigError, match="is empty: give a key, or leave both out"):  # MTCLI_API_KEY= served open
        create_app(translator, api_key="")


def test_a_bad_tgt_lang_and_sampling_none_are_answered_as_requests(tiny_run_dir: Path) -> None:
    """A lone surrogate in tgt_lang was a plain-text 500 with a traceback in the log (the error
    repeating it could not be encoded); a server that samples by default could not be asked to
    search ("none" was not a choice)."""
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, device="cpu", overrides=["decode.sampling=topk"])
    with TestClient(create_app(translator)) as client:
        bad = client.post("/translate", content=b'{"text": ["rot"], "tgt_lang": "x\\ud800"}',
                          headers={"Content-Type": "application/json"})
        assert bad.status_code == 422 and bad.json() == {"error": "tgt_lang: not valid Unicode (lone surrogate at "
                                                                  "column 2)"}
        searched = client.post("/translate", json={"text": LINES[:2], "sampling": "none", "beam": 2})
        assert searched.status_code == 200, searched.text
        assert searched.json()["translations"] == translator.translate(LINES[:2], sampling="none", beam=2)


def test_the_schema_lists_the_error_answers_as_sent(tiny_run_dir: Path) -> None:
    """/docs described a 422 of FastAPI's {"detail": [...]} and no other refusal; every one is
    {"error": ...}."""
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    with TestClient(create_app(Translator.from_run(tiny_run_dir, beam=2, device="cpu"))) as client:
        schema = client.get("/openapi.json").json()
    answers = schema["paths"]["/translate"]["post"]["responses"]
    assert sorted(answers) == ["200", "400", "401", "413", "415", "422", "500", "503"]
    assert sorted(schema["paths"]["/score"]["post"]["responses"]) == sorted([*answers, "501"])
    for status in ("400", "422", "503"):
        assert answers[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorAnswer"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    fields = schema["components"]["schemas"]["TranslateRequest"]["properties"]
    assert [(fields[f]["minimum"], fields[f]["maximum"]) for f in ("beam", "nbest")] == [(1, 16), (1, 16)]
    # ranges as JSON Schema's minimum/maximum, which /docs shows (pydantic wrote "ge"/"le" on the union)
    for field, (low, high) in (("length_penalty", (-5, 5)), ("temperature", (0.01, 100))):
        number = fields[field]["anyOf"][0]
        assert (number["type"], number["minimum"], number["maximum"]) == ("number", low, high), fields[field]
        assert '"ge"' not in json.dumps(fields[field]) and '"le"' not in json.dumps(fields[field])


def test_an_empty_api_key_variable_is_refused_not_served_open(tiny_run_dir: Path) -> None:
    """click reads an empty MTCLI_API_KEY= as unset: the server started without a key, unsaid."""
    from typer.testing import CliRunner

    from mtcli.cli import app

    for args, env in (([], {"MTCLI_API_KEY": ""}), (["--api-key", ""], {})):
        # an address not to be had: should the key go unchecked, the server stops there, not serves
        result = CliRunner().invoke(app, ["serve", str(tiny_run_dir), "--host", "256.0.0.1", *args], env=env)
        assert result.exit_code != 0 and "is empty: give a key, or leave both out" in result.stderr, result.output


def test_a_second_ctrl_c_forces_the_stop_in_one_line(tiny_run_dir: Path) -> None:
    """Ctrl-C twice during the shutdown's wait: uvicorn stops at once; the log showed a lifespan
    CancelledError traceback, and said the 60 s grace period had ended, 2 s into it."""
    server = Server(tiny_run_dir, "--batch-wait-ms", "5000", "--shutdown-grace-s", "60")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, {"text": ["ein hund läuft im park"]})
        time.sleep(0.5)  # the request waits for others to join its batch
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        answer = pending.result(timeout=60)
    assert answer.status_code == 503, answer.text
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert ("stopped by a second SIGINT before the 60 s shutdown grace period ended: 1 request(s) still "
            "unanswered were answered 503, untranslated") in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_a_sighup_during_a_reload_loads_once_more_after_it() -> None:
    """A new checkpoint_best written while a reload loads (a large model, a conversion): its
    SIGHUP was dropped, and the server kept the older model for good."""
    import threading
    from types import SimpleNamespace

    from mtcli.serve import Reloader

    app = SimpleNamespace(state=SimpleNamespace(batcher=SimpleNamespace(translator=SimpleNamespace(name="step 1"))),
                          summary="", openapi_schema=None)
    loading, go_on, loads = threading.Event(), threading.Event(), []

    def load() -> SimpleNamespace:
        loads.append(len(loads) + 2)
        if len(loads) == 1:  # the first load takes a while; a SIGHUP comes meanwhile
            loading.set()
            go_on.wait(30)
        return SimpleNamespace(name=f"step {loads[-1]}")

    reloader = Reloader(app, load)  # type: ignore[arg-type]
    first = reloader.start()
    assert first is not None and loading.wait(30)
    assert reloader.start() is None  # under way: it follows
    go_on.set()
    first.join(30)
    assert loads == [2, 3] and app.state.batcher.translator.name == "step 3"
    assert reloader.start().join(30) is None and loads == [2, 3, 4]  # and later ones as before



def test_a_beam_or_nbest_too_wide_for_the_vocabulary_is_a_422_and_a_default_one_stops_the_start(
        tiny_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the server's 1-16, a beam or an n-best wider than half a small model's output
    vocabulary got a 500 ("translation failed"), and a run whose own beam was too wide served
    (its health "ok") and failed every request."""
    from mtcli.errors import ConfigError
    from mtcli.model import Transformer
    from mtcli.serve_requests import RequestError, TranslateRequest, check_decoding

    monkeypatch.setattr(Transformer, "output_size", property(lambda self: 20))
    translator = Translator.from_run(tiny_run_dir, device="cpu", beam=2)
    for asked, said in (({"beam": 11}, "beam 11 needs an output vocabulary of at least 22 pieces"),
                        ({"nbest": 12}, "nbest 12 widens the beam to 12, which needs an output vocabulary of at "
                                        "least 24 pieces (this model has 20)")):
        with pytest.raises(RequestError, match=re.escape(said)) as caught:
            check_decoding(TranslateRequest(text=["ein hund"], **asked), translator)
        assert caught.value.status == 422
    check_decoding(TranslateRequest(text=["ein hund"], beam=10, nbest=10), translator)
    with pytest.raises(ConfigError, match=r"decode.beam_size=11 needs an output vocabulary of at least 22 pieces"):
        Translator.from_run(tiny_run_dir, device="cpu", beam=11)


def test_a_server_of_a_beam_past_16_takes_requests_for_its_own_beam(tiny_run_dir: Path) -> None:
    """serve --beam 20 decoded with beam 20 unasked, and answered a request asking for beam 20 (or
    its n-best) with a 422, "beam must be between 1 and 16"."""
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    translator = Translator.from_run(tiny_run_dir, beam=20, device="cpu")
    with TestClient(create_app(translator)) as client:
        for asked in ({"beam": 20}, {"nbest": 20}, {"beam": 17, "nbest": 3}):
            answer = client.post("/translate", json={"text": ["ein hund"], **asked})
            assert answer.status_code == 200, (asked, answer.text)
        refused = client.post("/translate", json={"text": ["ein hund"], "beam": 21})
        assert refused.status_code == 422 and refused.json()["error"] == "beam must be between 1 and 20, got 21"


def test_a_server_other_machines_reach_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """--host 0.0.0.0 without a key logged an INFO line only; uvicorn times out no slow request."""
    from mtcli.serve import warn_of_exposure

    with caplog.at_level("WARNING", logger="mtcli"):
        for host in ("127.0.0.1", "localhost", "::1"):
            warn_of_exposure(host, None)
        assert caplog.text == ""
        warn_of_exposure("0.0.0.0", None)
        warn_of_exposure("0.0.0.0", "key")
    assert "0.0.0.0 is reached from other machines: without an API key (--api-key, MTCLI_API_KEY) anyone who " \
           "reaches it translates; put a reverse proxy with TLS and read timeouts in front of it" in caplog.text
    assert "the API key crosses the network in clear text" in caplog.text


def test_a_reload_frees_the_model_it_replaces(tiny_run_dir: Path) -> None:
    """The app's startup closed over the first translator: after SIGHUPs the server held the
    first model beside the one it served (2.2 GB where one model took 1.3)."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    from mtcli.serve import Reloader, create_app

    first = Translator.from_run(tiny_run_dir, device="cpu", beam=1)
    gone = weakref.ref(first)
    app = create_app(first)
    del first
    with TestClient(app) as client:
        Reloader(app, lambda: Translator.from_run(tiny_run_dir, device="cpu", beam=1)).start().join(30)
        gc.collect()
        assert gone() is None
        assert client.post("/translate", json={"text": ["ein hund"]}).status_code == 200


def test_a_body_that_stops_arriving_is_answered_408(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn times out no body: a client that sent part of one held its connection for good,
    and a few hundred of them used up the server's file descriptors."""
    import asyncio

    from mtcli import serve_guards

    monkeypatch.setattr(serve_guards, "BODY_TIMEOUT_S", 0.2)
    sent: list[dict] = []
    parts = [{"type": "http.request", "body": b'{"text": ', "more_body": True}]

    async def receive() -> dict:
        if parts:
            return parts.pop()
        await asyncio.sleep(3600)  # the rest never comes
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive_: object, send_: object) -> None:
        while (await receive_())["more_body"]:  # type: ignore[operator]
            pass

    asyncio.run(serve_guards.BodyLimit(app, 1000)({"type": "http", "headers": []}, receive, send))
    assert sent[0]["status"] == 408 and b"stopped arriving for 0.2 s" in sent[1]["body"]


def test_a_request_whose_headers_stop_arriving_has_its_connection_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn times out no request headers: a client that sent part of a request line (a byte
    now and then) held its connection for good, on a new connection or a kept-alive one. A
    request whose headers are in is the body's timeout's, not this one's."""
    import threading

    import uvicorn

    from mtcli import serve_guards

    monkeypatch.setattr(serve_guards, "HEADER_TIMEOUT_S", 0.5)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           http=serve_guards.header_deadline_protocol()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def closed_within(sock: socket.socket, seconds: float) -> bool:
        sock.settimeout(seconds)
        try:
            return sock.recv(1024) == b""
        except TimeoutError:
            return False

    def answered(sock: socket.socket) -> bool:
        sock.settimeout(5)
        got = b""
        while not got.endswith(b"ok") and (chunk := sock.recv(1024)):
            got += chunk
        return got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok")

    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
            assert closed_within(slow, 5)
        with socket.create_connection(("127.0.0.1", port)) as kept:
            kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answered(kept)
            kept.sendall(b"GET / HT")  # the next request, on the kept-alive connection
            assert closed_within(kept, 5)
        with socket.create_connection(("127.0.0.1", port)) as body:
            body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
            assert not closed_within(body, 1.5)  # past the headers' 0.5 s: the body has its own timeout
            body.sendall(b"cd")
            assert answered(body)
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_server_speaks_http_through_the_header_deadline(tiny_run_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import mtcli.serve as serve_module
    from mtcli.errors import ConfigError

    configs: list[Any] = []

    class Unstarted:  # records what uvicorn would be given, and never starts
        started, force_exit = False, False

        def __init__(self, config: Any, listening: Any) -> None:
            configs.append(config)

        def run(self) -> None:
            pass

    monkeypatch.setattr(serve_module, "_Server", Unstarted)
    with pytest.raises(ConfigError, match="did not start"):
        serve_module.serve(Translator.from_run(tiny_run_dir, device="cpu"), port=free_port())
    assert configs[0].http.__name__ == "HeaderDeadline" and configs[0].ws == "none"  # (no WebSocket routes)


def test_a_request_at_each_limit_is_taken_and_one_past_it_refused() -> None:
    """Every limit is a most: a request with exactly max_lines lines, a line of max_chars
    characters, max_total_chars in all or a beam or n-best of max_beam passes; one more is refused
    (413 for the size, 422 for the search), naming what was asked."""
    from mtcli.serve import Limits
    from mtcli.serve_requests import RequestError, TranslateRequest, check_request

    limits = Limits(max_lines=3, max_chars=4, max_total_chars=10, max_beam=5)
    for body in ({"text": ["a", "b", "c"]}, {"text": ["abcd"]}, {"text": ["abcd", "abcd", "ab"]},
                 {"text": ["a"], "beam": 5, "nbest": 5}, {"text": ["a"], "beam": 1, "nbest": 1}):
        check_request(TranslateRequest(**body), limits)
    for body, status, said in (
            ({"text": ["a"] * 4}, 413, "too many lines: 4 (at most 3 a request)"),
            ({"text": ["abcde"]}, 413, "text[0] has 5 characters (at most 4)"),
            ({"text": ["abcd", "abcd", "abc"]}, 413, "11 characters in the request (at most 10)"),
            ({"text": ["a"], "beam": 6}, 422, "beam must be between 1 and 5, got 6"),
            ({"text": ["a"], "nbest": 6}, 422, "nbest must be between 1 and 5, got 6"),
            ({"text": ["a"], "nbest": 0}, 422, "nbest must be between 1 and 5, got 0")):
        with pytest.raises(RequestError) as caught:
            check_request(TranslateRequest(**body), limits)
        assert (caught.value.status, str(caught.value)) == (status, said)


def test_a_line_of_as_many_pieces_as_the_model_reads_is_taken() -> None:
    """A line is refused (413) only when it encodes to more pieces than the model reads."""
    from types import SimpleNamespace

    from mtcli.serve_requests import RequestError, TranslateRequest, check_decoding

    translator = SimpleNamespace(decode=SimpleNamespace(shortlist=0, sampling="none"), engine=None,
                                 max_source_pieces=4, source_pieces=lambda text, **_: [len(line) for line in text])
    check_decoding(TranslateRequest(text=["abcd", "a"]), translator)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"^text\[1\] encodes to 5 pieces \(the model reads at most 4\)") as caught:
        check_decoding(TranslateRequest(text=["abcd", "abcde"]), translator)  # type: ignore[arg-type]
    assert caught.value.status == 413


def test_the_limits_fit_a_servers_own_nbest() -> None:
    """A server whose own n-best (or beam) is past max_beam takes requests asking for it."""
    from types import SimpleNamespace

    from mtcli.serve import Limits

    limits = Limits()
    assert limits.fitting(SimpleNamespace(beam_size=4, nbest=20)).max_beam == 20  # type: ignore[arg-type]
    assert limits.fitting(SimpleNamespace(beam_size=18, nbest=1)).max_beam == 18  # type: ignore[arg-type]
    assert limits.fitting(SimpleNamespace(beam_size=4, nbest=2)) is limits  # type: ignore[arg-type]


class Recording(Poisoned):
    """A :class:`Poisoned` translator that also records the settings of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.settings: list[dict[str, object]] = []

    def translate(self, lines: list[str], **settings: object) -> list[str]:
        self.settings.append(settings)
        return super().translate(lines, **settings)


def test_the_batcher_decodes_together_only_requests_of_equal_settings() -> None:
    """Requests are batched by their settings (a setting left None is the server's own, as if
    not given); each batch is one call with its settings, and each request gets its own lines."""
    from mtcli.serve import Batcher, Limits

    translator = Recording()
    batcher = Batcher(translator, Limits(batch_wait_ms=300))  # type: ignore[arg-type]
    try:
        futures = [batcher.submit(["a"], "id0", beam=2), batcher.submit(["b"], "id1", beam=3),
                   batcher.submit(["c"], "id2", beam=2, seed=None), batcher.submit(["d"], "id3"),
                   batcher.submit(["e"], "id4", beam=None)]
        results = [f.result(timeout=30) for f in futures]
    finally:
        batcher.close()
    assert results == [("poisoned", [x]) for x in "ABCDE"]
    assert sorted(zip(map(tuple, translator.calls), [sorted(s.items()) for s in translator.settings], strict=True)) == [
        (("a", "c"), [("beam", 2)]), (("b",), [("beam", 3)]), (("d", "e"), [])]


def test_the_batcher_gathers_no_more_than_batch_lines() -> None:
    """A first request of batch_lines lines is decoded alone: the next waits for the next batch."""
    from mtcli.serve import Batcher, Limits

    translator = Poisoned()
    batcher = Batcher(translator, Limits(batch_wait_ms=200, batch_lines=2))  # type: ignore[arg-type]
    try:
        futures = [batcher.submit(["a", "b"], "id0"), batcher.submit(["c"], "id1")]
        assert [f.result(timeout=30) for f in futures] == [("poisoned", ["A", "B"]), ("poisoned", ["C"])]
    finally:
        batcher.close()
    assert translator.calls == [["a", "b"], ["c"]]


def test_closing_the_batcher_while_it_gathers_ends_it_after_that_batch() -> None:
    """close() during the wait for more requests decodes what was gathered, then stops the worker."""
    from mtcli.serve import Batcher, Limits

    batcher = Batcher(Poisoned(), Limits(batch_wait_ms=300))  # type: ignore[arg-type]
    future = batcher.submit(["a"], "id0")
    time.sleep(0.05)  # the worker waits for more
    assert batcher.close(timeout=3)
    assert future.result(timeout=0) == ("poisoned", ["A"]) and not batcher.alive


def test_a_failed_batch_of_two_requests_fails_only_the_bad_one() -> None:
    from mtcli.serve import Batcher, Limits

    translator = Poisoned()
    batcher = Batcher(translator, Limits(batch_wait_ms=300))  # type: ignore[arg-type]
    try:
        good, bad = batcher.submit(["x"], "id0"), batcher.submit(["poison"], "id1")
        assert good.result(timeout=30) == ("poisoned", ["X"])
        assert isinstance(bad.exception(timeout=30), TypeError)
    finally:
        batcher.close()
    assert translator.calls == [["x", "poison"], ["x"], ["poison"]]


def test_score_answers_the_translators_scores_in_order_and_refuses_bad_pairs(tiny_run_dir: Path) -> None:
    """POST /score: log p(target | source) per pair, batched with other requests as translations
    are; null where the model cannot produce the target; each refusal a 4xx, and it keeps serving."""
    from fastapi.testclient import TestClient

    from mtcli.serve import Limits, create_app

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    sources, targets = ["eine katze spielt", "rot", ""], ["a cat plays", "red", "two dogs"]
    expected = translator.score(sources, targets)
    too_long = " ".join(["dog"] * 400)
    with TestClient(create_app(translator, Limits(max_lines=4))) as client:
        answer = client.post("/score", json={"source": sources, "target": targets})
        assert answer.status_code == 200, answer.text
        assert answer.json()["scores"] == pytest.approx(expected, abs=1e-4)
        assert answer.json()["model"] == translator.name
        normalised = client.post("/score", json={"source": sources, "target": targets, "normalize": True})
        assert normalised.json()["scores"] == pytest.approx(translator.score(sources, targets, normalize=True), abs=1e-4)
        cannot = client.post("/score", json={"source": ["ein hund"], "target": [too_long]})
        assert cannot.status_code == 200 and cannot.json()["scores"] == [None]  # -inf, which JSON has no word for
        for body, status, words in [
            ({"source": ["a", "b"], "target": ["a"]}, 422, "source has 2 lines but target 1"),
            ({"source": ["a"] * 5, "target": ["a"] * 5}, 413, "too many lines: 5"),
            ({"source": [" ".join(["hund"] * 400)], "target": ["a dog"]}, 413, "source[0] encodes to"),
            ({"source": ["a"], "target": ["a"], "tgt_lang": "xx"}, 422, "xx"),
            ({"source": ["a"], "target": ["a"], "normalize": "yes"}, 422, "normalize"),
            (b'{"source": ["a"], "target": ["\\ud800"]}', 422, "target[0]: not valid Unicode"),
        ]:
            refused = (client.post("/score", json=body) if isinstance(body, dict) else
                       client.post("/score", content=body, headers={"content-type": "application/json"}))
            assert refused.status_code == status and words in refused.json()["error"], (body, refused.text)
        again = client.post("/score", json={"source": sources, "target": targets})
        assert again.json()["scores"] == pytest.approx(expected, abs=1e-4)
        assert client.post("/translate", json={"text": sources}).status_code == 200
        assert client.get("/openapi.json").json()["paths"]["/score"]["post"]["responses"].keys() >= {"200", "413", "422"}


def test_score_needs_the_api_key_as_translate_does(tiny_run_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    with TestClient(create_app(Translator.from_run(tiny_run_dir, device="cpu"), api_key=KEY)) as client:
        body = {"source": ["rot"], "target": ["red"]}
        assert client.post("/score", json=body).status_code == 401
        assert client.post("/score", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_server_of_an_ensemble_refuses_to_score_and_keeps_translating(tiny_run_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from mtcli.serve import create_app

    with TestClient(create_app(Translator.from_run(tiny_run_dir, device="cpu", ensemble=[tiny_run_dir]))) as client:
        refused = client.post("/score", json={"source": ["rot"], "target": ["red"]})
        assert refused.status_code == 501 and "ensemble" in refused.json()["error"]
        assert client.post("/translate", json={"text": ["rot"]}).status_code == 200


def test_pairs_to_score_are_batched_together_and_apart_from_lines_to_translate(tiny_run_dir: Path) -> None:
    from mtcli.serve_batching import Batcher, Limits

    translator = Translator.from_run(tiny_run_dir, device="cpu")
    calls: list[int] = []
    real = translator.score

    def counted(sources: list[str], targets: list[str], **settings: object) -> list[float]:
        calls.append(len(sources))
        return real(sources, targets, **settings)  # type: ignore[arg-type]

    translator.score = counted  # type: ignore[method-assign]
    batcher = Batcher(translator, Limits(batch_wait_ms=500))
    try:
        futures = [batcher.submit(["rot"], targets=["red"]),  # the same settings as the translation's
                   batcher.submit(["eine katze spielt"]),
                   batcher.submit(["rot", "eine katze spielt"], targets=["a cat", "a cat plays"])]
        (_, first), (_, translated), (_, both) = (f.result(timeout=60) for f in futures)
    finally:
        batcher.close(timeout=60)
    assert calls == [3]  # one call for both scoring requests, none for the translation
    assert translated == translator.translate(["eine katze spielt"])
    assert first + both == pytest.approx(real(["rot", "rot", "eine katze spielt"], ["red", "a cat", "a cat plays"]),
                                         abs=1e-4)
