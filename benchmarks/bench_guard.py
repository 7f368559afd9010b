"""Benchmark: the first-batch guard's cost as a ratio of one training step on the same packed batch.

Usage: python benchmarks/bench_guard.py [--model arch:qwen2] [--backend sdpa] [--device cpu] [--dtype float32]
                                     [--examples 3,16,64] [--rows 1,4] [--lengths 11,7,13] [--full] [--repeat 5]

One training step = what the trainer does per step on that batch: forward with labels (use_cache=False, train
mode), backward, one SGD step, zero_grad. The guard = ``verify_packed_batch`` on the same batch (the packed forward
plus the per-example reference: right-padded batches of the examples where they match the one-at-a-time truth, one
forward per example elsewhere; the diagnostic reruns only after a mismatch), under no_grad. Both are timed
``--repeat`` times after one warm-up each (CUDA synchronised), interleaved, so that load from other processes on a
shared machine hits both alike; the medians and the median of the per-pair ratios guard / step are printed, in wall
time and in this process's CPU time (steadier on a loaded machine: a wait for a core is not counted), one line per
batch shape from the same run. ``--threads`` sets torch's intra-op threads (default: torch's own).

The shapes: ``--examples`` (default 3, 16 and 64 examples of 8-16 tokens, as SFT on short texts packs them: 64 of
them is the issue's 764-token row) in ``--rows`` packed rows (1: one row; 4: four rows of equal example counts and
equal length, as a batch of packed rows). ``--lengths`` replaces
the sweep with one row of those lengths. ``--full`` builds the model at its real size with random weights (e.g.
``--model ../shared/hub-configs/meta-llama/Llama-3.2-1B --full --device cuda --dtype bfloat16 --lengths
512,384,700,448``); without it the config is shrunk as the audit does.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def _rows_batch(model, lengths: list[int], rows: int, device: str) -> dict:
    """``lengths`` as ``rows`` packed rows of equal example counts, one batch ``(rows, tokens)``: each row as the
    collator gives it, the rows of equal length (the last example of a shorter row grows to fill it: no padding,
    no attention_mask, as a batch of packed rows reaches eager / sdpa correctly)."""
    import torch

    from pytest_packcheck.model import batches as B

    start = B.position_ids_start(model.config)
    per = -(-len(lengths) // rows)
    parts = [list(lengths[i:i + per]) for i in range(0, len(lengths), per)]
    width = max(sum(p) for p in parts)
    for p in parts:
        p[-1] += width - sum(p)
    examples = B.make_examples(model.config, tuple(n for p in parts for n in p))
    batches, k = [], 0
    for p in parts:
        batches.append(B.packed_batch(examples[k:k + len(p)], start=start, device=device))
        k += len(p)
    return {key: torch.cat([b[key] for b in batches]) for key in ("input_ids", "position_ids", "labels")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="arch:qwen2")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--examples", default="3,16,64", help="example counts of the sweep")
    parser.add_argument("--rows", default="1,4", help="packed rows per batch in the sweep")
    parser.add_argument("--lengths", default=None, help="one row of these lengths instead of the sweep")
    parser.add_argument("--full", action="store_true", help="real size, random weights (no shrink)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pytest_packcheck.backends import REFERENCE_BACKEND, TORCH_VARLEN_BACKEND, register_reference_backend
    from pytest_packcheck.guard import verify_packed_batch
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    if args.backend in (REFERENCE_BACKEND, TORCH_VARLEN_BACKEND):
        register_reference_backend()
    resolved = resolve_model(parse_model_spec(args.model, "bench"), "bench")
    model = build_model(resolved, args.backend, args.dtype, device=args.device, shrink=not args.full)
    model.config.use_cache = False  # as Trainer / SFTTrainer set it
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model} ({type(model).__name__}, {n_params / 1e6:.1f}M params, {args.dtype}, {args.backend}, "
          f"{args.device}), torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def once(fn) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of one call."""
        sync()
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - t, time.process_time() - c

    if args.lengths:
        shapes = [([int(x) for x in args.lengths.split(",")], 1)]
    else:
        rng = random.Random(0)
        shapes = []
        for n in (int(x) for x in args.examples.split(",")):
            lengths = [rng.randint(8, 16) for _ in range(n)]
            shapes += [(lengths, rows) for rows in (int(r) for r in args.rows.split(",")) if rows == 1 or rows < n]
    for lengths, rows in shapes:
        batch = _rows_batch(model, lengths, rows, args.device)

        def step(batch=batch) -> None:
            model.train()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def guard(batch=batch) -> None:
            verify_packed_batch(model, batch, training=True)

        step(), guard()  # warm-up: first-call costs (kernels, mask functions, the tolerance file)
        timed = [(once(step), once(guard)) for _ in range(args.repeat)]
        pairs = [(s[0], g[0]) for s, g in timed]
        step_s, guard_s = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        ratio = statistics.median(g / s for s, g in pairs)
        cpu = statistics.median(g[1] / s[1] for s, g in timed if s[1] > 0)
        result = verify_packed_batch(model, batch, training=True)
        print(f"{len(lengths):3d} examples, {sum(lengths):4d} tokens in {rows} row{'s' if rows > 1 else ' '}: "
              f"training step {step_s * 1e3:7.1f} ms, guard {guard_s * 1e3:7.1f} ms ({result.forwards:2d} forwards, "
              f"{result.verdict}): guard / step = {ratio:.2f} wall, {cpu:.2f} CPU (medians of {args.repeat} interleaved pairs)")


if __name__ == "__main__":
    main()
