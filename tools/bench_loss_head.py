"""Benchmark the loss head: vocab_parallel_log_probs + GSPO loss vs plain F.cross_entropy, fwd + bwd.

    python tools/bench_loss_head.py                       # 4096 tokens x 32k vocab, fp32, one chunk
    python tools/bench_loss_head.py --chunk-size 1024 --dtype bfloat16 --tokens 8192 --vocab 65536

Both paths run on the same logits in the same process, interleaved repeat by repeat so machine load
hits them alike; the median and the minimum wall time of forward + backward are reported, with the
ratio ours / cross_entropy. On a GPU (``--device cuda``) times are synchronised and peak memory comes
from ``torch.cuda.max_memory_allocated``.

How CPU peak memory is measured (``testing/memory.py:peak_bytes``): every allocation and free of
torch's CPU allocator, on every thread, is counted by c10's allocation reporter, including the
temporaries inside fused ops and in the backward; its running total gives the bytes live at each
moment; the maximum is the
peak *above what existed before the step* (the logits, targets and other inputs are allocated
beforehand and are not counted; the logits' gradient is counted, since backward creates it). The
script also prints the size of one full-vocabulary fp32 copy of the logits so the peak can be read in
those units: plain cross_entropy needs ~2 (its saved log-softmax and the gradient), and the target for
ours is no extra full-vocabulary fp32 copy beyond that (with chunking, ~1 plus a chunk).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gspo_megatron.algorithms import LossConfig, LossContext, get_policy_loss, vocab_parallel_log_probs
from gspo_megatron.testing.memory import peak_bytes


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    batch = args.tokens // args.seq_len
    logits = (2 * torch.randn(batch, args.seq_len, args.vocab, generator=gen)).to(args.device, dtype)
    targets = torch.randint(0, args.vocab, (batch, args.seq_len), generator=gen).to(args.device)
    old = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = (old + 0.01 * torch.randn(old.shape, generator=gen).to(args.device)).detach()
    mask = torch.ones(batch, args.seq_len, dtype=torch.bool, device=args.device)
    mask[:, args.seq_len * 3 // 4 :] = torch.arange(batch, device=args.device).unsqueeze(-1) % 2 == 0
    advantages = torch.randn(batch, generator=gen).to(args.device)
    return logits, targets, old, mask, advantages


def _ours(logits, targets, old, mask, advantages, chunk_size):
    leaf = logits.detach().requires_grad_()
    log_probs, _ = vocab_parallel_log_probs(leaf, targets, chunk_size=chunk_size)
    ctx = LossContext(LossConfig(name="gspo", clip_low=3e-4, clip_high=4e-4))
    get_policy_loss("gspo")(log_probs, old, advantages, mask, ctx).loss.backward()
    return leaf.grad


def _cross_entropy(logits, targets, *_):
    leaf = logits.detach().requires_grad_()
    F.cross_entropy(leaf.view(-1, leaf.shape[-1]), targets.view(-1), reduction="sum").backward()
    return leaf.grad


def _timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    grad = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del grad
    return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: one chunk)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args(argv)
    if args.tokens % args.seq_len:
        parser.error("--tokens must be a multiple of --seq-len")
    if args.threads:
        torch.set_num_threads(args.threads)

    inputs = _inputs(args)
    paths = {
        "ours (log-probs + gspo)": lambda: _ours(*inputs, args.chunk_size),
        "F.cross_entropy": lambda: _cross_entropy(*inputs),
    }
    for fn in paths.values():  # warm-up
        _timed(fn, args.device)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            times[name].append(_timed(fn, args.device))
    peaks = {name: peak_bytes(fn, args.device) for name, fn in paths.items()}

    copy_bytes = args.tokens * args.vocab * 4
    print(
        f"{args.tokens} tokens x {args.vocab} vocab, {args.dtype}, device={args.device}, "
        f"threads={torch.get_num_threads()}, chunk_size={args.chunk_size}, repeats={args.repeats}"
    )
    print(f"one full-vocab fp32 copy = {copy_bytes / 2**20:.0f} MiB")
    for name in paths:
        print(
            f"{name:26s} median {statistics.median(times[name]) * 1e3:8.1f} ms  min {min(times[name]) * 1e3:8.1f} ms  "
            f"peak {peaks[name] / 2**20:8.0f} MiB ({peaks[name] / copy_bytes:.2f} fp32 copies)"
        )
    ours, ref = paths
    print(
        "ratio ours / cross_entropy: "
        f"time (median) {statistics.median(times[ours]) / statistics.median(times[ref]):.2f}x, "
        f"time (min) {min(times[ours]) / min(times[ref]):.2f}x, peak memory {peaks[ours] / peaks[ref]:.2f}x"
    )


if __name__ == "__main__":
    main()
