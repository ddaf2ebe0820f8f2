"""Tests of mtcli.infer.translate: strict reading, batching, order, truncation, n-best, the CLI."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import mtcli_here, mtcli_status

from mtcli.config import DecodeConfig
from mtcli.data.textio import count_lines, iter_binary_lines
from mtcli.errors import ConfigError, DataError
from mtcli.infer.files import format_nbest
from mtcli.infer.translate import (
    Translation,
    decode_config,
    translate_lines,
    translate_texts,
)

# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_decoding_device_is_the_cpu_under_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtcli.infer.translate import decoding_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decoding_device(DecodeConfig()) == torch.device("cuda:0")
    assert decoding_device(DecodeConfig(int8=True)) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decoding_device(DecodeConfig()) == torch.device("cpu")


def test_iter_binary_lines_strips_endings_and_bom() -> None:
    data = "\ufeffeins\r\nzwei\n\ndrei".encode()
    assert list(iter_binary_lines(io.BytesIO(data), "x")) == ["eins", "zwei", "", "drei"]


def test_iter_binary_lines_names_line_of_invalid_utf8() -> None:
    data = b"ok\nstill ok\nbad \xff byte\nnever read\n"
    lines = iter_binary_lines(io.BytesIO(data), "in.txt")
    assert next(lines) == "ok"
    with pytest.raises(DataError, match=r"in\.txt:3: invalid UTF-8"):
        list(lines)


def test_arriving_lines_hand_over_what_has_arrived_without_waiting() -> None:
    import os

    from mtcli.data.textio import ArrivingLines

    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb", buffering=0) as reader:
        windows = ArrivingLines(reader, "<pipe>", chunk_bytes=4).windows(3)
        os.write(write_fd, "\ufeffeins\r\nzwei\ndr".encode())
        assert next(windows) == ["eins", "zwei"]  # "dr" is not a line yet; no wait for it
        os.write(write_fd, b"ei\nvier\nfuenf\nsechs\nsieben")
        assert next(windows) == ["drei", "vier", "fuenf"]  # at most max_lines
        assert next(windows) == ["sechs"]
        os.write(write_fd, b" \xff\n")
        os.close(write_fd)
        with pytest.raises(DataError, match=r"<pipe>:7: invalid UTF-8"):
            next(windows)


def test_arriving_lines_iterate_like_the_line_reader() -> None:
    import os

    from mtcli.data.textio import ArrivingLines

    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"a\n\nb\r\nlast")
    os.close(write_fd)
    with os.fdopen(read_fd, "rb", buffering=0) as reader:
        assert list(ArrivingLines(reader, "<pipe>")) == ["a", "", "b", "last"]


def test_count_lines_with_and_without_final_newline(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_bytes(b"x\ny\n")
    b.write_bytes(b"x\ny")
    c.write_bytes(b"")
    assert (count_lines(a), count_lines(b), count_lines(c)) == (2, 2, 0)


def test_format_nbest() -> None:
    hyps = [Translation("a b", -0.5, [4, 5]), Translation("a c", -1.25, [4, 6])]
    assert format_nbest(hyps, 2, scored=False) == ["a b"]
    assert format_nbest(hyps, 2, scored=True) == ["-0.5000\ta b", "-1.2500\ta c"]
    assert format_nbest([Translation("", 0.0, [])], 3, scored=True) == ["0.0000\t", "-inf\t", "-inf\t"]


def test_decode_config_refuses_other_sections(toy_config_path: Path) -> None:
    from mtcli.config import load_config

    config = load_config(toy_config_path)
    assert decode_config(config, ["decode.beam_size=3"]).decode.beam_size == 3
    with pytest.raises(ConfigError, match="only decode"):
        decode_config(config, ["train.max_steps=3"])
    for malformed in ("noequals", "decode=3", ".=1"):  # said as train says it, not as another section
        with pytest.raises(ConfigError, match=f"--set '{re.escape(malformed)}': expected section.key=value"):
            decode_config(config, [malformed])


# ---------------------------------------------------------------------------------------------
# translate_lines with a fake search (reverses the source): order, empties, truncation
# ---------------------------------------------------------------------------------------------


class _FakeTokenizer:
    """One id per whitespace word: word 'wN' -> id N (>= 4)."""

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class _FakeModel(torch.nn.Module):
    max_positions = 9


@pytest.fixture
def fake_search(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Replace the search translate_lines runs with a reverser that records batch shapes."""
    shapes: list[tuple[int, int]] = []

    def generate(model, src, *, beam_size=1, nbest=1, **kwargs):  # noqa: ANN001, ANN003
        shapes.append(tuple(src.shape))
        out = []
        for row in src.tolist():
            ids = [t for t in row if t not in (0, 3)][::-1]
            out.append([
                types.SimpleNamespace(tokens=ids, score=-float(k), logprob=-float(k), attention=None)
                for k in range(nbest)
            ])
        return out

    monkeypatch.setattr("mtcli.infer.translate.generate", generate)
    return shapes


def _bundle() -> types.SimpleNamespace:
    return types.SimpleNamespace(model=_FakeModel(), tokenizer=_FakeTokenizer(), target_tags={})


def test_order_restored_and_counts_preserved(fake_search, caplog) -> None:  # noqa: ANN001
    lines = ["w4 w5 w6", "", "w7", "   ", "w8 w9 w10 w11 w12", "w13 w14"] * 5
    lines.append(" ".join(f"w{i}" for i in range(4, 30)))  # 26 pieces > limit of 8
    decode = DecodeConfig(beam_size=1, nbest=1, max_tokens=12)
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        out = list(translate_lines(_bundle(), iter(lines), decode, "cpu", window=7, name="doc"))
    assert len(out) == len(lines)
    for line, nbest in zip(lines[:-1], out[:-1], strict=True):
        assert nbest[0].text == " ".join(reversed(line.split()))
    assert out[-1][0].tokens == list(range(4, 12))[::-1]  # truncated to 8 pieces, not dropped
    assert "doc: line 31" in caplog.text and "truncated" in caplog.text
    # Empty lines never reach the model; every batch keeps to the token budget (or is single).
    assert sum(s[0] for s in fake_search) == sum(1 for line in lines if line.strip())
    assert all(b == 1 or b * s <= 12 for b, s in fake_search)


def test_a_window_names_its_lines_from_the_offset(caplog) -> None:  # noqa: ANN001
    """A window after the first counts its lines on from ``offset``: the line a typed tag starts
    is named by its number in the input, and its empty lines are filled without the model."""
    from mtcli.infer.translate import encode_window

    class Tagged(_FakeTokenizer):
        def encode(self, text: str) -> list[int]:
            return [4 if w.startswith("<") else int(w[1:]) for w in text.split()]

    with caplog.at_level(logging.WARNING, logger="mtcli"):
        sources, results = encode_window(Tagged(), ["w5", "", "<2xx> w6"], 8, "doc", 40, prefix=[3])
    assert "doc: line 43 starts with <2xx>, which is read as text" in caplog.text
    assert sources == {0: [3, 5], 2: [3, 4, 6]} and results[1][0].text == "" and results[0] is None


def test_a_line_of_as_many_pieces_as_the_model_reads_is_not_said_truncated(caplog) -> None:  # noqa: ANN001
    from mtcli.infer.translate import encode_window

    line = " ".join(f"w{i}" for i in range(4, 12))  # 8 pieces, the limit
    with caplog.at_level(logging.WARNING, logger="mtcli"):
        sources, _ = encode_window(_FakeTokenizer(), [line, line + " w12"], 8, "doc", 0)
    assert sources == {0: list(range(4, 12)), 1: list(range(4, 12))}
    assert "doc: line 2: source has 9 pieces, truncated" in caplog.text and "line 1" not in caplog.text


def test_progress_counts_lines_as_batches_finish(fake_search) -> None:  # noqa: ANN001
    # The window's longest lines are decoded first; the first line can only be yielded when its
    # batch is done, but on_done already reports every finished batch (and the empty lines).
    lines = ["w4", "", "w5 w6 w7 w8 w9 w10 w11", "w12 w13 w14 w15", "w16 w17", "w18 w19 w20"]
    done: list[int] = []
    stream = translate_lines(_bundle(), lines, DecodeConfig(beam_size=1, nbest=1, max_tokens=8),
                             "cpu", on_done=done.append)
    first = next(stream)
    assert first[0].text == "w4"
    assert done[0] == 1 and sum(done) == len(lines)  # "w4" is the shortest: its batch comes last
    assert len(done) == 1 + len(fake_search)  # the empty line, then one call per batch
    assert len(list(stream)) == len(lines) - 1


def test_streaming_reads_lazily(fake_search) -> None:  # noqa: ANN001
    consumed = []

    def source():  # noqa: ANN202
        for i in range(100):
            consumed.append(i)
            yield f"w{4 + i % 5}"

    stream = translate_lines(_bundle(), source(), DecodeConfig(beam_size=1, nbest=1), "cpu", window=10)
    first = next(stream)
    assert first[0].text == "w4"
    assert len(consumed) <= 11  # one window (plus the look-ahead of islice), not the whole input


def test_nbest_and_beam_budget(fake_search) -> None:  # noqa: ANN001
    decode = DecodeConfig(beam_size=3, nbest=2, max_tokens=20)
    out = list(translate_lines(_bundle(), ["w4 w5", "w6", ""], decode, "cpu"))
    assert [len(n) for n in out] == [2, 2, 1]
    assert [t.score for t in out[0]] == [0.0, -1.0]
    assert all(b == 1 or b * s * 3 <= 20 for b, s in fake_search)


def test_translate_texts_list_in_list_out(fake_search) -> None:  # noqa: ANN001
    assert translate_texts(_bundle(), ["w4 w5", "", "w6"], DecodeConfig(beam_size=1, nbest=1)) == [
        "w5 w4", "", "w6",
    ]
    assert translate_texts(_bundle(), [], DecodeConfig(beam_size=1, nbest=1)) == []


def test_model_mode_restored(fake_search) -> None:  # noqa: ANN001
    bundle = _bundle()
    bundle.model.train()
    list(translate_lines(bundle, ["w4"], DecodeConfig(beam_size=1, nbest=1), "cpu"))
    assert bundle.model.training


# ---------------------------------------------------------------------------------------------
# translate_lines with the real model and search
# ---------------------------------------------------------------------------------------------


def test_batched_equals_one_by_one_real_model(tiny_run_dir: Path) -> None:
    from mtcli.infer.loading import load_for_inference

    bundle = load_for_inference(tiny_run_dir, "best")
    lines = (tiny_run_dir / "text" / "test.src").read_text(encoding="utf-8").splitlines()[:12]
    lines[3:3] = ["", "  "]
    decode = DecodeConfig(beam_size=2, nbest=2, max_tokens=40, length_penalty=1.0)
    batched = list(translate_lines(bundle, lines, decode, "cpu", window=5))
    alone = [next(translate_lines(bundle, [line], decode, "cpu")) for line in lines]
    assert len(batched) == len(lines)
    for got, want in zip(batched, alone, strict=True):
        assert [t.tokens for t in got] == [t.tokens for t in want]
        assert [t.score for t in got] == pytest.approx([t.score for t in want], abs=1e-4)
    assert batched[3][0].text == "" and batched[4][0].tokens == []
    assert all(len(n) == 2 for i, n in enumerate(batched) if i not in (3, 4))


def test_parallel_workers_give_the_same_translations(tiny_run_dir: Path) -> None:
    from mtcli.infer.loading import load_for_inference

    bundle = load_for_inference(tiny_run_dir, "best")
    lines = (tiny_run_dir / "text" / "test.src").read_text(encoding="utf-8").splitlines()[:20]
    lines[5:5] = [""]
    decode = DecodeConfig(beam_size=2, nbest=2, max_tokens=60, length_penalty=1.0)
    threads = torch.get_num_threads()
    serial = list(translate_lines(bundle, lines, decode, "cpu", window=8))
    parallel = list(translate_lines(bundle, lines, DecodeConfig(**{**vars(decode), "workers": 3}), "cpu", window=8))
    assert [[t.tokens for t in n] for n in parallel] == [[t.tokens for t in n] for n in serial]
    for got, want in zip(parallel, serial, strict=True):
        assert [t.score for t in got] == pytest.approx([t.score for t in want], abs=1e-4)
    assert torch.get_num_threads() == threads  # restored after decoding
    torch.set_num_threads(4)
    try:
        first = translate_lines(bundle, lines, DecodeConfig(**{**vars(decode), "workers": 2}), "cpu", window=8)
        second = translate_lines(bundle, lines, DecodeConfig(**{**vars(decode), "workers": 2}), "cpu", window=8)
        next(first), next(second)  # two decodings open at once, closed in the order they began
        first.close()
        assert torch.get_num_threads() == 2  # the second still decodes with its share (was 4 again)
        second.close()
        assert torch.get_num_threads() == 4  # (was the first's 2, restored by the second)
    finally:
        torch.set_num_threads(threads)


def test_an_abandoned_generator_says_nothing_at_exit(tiny_run_dir: Path, tmp_path: Path) -> None:
    """A generator left open at the end of a script was finalised at interpreter shutdown, when
    setting the model's mode raised a TypeError printed as 'Exception ignored in'."""
    import subprocess
    import sys

    script = tmp_path / "abandon.py"
    script.write_text("from mtcli import Translator\n"
                      f"it = Translator.from_run({str(tiny_run_dir)!r}, device='cpu').translate_iter(['ein hund'] * 50)\n"
                      "next(it)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Exception ignored" not in done.stderr, done.stderr


def test_bf16_autocast_path(tiny_run_dir: Path) -> None:
    from mtcli.infer.loading import load_for_inference

    bundle = load_for_inference(tiny_run_dir, "best")
    decode = DecodeConfig(beam_size=1, nbest=1, bf16=True)
    out = translate_texts(bundle, ["eine katze spielt", "", "rot"], decode)
    assert len(out) == 3 and out[1] == ""


# ---------------------------------------------------------------------------------------------
# The CLI on a tiny real run directory
# ---------------------------------------------------------------------------------------------


def test_cli_translate_stdin_and_files(tiny_run_dir: Path, tmp_path: Path) -> None:
    lines = ["eine katze spielt", "", "ein hund " * 200, "rot"]
    text = "\n".join(lines) + "\n"
    res = mtcli_here("translate", str(tiny_run_dir), "--beam", "1", stdin=text.encode())
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().count("\n") == len(lines)
    assert res.stdout.decode().split("\n")[1] == ""
    assert b"truncated" in res.stderr and b"line 3" in res.stderr
    dash = mtcli_here("translate", str(tiny_run_dir), "-", "--beam", "1", stdin=text.encode())  # - is stdin too
    assert dash.returncode == 0 and dash.stdout == res.stdout, dash.stderr.decode()
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    mixed = mtcli_here("translate", str(tiny_run_dir), str(src), "-", "--beam", "1", stdin=text.encode())
    assert mixed.returncode != 0 and b"standard input is read alone" in mixed.stderr  # was "-: input file not found"

    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out.txt"
    res = mtcli_here("translate", str(tiny_run_dir), str(src), str(src), "-o", str(out), "--beam", "2")
    assert res.returncode == 0, res.stderr.decode()
    assert out.read_text(encoding="utf-8").count("\n") == 2 * len(lines)

    res = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "3", "--nbest", "2")
    assert res.returncode == 0, res.stderr.decode()
    rows = res.stdout.decode().splitlines()
    assert len(rows) == 2 * len(lines)
    for row in rows:
        value, _, _ = row.partition("\t")
        float(value)
    first, second = (float(r.split("\t")[0]) for r in rows[:2])
    assert first >= second


def test_cli_translate_decodes_an_average_as_evaluate_does(tiny_run_dir: Path, tmp_path: Path) -> None:
    """The averaged model a README row is scored with could be translated only after mtcli average -o."""
    from mtcli.infer.translator import Translator

    source = tmp_path / "in.txt"
    lines = ["eine katze spielt", "", "ein hund läuft im park", "rot"]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for option, k in (("--average-last", 2), ("--average-best", 2)):
        done = mtcli_here("translate", str(tiny_run_dir), str(source), option, str(k), "--beam", "1", "-q")
        assert done.returncode == 0, done.stderr
        kind = option.removeprefix("--").replace("-", "_")
        expected = Translator.from_run(tiny_run_dir, beam=1, device="cpu", **{kind: k}).translate(lines)
        assert done.stdout.decode("utf-8").splitlines() == expected
    assert expected != Translator.from_run(tiny_run_dir, beam=1, device="cpu").translate(lines)  # not the best's
    assert mtcli_here("translate", str(tiny_run_dir), str(source), "--average-last", "5").returncode != 0  # 2 on disk


def test_cli_translate_reads_the_inputs_a_shell_passes(tiny_run_dir: Path, tmp_path: Path) -> None:
    """Process substitution, a named pipe, /dev/stdin, /dev/null and a .gz file are read as the
    streams (or files) they are and give what the plain file gives; a directory says so."""
    import gzip
    import shlex
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("bash is not installed (process substitution needs it)")
    src = tmp_path / "in.txt"
    src.write_text("eine katze spielt\n\nein hund\nrot\n", encoding="utf-8")
    packed = tmp_path / "in.txt.gz"
    packed.write_bytes(gzip.compress(src.read_bytes()))
    expected = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "2")
    assert expected.returncode == 0 and expected.stdout.count(b"\n") == 4, expected.stderr.decode()
    mtcli = f"{shlex.quote(sys.executable)} -m mtcli.cli translate {shlex.quote(str(tiny_run_dir))} --beam 2"
    q = shlex.quote
    fifo = q(str(tmp_path / "fifo"))
    # one process reads a process substitution, a named pipe, a pipe as /dev/stdin, a .gz file
    # and /dev/null, in that order; another reads /dev/stdin redirected from a file
    commands = {
        "<(cat) fifo /dev/stdin .gz /dev/null": (
            f"mkfifo {fifo}; (cat {q(str(src))} > {fifo} &); cat {q(str(src))} | "
            f"{mtcli} <(cat {q(str(src))}) {fifo} /dev/stdin {q(str(packed))} /dev/null", 4),
        "/dev/stdin redirected": (f"{mtcli} /dev/stdin < {q(str(src))}", 1),
    }
    for what, (command, copies) in commands.items():
        res = subprocess.run(["bash", "-c", command], capture_output=True, timeout=300)
        assert res.returncode == 0, (what, res.stderr.decode())
        assert res.stdout == expected.stdout * copies, what
    res = mtcli_here("translate", str(tiny_run_dir), "/dev/null")  # nothing in: nothing out, and no error
    assert res.returncode == 0 and res.stdout == b"", res.stderr.decode()
    res = mtcli_here("translate", str(tiny_run_dir), str(tmp_path))
    assert res.returncode != 0
    assert res.stderr.decode().strip() == f"mtcli: error: {tmp_path}: is a directory, expected a text file"


def test_cli_translate_answers_each_piped_line_before_the_next(tiny_run_dir: Path) -> None:
    import select

    proc = subprocess.Popen([sys.executable, "-m", "mtcli.cli", "translate", str(tiny_run_dir), "--beam", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in (b"eine katze spielt\n", b"rot\n"):
            proc.stdin.write(line)
            proc.stdin.flush()  # and keep stdin open: a pipe, not a file
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no translation came back while the input pipe stayed open"
            assert proc.stdout.readline().endswith(b"\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
        assert proc.stdout.read() == b""  # one output line per input line
    finally:
        proc.kill()


def test_cli_translate_invalid_utf8_leaves_no_output(tiny_run_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "bad.txt"
    src.write_bytes(b"eine katze\n" * 5 + b"kaputt \xc3\x28\n" + b"rot\n")
    out = tmp_path / "out.txt"
    res = mtcli_here("translate", str(tiny_run_dir), str(src), "-o", str(out), "--beam", "1")
    assert res.returncode != 0
    err = res.stderr.decode()
    assert ":6: invalid UTF-8" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("mtcli: error")]) == 1
    assert not out.exists()
    assert list(tmp_path.glob(".out.txt*")) == []


@pytest.mark.parametrize(
    "args",
    [
        ["translate", "{missing}"],
        ["translate", "{run}", "--checkpoint", "{missing}/nope.pt"],
        ["translate", "{run}", "{missing}/in.txt"],
    ],
)
def test_cli_translate_bad_input(args: list[str], tiny_run_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    argv = [a.format(run=tiny_run_dir, missing=missing) for a in args]
    res = mtcli_here(*argv, stdin=b"eine katze\n")
    assert res.returncode != 0
    err = res.stderr.decode().strip()
    assert "Traceback" not in err and err.startswith("mtcli: error:")
    assert len(err.splitlines()) == 1


def test_cli_translate_refuses_outputs_it_cannot_write_before_it_decodes(tiny_run_dir: Path, tmp_path: Path) -> None:
    """An output that is its own input (its translation would replace it), an attention
    directory that cannot be made, a hidden partial file that cannot be opened, a closed
    standard input or output: one line each, naming what the user gave."""
    src = tmp_path / "in.txt"
    src.write_text("eine katze\n", encoding="utf-8")
    cases = [
        ([str(src), "-o", str(src)], "", f"{src}: is the input {src}; write the translation to another file"),
        ([str(src), "--plot-attention", "/proc/plots"], "",
         "/proc/plots: cannot make the directory for the attention plots (No such file or directory)"),
        ([str(src), "-o", "/proc/out.txt"], "", "/proc/out.txt: No such file or directory"),
        ([str(src)], ">&-", "<stdout>: closed; give an output file (-o)"),
        ([], "<&-", "<stdin>: closed; give input files, or lines on standard input"),
        # its own output appended to it: read again as it was written, it grew until the disk was full
        ([str(src)], f'>> "{src}"', f"{src}: is also standard output (>> {src}); write the translation to "
                                   "another file"),
    ]
    for extra, redirect, expected in cases:
        if not redirect:  # (a closed descriptor needs a process of its own)
            res = mtcli_here("translate", str(tiny_run_dir), *extra)
            assert res.returncode == 1 and res.stderr.decode() == f"mtcli: error: {expected}\n", res.stderr
            continue
        argv = ["bash", "-c", f'"$@" {redirect}', "-", sys.executable, "-m", "mtcli.cli", "translate",
                str(tiny_run_dir), *extra]
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             timeout=300, check=False)
        assert res.returncode == 1 and res.stderr.decode() == f"mtcli: error: {expected}\n", res.stderr
    assert src.read_text(encoding="utf-8") == "eine katze\n"


def test_translate_files_writes_into_a_pipe_and_through_a_link(tiny_run_dir: Path, tmp_path: Path) -> None:
    """-o naming a FIFO is written as a stream (it was renamed over: its reader got nothing); -o
    naming a link writes its target, the link kept."""
    import os
    import threading

    from mtcli.infer.files import translate_files

    src = tmp_path / "in.txt"
    src.write_text("eine katze\nrot\n", encoding="utf-8")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")))
    reader.start()
    translate_files(tiny_run_dir, [src], fifo, beam=1, device="cpu")
    reader.join(timeout=60)
    assert len(got) == 1 and got[0].count("\n") == 2 and not fifo.is_file()
    target, link = tmp_path / "out.txt", tmp_path / "link.txt"
    link.symlink_to(target)
    translate_files(tiny_run_dir, [src], link, beam=1, device="cpu")
    assert link.is_symlink() and target.read_text(encoding="utf-8") == got[0]


def test_a_sampling_default_beside_a_search_is_said_to_change_nothing(
        tiny_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """translate --set decode.temperature=0.5 without --sampling: the setting was silently unused."""
    from mtcli.infer.files import translate_files

    src = tmp_path / "in.txt"
    src.write_text("eine katze\n", encoding="utf-8")
    translate_files(tiny_run_dir, [src], tmp_path / "out.txt", beam=1, device="cpu",
                    overrides=["decode.temperature=0.5"])
    assert "decode.temperature: for sampling only, and this translation searches" in caplog.text


def test_an_input_rewritten_while_it_is_translated_leaves_no_output(
        tiny_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines read after a rewrite came from the new text, from the middle of a line: the
    output had neither file's line count, under the final name, exit 0. Now an error naming it."""
    from mtcli.errors import DataError
    from mtcli.infer.files import translate_files
    from mtcli.infer.translator import Translator

    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("eine katze\nrot\n" * 3, encoding="utf-8")
    real = Translator.stream

    def stream(self: Translator, lines, **kwargs):  # noqa: ANN001, ANN003, ANN202
        src.write_text("ganz andere zeilen\n" * 7, encoding="utf-8")  # rewritten while being read
        yield from real(self, lines, **kwargs)

    monkeypatch.setattr(Translator, "stream", stream)
    with pytest.raises(DataError, match="in.txt: changed while translate read it; translate it again"):
        translate_files(tiny_run_dir, [src], out, beam=1, device="cpu")
    assert not out.exists() and not list(tmp_path.glob(".out.txt*"))  # its lines are not the key's: none kept
    # touched (same text) or deleted (its open file read to the end): the translation is whole
    import os

    def after_the_first_line(lines, change):  # noqa: ANN001, ANN202
        for i, line in enumerate(lines):
            yield line
            if i == 0:
                change()

    for change in (lambda: os.utime(src, (1, 1)), src.unlink):
        src.write_text("eine katze\nrot\n" * 3, encoding="utf-8")
        monkeypatch.setattr(Translator, "stream", lambda self, lines, change=change, **kw: real(
            self, after_the_first_line(lines, change), **kw))
        translate_files(tiny_run_dir, [src], out, beam=1, device="cpu")
        assert out.read_text(encoding="utf-8").count("\n") == 6


def test_cli_translate_checkpoint_from_other_vocab(tiny_run_dir: Path, tmp_path: Path) -> None:
    import shutil

    from mtcli.data.tokenizer import Tokenizer

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    text = (run / "text" / "val.src").read_text(encoding="utf-8").splitlines() * 3
    Tokenizer.train(text, tmp_path / "other", 40, "unigram", 1.0, 0)
    shutil.copyfile(tmp_path / "other.model", run / "spm.model")
    out = tmp_path / "out.txt"
    res = mtcli_here("translate", str(run), "-o", str(out), stdin=b"eine katze\n")
    assert res.returncode != 0
    err = res.stderr.decode().strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "vocabulary" in err
    assert not out.exists()


def test_cli_translate_plot_attention(tiny_run_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("eine katze spielt\n\nrot\n", encoding="utf-8")
    plots = tmp_path / "att"
    res = mtcli_here(
        "translate", str(tiny_run_dir), str(src), "--beam", "1", "--plot-attention", str(plots),
        "-o", str(tmp_path / "out.txt"),
    )
    assert res.returncode == 0, res.stderr.decode()
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert pngs == ["000001.png", "000003.png"]
    assert (plots / "000001.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # again into the same directory, of a shorter input whose first line is empty: the older
    # plots of lines it has not (1, 3) are gone, other files stay
    (plots / "notes.png").write_bytes(b"mine")
    src.write_text("\nrot\n", encoding="utf-8")
    res = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "1", "--plot-attention", str(plots))
    assert res.returncode == 0, res.stderr.decode()
    assert sorted(p.name for p in plots.glob("*.png")) == ["000002.png", "notes.png"]


def test_translate_refuses_to_write_over_a_runs_own_files(tiny_run_dir: Path, tmp_path: Path) -> None:
    """-o naming a run's config, checkpoint or test text broke the run (it was written over)."""
    import shutil

    from mtcli.errors import DataError
    from mtcli.infer.files import translate_files

    src = tmp_path / "in.txt"
    src.write_text("eine katze\n", encoding="utf-8")
    run = shutil.copytree(tiny_run_dir, tmp_path / "run")
    (run / "text").mkdir(exist_ok=True)
    for path, role in [(run / "config.yaml", "the run's config"),
                       (run / "checkpoints" / "checkpoint_best.pt", "a checkpoint training resumes from"),
                       (run / "text" / "test.src", "the run's copy of a validation or test text")]:
        before = path.read_bytes() if path.exists() else None
        with pytest.raises(DataError, match=f"{path}: {role}.*a file of a run; write the translation to another file"):
            translate_files(run, [src], path)
        assert (path.read_bytes() if path.exists() else None) == before


def test_cli_translate_to_a_full_standard_output_names_it(tiny_run_dir: Path, tmp_path: Path) -> None:
    """`mtcli translate RUN in.txt > /dev/full` said only "No space left on device"."""
    src = tmp_path / "in.txt"
    src.write_text("eine katze\n", encoding="utf-8")
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "mtcli.cli", "translate", str(tiny_run_dir), str(src)],
                             stdout=full, stderr=subprocess.PIPE, timeout=300, check=False)
    assert res.returncode == 1 and res.stderr.decode() == "mtcli: error: <stdout>: No space left on device\n"


def test_seed_without_sampling_names_the_flag(tiny_run_dir: Path) -> None:
    """translate --seed without --sampling said to add "sampling topk or topp": the Python API's
    words, not the flag that asks for sampling."""
    result = mtcli_here("translate", str(tiny_run_dir), "--seed", "3", stdin=b"hello\n")
    assert result.returncode == 2 and b"--sampling topk" in result.stderr and b"Traceback" not in result.stderr


def test_translations_to_standard_output_are_utf8_whatever_the_locale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a Latin-1 locale, stdout could not write a Chinese translation (a traceback after
    the lines before it) and wrote an umlaut as one Latin-1 byte; input and -o are UTF-8."""
    from mtcli.infer.files import _opened

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    with _opened(None, None, None, {}) as (handle, partial):  # type: ignore[arg-type]
        handle.write("猫 über\n")
        handle.flush()
    assert partial is None and raw.getvalue() == "猫 über\n".encode()


def test_an_empty_path_option_is_refused_not_the_working_directory(tiny_run_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--plot-attention "$UNSET"`` wrote its PNGs into the working directory, over files of
    the same names, and ``evaluate --output ""`` its report; ``-o ""`` named "." a directory."""
    src = tmp_path / "in.txt"
    src.write_text("eine katze\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for argv, option in ((["translate", str(tiny_run_dir), str(src), "--plot-attention", ""], "'--plot-attention'"),
                         (["translate", str(tiny_run_dir), str(src), "-o", " "], "'--output' / '-o'"),
                         (["evaluate", str(tiny_run_dir), "--output", ""], "'--output' / '-o'")):
        res = mtcli_here(*argv)
        assert res.returncode == 2 and f"Invalid value for {option}: an empty path" in res.stderr.decode(), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@pytest.mark.parametrize("args", [["translate", "RUN", "--checkpoint", "--beam", "3"],
                                  ["translate", "RUN", "-o", "--beam", "3"],
                                  ["train", "cfg.yaml", "--init-from", "--set", "train.max_steps=2"]])
def test_an_option_whose_value_is_another_option_is_a_usage_error(args: list[str]) -> None:
    """An empty shell variable left an option without its value: click took the next option as
    the value (a checkpoint named --beam; an output file named --beam)."""
    done = mtcli_here(*args)
    assert done.returncode == 2 and b"is an option, not a value" in done.stderr, done.stderr


def test_an_output_in_a_symbolic_link_loop_is_one_line(tiny_run_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Python 3.11's Path.resolve() raises RuntimeError on a loop: translate -o and average -o
    printed its traceback."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    src = tmp_path / "in.txt"
    src.write_text("ein hund\n", encoding="utf-8")
    for args in (["translate", str(tiny_run_dir), str(src), "-o", str(tmp_path / "a")],
                 ["average", str(tiny_run_dir), "--last", "1", "-o", str(tmp_path / "a" / "avg.pt")]):
        assert mtcli_status(*args) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"mtcli: error: {tmp_path}/") and err.endswith(": Too many levels of symbolic links\n"), err


@pytest.mark.parametrize("terminal", [True, False])
def test_no_bar_is_drawn_over_translations_written_to_the_terminal(terminal: bool, tiny_run_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar and the translations shared the terminal's rows: a translation started on the bar's."""
    from mtcli.infer import files

    class Screen(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    bars: list[bool] = []
    real = files.progress
    monkeypatch.setattr(files, "progress", lambda **kw: bars.append(kw["enabled"]) or real(**kw))
    monkeypatch.setattr(sys, "stdout", Screen())
    src = tmp_path / "in.txt"
    src.write_text("ein hund\n", encoding="utf-8")
    files.translate_files(tiny_run_dir, [src], None, beam=1, device="cpu")
    assert bars == [not terminal] and len(sys.stdout.getvalue().splitlines()) == 1


def test_quiet_keeps_stderr_for_warnings_and_errors(tiny_run_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("ein hund\n", encoding="utf-8")
    from mtcli.logs import setup_logging

    loud = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "1")
    try:
        quiet = mtcli_here("translate", str(tiny_run_dir), str(src), "--beam", "1", "-q")
    finally:
        setup_logging()  # (this process's console log as the other tests find it)
    assert b"INFO" in loud.stderr and (quiet.returncode, quiet.stderr, quiet.stdout) == (0, b"", loud.stdout)
