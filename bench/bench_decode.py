"""Decoding speed of mtcli's search against CTranslate2 on the exported model (Multi30k test2016).

mtcli's torch decoding against CTranslate2, fp32 and int8 (``decode.int8``), greedy and beam 5,
in batches and one sentence a call, on the 1,000-sentence Multi30k test2016 source.

Every variant runs in its own subprocess (CTranslate2's workers never share a process with
torch's thread pool), on the same pre-tokenised input, in the same batches: sentences sorted by
source length (longest first) and cut into ``--batch`` sentences (64). The torch worker keeps
freed memory in the process (:func:`mtcli.allocator.keep_freed_memory`), as the commands that
decode do; CTranslate2 has its own caching allocator. Only the decoding is
timed (tokenisation and model loading are not), after one untimed warm-up batch. Reported per
variant: sentences/s, output tokens/s (generated pieces, no ``</s>``), the number of output
tokens, seconds, and the worker's peak RSS.

Model: ``--run-dir`` (a trained run, ``--checkpoint best``), else a random model of the
Multi30k recipe's shape (configs/multi30k_de_en.yaml: d_model 256, 3+3 layers, 4 heads, d_ff
1024) with the SentencePiece model of a prepared Multi30k cache
(``data/prepared/multi30k_de_en/spm.model``) or, when there is none, one trained on the fly from
the shared Multi30k training text (8k vocabulary, ~20 s). A random model rarely emits ``</s>``,
so for it every engine decodes exactly ``--fixed-length`` tokens (default 24: no early stop, same
work everywhere); for a trained run the recipe's ``max_len_a * S + max_len_b`` cap applies.

Usage (from the repository root)::

    python bench/bench_decode.py                          # random model of the recipe shape
    python bench/bench_decode.py --run-dir data/runs/multi30k_de_en
    python bench/bench_decode.py --limit 64 --variants torch-greedy ct2-greedy-fp32  # smoke
    python bench/bench_decode.py --rounds 5 --variants torch-beam5 ct2-beam5-fp32  # interleaved

Results: a table on stdout and ``bench/results/decode_<time>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout without mtcli installed (e.g. a GPU box)
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"  # input: test_2016_flickr.<the run's source language>
RECIPE = REPO / "configs" / "multi30k_de_en.yaml"

# name -> (engine, beam, options): torch against CTranslate2, fp32 and int8, greedy and beam 5, in
# batches and one sentence a call; plus the packed fp32 copy against the model as it is
VARIANTS: dict[str, tuple[str, int, dict]] = {
    "torch-greedy": ("torch", 1, {"use_cache": True, "bf16": False}),
    "torch-beam5": ("torch", 5, {"use_cache": True, "bf16": False}),
    "torch-greedy-int8": ("torch", 1, {"use_cache": True, "bf16": False, "int8": True}),
    "torch-beam5-int8": ("torch", 5, {"use_cache": True, "bf16": False, "int8": True}),
    # the model as it is, without the oneDNN-packed fp32 copy translate_lines decodes with
    "torch-greedy-unpacked": ("torch", 1, {"use_cache": True, "bf16": False, "plain": True}),
    "torch-beam5-unpacked": ("torch", 5, {"use_cache": True, "bf16": False, "plain": True}),
    "ct2-greedy-fp32": ("ct2", 1, {"compute_type": "float32"}),
    "ct2-beam5-fp32": ("ct2", 5, {"compute_type": "float32"}),
    "ct2-greedy-int8": ("ct2", 1, {"compute_type": "int8"}),
    "ct2-beam5-int8": ("ct2", 5, {"compute_type": "int8"}),
    # latency as a server sees it: one sentence per call, p50/p99 over the input
    "torch-greedy-latency": ("torch", 1, {"use_cache": True, "bf16": False, "batch": 1}),
    "torch-beam5-latency": ("torch", 5, {"use_cache": True, "bf16": False, "batch": 1}),
    "torch-beam5-latency-int8": ("torch", 5, {"use_cache": True, "bf16": False, "int8": True, "batch": 1}),
    "ct2-greedy-latency": ("ct2", 1, {"compute_type": "float32", "batch": 1}),
    "ct2-beam5-latency": ("ct2", 5, {"compute_type": "float32", "batch": 1}),
    "ct2-beam5-latency-int8": ("ct2", 5, {"compute_type": "int8", "batch": 1}),
}


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def _time_batches(run, batches: list[list[int]], workers: int = 1) -> dict:
    """Warm up on the first batch, then time ``run`` over all (``workers`` batches at a time on
    as many threads); output tokens and peak RSS too."""
    from concurrent.futures import ThreadPoolExecutor

    run(batches[0])
    start = time.perf_counter()
    each: list[float] = []
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            tokens = sum(pool.map(run, batches))
    else:
        tokens = 0
        for batch in batches:
            began = time.perf_counter()
            tokens += run(batch)
            each.append(time.perf_counter() - began)
    result = {"seconds": time.perf_counter() - start, "output_tokens": tokens, "peak_rss_mb": _peak_rss_mb()}
    if each and len(batches[0]) == 1:  # one sentence a call: its latency distribution
        each.sort()
        result["p50_ms"] = round(1000 * each[len(each) // 2], 1)
        result["p99_ms"] = round(1000 * each[min(len(each) - 1, int(0.99 * len(each)))], 1)
    return result


def _median_round(runs: list[dict]) -> dict:
    """One variant's row from its rounds: the round of median speed, with every round's tokens/s
    under ``tokens_per_s_rounds`` (and its peak RSS the highest of the rounds')."""
    timed = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
    if not timed:
        return runs[0]
    row = dict(timed[(len(timed) - 1) // 2])
    if len(runs) > 1:
        row["tokens_per_s_rounds"] = [r.get("tokens_per_s") for r in runs]
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in timed)
    return row


def _batches(lengths: list[int], size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + size] for i in range(0, len(order), size)]


# ------------------------------------------------------------------------------------ workers


def worker_torch(job: dict) -> dict:
    """Decode with mtcli.infer.search.generate in this process; return timings."""
    import torch

    from mtcli.allocator import bound_onednn_cache, keep_freed_memory
    from mtcli.data.batching import collate_sources
    from mtcli.infer.loading import load_for_inference
    from mtcli.infer.search import generate
    from mtcli.infer.translate import model_for_decoding, run_shortlist

    keep_freed_memory()  # as `mtcli translate` and `evaluate` do before they decode
    bound_onednn_cache()  # as `mtcli translate`, `evaluate` and `serve` do
    workers = job.get("workers", 1)
    torch.set_num_threads(max(1, job["threads"] // workers))  # as decode.workers does
    bundle = load_for_inference(job["run_dir"], job["checkpoint"], device="cpu")
    decode = dataclasses.replace(bundle.config.decode, int8=bool(job.get("int8")), bf16=job["bf16"],
                                 shortlist=job.get("shortlist", 0))
    shortlist = run_shortlist(bundle, decode)
    model = bundle.model
    if not job.get("plain"):  # what translate_lines decodes with: an int8 or a packed fp32 copy
        model = model_for_decoding(model, decode, "cpu")
    ids = json.loads(Path(job["inputs"]).read_text(encoding="utf-8"))["ids"]
    fixed = job["fixed_length"]
    a, b = (0.0, fixed) if fixed else (decode.max_len_a, decode.max_len_b)
    batches = _batches([len(s) for s in ids], job["batch"])
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if job["bf16"] else torch.autocast("cpu", enabled=False)
    )

    def run(batch: list[int]) -> int:
        src = collate_sources([ids[i] for i in batch], "cpu")
        with torch.inference_mode(), autocast:
            hyps = generate(
                model, src, beam_size=job["beam"], length_penalty=decode.length_penalty,
                max_len_a=a, max_len_b=b, nbest=1, use_cache=job["use_cache"], shortlist=shortlist,
            )
        return sum(len(h[0].tokens) for h in hyps)

    return dict(_time_batches(run, batches, workers), sentences=len(ids), torch=torch.__version__)


def worker_ct2(job: dict) -> dict:
    """Decode with CTranslate2 in this process (no torch imported); return timings."""
    import ctranslate2

    data = json.loads(Path(job["inputs"]).read_text(encoding="utf-8"))
    pieces, decode = data["pieces"], data["decode"]
    translator = ctranslate2.Translator(
        job["ct2_dir"], device="cpu", compute_type=job["compute_type"],
        intra_threads=max(1, job["threads"] // job.get("workers", 1)), inter_threads=job.get("workers", 1),
    )
    batches = _batches([len(s) for s in pieces], job["batch"])
    fixed = job["fixed_length"]

    def run(batch: list[int]) -> int:
        src = [pieces[i] for i in batch]
        if fixed:
            limit = fixed
        else:
            # mtcli: at most int(a * m + b) tokens before </s> for m source pieces (no </s>).
            limit = int(decode["max_len_a"] * max(len(s) for s in src) + decode["max_len_b"])
        out = translator.translate_batch(
            src, beam_size=job["beam"], length_penalty=decode["length_penalty"],
            max_decoding_length=limit, min_decoding_length=0, max_input_length=0,
            suppress_sequences=[["<blank>"], ["<s>"]],  # mtcli's search never emits pad/bos
        )
        return sum(len(r.hypotheses[0]) for r in out)

    return dict(_time_batches(run, batches, job.get("workers", 1)), sentences=len(pieces),
                ctranslate2=ctranslate2.__version__)


# ------------------------------------------------------------------------------------ setup


def _random_run_dir(work: Path, spm_path: Path | None, seed: int, output_vocab: str = "joint") -> Path:
    """A run dir holding a random model of the Multi30k recipe shape and an 8k SentencePiece;
    ``output_vocab="target"``: with the output vocabulary of the prepared cache's target side."""
    import shutil

    import torch

    from mtcli.checkpoint import save_checkpoint
    from mtcli.config import load_config, save_config
    from mtcli.data.tokenizer import Tokenizer
    from mtcli.fileio import sha256_file
    from mtcli.model import Transformer

    run = work / "random_run"
    run.mkdir(parents=True, exist_ok=True)
    config = load_config(RECIPE, [f"train.run_dir={run}", f"model.output_vocab={output_vocab}"])
    output_ids = None
    if output_vocab == "target":
        from mtcli.data.cache import PreparedCorpus

        prepared = REPO / "data" / "prepared" / config.data.name
        if spm_path is not None or not prepared.is_dir():
            raise SystemExit(f"--output-vocab target lists the target pieces of {prepared}: "
                             f"run `mtcli prepare {RECIPE}` first (and leave out --spm)")
        output_ids = PreparedCorpus.open(prepared, verify=False).target_vocabulary()
    if spm_path is None:
        cached = REPO / "data" / "prepared" / config.data.name / "spm.model"
        spm_path = cached if cached.is_file() else None
    if spm_path is None:
        shared = REPO.parent / "shared" / "data" / "multi30k"
        if not (shared / f"train.{config.data.src_lang}").is_file():
            raise SystemExit(f"no SentencePiece model to build the random model with: {shared} is not here "
                             f"(give --spm MODEL, or run `mtcli prepare {RECIPE}` first; and --input FILE)")
        print(f"training an {config.data.vocab_size}-piece SentencePiece model on {shared} ...",
              file=sys.stderr)
        sentences = []
        for lang in (config.data.src_lang, config.data.tgt_lang):
            sentences += (shared / f"train.{lang}").read_text(encoding="utf-8").splitlines()
        spm_path = Tokenizer.train(sentences, work / "spm", config.data.vocab_size,
                                   config.data.spm_model_type, 1.0, 200_000, seed=1)
    shutil.copyfile(spm_path, run / "spm.model")
    tokenizer = Tokenizer(run / "spm.model")
    save_config(config, run / "config.yaml")
    torch.manual_seed(seed)
    model = Transformer(config.model, tokenizer.vocab_size, output_ids=output_ids)
    save_checkpoint(run / "checkpoints" / "checkpoint_best.pt", {
        "format": 1, "step": 0, "model": model.state_dict(), "config": config.to_dict(),
        "vocab": {"size": tokenizer.vocab_size, "spm_sha256": sha256_file(run / "spm.model")},
    })
    return run


def _machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count()}
    from mtcli.device import cpu_info

    name, flags = cpu_info()
    if name:
        info["cpu"] = name
    if flags:
        info["avx512_bf16"] = "avx512_bf16" in flags
        info["amx_bf16"] = "amx_bf16" in flags
    return info


def _run_worker(job: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), MKL_NUM_THREADS=str(job["threads"]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, set up model and inputs, run every variant, print and save results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="trained run directory (default: random model)")
    parser.add_argument("--checkpoint", default="best")
    parser.add_argument("--input", type=Path, default=None,
                        help="source lines (default: Multi30k's test2016 in the run's source language)")
    parser.add_argument("--limit", type=int, default=0, help="first N input lines only (0: all)")
    parser.add_argument("--batch", type=int, default=64, help="sentences per batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--fixed-length", type=int, default=None,
                        help="decode exactly this many tokens (default: 24 for a random model, "
                             "0 = the recipe's length cap for a trained run)")
    parser.add_argument("--spm", type=Path, default=None, help="SentencePiece model for the random model")
    parser.add_argument("--output-vocab", choices=["joint", "target"], default="joint",
                        help="the random model's softmax: the joint vocabulary or the target side's "
                             "pieces of the prepared cache (model.output_vocab)")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS),
                        default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variant list this many times, interleaved: each row is then "
                             "the variant's median round and each ratio the median of the rounds' "
                             "ratios (a shared VM's speed drifts by 10-20%% from minute to minute)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker)
        result = worker_ct2(job) if job["engine"] == "ct2" else worker_torch(job)
        print(json.dumps(result))
        return 0

    from mtcli.data.textio import read_lines
    from mtcli.infer.loading import load_for_inference

    work = Path(tempfile.mkdtemp(prefix="bench_decode_"))
    run_dir = args.run_dir or _random_run_dir(work, args.spm, seed=1, output_vocab=args.output_vocab)
    fixed = args.fixed_length if args.fixed_length is not None else (0 if args.run_dir else 24)
    bundle = load_for_inference(run_dir, args.checkpoint, device="cpu")
    args.input = args.input or MULTI30K / f"test_2016_flickr.{bundle.config.data.src_lang}"
    if not args.input.is_file():
        print(f"input {args.input} not found (give --input FILE: source lines to decode)", file=sys.stderr)
        return 2
    tok, decode = bundle.tokenizer, bundle.config.decode
    lines = list(read_lines(args.input))
    if args.limit:
        lines = lines[: args.limit]
    limit = bundle.config.model.max_positions - 1
    ids = [tok.encode(line)[:limit] for line in lines]
    pieces = [[tok.id_to_piece(i) for i in s] for s in ids]
    inputs = work / "inputs.json"
    inputs.write_text(json.dumps({
        "ids": ids, "pieces": pieces,
        "decode": {"max_len_a": decode.max_len_a, "max_len_b": decode.max_len_b,
                   "length_penalty": decode.length_penalty},
    }), encoding="utf-8")
    del bundle

    ct2_dir = None
    if any(VARIANTS[v][0] == "ct2" for v in args.variants):
        try:
            from mtcli.infer.export import export_model

            ct2_dir = str(export_model(run_dir, work / "ct2", checkpoint=args.checkpoint))
        except Exception as exc:  # noqa: BLE001 - report and go on with the torch variants
            print(f"CTranslate2 export failed, skipping ct2 variants: {exc}", file=sys.stderr)

    rounds: dict[str, list[dict]] = {}
    for round_number in range(args.rounds):
        for name in args.variants:
            engine, beam, options = VARIANTS[name]
            if engine == "ct2" and ct2_dir is None:
                continue
            job = {"engine": engine, "beam": beam, "threads": args.threads, "batch": args.batch,
                   "fixed_length": fixed, "inputs": str(inputs), "run_dir": str(run_dir),
                   "checkpoint": args.checkpoint, "ct2_dir": ct2_dir, **options}
            print(f"running {name} (round {round_number + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
            try:
                result = _run_worker(job, args.timeout)
            except subprocess.TimeoutExpired:
                result = {"error": f"timed out after {args.timeout:.0f}s"}
            row = {"variant": name, "engine": engine, "beam": beam, **options, **result}
            if "seconds" in result:
                row["sentences_per_s"] = round(result["sentences"] / result["seconds"], 1)
                row["tokens_per_s"] = round(result["output_tokens"] / result["seconds"], 1)
            rounds.setdefault(name, []).append(row)
    rows = [_median_round(runs) for runs in rounds.values()]
    by = {r["variant"]: r for r in rows if "sentences_per_s" in r}

    def ratio(a: str, b: str) -> float | None:
        """The median over rounds of ``a``'s tokens/s over ``b``'s in the same round."""
        if a in by and b in by:
            each = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rounds[a], rounds[b], strict=True)
                    if "tokens_per_s" in x and "tokens_per_s" in y]
            return round(statistics.median(each), 2)
        return None

    comparisons = {
        "torch beam5 / ct2 fp32 beam5 (tokens/s)": ratio("torch-beam5", "ct2-beam5-fp32"),
        "torch greedy / ct2 fp32 greedy (tokens/s)": ratio("torch-greedy", "ct2-greedy-fp32"),
        "torch beam5 int8 / ct2 int8 beam5 (tokens/s)": ratio("torch-beam5-int8", "ct2-beam5-int8"),
        "torch greedy int8 / ct2 int8 greedy (tokens/s)": ratio("torch-greedy-int8", "ct2-greedy-int8"),
        "torch beam5 packed / unpacked (tokens/s)": ratio("torch-beam5", "torch-beam5-unpacked"),
        "torch greedy packed / unpacked (tokens/s)": ratio("torch-greedy", "torch-greedy-unpacked"),
        "torch beam5 / ct2 fp32 beam5, one sentence a call (tokens/s)": ratio("torch-beam5-latency",
                                                                               "ct2-beam5-latency"),
        "torch greedy / ct2 fp32 greedy, one sentence a call (tokens/s)": ratio("torch-greedy-latency",
                                                                                 "ct2-greedy-latency"),
    }
    header = f"{'variant':36s} {'sent/s':>8s} {'tok/s':>9s} {'out tok':>8s} {'sec':>7s} {'RSS MB':>7s}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:36s} error: {r['error']}")
            continue
        latency = f"  p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms" if "p50_ms" in r else ""
        each = r.get("tokens_per_s_rounds")
        each = "  rounds: " + " / ".join(f"{x:.0f}" if x else "-" for x in each) if each else ""
        print(f"{r['variant']:36s} {r['sentences_per_s']:8.1f} {r['tokens_per_s']:9.1f} "
              f"{r['output_tokens']:8d} {r['seconds']:7.2f} {r['peak_rss_mb']:7.1f}{latency}{each}")
    for key, value in comparisons.items():
        if value is not None:
            print(f"{key}: {value}x")

    report = {
        "benchmark": "decode", "input": str(args.input), "sentences": len(lines),
        "model": str(args.run_dir) if args.run_dir else "random (configs/multi30k_de_en.yaml shape)",
        "checkpoint": args.checkpoint, "batch_sentences": args.batch, "threads": args.threads,
        "fixed_length": fixed, "length_penalty": decode.length_penalty, "rounds": args.rounds,
        "machine": _machine(), "rows": rows, "comparisons": comparisons,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = args.output or REPO / "bench" / "results" / f"decode_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
