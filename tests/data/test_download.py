"""Public corpora fetched by name, with no internet: a loopback HTTP server on 127.0.0.1 serves
copies of fixture files at the pinned paths, and ``MTCLI_DATA_URL`` points the downloader at it.
A fresh download verifies; a cache hit asks for nothing; a wrong checksum, a server that is down
and a transfer cut off halfway each give one error naming the URL and leave nothing behind."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, SHARED_DATA, TOY_DIR

from mtcli.config import load_config
from mtcli.data import download
from mtcli.data.download import CORPORA, PublicFile, locate
from mtcli.data.prepare import prepare
from mtcli.data.sources import open_source
from mtcli.errors import DataError


class Files(http.server.ThreadingHTTPServer):
    """Serves ``pages`` (URL path -> bytes); counts requests; may cut each transfer in half."""

    def __init__(self, pages: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.pages, self.requests, self.cut = pages, [], False
        self.url = f"http://127.0.0.1:{self.server_address[1]}/"


class Handler(http.server.BaseHTTPRequestHandler):
    server: Files

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append(self.path)
        body = self.server.pages.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if self.server.cut else body)
        if self.server.cut:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def _file(name: str, parts: list[tuple[str, bytes]], text: bytes) -> PublicFile:
    return PublicFile(name, tuple(p for p, _ in parts), len(text), hashlib.sha256(text).hexdigest())


@pytest.fixture
def toy_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Files, Path]]:
    """The toy corpus as a public one: train.src gzipped, train.tgt in two plain parts, the
    rest plain; served on 127.0.0.1, cached under ``tmp_path/cache``, no local copy."""
    pages: dict[str, bytes] = {}
    files = []
    for path in sorted(TOY_DIR.iterdir()):
        text = path.read_bytes()
        if path.name == "train.src":
            parts = [(f"toy/{path.name}.gz", gzip.compress(text))]
        elif path.name == "train.tgt":
            cut = text.index(b"\n", len(text) // 2) + 1
            parts = [(f"toy/{path.name}.1", text[:cut]), (f"toy/{path.name}.2", text[cut:])]
        else:
            parts = [(f"toy/{path.name}", text)]
        pages.update(parts)
        files.append(_file(path.name, parts, text))
    monkeypatch.setitem(CORPORA, "toy-public", tuple(files))
    monkeypatch.setattr(download, "LOCAL_COPIES", ())
    monkeypatch.setenv("MTCLI_DATA", str(tmp_path / "cache"))
    server = Files(pages)
    monkeypatch.setenv("MTCLI_DATA_URL", server.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, tmp_path / "cache" / "toy-public"
    server.shutdown()
    server.server_close()


def _same_as_toy(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in TOY_DIR.iterdir())
    for path in TOY_DIR.iterdir():
        assert (root / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_fresh_download_is_verified_and_the_next_use_asks_for_nothing(toy_corpus: tuple[Files, Path]) -> None:
    server, root = toy_corpus
    assert locate("toy-public") == root
    _same_as_toy(root)
    asked = len(server.requests)
    assert asked == sum(len(f.parts) for f in CORPORA["toy-public"])
    source = open_source("toy-public", "src", "tgt")
    assert source.splits() == ["test", "train", "val"]
    assert len(server.requests) == asked  # a cache hit makes no request


def test_a_changed_cached_file_is_fetched_again(toy_corpus: tuple[Files, Path], caplog) -> None:
    server, root = toy_corpus
    locate("toy-public")
    (root / "val.src").write_bytes(b"edited\n")
    asked = len(server.requests)
    locate("toy-public")
    assert server.requests[asked:] == ["/toy/val.src"]
    assert f"{root / 'val.src'}: not the pinned text of toy-public (its size or sha256 differs)" in caplog.text
    _same_as_toy(root)


def _nothing_half_written(root: Path) -> None:
    leftovers = [p.name for p in root.iterdir()] if root.exists() else []
    assert not [name for name in leftovers if name.startswith(".") or name.endswith(".tmp")], leftovers


def test_a_wrong_checksum_keeps_nothing(toy_corpus: tuple[Files, Path]) -> None:
    server, root = toy_corpus
    server.pages["toy/val.src"] = b"not the pinned text\n"
    with pytest.raises(DataError) as err:
        locate("toy-public")
    message = str(err.value)
    assert f"{server.url}toy/val.src: the download does not match its pinned checksum" in message
    assert "--set data.source=DIR" in message and "\n" not in message
    assert not (root / "val.src").exists()
    _nothing_half_written(root)


def test_a_download_of_the_pinned_size_with_other_bytes_keeps_nothing(toy_corpus: tuple[Files, Path]) -> None:
    """The sha256 is checked, not just the size: one flipped byte is refused."""
    server, root = toy_corpus
    text = (TOY_DIR / "val.src").read_bytes()
    server.pages["toy/val.src"] = bytes([text[0] ^ 1]) + text[1:]
    with pytest.raises(DataError, match="the download does not match its pinned checksum"):
        locate("toy-public")
    assert not (root / "val.src").exists()
    _nothing_half_written(root)


def test_a_cached_file_of_the_pinned_size_with_other_bytes_is_fetched_again(toy_corpus: tuple[Files, Path]) -> None:
    server, root = toy_corpus
    locate("toy-public")
    text = (root / "val.src").read_bytes()
    (root / "val.src").write_bytes(bytes([text[0] ^ 1]) + text[1:])
    asked = len(server.requests)
    locate("toy-public")
    assert server.requests[asked:] == ["/toy/val.src"]
    _same_as_toy(root)


def test_a_transfer_cut_off_halfway_keeps_nothing(toy_corpus: tuple[Files, Path]) -> None:
    server, root = toy_corpus
    server.cut = True
    with pytest.raises(DataError, match=rf"^cannot download {server.url}toy/\S+: .*--set data.source=DIR"):
        locate("toy-public")
    assert not root.exists()  # the first file failed: not even an empty directory is left
    _nothing_half_written(root)


def test_a_server_that_is_down_is_one_line_naming_the_url(toy_corpus: tuple[Files, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    server, root = toy_corpus
    server.shutdown()
    server.server_close()
    monkeypatch.setenv("MTCLI_DATA_URL", server.url)  # nothing listens there now
    with pytest.raises(DataError) as err:
        locate("toy-public")
    assert str(err.value).startswith(f"cannot download {server.url}toy/test.src: ")
    assert "Without internet" in str(err.value) and "\n" not in str(err.value)
    assert "in DIR/toy-public/ and set MTCLI_DATA=DIR" in str(err.value)  # for recipes of several corpora
    # which files, and the make target of this corpus (make reproduce DATA=DIR is Multi30k's)
    assert "put its files (" in str(err.value) and "REPRODUCE_ARGS='--data DIR'" in str(err.value)
    from mtcli.data.download import CORPORA, _instead

    assert "train.en" in _instead("multi30k") and "(make reproduce DATA=DIR;" in _instead("multi30k")
    assert all(f.name in str(err.value) for f in CORPORA["toy-public"])
    _nothing_half_written(root)


def test_what_a_killed_download_left_is_removed_once_stale(toy_corpus: tuple[Files, Path]) -> None:
    """A SIGKILL mid-transfer leaves the temporary file: removed by the next download of that
    file once untouched for STALE_S (a day; a live download writes it far more often)."""
    import os
    import time

    _, root = toy_corpus
    root.mkdir(parents=True)
    stale, live = root / ".val.src.abc123.tmp", root / ".val.tgt.def456.tmp"
    for path in (stale, live):
        path.write_bytes(b"half")
    old = time.time() - download.STALE_S - 60
    os.utime(stale, (old, old))
    locate("toy-public")
    assert not stale.exists() and live.exists()


def test_a_local_copy_wins_and_is_left_as_it_is(toy_corpus: tuple[Files, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server, root = toy_corpus
    copies = tmp_path / "shared"
    (copies / "toy-public").mkdir(parents=True)
    (copies / "toy-public" / "train.src").write_text("a local file\n")
    monkeypatch.setattr(download, "LOCAL_COPIES", (copies,))
    assert locate("toy-public") == copies / "toy-public"
    assert server.requests == [] and not root.exists()
    assert (copies / "toy-public" / "train.src").read_text() == "a local file\n"


def test_prepare_without_shared_data_or_network_names_the_url(tmp_path: Path) -> None:
    """What a fresh clone on a machine with no ../shared and no network sees."""
    env = {**os.environ, "MTCLI_DATA_URL": "http://127.0.0.1:9/", "MTCLI_DATA": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "mtcli.cli", "prepare", str(REPO / "configs" / "multi30k_de_en.yaml")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("mtcli: error: cannot download http://127.0.0.1:9/multi30k/dataset/"), result.stderr
    assert "--set data.source=DIR" in lines[-1] and "Traceback" not in result.stderr


@pytest.mark.shared_data
def test_multi30k_from_the_test_server_is_the_shared_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Gzipped copies of ../shared/data/multi30k served at the pinned paths download, verify,
    and prepare into the same cache as the shared directory: the same build key and file hashes."""
    shared = SHARED_DATA / "multi30k"
    if not shared.is_dir():
        pytest.skip(f"{shared} not found")
    pages = {f.parts[0]: gzip.compress((shared / f.name).read_bytes(), compresslevel=1) for f in CORPORA["multi30k"]}
    server = Files(pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(download, "LOCAL_COPIES", ())
        monkeypatch.setenv("MTCLI_DATA", str(tmp_path))
        monkeypatch.setenv("MTCLI_DATA_URL", server.url)
        splits = ["train", "val", "test_2016_flickr"]
        fetched = open_source("multi30k", "de", "en")
        assert fetched.root == tmp_path / "multi30k"
        assert fetched.fingerprint(splits) == open_source(str(shared), "de", "en").fingerprint(splits)
        manifests = []
        for name, source in (("fetched", "multi30k"), ("shared", str(shared))):
            config = load_config(REPO / "configs" / "multi30k_de_en.yaml", [
                f"data.source={source}", f"data.prepared_dir={tmp_path / name}", "data.vocab_size=500",
                "data.spm_max_sentences=2000"])
            manifests.append(json.loads((prepare(config).directory / "manifest.json").read_text()))
        assert manifests[0]["build_key"] == manifests[1]["build_key"]
        files = [{name: record["sha256"] for name, record in m["files"].items()} for m in manifests]
        assert files[0] == files[1] and len(files[0]) > 10  # the same cache, file for file
    finally:
        server.shutdown()
        server.server_close()


def test_a_test_set_sacrebleu_fetches_is_read_through_its_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """newstest2014-filtered comes through sacreBLEU's DATASETS, which no other test touched: a
    change in its API would break `prepare` of the WMT recipe with every test green."""
    from http.client import HTTPException

    from sacrebleu.dataset import DATASETS

    real = DATASETS["wmt14"]  # the calls made of it, as the installed sacreBLEU has them
    assert isinstance(real.data[0], str) and all(callable(getattr(real, name)) for name in (
        "process_to_text", "get_source_file", "get_reference_files"))
    (tmp_path / "src.txt").write_bytes(b"a source\n")
    (tmp_path / "ref.txt").write_bytes(b"eine Referenz\n")

    class TestSet:
        data = ["https://example.org/test.tgz"]
        fail = False

        def process_to_text(self, langpair: str) -> None:
            assert langpair == "en-de"
            if self.fail:
                raise SystemExit(1)  # what sacreBLEU does when its download fails

        def get_source_file(self, langpair: str) -> str:
            return str(tmp_path / "src.txt")

        def get_reference_files(self, langpair: str) -> list[str]:
            return [str(tmp_path / "ref.txt")]

    test_set = TestSet()
    monkeypatch.setitem(DATASETS, "wmt14", test_set)
    for side, text in (("src", b"a source\n"), ("ref", b"eine Referenz\n")):
        url, chunks = download._source(f"sacrebleu:wmt14:en-de:{side}")
        assert url == "https://example.org/test.tgz" and b"".join(chunks) == text
    test_set.fail = True
    with pytest.raises(HTTPException, match="^sacreBLEU could not download it$"):
        b"".join(download._source("sacrebleu:wmt14:en-de:src")[1])
