"""Training speed: mtcli's Transformer (fp32 and bf16 autocast) against a plain
``torch.nn.Transformer`` of the same shape, fed the same token batches.

Shape: the Multi30k recipe (configs/multi30k_de_en.yaml: d_model 256, 3+3 layers, 4 heads,
d_ff 1024, dropout 0.3 / attention dropout 0.1, tied 8k joint vocabulary), ~4k-token batches
(``--max-tokens``). Batches are real Multi30k training batches from the prepared cache
``data/prepared/multi30k_de_en`` (built by mtcli's own batching: length-sorted pools, so the
padding fraction is what training sees) when it exists, else synthetic pairs whose piece lengths
follow Multi30k's (mean ~16, long right tail) with random ids.

Each variant runs in its own subprocess (so each peak RSS is its own) on the same saved batches:
``--warmup`` untimed steps, then ``--steps`` timed ones, a step being forward + label-smoothed
loss + backward + Adam update. Reported: target tokens/s (non-pad target tokens per second of
timed steps), ms/step, padding fraction, peak RSS (CPU) or peak allocated memory (CUDA),
estimated model FLOP/s, and its share of this machine's measured matmul peak.

FLOPs per step (padded shapes, training = 3x forward, multiply-add = 2 FLOPs):
forward = 2 * [ B*S*L_e*(4d^2 + 2*d*d_ff)                        encoder projections + FFN
              + B*T*L_d*(4d^2 + 2d^2 + 2*d*d_ff) + B*S*L_d*2d^2  decoder self/cross attn + FFN
              + B*T*d*V ]                                        output projection
        + 4*B*d*[ L_e*S^2 + L_d*(T^2 + T*S) ]                    QK^T and AV
which is the usual ``6 * params * tokens`` made explicit per stack, plus attention.

The matmul peak is measured in a separate worker: square ``--peak-size`` GEMMs and a GEMM of the
FFN's shape (4096 x 256 x 1024), fp32 and bf16, best of several runs.

Usage (from the repository root)::

    python bench/bench_train.py                       # full: recipe shape, 30 timed steps
    python bench/bench_train.py --smoke               # seconds: tiny shape, 3 steps
    python bench/bench_train.py --variants ours-fp32 torch-nn-fp32 --steps 50 --threads 2
    python bench/bench_train.py --variants ours-fp32 --profile 20   # + the top 20 ops (slower steps)
    python bench/bench_train.py --variants ours-bf16 --set train.rdrop_alpha=5   # R-Drop's doubled step

Results: a table on stdout and ``bench/results/train_<time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout without mtcli installed (e.g. a GPU box)
RECIPE = REPO / "configs" / "multi30k_de_en.yaml"
PREPARED = REPO / "data" / "prepared" / "multi30k_de_en"
# reference-*: the loop a PyTorch user would write: nn.Transformer, F.cross_entropy with label
# smoothing, AdamW (fused on a GPU), torch.compile on a GPU (the training issue's reference loop);
# reference-bf16-eager: the same loop without torch.compile
# ours-*-compile: mtcli's own training forward and loss (mtcli.train.step.forward_loss) under
# torch.compile, as train.compile runs it
# ours-bf16-pageable: ours-bf16 with each batch copied to the GPU from ordinary (pageable) host
# memory, as mtcli did before mtcli.device.to_device pinned it: that copy waits for the GPU
# ours-bf16-static-*: an upper bound, not a training loop: every batch exactly --static-length
# tokens a row on both sides, no padding, as many rows as --max-tokens allows (what packing
# sentences into fixed rows would give, less its block-diagonal masks), compiled for that one
# shape (-compile), and replayed as CUDA graphs (-graphs: torch.compile's "reduce-overhead")
# ours-bf16-packed-*: the same sentences as every other variant, packed end to end into rows of
# --pack-length slots (mtcli.data.packing; Transformer.forward_packed keeps them apart), as many
# rows as --max-tokens allows: one shape for every batch, compiled (-compile) and replayed as
# CUDA graphs (-graphs: what train.pack_length with train.compile runs on a GPU). Like the trainer,
# the ours-* loops let the device skip a non-finite update and read each step's loss a step later;
# -sync waits for the loss before each update instead (the trainer's loop before it did that);
# -flex- keeps the packed pairs apart with FlexAttention block masks (Transformer.flex_packed);
# -fp32norm keeps the residual stream in float32, as autocast alone does on a GPU (mtcli's
# LayerNorm keeps a GPU's training stream in bf16)
VARIANTS = ["ours-fp32", "ours-bf16", "ours-bf16-compile", "ours-bf16-pageable", "ours-bf16-static-compile",
            "ours-bf16-static-graphs", "ours-bf16-packed-compile", "ours-bf16-packed-graphs",
            "ours-bf16-packed-graphs-sync", "ours-bf16-packed-graphs-fp32norm", "ours-bf16-packed-flex-graphs", "torch-nn-fp32",
            "torch-nn-bf16", "reference-fp32", "reference-bf16", "reference-bf16-eager"]
PACKED_KEYS = ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions", "tgt_positions")
DEFAULT_VARIANTS = ["ours-fp32", "ours-bf16", "torch-nn-fp32"]


# --------------------------------------------------------------------------- batches


def build_batches(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Collate ``warmup + steps`` training batches once and save them for the workers."""
    import numpy as np
    import torch

    from mtcli.data.batching import BatchStream, collate, make_batches

    need = args.warmup + args.steps
    source = "synthetic"
    output_ids = None
    if args.prepared.is_dir() and not args.synthetic and not args.smoke:
        from mtcli.data.cache import PreparedCorpus

        corpus = PreparedCorpus.open(args.prepared, verify=False)
        stream = BatchStream(corpus.array("train", corpus.src_lang), corpus.array("train", corpus.tgt_lang),
                             max_tokens=args.max_tokens, max_source_length=256, max_target_length=256,
                             seed=1)
        vocab = corpus.vocab_size
        batches = [stream.collate(stream.next_group().batches[0]) for _ in range(need)]
        padding_epoch = stream.padding_fraction(0)
        source = f"Multi30k train ({args.prepared})"
        # what model.output_vocab: target lists for this cache's direction
        output_ids = torch.from_numpy(corpus.target_vocabulary())
    else:
        rng = np.random.default_rng(0)
        n = 29_000
        vocab = args.vocab
        # Multi30k de/en piece lengths with an 8k unigram model: mean ~16, sd ~6, tail to ~80;
        # --mean-length scales the same shape (WMT14 en-de with a 37k BPE: about 28)
        scale = 2.3 * args.mean_length / 16.1
        cap = int(100 * args.mean_length / 16.1)
        src_len = np.clip(rng.gamma(7.0, scale, n).astype(np.int64), 2, cap)
        tgt_len = np.clip((src_len * rng.normal(0.95, 0.15, n)).astype(np.int64), 2, cap)

        class Synthetic:
            def __init__(self, lengths: np.ndarray, seed: int) -> None:
                self.lengths = lengths
                self.rng = np.random.default_rng(seed)

            def __len__(self) -> int:
                return len(self.lengths)

            def __getitem__(self, i: int) -> np.ndarray:
                return self.rng.integers(4, vocab, int(self.lengths[i])).astype(np.int32)

        src, tgt = Synthetic(src_len, 1), Synthetic(tgt_len, 2)
        all_batches = make_batches(src_len, tgt_len, np.arange(n), args.max_tokens, seed=1)
        from mtcli.data.batching import padding_fraction

        padding_epoch = padding_fraction(all_batches, src_len, tgt_len)
        # the corpus's batches again from the first when it has fewer than warm-up + timed steps
        # (a large --max-tokens): every step timed is one the figures count
        batches = [collate(src, tgt, all_batches[i % len(all_batches)]) for i in range(need)]
    payload = {
        "src": [b.src for b in batches],
        "tgt_in": [b.tgt_in for b in batches],
        "tgt_out": [b.tgt_out for b in batches],
        "vocab": vocab,
        "output_ids": output_ids,
    }
    torch.save(payload, path)
    timed = batches[args.warmup:]
    real = sum(b.src_tokens + b.tgt_tokens for b in timed)
    padded = sum(b.padded_tokens for b in timed)
    return {
        "source": source,
        "vocab": vocab,
        "batches": len(batches),
        "mean_batch_sentences": float(np.mean([len(b.indices) for b in timed])),
        "mean_batch_target_tokens": float(np.mean([b.tgt_tokens for b in timed])),
        "padding_timed_batches": 1.0 - real / padded,
        "padding_epoch": padding_epoch,
    }


# --------------------------------------------------------------------------- models


def make_baseline(cfg: Any, vocab: int) -> Any:
    """torch.nn.Transformer of the recipe's shape + tied embeddings, sinusoidal positions, output."""
    import torch
    from torch import nn

    class NNTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.d = d
            self.embed = nn.Embedding(vocab, d, padding_idx=0)
            nn.init.normal_(self.embed.weight, 0.0, d**-0.5)
            pos = torch.arange(cfg.max_positions, dtype=torch.float32)[:, None]
            div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
            pe = torch.zeros(cfg.max_positions, d)
            pe[:, 0::2] = torch.sin(pos * div)
            pe[:, 1::2] = torch.cos(pos * div)
            self.register_buffer("pe", pe, persistent=False)
            self.drop = nn.Dropout(cfg.dropout)
            self.core = nn.Transformer(d, cfg.n_heads, cfg.encoder_layers, cfg.decoder_layers,
                                       cfg.d_ff, cfg.dropout, batch_first=True,
                                       norm_first=cfg.pre_norm)

        def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
            scale = math.sqrt(self.d)
            x = self.drop(self.embed(src) * scale + self.pe[: src.size(1)])
            y = self.drop(self.embed(tgt_in) * scale + self.pe[: tgt_in.size(1)])
            causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
            src_pad, tgt_pad = src.eq(0), tgt_in.eq(0)
            h = self.core(x, y, tgt_mask=causal, src_key_padding_mask=src_pad,
                          tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
                          tgt_is_causal=True)
            return h @ self.embed.weight.t()

    return NNTransformer()


def flops_per_step(cfg: Any, vocab: int, batch_shapes: list[tuple[int, int, int]]) -> float:
    """Training FLOPs (3x forward) of the padded batches, formula in the module docstring."""
    d, f, le, ld = cfg.d_model, cfg.d_ff, cfg.encoder_layers, cfg.decoder_layers
    total = 0.0
    for b, s, t in batch_shapes:
        linear = (b * s * le * (4 * d * d + 2 * d * f)
                  + b * t * ld * (6 * d * d + 2 * d * f) + b * s * ld * 2 * d * d
                  + b * t * d * vocab)
        attention = 2 * b * d * (le * s * s + ld * (t * t + t * s))
        total += 3 * (2 * linear + 2 * attention)
    return total / max(len(batch_shapes), 1)


# --------------------------------------------------------------------------- workers


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def fixed_shape_batches(args: argparse.Namespace, data: dict[str, Any], packed: bool, vocab: int) -> None:
    """Replace the saved batches, in place, by batches of one shape: the sentences of all of them
    packed into rows of ``--pack-length`` slots (``packed``), else random ids filling rows of
    ``--static-length`` (no padding at all); as many rows as ``--max-tokens`` allows."""
    import numpy as np
    import torch

    from mtcli.data.packing import collate_packed, pack_epoch
    from mtcli.data.tokenizer import EOS_ID

    if not packed:
        rows, length = max(1, args.max_tokens // args.static_length), args.static_length
        gen = torch.Generator().manual_seed(1)
        for key in PACKED_KEYS[:3]:
            data[key] = [torch.randint(4, vocab, (rows, length), generator=gen) for _ in data[key]]
        return
    src: list[np.ndarray] = []
    tgt: list[np.ndarray] = []
    for src_batch, tgt_batch in zip(data["src"], data["tgt_out"], strict=True):
        for s_row, t_row in zip(src_batch.tolist(), tgt_batch.tolist(), strict=True):
            src.append(np.asarray(s_row[: s_row.index(EOS_ID)]))
            tgt.append(np.asarray(t_row[: t_row.index(EOS_ID)]))
    lengths = [np.array([len(x) for x in side]) for side in (src, tgt)]
    fits = np.flatnonzero(np.maximum(*lengths) < args.pack_length)  # a longer pair has no row
    data["pairs_skipped"] = len(src) - len(fits)
    # as the trainer packs an epoch: the pairs shuffled, then laid into rows (the token batches'
    # order groups pairs of one length, which pack worse); a last, part-filled batch is left out
    n_rows = max(1, args.max_tokens // args.pack_length)
    groups = pack_epoch(*lengths, fits, n_rows, args.pack_length, seed=1, epoch=0)
    batches = [collate_packed(src, tgt, rows, n_rows, args.pack_length)
               for rows in (groups[:-1] if len(groups) > 1 and len(groups[-1]) < n_rows else groups)]
    # packed, the pairs fill fewer batches: as many as the token batches, from the first again
    batches = [batches[i % len(batches)] for i in range(len(data["src"]))]
    for key in PACKED_KEYS:
        data[key] = [getattr(b, key) for b in batches]


def worker_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Time one variant on the saved batches; returns its row."""
    import torch

    from mtcli.allocator import keep_freed_memory
    from mtcli.config import load_config
    from mtcli.data.batching import pad_length
    from mtcli.device import to_device
    from mtcli.train.loss import LabelSmoothedLoss
    from mtcli.train.rdrop import rdrop_loss
    from mtcli.train.schedule import build_optimizer, build_schedule
    from mtcli.train.step import (
        COMPILE_LENGTH_MULTIPLE,
        HostValues,
        compile_forward_loss,
        mark_sizes_dynamic,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as mtcli.train does (MTCLI_KEEP_FREED_MEMORY=0 measures without it)
    device = torch.device(args.device)
    data = torch.load(args.batches, weights_only=True)
    config = load_config(RECIPE, list(args.set or []))
    cfg = config.model
    vocab = int(data["vocab"])
    torch.manual_seed(1)
    name = args.worker
    output_ids = data.get("output_ids") if cfg.output_vocab == "target" else None
    if name.startswith("ours"):
        from mtcli.model import Transformer

        model = Transformer(cfg, vocab, output_ids=output_ids).to(device)
        model.flex_packed = "-flex-" in name
        if name.endswith("-fp32norm"):  # the float32 residual stream that autocast gives a GPU
            from mtcli.model.layers import LayerNorm

            LayerNorm.devices = ()
    else:
        model = make_baseline(cfg, vocab).to(device)
    bf16 = "bf16" in name
    params = sum(p.numel() for p in model.parameters())
    criterion = LabelSmoothedLoss(config.train.label_smoothing)
    optimizer = build_optimizer(model, config.train)
    reference = name.startswith("reference")
    reference_compiled = reference and args.compile and not name.endswith("-eager")
    if reference:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, betas=tuple(config.train.adam_betas),
                                      eps=config.train.adam_eps, weight_decay=0.0, fused=device.type == "cuda")
    schedule = build_schedule(optimizer, cfg.d_model, config.train)
    model.train()
    forward = torch.compile(model, dynamic=True) if reference_compiled else model

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    backends = contextlib.nullcontext()
    if args.sdpa_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        import mtcli.model.attention as attention

        backends = sdpa_kernel([getattr(SDPBackend, b.strip().upper()) for b in args.sdpa_backends.split(",")])
        # the backends asked for: mtcli's attention otherwise enters its own choice inside them
        # (16-bit on CUDA: every backend but cuDNN's), which wins
        attention.sdpa_backends = lambda device_type, dtype: None

    ours = name.startswith("ours")
    # like with like: both loops run each batch once, unless --set train.rdrop_alpha=A asks for
    # R-Drop's doubled step (the recipe's own alpha is not applied by default)
    asked = any(item.split("=", 1)[0].strip() == "train.rdrop_alpha" for item in args.set or [])
    alpha = config.train.rdrop_alpha if ours and asked else 0.0

    compiled = "-compile" in name or "-graphs" in name
    pageable = name.endswith("-pageable")
    sync_each_step = name.endswith("-sync")
    pending: list[HostValues] = []
    static, packed = "-static-" in name, "-packed-" in name
    if static or packed:  # one fixed shape for every batch
        fixed_shape_batches(args, data, packed, vocab)
        train_forward = compile_forward_loss(one_shape=True, graphs="-graphs" in name)
    else:
        train_forward = compile_forward_loss() if compiled else None
    # FLOPs of the batches as collated; a compiled loop pads their lengths to a multiple of 8, as
    # train.compile does (Batch.padded), so that one graph serves every batch
    shapes = [(int(s.size(0)), int(s.size(1)), int(t.size(1))) for s, t in zip(data["src"], data["tgt_in"], strict=True)]
    if (compiled and not (static or packed)) or reference_compiled:
        for key in ("src", "tgt_in", "tgt_out"):
            data[key] = [pad_length(t, COMPILE_LENGTH_MULTIPLE) for t in data[key]]

    def eager_loss(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else torch.autocast(device.type, enabled=False)
        if alpha > 0:  # the batch twice, as one, as mtcli.train runs it
            src, tgt_in = torch.cat([src, src]), torch.cat([tgt_in, tgt_in])
        with ctx:
            if reference_compiled:  # its sizes dynamic from the start, as compile_forward_loss does
                mark_sizes_dynamic(src, tgt_in)
            logits = forward(src, tgt_in)
        targets = model.output_targets(tgt_out) if ours else tgt_out
        if reference:
            return torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=0, reduction="sum",
                label_smoothing=config.train.label_smoothing)
        return rdrop_loss(criterion, logits, targets, alpha)[0] if alpha > 0 else criterion(logits, targets).loss

    def step(i: int) -> int:
        tokens = int(data["tgt_out"][i].ne(0).sum())  # on the host, as the trainer counts them
        move = (lambda t: t.to(device, non_blocking=True)) if pageable else (lambda t: to_device(t, device))
        src, tgt_in, tgt_out, *layout = (move(data[k][i]) for k in (PACKED_KEYS if packed else PACKED_KEYS[:3]))
        if compiled:  # the trainer's step: its forward and loss
            loss, logged, _ = train_forward(model, criterion, model.output_targets, "bf16" if bf16 else "fp32",
                                            src, tgt_in, tgt_out, *layout)
        else:
            loss = eager_loss(src, tgt_in, tgt_out)
            logged = loss.detach()
        (loss / tokens).backward()
        if ours and sync_each_step:  # waiting for the loss before the update (the trainer before)
            if not math.isfinite(float(logged)):
                raise RuntimeError("non-finite loss")
        elif ours:  # as the trainer: the device skips a non-finite update, the host reads the loss a step later
            optimizer.found_inf = (~torch.isfinite(logged)).float()
        optimizer.step()
        if ours and not sync_each_step:
            del optimizer.found_inf
            if pending and not math.isfinite(pending.pop().read()[0]):
                raise RuntimeError("non-finite loss")
            pending.append(HostValues(logged.double().reshape(1)))
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    n = len(data["src"])
    backends.__enter__()
    for i in range(args.warmup):
        step(i)
    sync()  # the peak memory spans the warm-up: a CUDA graph allocates its memory while it is recorded
    tokens = 0
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    profiler = contextlib.nullcontext()
    if args.profile:
        from torch.profiler import profile

        profiler = profile()
    start = time.perf_counter()
    with profiler:
        for i in range(args.warmup, n):
            tokens += step(i)
        sync()
    seconds = time.perf_counter() - start
    backends.__exit__(None, None, None)
    if args.profile:  # on stderr: stdout carries the row
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=key, row_limit=args.profile), file=sys.stderr)
    shapes = shapes[args.warmup:]
    flops = flops_per_step(cfg, vocab if output_ids is None or not ours else len(output_ids), shapes) * (2 if alpha > 0 else 1)
    steps = n - args.warmup
    row = {
        "variant": name,
        "params": params,
        "steps": steps,
        "seconds": seconds,
        "ms_per_step": 1000 * seconds / steps,
        "target_tokens_per_s": tokens / seconds,
        "model_gflops_per_step": flops / 1e9,
        "achieved_gflop_s": flops * steps / seconds / 1e9,
        "peak_rss_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
        # graphs torch.compile built during the timed steps: above 0, the time holds compiling
        "compiles_in_timed_steps": counters["stats"]["unique_graphs"] - graphs_before,
    }
    if packed:  # pairs longer than a row, left out of the packed batches
        row["pairs_skipped"] = data["pairs_skipped"]
    if device.type == "cuda":
        row["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return row


def worker_peak(args: argparse.Namespace) -> dict[str, Any]:
    """Best-of-N GEMM throughput in fp32 and bf16 (square and the FFN's shape)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out: dict[str, Any] = {}
    n = args.peak_size
    shapes = {"square": (n, n, n), "ffn": (4096, 256, 1024)}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for label, (m, k, nn_) in shapes.items():
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, nn_, device=device, dtype=dtype)
            best = float("inf")
            for _ in range(args.peak_reps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                for _ in range(3):
                    a @ b
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, (time.perf_counter() - t) / 3)
            out[f"{dtype_name}_{label}_gflop_s"] = 2 * m * k * nn_ / best / 1e9
    return out


# --------------------------------------------------------------------------- driver


def run_worker(args: argparse.Namespace, role: str, batches: Path, deadline: float = math.inf) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", role, "--batches", str(batches), "--device", args.device,
           "--warmup", str(args.warmup), "--peak-size", str(args.peak_size),
           "--peak-reps", str(args.peak_reps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.profile and role != "peak":
        cmd += ["--profile", str(args.profile)]
    for item in args.set or []:
        cmd += ["--set", item]
    if args.sdpa_backends:
        cmd += ["--sdpa-backends", args.sdpa_backends]
    cmd += ["--compile" if args.compile else "--no-compile", "--static-length", str(args.static_length),
            "--pack-length", str(args.pack_length),
            "--max-tokens", str(args.max_tokens)]
    error = None
    timeout = min(args.worker_timeout or math.inf, deadline - time.monotonic())
    if timeout <= 0:
        print(f"worker {role} skipped: --time-budget spent", file=sys.stderr, flush=True)
        return {"variant": role, "error": "skipped: --time-budget spent"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=None if math.isinf(timeout) else timeout)
        if proc.returncode != 0:
            error = (f"failed:\n{proc.stderr[-3000:]}",
                     proc.stderr.strip().splitlines()[-1][-300:] if proc.stderr.strip() else "?")
    except subprocess.TimeoutExpired:
        error = (f"ran past its {timeout:.0f} s (--worker-timeout, --time-budget)",) * 2
    if error is not None:
        if role == "peak":
            raise SystemExit(f"worker {role} {error[0]}")
        # one variant failing (say, a compiler error) leaves the others' rows standing
        print(f"worker {role} {error[0]}", file=sys.stderr, flush=True)
        return {"variant": role, "error": error[1]}
    if args.profile and role != "peak":
        print(f"{role}: top ops over the timed steps (the profiler slows every op a little)\n"
              f"{proc.stderr.strip()}", flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    from mtcli.device import cpu_name

    return f"{cpu_name()} ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8000, help="synthetic vocabulary size")
    parser.add_argument("--pack-length", type=int, default=128,
                        help="slots a row of the ours-bf16-packed-* variants' packed batches (default: %(default)s)")
    parser.add_argument("--static-length", type=int, default=32,
                        help="tokens a row of the ours-bf16-static-* variants' fixed batches (default: %(default)s)")
    parser.add_argument("--mean-length", type=float, default=16.1,
                        help="synthetic pieces per sentence, mean (default: Multi30k's; WMT14 en-de: 28)")
    parser.add_argument("--synthetic", action="store_true", help="ignore the prepared cache")
    parser.add_argument("--prepared", type=Path, default=PREPARED,
                        help="prepared cache whose training batches are timed (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--sdpa-backends", default="",
                        help="SDPA backends allowed in the timed steps, e.g. flash_attention,efficient_attention,math "
                             "(default: PyTorch's choice)")
    parser.add_argument("--peak-size", type=int, default=1024)
    parser.add_argument("--peak-reps", type=int, default=5)
    parser.add_argument("--peak-from", type=Path, default=None, metavar="JSON",
                        help="take the matmul peak from an earlier run's --output on this machine instead of "
                             "measuring it again")
    parser.add_argument("--set", action="append",
                        help="config override: the model shape, or train.rdrop_alpha=A to time R-Drop's step")
    parser.add_argument("--smoke", action="store_true", help="tiny shape and 3 steps (seconds)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the timed steps and print the top N ops by their own time on the device "
                             "(a GPU's kernel time, else CPU time)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the reference loop (default: on a GPU only)")
    parser.add_argument("--gpu-json", type=Path, default=None,
                        help="also write rows of variant, device, tokens_per_s, mfu (against the measured "
                             "bf16 matmul peak) and peak_mem_gb here (bench/gpu_check.sh)")
    parser.add_argument("--worker-timeout", type=float, default=0,
                        help="seconds one variant may take, compiling included (0: no limit); past it, its "
                             "row is an error and the next variant runs")
    parser.add_argument("--time-budget", type=float, default=0,
                        help="seconds the whole run may take (0: no limit); a variant gets at most what is left, "
                             "and those left when it is spent are skipped")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"bench_train.py: --device {args.device}, but there is no CUDA GPU here "
                             "(torch.cuda.is_available() is False)")
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.worker:
        row = worker_peak(args) if args.worker == "peak" else worker_variant(args)
        print(json.dumps(row))
        return
    if args.smoke:
        args.steps, args.warmup, args.max_tokens, args.vocab = 3, 1, 512, 500
        args.peak_size, args.peak_reps = 256, 2
        args.set = (args.set or []) + ["model.d_model=64", "model.d_ff=128", "model.encoder_layers=1",
                                       "model.decoder_layers=1", "model.n_heads=2"]
    deadline = time.monotonic() + (args.time_budget or math.inf)
    with tempfile.TemporaryDirectory() as tmp:
        batches_path = Path(tmp) / "batches.pt"
        info = build_batches(args, batches_path)
        print(f"batches: {info['source']}: {info['batches']} x ~{info['mean_batch_sentences']:.0f} "
              f"sentences, ~{info['mean_batch_target_tokens']:.0f} target tokens, padding "
              f"{info['padding_timed_batches']:.3f} (epoch {info['padding_epoch']:.3f})", flush=True)
        peak = earlier_peak(args.peak_from) if args.peak_from else run_worker(args, "peak", batches_path)
        rows = []
        failed = []
        for variant in args.variants:
            row = run_worker(args, variant, batches_path, deadline)
            if "error" in row:
                failed.append(row)
                continue
            peak_key = "bf16" if "bf16" in variant else "fp32"
            row["share_of_matmul_peak"] = row["achieved_gflop_s"] / peak[f"{peak_key}_square_gflop_s"]
            rows.append(row)
            print(f"  {variant}: {row['target_tokens_per_s']:,.0f} tok/s", flush=True)
            # written after every variant, so that a run cut short keeps the rows it finished
            save_results(args, info, peak, rows, failed, quiet=True)
    base = next((r for r in rows if r["variant"] == "torch-nn-fp32"), None)
    ours32 = next((r for r in rows if r["variant"] == "ours-fp32"), None)
    for row in rows:
        row["vs_torch_nn_fp32"] = row["target_tokens_per_s"] / base["target_tokens_per_s"] if base else None
        row["vs_ours_fp32"] = row["target_tokens_per_s"] / ours32["target_tokens_per_s"] if ours32 else None

    print()
    print(f"device: {device_name(args.device)}; torch threads {rows[0]['threads'] if rows else '?'}")
    print("matmul peak GFLOP/s: " + ", ".join(f"{k.replace('_gflop_s', '')} {v:,.0f}" for k, v in peak.items()))
    header = f"{'variant':<20}{'tok/s':>10}{'ms/step':>10}{'vs nn':>8}{'vs ours32':>10}{'GFLOP/s':>10}{'% peak':>8}{'RSS MB':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        vs_nn = f"{r['vs_torch_nn_fp32']:.2f}x" if r["vs_torch_nn_fp32"] else "-"
        vs_32 = f"{r['vs_ours_fp32']:.2f}x" if r["vs_ours_fp32"] else "-"
        print(f"{r['variant']:<20}{r['target_tokens_per_s']:>10,.0f}{r['ms_per_step']:>10.1f}{vs_nn:>8}"
              f"{vs_32:>10}{r['achieved_gflop_s']:>10.1f}{100 * r['share_of_matmul_peak']:>7.1f}%"
              f"{r['peak_rss_mb']:>9.0f}")
    save_results(args, info, peak, rows, failed)


def earlier_peak(path: Path) -> dict[str, float]:
    """The matmul peak an earlier run of this bench measured (its ``--output`` JSON)."""
    try:
        return json.loads(path.read_text())["matmul_peak"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"bench_train.py: --peak-from {path}: no matmul peak there ({exc})") from None


def save_results(args: argparse.Namespace, info: dict[str, Any], peak: dict[str, float], rows: list[dict[str, Any]],
                 failed: list[dict[str, Any]], quiet: bool = False) -> None:
    """Write the run's JSON (``--output``, by default a dated file under bench/results) and,
    with ``--gpu-json``, the GPU rows."""
    result = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": device_name(args.device),
        "torch": __import__("torch").__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("worker", "batches")},
        "batches": info,
        "matmul_peak": peak,
        "rows": rows,
        "failed": failed,
    }
    if args.output is None:
        args.output = REPO / "bench" / "results" / f"train_{time.strftime('%Y%m%d_%H%M%S')}.json"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if not quiet:
        print(f"\nwrote {args.output}")
    if args.gpu_json:
        write_gpu_rows(args.gpu_json, result, quiet)


def write_gpu_rows(path: Path, result: dict[str, Any], quiet: bool = False) -> None:
    """The training issue's schema: one row per variant with ``variant``, ``device``,
    ``tokens_per_s`` (real target tokens), ``mfu`` (those tokens at 4.0e8 FLOPs each, the WMT14
    base shape's, over the measured bf16 matmul peak: padding, and a packed row's attention
    across its whole row, earn nothing) and ``peak_mem_gb`` (the GPU's peak allocation, else the
    process's peak RSS). ``mfu_model_flops`` counts the FLOPs of the batches as run instead."""
    peak = result["matmul_peak"]["bf16_square_gflop_s"]
    rows = [{
        "variant": r["variant"],
        "device": result["device"],
        "tokens_per_s": round(r["target_tokens_per_s"], 1),
        "mfu": round(r["target_tokens_per_s"] * 4.0e8 / (peak * 1e9), 4),
        "peak_mem_gb": round((r.get("peak_cuda_mb") or r["peak_rss_mb"]) / 1024, 2),
        "ms_per_step": round(r["ms_per_step"], 2),
        "compiles_in_timed_steps": r.get("compiles_in_timed_steps", 0),
        "mfu_model_flops": round(r["achieved_gflop_s"] / peak, 4),
    } for r in result["rows"]]
    reference = max((r for r in rows if "reference" in r["variant"]), key=lambda r: r["tokens_per_s"], default=None)
    for row in rows:
        row["vs_reference"] = round(row["tokens_per_s"] / reference["tokens_per_s"], 3) if reference else None
    body = {"time": result["time"], "torch": result["torch"], "bf16_peak_gflop_s": peak,
            "batches": result["batches"], "settings": result["settings"], "rows": rows,
            "failed": result.get("failed", [])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    if not quiet:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
