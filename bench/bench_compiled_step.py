"""A compiled decoder step against the eager one decoding runs: one sentence, beam 5, on a CPU.

At one sentence a call (a server's latency) a beam-5 decoder step multiplies 5 rows by every
weight matrix and runs about a hundred small operations, each with its own dispatch; the
matrix products are a small part of the time. This benchmark measures what compiling the step
gives: ``torch.compile`` (inductor, ``freezing`` so that it lays the weights out once) over one
decoder step with every shape fixed, as a compiled step needs them:

- ``rows`` decoder rows (``--beam``, one sentence's beams);
- a key/value cache preallocated at ``--max-len`` positions: the step writes its key and value
  at the current position and attends to every position, the later ones masked;
- a source of ``--source-length`` pieces.

Against it, in the same process and in interleaved rounds, the eager step that ``generate``
runs (``Transformer.decode`` with a ``DecoderCache``) on the packed fp32 copy that
``translate``/``evaluate``/``serve`` decode with, and on the model as it is. Each variant
decodes the same ``--steps`` positions from the same tokens; its logits are checked against the
eager packed step's at every position. Reported: the compile time and each variant's ms per
step (median over rounds, and the spread).

The model is a random one of the Multi30k recipe's shape (configs/multi30k_en_de.yaml), or a
trained run with ``--run-dir`` (the step's cost does not depend on the weights' values).

Usage (from the repository root)::

    python bench/bench_compiled_step.py                   # beam 5, 2 threads, max-len 64
    python bench/bench_compiled_step.py --threads 1 --max-len 128

Results: a table on stdout and ``bench/results/compiled_step_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtcli.config import load_config  # noqa: E402
from mtcli.infer.packed import pack_for_decoding  # noqa: E402
from mtcli.model import Transformer  # noqa: E402


def static_step(model: Transformer, rows: int, max_len: int):
    """One post-norm decoder step with fixed shapes (the math of ``DecoderLayer.step``).

    ``step(token [rows, 1], position [1], keys, values, cross_keys, cross_values)`` with
    ``keys[l]``/``values[l]`` ``[rows, h, max_len, d_k]`` (written at ``position``) and
    ``cross_*[l]`` ``[1, h, S, d_k]``; returns the logits ``[rows, output_size]``.
    """
    if model.cfg.pre_norm:
        raise SystemExit("this benchmark writes out the post-norm step only (the recipes')")
    h, d = model.cfg.n_heads, model.cfg.d_model
    d_k, dec = d // h, model.decoder
    scale = 1.0 / math.sqrt(d_k)
    times = torch.arange(max_len).view(1, 1, 1, max_len)

    def step(token, position, keys, values, cross_keys, cross_values):
        x = dec.embed(token) + dec.positions.pe.index_select(0, position).view(1, 1, d)
        future = torch.zeros(1, 1, 1, max_len).masked_fill(times > position, float("-inf"))
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj(x).view(rows, 3, h, d_k)
            keys[i].index_copy_(2, position, qkv[:, 1].unsqueeze(2))
            values[i].index_copy_(2, position, qkv[:, 2].unsqueeze(2))
            scores = torch.matmul(qkv[:, 0].unsqueeze(2), keys[i].transpose(-2, -1)) * scale
            out = torch.matmul(torch.softmax(scores + future, -1), values[i]).reshape(rows, 1, d)
            x = layer.sublayer[0].norm(x + attn.out_proj(out))
            cross = layer.cross_attn
            q = cross.q_proj(x).view(1, rows, h, d_k).transpose(1, 2)
            scores = torch.matmul(q, cross_keys[i].transpose(-2, -1)) * scale
            out = torch.matmul(torch.softmax(scores, -1), cross_values[i])
            x = layer.sublayer[1].norm(x + cross.out_proj(out.transpose(1, 2).reshape(rows, 1, d)))
            ffn = layer.feed_forward
            x = layer.sublayer[2].norm(x + ffn.w_2(F.relu(ffn.w_1(x))))
        return model.project(x).view(rows, -1)

    return step


def main(argv: list[str] | None = None) -> int:
    """Compile the step, time every variant in interleaved rounds, print and save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="trained run (default: random model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=64, help="cache positions of the compiled step")
    parser.add_argument("--source-length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.run_dir:
        from mtcli.infer.loading import load_for_inference

        model = load_for_inference(args.run_dir, "best", device="cpu").model.eval()
    else:
        cfg = load_config(REPO / "configs" / "multi30k_en_de.yaml", [])
        model = Transformer(cfg.model, cfg.data.vocab_size).eval()
    packed = pack_for_decoding(model)
    rows, vocab, steps = args.beam, model.decoder.embed.weight.size(0), args.steps
    if steps > args.max_len:
        raise SystemExit("--steps must not exceed --max-len")
    tokens = torch.randint(4, vocab, (steps, rows, 1))
    src = torch.randint(4, vocab, (1, args.source_length))
    src[0, -1] = 2

    with torch.inference_mode():
        # the encoder's keys/values per layer, [1, h, S, d_k] and contiguous, as init_cache makes them
        cache = packed.init_cache(packed.encode(src), beam_size=rows, max_len=args.max_len)
        cross_k, cross_v = cache.cross_k, cache.cross_v
        h, d_k = model.cfg.n_heads, model.cfg.d_model // model.cfg.n_heads
        keys = [torch.zeros(rows, h, args.max_len, d_k) for _ in cross_k]
        values = [torch.zeros(rows, h, args.max_len, d_k) for _ in cross_k]

        def eager(m: Transformer) -> list[torch.Tensor]:
            e = m.encode(src)
            c = m.init_cache(e, beam_size=rows, max_len=args.max_len)
            return [m.decode(tokens[t], e, c)[:, 0].clone() for t in range(steps)]

        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        began = time.perf_counter()
        compiled = torch.compile(static_step(model, rows, args.max_len), dynamic=False)
        compiled(tokens[0], torch.tensor([0]), keys, values, cross_k, cross_v)
        compile_s = time.perf_counter() - began

        def run_compiled() -> list[torch.Tensor]:
            return [compiled(tokens[t], torch.tensor([t]), keys, values, cross_k, cross_v).clone()
                    for t in range(steps)]

        variants = {"eager, packed fp32 (what decoding runs)": lambda: eager(packed),
                    "eager, the model as it is": lambda: eager(model),
                    "compiled, fixed shapes": run_compiled}
        reference = eager(packed)
        agree = {}
        for name, fn in variants.items():
            out = fn()
            agree[name] = max(float((a - b).abs().max()) for a, b in zip(out, reference, strict=True))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                began = time.perf_counter()
                fn()
                times[name].append(1000 * (time.perf_counter() - began) / steps)

    from mtcli.device import cpu_info

    rows_out = []
    print(f"compile: {compile_s:.1f} s; {rows} rows, cache {args.max_len} positions, "
          f"source {args.source_length} pieces, {args.threads} threads")
    for name, ms in times.items():
        med = statistics.median(ms)
        print(f"{name:42s} {med:7.3f} ms/step (min {min(ms):.3f}, max {max(ms):.3f}); "
              f"max |logit diff| {agree[name]:.2e}")
        rows_out.append({"variant": name, "ms_per_step_median": round(med, 3),
                         "ms_per_step": [round(x, 3) for x in ms], "max_abs_logit_diff": agree[name]})
    report = {"benchmark": "compiled_step", "cpu": cpu_info()[0], "threads": args.threads,
              "rows": rows, "max_len": args.max_len, "source_length": args.source_length,
              "steps": steps, "compile_seconds": round(compile_s, 1), "torch": torch.__version__,
              "model": str(args.run_dir) if args.run_dir else "random (configs/multi30k_en_de.yaml shape)",
              "rows_out": rows_out, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = args.output or REPO / "bench" / "results" / f"compiled_step_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
