"""Load benchmark of `mtcli serve`: 1, 8 and 32 concurrent clients on loopback, bounded.

Starts `mtcli serve RUN_DIR` on 127.0.0.1 (a free port), then for each client count sends the
same fixed list of requests (one Multi30k test sentence each, ``--requests`` of them, default
all 1,000), each client sending its next request as soon as its last one is answered. Every
answer is checked against the offline output of :class:`mtcli.Translator` on the same sentences
(decoded in this process first, same checkpoint and beam). Reported per client count:
requests/s, sentences/s, p50 and p99 latency, and errors; at the end the server's peak RSS
(VmHWM). The server is stopped with SIGTERM and must exit 0. Nothing leaves the machine.

Usage (from the repository root; needs the serve extra and httpx)::

    python bench/bench_serve.py --run-dir data/runs/multi30k_en_de-seed1
    python bench/bench_serve.py --run-dir RUN --requests 64 --clients 1,8   # a smoke run

Results: a table on stdout and ``bench/results/serve_<time>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_INPUT = REPO.parent / "shared" / "data" / "multi30k" / "test_2016_flickr.{src}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(run_dir: Path, port: int, beam: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "mtcli.cli", "serve", str(run_dir), "--port", str(port),
                             "--beam", str(beam), "--device", "cpu"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start within 180 s")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load(url: str, sentences: list[str], expected: list[str], clients: int) -> dict:
    """Send every sentence as one request from ``clients`` concurrent clients; check answers."""
    latencies: list[float] = [0.0] * len(sentences)
    wrong = errors = 0
    order = iter(range(len(sentences)))

    def client() -> tuple[int, int]:
        bad = failed = 0
        with httpx.Client(timeout=300) as session:
            for i in order:  # a shared iterator: each client takes the next request
                start = time.perf_counter()
                answer = session.post(f"{url}/translate", json={"text": [sentences[i]]})
                latencies[i] = time.perf_counter() - start
                if answer.status_code != 200:
                    failed += 1
                elif answer.json()["translations"] != [expected[i]]:
                    bad += 1
        return bad, failed

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for bad, failed in pool.map(lambda _: client(), range(clients)):
            wrong += bad
            errors += failed
    seconds = time.perf_counter() - start
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(sentences), "seconds": round(seconds, 2),
            "requests_per_s": round(len(sentences) / seconds, 2),
            "sentences_per_s": round(len(sentences) / seconds, 2),
            "p50_ms": round(1000 * statistics.median(ordered), 1),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            "wrong_answers": wrong, "errors": errors}


def main() -> int:
    from mtcli.config import load_config
    from mtcli.infer.translator import Translator

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--input", type=Path, default=None, help="source sentences (default: Multi30k test2016)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from mtcli.errors import MtcliError

    try:
        config = load_config(args.run_dir / "config.yaml", lenient=True)
    except MtcliError as exc:
        raise SystemExit(f"bench_serve.py: --run-dir {args.run_dir}: {exc}") from None
    source = args.input or Path(str(DEFAULT_INPUT).format(src=config.data.src_lang))
    if not source.is_file():
        raise SystemExit(f"bench_serve.py: {source} is not a file (give --input FILE: source sentences)")
    sentences = [line for line in source.read_text(encoding="utf-8").splitlines() if line][: args.requests]
    if not sentences:
        raise SystemExit(f"bench_serve.py: {source} holds no sentence to send")
    import torch

    torch.set_num_threads(args.threads)
    expected = Translator.from_run(args.run_dir, beam=args.beam, device="cpu").translate(sentences)
    port = free_port()
    server = start_server(args.run_dir, port, args.beam, args.threads)
    rows = []
    try:
        for clients in (int(c) for c in args.clients.split(",")):
            rows.append(load(f"http://127.0.0.1:{port}", sentences, expected, clients))
            print(json.dumps(rows[-1]), flush=True)
        rss = peak_rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\nmtcli serve, {args.run_dir}, beam {args.beam}, {args.threads} threads, {cpu}, "
          f"{os.cpu_count()} cores; server peak RSS {rss:.0f} MB; SIGTERM exit code {code}")
    print("| clients | requests/s | sentences/s | p50 ms | p99 ms | wrong | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests_per_s']} | {r['sentences_per_s']} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['wrong_answers']} | {r['errors']} |")
    out = REPO / "bench" / "results" / f"serve_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "run_dir": str(args.run_dir), "beam": args.beam,
                               "threads": args.threads, "server_peak_rss_mb": round(rss, 1),
                               "sigterm_exit": code, "rows": rows}, indent=2) + "\n")
    return 0 if code == 0 and all(r["wrong_answers"] == r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
