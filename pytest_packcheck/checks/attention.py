"""The attention checks: the requested backend ran, on the varlen kernel where it is a flash one (backend), and
its per-example logits equal eager's (cross_backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..backends import FLASH_FAMILY, count_attention_calls, effective_attn_implementation, is_call_on
from ..model import batches as B
from ..results import CheckResult
from .probes import stateful_layers
from .registry import numerics_evidence, within_numerics
from .workbench import Workbench, _fmt, capture_warnings

# ------------------------------------------------------------------------------------------------------------
# 7. backend / fallback


# LlamaAttention, GPT2Attention, ...; LongcatFlashMLA; before 4.48 a class per backend: LlamaFlashAttention2
_ATTENTION_SUFFIXES = ("Attention", "MLA", "FlashAttention2")


def attention_modules(model: Any) -> list[Any]:
    """Innermost modules whose class name ends with "Attention" or "MLA" (LlamaAttention, LongcatFlashMLA)."""
    return [module for module in model.modules() if type(module).__name__.endswith(_ATTENTION_SUFFIXES)
            and not any(type(child).__name__.endswith(_ATTENTION_SUFFIXES) for child in module.children())]


def _sequence_mixer(module: Any, stateful: set[str]) -> bool:
    """A linear-attention / state-space mixer named like attention (KimiLinearDeltaAttention): it keeps its own
    state and dispatches to no attention backend."""
    import torch

    return type(module).__name__ in stateful or any(isinstance(m, torch.nn.Conv1d) for m in module.modules())


def expected_attention_calls(model: Any) -> int:
    """Attention modules found in the model (each called once by a plain forward); :func:`check_backend` counts
    the ones that actually run instead (see :func:`count_attention_module_runs`)."""
    return len(attention_modules(model))


@contextlib.contextmanager
def count_attention_module_runs(model: Any, calls: list[Any]) -> Iterator[list[int]]:
    """Attention dispatches each attention-module forward made while the block runs (``calls``: the probe's
    list of dispatches, read before and after each forward), one entry per forward: a layer reused across cycles
    (hrm_text's H/L cycles) has an entry per run, a module that never runs on the text path (a vision tower's
    attention, phi4_multimodal's audio blocks) none, diffllama's differential attention 2 per run."""
    runs: list[int] = []
    starts: list[int] = []
    stateful = set(stateful_layers(model))

    def pre(*_: Any) -> None:
        starts.append(len(calls))

    def post(module: Any, *_: Any) -> None:
        n = len(calls) - starts.pop()
        if n or not _sequence_mixer(module, stateful):  # a mixer that dispatches nothing is not an attention call
            runs.append(n)

    modules = attention_modules(model)
    handles = [m.register_forward_pre_hook(pre) for m in modules] + [m.register_forward_hook(post) for m in modules]
    try:
        yield runs
    finally:
        for handle in handles:
            handle.remove()


# names of attention backends as transformers writes them; "flash-linear-attention" (a linear-attention kernel
# package) and causal_conv1d fallbacks are other components, reported but not a backend swap
_ATTENTION_WORDS = ("sdpa", "eager", "flash_attention", "flex_attention", "scaled_dot_product", "attn_implementation",
                    "attention implementation")
_FALLBACK_WORDS = ("fall back", "falling back", "fallback", "not support", "instead of", "will be used")


def counted_packed_forward(wb: Workbench) -> tuple[list[str], Any, list[int]]:
    """One real forward of the default packed row (never the cached logits) with its attention calls counted
    (:func:`~pytest_packcheck.backends.count_attention_calls`, the boundaries each call received), its
    attention-module runs (:func:`count_attention_module_runs`) and the warnings logged during it
    (:func:`~.workbench.capture_warnings`): ``(warnings, probe, runs)``. On the runner's workbench
    (``wb.share_counted_forward``) cached per model and collator, so :func:`check_backend`'s evidence and
    :func:`~.probes.leak_probe`'s ``attention_boundaries`` come from one forward (issue 47: they ran the same row
    twice, with the same counter); elsewhere a fresh forward on each call. The counters only observe the calls.

    Raises:
        Exception: what the forward or a counter raised (kept, raised again to the next caller)."""
    key = ("counted_packed", id(wb.model), id(wb.collator_factory))
    if key not in wb._cache or not wb.share_counted_forward:
        try:
            with capture_warnings() as logged, count_attention_calls(wb.model, wb.lengths) as probe, \
                    count_attention_module_runs(wb.model, probe.calls) as runs:
                wb.forward(wb.packed())
            wb._cache[key] = (logged, probe, runs)
        except Exception as exc:  # noqa: BLE001 - each caller reports it its own way
            wb._cache[key] = exc
    got = wb._cache[key]
    if isinstance(got, BaseException):
        raise got
    return got


def check_backend(wb: Workbench) -> CheckResult:
    """Requested vs effective attn_implementation; attention calls per backend in one packed forward (expected:
    one per attention layer, all on the requested backend); whether the packed boundaries reached every call
    (mask / cu_seq_lens inspected); fallback warnings logged during the forward."""
    requested = wb.backend
    effective = effective_attn_implementation(wb.model)
    if requested and requested.startswith("paged|") and effective == requested.removeprefix("paged|"):
        requested = effective  # transformers drops the prefix it deprecated (5.x: "only needed for paged|eager")
    found = expected_attention_calls(wb.model)
    logged, probe, runs = counted_packed_forward(wb)  # a real forward, never the cached logits
    # each attention-module forward that ran must dispatch at least once (diffllama dispatches twice); where no
    # module ran through a module call, one per module found
    expected = sum(max(1, n) for n in runs) if runs else found
    counts = probe.counts()
    on_requested = sum(v for k, v in counts.items() if is_call_on(k, requested))
    others = {k: v for k, v in counts.items() if not is_call_on(k, requested)}
    isolated = [c.isolated for c in probe.calls]
    # only attention fallbacks: a convolution kernel falling back to PyTorch (causal_conv1d) is not a backend swap
    fallback_msgs = [m for m in logged if any(w in m.lower() for w in _FALLBACK_WORDS)
                     and any(a in m.lower() for a in _ATTENTION_WORDS)]
    metrics = {
        "requested": requested,
        "effective": effective,
        "calls": counts,
        "expected_calls": expected,
        "attention_modules_found": found,
        "attention_module_runs": len(runs),
        "dispatches_per_run": sorted(set(runs)),
        "varlen_kernel_calls": probe.varlen_calls,
        "dense_kernel_calls": probe.dense_flash_calls,
        "boundaries_reached": sum(1 for i in isolated if i),
        "boundaries_missing": sum(1 for i in isolated if i is False),
        "warnings": fallback_msgs[:3],
        "other_fallback_warnings": [m[:200] for m in logged if m not in fallback_msgs and any(w in m.lower() for w in _FALLBACK_WORDS)][:3],
    }
    contract = kernel_argument_items(probe.varlen_arguments)
    if contract:
        metrics["kernel_arguments"] = contract
    swap = {"requested": requested, "effective": effective, "calls": counts}
    if effective != requested:
        return CheckResult("fallback", metrics, f"requested {requested}, model runs {effective}", cause="backend_swap", evidence=swap)
    if others:
        return CheckResult("fallback", metrics, f"silent backend swap: requested {requested} but attention ran on {others}",
                           cause="backend_swap", evidence=swap)
    if fallback_msgs:
        return CheckResult("fallback", metrics, f"fallback warning: {fallback_msgs[0][:160]}", cause="backend_swap",
                           evidence={**swap, "warning": fallback_msgs[0][:160]})
    if expected and not counts and requested == "eager":
        return CheckResult("skipped", metrics, f"{type(wb.model).__name__} computes eager attention inline (no dispatch function to count); isolation and parity checks still apply")
    count = {"attention_calls": on_requested, "attention_module_runs": len(runs), "attention_modules_found": found}
    if expected and on_requested == 0:
        return CheckResult("fail", metrics, f"no attention call reached {requested} (expected {expected})", cause="backend_swap",
                           evidence=count)
    if on_requested != expected:
        return CheckResult("fail", metrics, (
            f"{on_requested} attention calls on {requested}, expected {expected} ({len(runs)} forward calls of attention "
            f"modules in this packed forward, each dispatching at least once; {found} attention modules found)"),
            cause="call_count", evidence=count)
    if requested in FLASH_FAMILY and (probe.dense_flash_calls or probe.varlen_calls != on_requested):
        return CheckResult("fail", metrics, (
            f"varlen kernel called {probe.varlen_calls} times and the dense (padded) flash kernel "
            f"{probe.dense_flash_calls} times for {on_requested} attention calls: the dense path ran"),
            cause="dense_kernel", evidence={"varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls})
    broken = {k: v for k, v in contract.items() if v["status"] == "fail" and v["kind"] != "fa4"}
    if broken:  # a real flash kernel (no enforcement of its own) received what it refuses or misreads
        name, item = next(iter(broken.items()))
        return CheckResult("fail", metrics, (
            f"the varlen kernel received {name}: {item['received']} in {item['calls_failing']} of {item['calls']} calls; "
            f"it requires {item['expected']}"), cause="kernel_arguments",
            evidence={k: {"received": v["received"], "calls_failing": v["calls_failing"]} for k, v in broken.items()})
    if metrics["boundaries_missing"]:
        return CheckResult("fail", metrics, f"packed boundaries missing in {metrics['boundaries_missing']} of {len(isolated)} attention calls",
                           cause="leak", evidence={"boundaries_missing": metrics["boundaries_missing"], "attention_calls": len(isolated)})
    if expected == 0:
        return CheckResult("skipped", metrics, f"{type(wb.model).__name__} has no attention layers: no backend to verify")
    # items FlashAttention-2 accepts and FlashAttention-4 does not (a 0-d tensor max_seqlen): a finding beside the pass
    fa4 = [{"cause": "kernel_arguments", "evidence": f"{k}: {v['received']} in {v['calls_failing']} of {v['calls']} varlen "
            f"calls; FlashAttention-2 takes it, FlashAttention-4 requires {v['expected']}"}
           for k, v in contract.items() if v["status"] == "fail" and v["kind"] == "fa4"]
    held = sum(1 for v in contract.values() if v["status"] == "pass")
    note = f"; varlen kernel arguments: {held}/{len(contract)} contract items hold" if contract else ""
    return CheckResult("pass", metrics, f"{on_requested}/{expected} calls on {requested}, boundaries reached in all{note}",
                       findings=fa4)


def kernel_argument_items(calls: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The varlen kernel argument contract over one forward's calls (:func:`backends.varlen_argument_contract`
    per call), item by item: ``status`` pass (held in every call), fail (broken in at least one) or n/a (not
    decidable), what was received (the first failing call's, else the first call's), the expected value, the
    kernel source that states it, its kind (refused / misread / fa4) and the call counts. Empty without varlen
    calls."""
    from ..backends import VARLEN_CONTRACT

    out: dict[str, dict[str, Any]] = {}
    for name, (expected, source, kind) in VARLEN_CONTRACT.items():
        seen = [c[name] for c in calls if name in c]
        if not seen:
            continue
        failing = [i for i in seen if i["ok"] is False]
        decided = [i for i in seen if i["ok"] is not None]
        status = "fail" if failing else ("pass" if decided else "n/a")
        out[name] = {"status": status, "received": (failing or seen)[0]["received"], "expected": expected,
                     "source": source, "kind": kind, "calls": len(seen), "calls_failing": len(failing)}
    return out


# ------------------------------------------------------------------------------------------------------------
# 10. cross-backend parity, causality, edge lengths


def _eager_twin(wb: Workbench) -> Any:
    """A copy of the workbench's model on eager attention, same weights (cached per model): the reference every
    other backend's per-example logits are compared with. ``set_attn_implementation`` from transformers 4.48 (it
    reaches every sub-config); before, the configs' ``_attn_implementation`` is set directly. A model whose
    attention modules are a class per backend (before 4.48: LlamaFlashAttention2, LlamaSdpaAttention), which a
    config switch does not change, is built again on eager and given the same weights."""
    key = ("eager_twin", id(wb.model))
    if key not in wb._cache:
        import copy

        setter = getattr(wb.model, "set_attn_implementation", None)
        per_backend = any(type(m).__name__.endswith(("FlashAttention2", "SdpaAttention")) for m in wb.model.modules())
        if per_backend and not callable(setter):
            config = copy.deepcopy(wb.model.config)
            config._attn_implementation_internal = None
            param = next(wb.model.parameters())
            twin = type(wb.model)._from_config(config, attn_implementation="eager", torch_dtype=param.dtype)
            twin.load_state_dict(wb.model.state_dict())
            wb._cache[key] = twin.to(param.device).eval()
            return wb._cache[key]
        twin = copy.deepcopy(wb.model)
        setter = getattr(twin, "set_attn_implementation", None)
        if callable(setter):
            setter("eager")
        else:
            for module in twin.modules():
                config = getattr(module, "config", None)
                if config is not None and hasattr(config, "_attn_implementation_internal"):
                    config._attn_implementation_internal = "eager"
        wb._cache[key] = twin
    return wb._cache[key]


def window_probe_lengths(wb: Workbench) -> list[int]:
    """Example lengths around the model's sliding window (window - 1, window, window + 3) when it has one within
    64 tokens; [] otherwise."""
    window = getattr(wb.config, "sliding_window", None)
    if isinstance(window, int) and 2 < window <= 64:
        return [window - 1, window, window + 3]
    return []


def check_cross_backend(wb: Workbench) -> CheckResult:
    """This backend's per-example (unpacked) logits vs eager's on the same weights (a deep copy switched to eager),
    on the workbench's examples and on lengths around the sliding window (:func:`window_probe_lengths`): max abs
    diff <= ``logits_atol``. Catches what packed-vs-solo cannot, because packed and solo runs share it: a backend
    that applies another sliding window, softcap or scaling than eager. Not planned on eager (the reference).
    Causes: sliding_window (only examples longer than the window differ), kernel_numerics (the difference is within
    10x the dtype's float rounding, :func:`~pytest_packcheck.checks.registry.within_numerics` with no tolerance),
    cross_backend."""
    if wb.backend in (None, "eager"):
        return CheckResult("skipped", {}, "eager is the reference other backends are compared with")
    twin = _eager_twin(wb)
    extra = B.make_examples(wb.config, tuple(window_probe_lengths(wb)), seed=3) if window_probe_lengths(wb) else []
    diffs = [(len(e), float((mine - wb.solo(e, twin)).abs().max()))  # this backend's solo logits are cached
             for e, mine in zip(wb.examples, wb.solo_logits(), strict=True)]
    for e in extra:
        diffs.append((len(e), float((wb.solo(e) - wb.solo(e, twin)).abs().max())))
    atol = wb.tol["logits_atol"]
    worst = max(d for _, d in diffs)
    metrics = {"max_abs_diff_vs_eager": worst, "per_length": {str(n): d for n, d in diffs}, "atol": atol,
               "window_probe_lengths": window_probe_lengths(wb)}
    if worst <= atol:
        return CheckResult("pass", metrics, f"per-example logits = eager's within {_fmt(worst)} on {len(diffs)} examples "
                           f"(lengths {sorted({n for n, _ in diffs})})")
    window = getattr(wb.config, "sliding_window", None)
    bad = sorted({n for n, d in diffs if d > atol})
    evidence = {"max_abs_diff_vs_eager": worst, "lengths_off": bad}
    if isinstance(window, int) and all(n > window for n in bad) and any(n <= window for n, _ in diffs):
        return CheckResult("fail", metrics, f"per-example logits differ from eager's by {_fmt(worst)} only above the "
                           f"{window}-token sliding window (lengths {bad})", cause="sliding_window",
                           evidence={**evidence, "sliding_window": window})
    if within_numerics(worst, 0.0, wb.dtype):
        # within 10x float rounding of eager: kernel numerics, not another attention (a tolerance below rounding,
        # float32.logits_atol=1e-9, put llama / sdpa under "Do not pack" for 1.2e-07; trial 10, 64). Unlike the
        # parity probes no isolation result backs a wider margin here, so 10x the tolerance is not used.
        return CheckResult("fail", metrics, f"per-example logits differ from eager's by {_fmt(worst)} (lengths {bad}): "
                           "within kernel numerics, the same attention", cause="kernel_numerics",
                           evidence={**evidence, **numerics_evidence("logits_atol", worst, atol, wb.dtype)})
    return CheckResult("fail", metrics, f"per-example logits differ from eager's by {_fmt(worst)} (lengths {bad}): this "
                       "backend computes another attention than eager, packed or not", cause="cross_backend", evidence=evidence)


def key_number(metrics: dict[str, Any]) -> str | None:
    """The backend check's key number: attention calls on the requested backend / expected, and on a flash-family
    backend which kernel ran (results written before dense calls were counted: neither). None without counts."""
    if "calls" not in metrics:
        return None
    text = f"{sum(metrics['calls'].values())}/{metrics.get('expected_calls', '?')} calls"
    if "dense_kernel_calls" in metrics and (metrics.get("varlen_kernel_calls") or metrics["dense_kernel_calls"]):
        text += f", varlen {metrics.get('varlen_kernel_calls', 0)} / dense {metrics['dense_kernel_calls']}"
    if metrics.get("boundaries_missing"):  # the number the fail rests on beside the count (opt showed "2/2 calls" as
        text += f", boundaries missing in {metrics['boundaries_missing']}"  # a pass did; trial 12, 3)
    return text
