"""``packcheck bench``: what packing buys. The same examples trained padded and packed, step for step.

For a model and a length distribution, K optimizer steps (after W warm-up steps) are run twice on the same
micro-batches: padded (``DataCollatorWithPadding``-style: each micro-batch padded to its longest example, labels
-100 on the padding) and packed (``DataCollatorWithFlattening``: one row, position_ids restarting). Reported:
useful tokens/s (label tokens that are not padding), step time, peak memory (``torch.cuda.max_memory_allocated``
on CUDA), the padding overhead, the measured speedup and the ideal one (padded tokens / packed tokens =
1 + padding overhead; slightly below padded / useful label tokens, which would also count each example's
unlabelled first token as padding). Tokens/s and the speedup are totals over the measured steps, like the
ideal speedup; step times are medians with their spread (min, max), and so is the per-step speedup (step i holds
the same examples in both modes). Each step runs a third time, packed with packcheck's attention-call
counting on, to measure what the instrumentation costs; the three are interleaved in a rotating order. Token ids are synthetic: the cost depends on lengths,
not content. On CPU this is a smoke test of the machinery: no speed claims.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, read_user_text

#: Built-in length profiles (tokens per example). flan: short instructions with a long tail (most under 300
#: tokens, some past 1500), very variable; orcamath: longer and uniform-ish; uniform / fixed: for control.
PROFILES = ("flan", "orcamath", "uniform", "fixed")


def sample_lengths(profile: str, n: int, max_length: int, seed: int = 0, fixed: int = 512, source: str = "--profile") -> list[int]:
    """``n`` example lengths from a built-in profile or a file (one integer per line), capped at ``max_length``.

    Raises:
        PackcheckUsageError: unknown profile / missing file / a line that is not a positive integer.
    """
    return _clip(raw_lengths(profile, n, max_length, seed, fixed, source), max_length)


def _clip(raw: list[int], max_length: int) -> list[int]:
    return [max(2, min(max_length, x)) for x in raw]


def raw_lengths(profile: str, n: int, max_length: int, seed: int = 0, fixed: int = 512, source: str = "--profile") -> list[int]:
    """The lengths :func:`sample_lengths` draws, before the cap (``uniform`` draws within 16..max_length)."""
    rng = random.Random(seed)
    if profile == "flan":
        raw = [int(rng.lognormvariate(math.log(120), 1.0)) for _ in range(n)]  # median 120, p95 ~ 620
    elif profile == "orcamath":
        raw = [int(rng.gauss(480, 120)) for _ in range(n)]
    elif profile == "uniform":
        raw = [rng.randint(min(16, max_length), max_length) for _ in range(n)]
    elif profile == "fixed":
        raw = [fixed] * n
    else:
        path = Path(profile)
        if not path.is_file():
            looks_like_path = any(ch in profile for ch in "/\\.")
            raise PackcheckUsageError(
                (f"Length file '{profile}' (from {source}) does not exist or is not a file" if looks_like_path
                 else f"Unknown length profile '{profile}' (from {source})")
                + f": use one of {', '.join(PROFILES)} or a file with one length per line."
            )
        values = []
        text = read_user_text(path, f"Length file (from {source})", "give a text file with one length per line.")
        for i, row in enumerate(text.splitlines(), 1):  # the file's own line numbers, blank lines counted (trial 15, 237)
            for line in row.split():
                if not line.isdigit() or int(line) < 2:
                    raise PackcheckUsageError(f"Length file {path} (from {source}) line {i}: '{line}' is not an integer >= 2.")
                values.append(int(line))
        if not values:
            raise PackcheckUsageError(f"Length file {path} (from {source}) holds no lengths.")
        raw = [values[i % len(values)] for i in range(n)]
    return raw


@dataclass
class RunStats:
    """One mode's steps (medians over the measured steps, spread as [min, max])."""

    mode: str
    step_s: float
    step_s_spread: list[float]
    #: total useful tokens / total time over the measured steps: the same aggregation as the ideal speedup (a
    #: median of per-step rates would weight short and long steps alike and not compare with it)
    useful_tokens_per_s: float
    tokens_per_step: float  # tokens the model processed per step (padding included), median
    useful_tokens_per_step: float
    peak_memory_mib: float | None
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)


def _padded_micro_batch(examples: list[list[int]], pad_id: int, device: str) -> dict[str, Any]:
    import torch

    longest = max(len(e) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def _packed_micro_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": e} for e in examples], return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}


def _useful(batch: dict[str, Any]) -> int:
    """Label tokens that count in the loss (not -100, after the causal shift)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def _step(model: Any, optimizer: Any, batch: dict[str, Any], cuda: bool, instrument: bool) -> tuple[float, float, float | None]:
    """One optimizer step: (seconds, loss, peak MiB on CUDA else None). The peak statistic is reset before the
    step, so the peak is the most memory allocated at any moment of this step (weights and batches included)."""
    import contextlib

    import torch

    from ..backends import count_attention_calls

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ctx = count_attention_calls(model) if instrument else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None
    return seconds, round(float(loss.detach()), 5), peak


def _stats(mode: str, measured: list[dict[str, Any]], times: list[float], losses: list[float], peaks: list[float | None]) -> RunStats:
    useful = statistics.median(_useful(b) for b in measured)
    tokens = statistics.median(b["input_ids"].numel() for b in measured)
    per_s = sum(_useful(b) for b in measured) / sum(times)
    peak = max(peaks) if peaks and peaks[0] is not None else None
    return RunStats(mode, round(statistics.median(times), 5), [round(min(times), 5), round(max(times), 5)], round(per_s, 1),
                    tokens, useful, peak, losses, [round(t, 6) for t in times])


def run_bench(model: Any, *, profile: str = "flan", steps: int = 10, warmup: int = 2, batch_size: int = 16,
              max_length: int = 2048, device: str = "cpu", seed: int = 0, pad_id: int = 0,
              instrumentation: bool = True, targets: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Train ``warmup + steps`` steps on micro-batches of ``batch_size`` examples, each step once padded, once
    packed and (``instrumentation``) once packed with packcheck's attention-call counting; return the figures
    (see the module docstring), with ``targets`` (default audit/bench_targets.toml) judged on them.

    The modes are interleaved step by step, in an order that rotates from one step to the next, so warm-up
    costs, clock drift and allocator growth fall on all modes alike (run one mode after the other, the first one
    paid them: padded read up to 1.9x slower on identical batches). Timing does not depend on the weights'
    values, so the modes share one model and one SGD optimizer; the first-step loss parity is measured before
    any step, from the initial weights, which are restored at the end.

    Raises:
        PackcheckUsageError: ``steps`` or ``warmup`` below 1, ``max_length`` below 2.
    """
    import torch

    if steps < 1 or warmup < 1 or max_length < 2:
        raise PackcheckUsageError(
            f"bench needs steps >= 1, warmup >= 1 (the first step pays one-time costs) and max_length >= 2; got "
            f"steps={steps}, warmup={warmup}, max_length={max_length}.")
    vocab = int(model.config.vocab_size)
    n = (steps + warmup) * batch_size
    raw = raw_lengths(profile, n, max_length, seed)
    lengths = _clip(raw, max_length)
    clipped = sum(1 for x in raw if x > max_length)
    rng = random.Random(seed + 1)
    examples = [[rng.randrange(1, vocab) for _ in range(length)] for length in lengths]
    groups = [examples[i * batch_size:(i + 1) * batch_size] for i in range(steps + warmup)]
    padded = [_padded_micro_batch(g, pad_id, device) for g in groups]
    packed = [_packed_micro_batch(g, device) for g in groups]
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}  # off the GPU: no memory skew
    cuda = device.startswith("cuda")
    model.train()
    with torch.no_grad():
        first = {mode: float(model(**b[0], use_cache=False).loss) for mode, b in (("padded", padded), ("packed", packed))}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)  # the step's cost is forward + backward; SGD adds little
    modes = [("padded", padded, False), ("packed", packed, False)] + ([("counted", packed, True)] if instrumentation else [])
    record: dict[str, tuple[list, list, list]] = {m: ([], [], []) for m, _, _ in modes}
    try:
        for i in range(warmup + steps):
            for mode, batches, instrument in modes[i % len(modes):] + modes[:i % len(modes)]:
                seconds, loss, peak = _step(model, optimizer, batches[i], cuda, instrument)
                if i >= warmup:
                    for slot, value in zip(record[mode], (seconds, loss, peak), strict=True):
                        slot.append(value)
    finally:
        model.load_state_dict(state)
    runs = {mode: _stats(mode, batches[warmup:], *record[mode]) for mode, batches, _ in modes[:2]}
    pad, pack = runs["padded"], runs["packed"]
    overhead = None
    if instrumentation:
        overhead = round(statistics.median(record["counted"][0]) / statistics.median(record["packed"][0]) - 1, 4)
    padded_tokens = sum(b["input_ids"].numel() for b in padded[warmup:])
    real_tokens = sum(sum(len(e) for e in g) for g in groups[warmup:])
    result = {
        "profile": profile, "steps": steps, "warmup": warmup, "batch_size": batch_size, "max_length": max_length,
        "device": device, "lengths": {"median": statistics.median(lengths), "min": min(lengths), "max": max(lengths),
                                      "mean": round(statistics.fmean(lengths), 1), "clipped_to_max_length": clipped},
        "runs": {k: asdict(v) for k, v in runs.items()},
        "padding_overhead": round(padded_tokens / real_tokens - 1, 4),
        "ideal_speedup": round(padded_tokens / real_tokens, 3),
        "speedup": round(pack.useful_tokens_per_s / pad.useful_tokens_per_s, 3),
        # step i holds the same examples in both modes: its speedup is padded time / packed time
        "speedup_per_step": _spread([a / b for a, b in zip(pad.step_times_s, pack.step_times_s, strict=True)]),
        "memory_reduction": (round(1 - pack.peak_memory_mib / pad.peak_memory_mib, 4)
                             if pack.peak_memory_mib and pad.peak_memory_mib else None),
        "loss_first_step_delta": round(abs(first["packed"] - first["padded"]), 6),
    }
    result["fraction_of_ideal"] = round(result["speedup"] / result["ideal_speedup"], 3)
    if overhead is not None:
        result["instrumentation_overhead"] = overhead
    result["targets"] = judge_targets(result, load_targets() if targets is None else targets, device)
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


#: Target keys of audit/bench_targets.toml: (result key, "min" or "max", label).
TARGET_KEYS = {
    "min_speedup": ("speedup", "min", "speedup (useful tokens/s, packed / padded)"),
    "min_fraction_of_ideal": ("fraction_of_ideal", "min", "fraction of the ideal speedup"),
    "min_memory_reduction": ("memory_reduction", "min", "peak memory saved"),
    "max_instrumentation_overhead": ("instrumentation_overhead", "max", "instrumentation overhead"),
}


def load_targets(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """audit/bench_targets.toml (or ``path``): ``{profile or "all": {key: value}}``.

    Raises:
        PackcheckUsageError: a key outside :data:`TARGET_KEYS` or a value that is not a number.
    """
    from ..config.audits import PACKAGE_AUDIT_DIR
    from ..errors import read_document

    file = Path(path) if path else PACKAGE_AUDIT_DIR / "bench_targets.toml"
    data = read_document(file, "toml", "Bench targets file", "pass a TOML file of [profile] tables, e.g. audit/bench_targets.toml.")
    for profile, table in data.items():
        for key, value in table.items():
            if key not in TARGET_KEYS or not isinstance(value, (int, float)):
                raise PackcheckUsageError(
                    f"{file} [{profile}] {key} = {value!r}: expected a number under one of {', '.join(TARGET_KEYS)}.")
    return data


def judge_targets(result: dict[str, Any], targets: dict[str, dict[str, float]], device: str) -> list[dict[str, Any]]:
    """Each target that applies to ``result``'s profile, with the measured value and whether it is met.
    ``met`` is None on CPU (a smoke test: no speed claims) or when the figure was not measured."""
    out = []
    for scope in ("all", result["profile"]):
        for key, required in targets.get(scope, {}).items():
            field_name, kind, label = TARGET_KEYS[key]
            measured = result.get(field_name)
            met = None
            if device.startswith("cuda") and isinstance(measured, (int, float)):
                met = measured >= required if kind == "min" else measured <= required
            out.append({"target": key, "label": label, "required": required, "measured": measured, "met": met})
    return out


def bench_backend(doc: dict[str, Any], label: str) -> str | None:
    """The backend to bench ``label`` on: the first of :data:`.backends.BENCH_BACKEND_PREFERENCE` (the backend
    table's bench order, fastest kernels first) the audit ran for it with at least one verdict (pass / fail /
    fallback)."""
    from ..backends.table import BENCH_BACKEND_PREFERENCE

    ran = {c["backend"] for c in doc["cells"] if c["model"]["label"] == label and c["status"] in ("pass", "fail", "fallback")}
    return next((b for b in BENCH_BACKEND_PREFERENCE if b in ran), None)


def bench_audit(doc: dict[str, Any], profiles: list[str], steps: int, device: str, dtype: str | None = None,
                log: Any = print, batch_size: int = 16, max_length: int = 2048) -> list[dict[str, Any]]:
    """``packcheck bench`` for every model of an audit document (on :func:`bench_backend`, the audit's weights
    and size), one entry per model and profile. A model that cannot be built or benched becomes an entry with
    ``error`` (its reason), never an exception: the audit's results are already written."""
    from ..backends import ensure_registered
    from ..model.build import build_model
    from ..model.resolve import resolve_model
    from ..model.specs import parse_model_spec
    from ..report.bench import bench_terminal_lines

    out: list[dict[str, Any]] = []
    targets = load_targets()
    dtype = dtype or (doc.get("settings", {}).get("dtypes") or ["float32"])[0]
    seen: dict[str, dict[str, Any]] = {}
    for c in doc["cells"]:
        seen.setdefault(c["model"]["label"], c["model"])
    for label, model_info in seen.items():
        backend = bench_backend(doc, label)
        base = {"model": model_info, "attn_implementation": backend, "dtype": dtype}
        if backend is None:
            out += [{**base, "profile": p, "error": "no backend gave this model a verdict in the audit (every cell errored, was unsupported or skipped)"}
                    for p in profiles]
            log(f"bench {label}: not measured: no backend gave it a verdict in the audit")
            continue
        try:
            ensure_registered(backend)
            resolved = resolve_model(parse_model_spec(model_info["spec"], "the audit"), "the audit")
            if resolved.error:
                raise RuntimeError(resolved.error)
            model = build_model(resolved, backend, dtype, doc.get("settings", {}).get("weights", "random"), device)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be built is an entry, not a crash
            out += [{**base, "profile": p, "error": f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"} for p in profiles]
            log(f"bench {label} / {backend}: not measured: {out[-1]['error']}")
            continue
        n_params = sum(p.numel() for p in model.parameters())
        try:  # packcheck bench's refusal, per model: --bench-max-length 99999999999 ran on past any time limit (trial 5)
            refuse_unfit_bench(bench_memory_estimate(model.config, n_params, dtype, batch_size, max_length),
                               available_memory(device), f"{label} ({n_params / 1e6:.1f}M parameters, {dtype}, "
                               f"{batch_size} x {max_length} tokens)")
        except PackcheckUsageError as exc:
            out += [{**base, "profile": p, "error": str(exc).replace("--batch-size", "--bench-batch-size")
                     .replace("--max-length", "--bench-max-length")} for p in profiles]
            log(f"bench {label} / {backend}: not measured: {out[-1]['error']}")
            del model
            continue
        for profile in profiles:
            try:
                r = run_bench(model, profile=profile, steps=steps, device=device, batch_size=batch_size, max_length=max_length,
                              targets=targets)
            except Exception as exc:  # noqa: BLE001 - same: the reason goes into the report
                out.append({**base, "profile": profile, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
                log(f"bench {label} / {backend} / {profile}: not measured: {out[-1]['error']}")
                continue
            out.append({**base, **r, "parameters": sum(p.numel() for p in model.parameters())})
            for line in bench_terminal_lines(out[-1], device, where=f"bench {label} / {backend} / "):
                log(line)
        del model
    return out


def bench_memory_estimate(config: Any, n_params: int, dtype: str, batch_size: int, max_length: int) -> dict[str, int]:
    """Bytes a bench step needs at least, by part, before anything runs (issue 42: a 7B model in float32, or a batch
    that cannot fit, grew until the kernel's OOM killer ended the run). ``weights`` and ``gradients`` (SGD keeps no
    state): ``n_params`` x the dtype's size; ``activations``: the padded batch (``batch_size`` x ``max_length``
    tokens, the larger of the two modes) x layers x hidden size x 16 values kept for the backward (attention and MLP
    inputs, norms, residuals: a floor, not a ceiling); ``logits``: tokens x vocabulary x 3 float32 copies (logits,
    their log-softmax and its gradient). ``config``: the model's (text) config."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or getattr(text, "d_model", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or getattr(text, "num_layers", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    tokens = batch_size * max_length
    return {"weights": n_params * size, "gradients": n_params * size, "activations": tokens * layers * hidden * 16 * size,
            "logits": tokens * vocab * 4 * 3}


def available_memory(device: str) -> int | None:
    """Bytes free for a bench on ``device``: CUDA's free memory (``torch.cuda.mem_get_info``), else the host's
    MemAvailable (/proc/meminfo, in kB there) capped by a cgroup memory limit; None where neither can be read."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except (RuntimeError, AssertionError):
            return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit.isdigit():
            free = min(free if free is not None else 1 << 62, int(limit) - usage)
    except (OSError, ValueError):
        pass
    return free


def refuse_unfit_bench(parts: dict[str, int], free: int | None, what: str) -> None:
    """Refuse a bench whose :func:`bench_memory_estimate` exceeds the memory ``free`` on its device, naming the size
    it needs by part and the fixes; nothing when it fits or ``free`` is unknown.

    Raises:
        PackcheckUsageError: ``bench needs about N GB ... this machine has M GB available``.
    """
    from ..errors import PackcheckUsageError

    need = sum(parts.values())
    if free is None or need <= free:
        return
    gb = 1024 ** 3
    detail = ", ".join(f"{k} {v / gb:.1f}" for k, v in parts.items() if v)
    raise PackcheckUsageError(f"bench of {what} needs about {need / gb:.1f} GB ({detail} GB; the padded batch of the "
                              f"run) and this machine has {free / gb:.1f} GB available: lower --batch-size or "
                              "--max-length, drop --full-size, or use --dtype bfloat16 (on a GPU).")
