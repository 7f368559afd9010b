"""Benchmark: the first-batch guard's cost as a ratio of one training step on the same packed row.

Usage: python benchmarks/bench_guard.py [--model arch:llama] [--backend sdpa] [--device cpu] [--dtype float32]
                                     [--lengths 11,7,13] [--full] [--repeat 5]

One training step = what the trainer does per step on that row: forward with labels (use_cache=False, train
mode), backward, one SGD step, zero_grad. The guard = ``verify_packed_batch`` on the same row (the packed forward
plus one forward per example, under no_grad). Both are timed ``--repeat`` times after one warm-up each
(CUDA synchronised), interleaved; the medians and the median of the per-pair ratios guard / step are printed. ``--full`` builds the model at its real size
with random weights (e.g. ``--model ../shared/hub-configs/meta-llama/Llama-3.2-1B --full --device cuda
--dtype bfloat16 --lengths 512,384,700,448``); without it the config is shrunk as the audit does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="arch:llama")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="11,7,13")
    parser.add_argument("--full", action="store_true", help="real size, random weights (no shrink)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from pytest_packcheck.backends import REFERENCE_BACKEND, TORCH_VARLEN_BACKEND, register_reference_backend
    from pytest_packcheck.guard import verify_packed_batch
    from pytest_packcheck.model import batches as B
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    if args.backend in (REFERENCE_BACKEND, TORCH_VARLEN_BACKEND):
        register_reference_backend()
    resolved = resolve_model(parse_model_spec(args.model, "bench"), "bench")
    model = build_model(resolved, args.backend, args.dtype, device=args.device, shrink=not args.full)
    model.config.use_cache = False  # as Trainer / SFTTrainer set it
    lengths = tuple(int(x) for x in args.lengths.split(","))
    examples = B.make_examples(model.config, lengths)
    batch = B.packed_batch(examples, start=B.position_ids_start(model.config), device=args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step() -> None:
        model.train()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def guard() -> None:
        verify_packed_batch(model, batch, training=True)

    def once(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    step(), guard()  # warm-up: first-call costs (kernels, mask functions, the tolerance file)
    # interleaved, so that load from other processes on a shared machine hits both alike; the ratio is taken per pair
    pairs = [(once(step), once(guard)) for _ in range(args.repeat)]
    step_s, guard_s = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    ratio = statistics.median(g / s for s, g in pairs)
    result = verify_packed_batch(model, batch, training=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model} ({type(model).__name__}, {n_params / 1e6:.1f}M params, {args.dtype}, {args.backend}, "
          f"{args.device}), row {sum(lengths)} tokens in {len(lengths)} examples, torch threads {torch.get_num_threads()}")
    print(f"training step {step_s * 1e3:.1f} ms, guard {guard_s * 1e3:.1f} ms ({result.forwards} forwards, "
          f"verdict {result.verdict}): guard / step = {ratio:.2f} (median of {args.repeat} interleaved pairs)")


if __name__ == "__main__":
    main()
