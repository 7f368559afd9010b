"""``packcheck bench``: train the same examples padded and packed; report tokens/s, memory and the speedup.

Packed vs padded training steps on synthetic token ids with a length profile (:mod:`pytest_packcheck.run.throughput`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(bench: argparse.ArgumentParser) -> None:
    bench.description = "Packed vs padded training steps on synthetic token ids with a length profile."
    bench.add_argument("--model", default="arch:llama", help="Model spec (org/name, local dir, arch:<type>); default arch:llama.")
    bench.add_argument("--profile", action="append", default=[],
                       help="Length profile: flan, orcamath, uniform, fixed, or a file of lengths (repeatable; default flan and orcamath).")
    bench.add_argument("--steps", type=int, default=10, help="Measured optimizer steps per mode (default 10).")
    bench.add_argument("--warmup", type=int, default=2, help="Warm-up steps per mode, not measured (default 2).")
    bench.add_argument("--batch-size", type=int, default=16, help="Examples per step (default 16).")
    bench.add_argument("--max-length", type=int, default=2048, help="Longest example in tokens (default 2048).")
    bench.add_argument("--attn", "--packcheck-attn", dest="attn", default=None, help="attn_implementation (default sdpa on CPU, packcheck_flash_torch_varlen on CUDA).")
    bench.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu).")
    bench.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default float32 on CPU, bfloat16 on CUDA).")
    bench.add_argument("--full-size", action="store_true", help="Random weights at the config's real size (no shrink).")
    bench.add_argument("--no-instrumentation", action="store_true", help="Skip the run with attention-call counting on.")
    bench.add_argument("-o", "--output-dir", default="reports", help="Where <name>.md / .json go (default reports).")
    bench.add_argument("--name", default="bench", help="File name stem (default bench).")


def run(ns: argparse.Namespace) -> int:
    """``packcheck bench``: exit 0 with figures written, 1 when every profile failed (each error is in the files).

    Raises:
        PackcheckUsageError: an unknown --device / --attn / --dtype, a number below its floor, a bad --name or --profile, a
            device or backend that cannot train here, a model that cannot be built; all before anything is measured.
    """
    import json

    from ..backends import (
        KNOWN_BACKENDS,
        TORCH_VARLEN_BACKEND,
        backend_availability,
        ensure_registered,
    )
    from ..config.options import DTYPES, parse_device
    from ..errors import PackcheckUsageError, closest, scrub_secrets
    from ..model.build import build_model
    from ..model.resolve import resolve_model
    from ..model.specs import parse_model_spec
    from ..report.bench import bench_terminal_lines, render_bench
    from ..results import probe_folder, write_set
    from ..results.environment import environment
    from ..run.throughput import load_targets, run_bench, sample_lengths

    ns.device = parse_device(ns.device, "--device")  # tpu, mps, cudax: refused before anything is built
    cuda = ns.device.startswith("cuda")
    attn = ns.attn or (TORCH_VARLEN_BACKEND if cuda else "sdpa")
    dtype = ns.dtype or ("bfloat16" if cuda else "float32")
    if attn not in KNOWN_BACKENDS:
        raise PackcheckUsageError(f"Unknown backend '{attn}' (from --attn). Expected one of: {', '.join(KNOWN_BACKENDS)}.{closest(attn, KNOWN_BACKENDS)}")
    if dtype not in DTYPES:
        raise PackcheckUsageError(f"Unknown dtype '{dtype}' (from --dtype). Expected one of: {', '.join(DTYPES)}.{closest(dtype, DTYPES)}")
    for name, least in (("steps", 1), ("warmup", 1), ("batch_size", 1), ("max_length", 2)):
        if getattr(ns, name) < least:
            why = " (the first step of each mode pays one-time costs; it is never timed)" if name == "warmup" else ""
            raise PackcheckUsageError(f"--{name.replace('_', '-')} {getattr(ns, name)} must be >= {least}{why}.")
    for name, most in (("steps", 10_000), ("warmup", 1_000)):  # a run without bound (trial of issue 42: 10**23 steps)
        if getattr(ns, name) > most:
            raise PackcheckUsageError(f"--{name} {getattr(ns, name)} is over {most:,}: a bench's figures settle within "
                                      "tens of steps; give e.g. --steps 20.")
    if scrub_secrets(ns.name) != ns.name:  # it would name the files and the line that prints their paths
        raise PackcheckUsageError("--name looks like an access token (or holds a secret variable's value): it names the "
                                  "bench's files, so pass a plain stem, e.g. --name bench-llama.")
    if not ns.name.strip() or any(ch in ns.name for ch in "/\\") or ns.name in (".", ".."):
        raise PackcheckUsageError(f"--name '{ns.name}' must be a file name stem without a path: use -o/--output-dir for the folder.")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise PackcheckUsageError(f"Device '{ns.device}' (from --device) is not available: torch sees no CUDA device. Use --device cpu.")
    targets = load_targets()  # a broken targets file is refused before anything is measured
    profiles = list(dict.fromkeys(ns.profile)) or ["flan", "orcamath"]
    if len(profiles) < len(ns.profile):  # trial of issue 42: three identical rows, no word
        print(f"packcheck bench: note: --profile given twice; each profile is measured once ({', '.join(profiles)})",
              file=sys.stderr)
    for profile in profiles:  # a bad profile or lengths file is refused before the model is built
        sample_lengths(profile, 1, ns.max_length, source="--profile")
    avail = backend_availability(attn, ns.device)
    if not avail.available:
        raise PackcheckUsageError(f"Backend '{attn}' (from --attn) cannot run on {ns.device}: {avail.reason}.")
    if not avail.backward:
        raise PackcheckUsageError(f"Backend '{attn}' (from --attn) cannot train on {ns.device}: {avail.backward_reason}. "
                                  "Use sdpa or eager there.")
    resolved = resolve_model(parse_model_spec(ns.model, "--model"), "--model")
    if resolved.error:
        raise PackcheckUsageError(f"Model '{ns.model}' (from --model) cannot be built: {resolved.error}")
    out = Path(ns.output_dir)
    probe_folder(out, "-o/--output-dir", "Output directory")  # before minutes of measuring, not after (a full disk says so)
    ensure_registered(attn)
    from ..run.throughput import available_memory, bench_memory_estimate, refuse_unfit_bench

    free = available_memory(ns.device)
    if ns.full_size:  # counted on the meta device: a model too big for this machine is refused before it is built
        meta_params = _meta_parameters(resolved)
        if meta_params is not None:
            refuse_unfit_bench(bench_memory_estimate(resolved.config, meta_params, dtype, ns.batch_size, ns.max_length),
                               free, f"{ns.model} at full size ({meta_params / 1e9:.2f}B parameters, {dtype})")
    try:  # a model that cannot run on this backend (mamba on sdpa) is refused before anything is measured
        model = build_model(resolved, attn, dtype, "random", ns.device, shrink=not ns.full_size)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises at build: one line, exit 2
        text = " ".join(str(exc).split())
        first = text if len(text) <= 300 else text[:300] + " ..."
        hint = " (try --attn eager)" if attn != "eager" else ""
        raise PackcheckUsageError(f"Model '{ns.model}' (from --model) cannot be built with --attn {attn} on {ns.device}: "
                                  f"{type(exc).__name__}: {first}{hint}") from None
    n_params = sum(p.numel() for p in model.parameters())
    # the batch too: --batch-size / --max-length that cannot fit grew until the OOM killer (issue 42)
    refuse_unfit_bench(bench_memory_estimate(model.config, n_params, dtype, ns.batch_size, ns.max_length), free,
                       f"{ns.model} ({n_params / 1e6:.1f}M parameters, {dtype}, {ns.batch_size} x {ns.max_length} tokens)")
    env = environment(ns.device)
    label = f"{resolved.spec.label} ({n_params / 1e6:.1f}M parameters{'' if ns.full_size else ', shrunk'})"
    results: list[dict] = []
    for profile in profiles:
        base = {"model": resolved.record(), "parameters": n_params, "attn_implementation": attn, "dtype": dtype, "profile": profile}
        try:
            r = run_bench(model, profile=profile, steps=ns.steps, warmup=ns.warmup, batch_size=ns.batch_size,
                          max_length=ns.max_length, device=ns.device, instrumentation=not ns.no_instrumentation,
                          targets=targets)
        except Exception as exc:  # noqa: BLE001 - one profile failing (OOM, kernel error) keeps the others' figures
            results.append({**base, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            print(f"{profile}: not measured: {results[-1]['error']}", file=sys.stderr)
        else:
            results.append({**base, **r})
            print("\n".join(bench_terminal_lines(results[-1], ns.device)))  # the Markdown's figures and caveats
        if "error" in results[-1]:
            _free_cuda(ns.device)  # out of the except block: its traceback no longer holds the failed step's tensors
        # written after every profile: a run stopped by a time limit keeps what it measured
        # one set (results.write_set), the JSON last; the folder named as the flag that chose it
        write_set([(out / f"{ns.name}.md", render_bench(results, env, label)),
                   (out / f"{ns.name}.json", json.dumps({"environment": env, "results": results}, indent=1) + "\n")],
                  "-o/--output-dir")
    print(f"bench written: {out / (ns.name + '.md')}, {out / (ns.name + '.json')}")
    return 1 if all("error" in r for r in results) else 0


def _free_cuda(device: str) -> None:
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _meta_parameters(resolved: object) -> int | None:
    """The parameter count of ``resolved``'s model at full size, built on the meta device (no memory); None where
    it does not build there (the real build then says why)."""
    import torch
    import transformers

    try:
        auto = getattr(transformers, getattr(resolved, "auto_class", "AutoModelForCausalLM"))
        with torch.device("meta"):
            model = auto.from_config(resolved.config)  # type: ignore[attr-defined]
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - any build error is the real build's to report
        return None
