"""Availability: whether a backend can run here, with the reason a skipped cell shows, read from its record's
needs (:class:`.table.Need`); for a name outside the table, transformers' own answer.
Heavy imports happen inside functions.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

from .registration import reference_backend_supported, reference_mode
from .table import BY_NAME, Need, stand_in_active


@dataclass(frozen=True)
class BackendAvailability:
    """Whether a backend can run here, whether it has a backward pass, and why not."""

    name: str
    available: bool
    reason: str = ""
    backward: bool = True
    backward_reason: str = ""
    #: verdict of its cells when not available: "skipped" (this machine lacks something) or "unsupported"
    #: (the installed transformers cannot express it)
    status: str = "skipped"


def backend_availability(name: str, device: str = "cpu") -> BackendAvailability:
    """Tell whether ``name`` can run on ``device`` with the installed libraries: each of its record's
    :attr:`~.table.Backend.needs`, in order, and its backward pass (:attr:`~.table.Backend.backward_on_cpu`).

    E.g. flash_attention_2 needs CUDA and the ``flash_attn`` package; flash_attention_3 a Hopper GPU (compute
    capability 9.x) and ``flash_attn_interface`` from the flash-attn-3 distribution (as transformers'
    ``is_flash_attn_3_available`` looks for it); flex_attention has no backward on CPU (torch raises
    NotImplementedError, measured on torch 2.13.0+cpu). A name outside the table runs when transformers takes it,
    else is skipped with transformers' reason.
    """
    backend = BY_NAME.get(name)
    if backend is None:  # any other name transformers takes: run it, or skip with transformers' reason
        refusal = attn_implementation_refusal(name)
        if refusal is not None:
            return BackendAvailability(name, False, f"is refused by transformers here: {refusal[1]}", status="skipped")
        return BackendAvailability(name, True)
    missing = [why for need in backend.needs if (why := _missing(need, device))]
    if backend.unavailable == "unsupported":  # transformers cannot express it: its own words, not "needs ..."
        return BackendAvailability(name, not missing, "; ".join(missing), status="unsupported")
    if missing:
        return BackendAvailability(name, False, "needs " + " and ".join(missing))
    if not backend.backward_on_cpu and not device.startswith("cuda"):
        return BackendAvailability(name, True, backward=False,
                                   backward_reason=f"{name} has no backward pass on CPU (forward-only)")
    return BackendAvailability(name, True)


def _missing(need: Need, device: str) -> str:
    """What ``need`` lacks on ``device``, in the skip reason's words; "" when it is met."""
    cuda = device.startswith("cuda")
    if need.kind == "cuda":
        return "" if cuda or (need.stand_in and stand_in_active()) else f"a CUDA device (running on {device}){need.words}"
    if need.kind == "gpu":  # only asked of a CUDA device (no device: the "cuda" need says so)
        if not cuda:
            return ""
        major, minor = cuda_capability(device)
        low, high = need.majors[0], need.majors[-1]
        return "" if major >= low and (high is None or major <= high) else need.words.format(major, minor)
    if need.kind == "package":
        if importlib.util.find_spec(need.module) is None:
            return f"{need.words} ({need.module} not importable)"
        if need.distribution and not _distributed_as(need.module, need.distribution):
            return f"{need.words} ({need.module} is installed by another distribution)"
        return ""
    if need.kind == "module":
        return "" if importlib.util.find_spec(need.module) is not None else need.words
    ok, why = reference_backend_supported()
    if need.kind == "flash_path" or not ok:
        return why
    if need.kind == "kernel_loader":
        return "" if reference_mode() == "loader" else (
            f"transformers >= 4.55.1 (its flash kernel loader; {_transformers_version()} keeps flash-attn's "
            "functions as module globals, which packcheck routes to its CPU reference only)")
    raise ValueError(f"backend table: unknown need kind {need.kind!r}")


#: The start of transformers' refusal of a name it does not know at all (5.x ``get_correct_attn_implementation``)
_UNKNOWN_ATTN = "is not supported. The only possible arguments are"


@functools.cache
def attn_implementation_refusal(name: str) -> tuple[str, str] | None:
    """How the installed transformers takes ``attn_implementation=name`` (a registry name, a kernel-hub repo,
    ``paged|sdpa``): None when a tiny llama builds with it (on the meta device, no memory); ("unknown", its
    message) when transformers does not know the name (a typo: a usage error); ("refused", its message) when it
    knows the name but cannot load it here (``kernels`` not installed, flash-attn missing): cells are skipped with
    that reason."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, attn_implementation=name)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal is the answer
        text = " ".join(str(exc).split())
        return ("unknown" if _UNKNOWN_ATTN in text else "refused", f"{type(exc).__name__}: {text[:300]}")
    return None


def _distributed_as(module: str, distribution: str) -> bool:
    from importlib.metadata import packages_distributions

    return distribution in {d.replace("_", "-").lower() for d in packages_distributions().get(module, [])}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def cuda_capability(device: str) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of ``device`` (e.g. ``(9, 0)`` on H100 / H200)."""
    import torch

    return torch.cuda.get_device_capability(torch.device(device))
