"""Building models: a resolved config -> (shrunk) model, in eval mode, on its device.

``--packcheck-weights=random`` shrinks the config with :func:`~.shrink.shrink_config` and builds random weights;
``pretrained`` loads the real weights with ``AutoModelForCausalLM.from_pretrained`` (or the multimodal auto class
of a model run on its text path).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from .build_errors import LibraryConfigError, OverrideConfigError, ShrinkError, WeightsError
from .multimodal import mrope_section_mismatch
from .resolve import ResolvedModel, auto_model_class, resolve_model
from .shrink import mechanism_gaps, shrink_config
from .tiny import TINY_SLIDING_WINDOW
from .twin import build_on_meta, own_module_attribute_missing, unshrunk_build_error

#: Random-weight models above this many parameters are refused (the shrink missed a size key).
MAX_RANDOM_PARAMS = 30_000_000


@contextlib.contextmanager
def reference_kernel_accepted(auto: Any, config: Any, attn_implementation: str) -> Any:
    """While a model is built on ``packcheck_flash_ref``, list it in the ``_compatible_flash_implementations`` of
    the model's classes that declare them. transformers 5.x swaps any flash-like name that is not listed for the
    first listed Hub kernel (GPT-OSS: ``kernels-community/vllm-flash-attn3``, ``modeling_utils.
    _check_and_adjust_attn_implementation``), which needs the ``kernels`` package and the Hub: GPT-OSS got no flash
    verdict on CPU. The reference kernel takes the sinks such kernels exist for (``s_aux``, see
    :func:`backends.varlen_reference_kernel`), so it is a compatible implementation. The torch varlen stand-in
    has no sinks and is not listed. Restored on exit."""
    import sys

    from ..backends import REFERENCE_BACKEND

    patched: list[tuple[type, Any]] = []
    if attn_implementation == REFERENCE_BACKEND:
        try:
            module = sys.modules.get(auto._model_mapping[type(config)].__module__)
        except Exception:  # noqa: BLE001 - remote code or an unmapped config: nothing declared to extend
            module = None
        for obj in list(vars(module).values()) if module else []:
            listed = vars(obj).get("_compatible_flash_implementations") if isinstance(obj, type) else None
            if isinstance(listed, list | tuple) and REFERENCE_BACKEND not in listed:
                patched.append((obj, listed))
                obj._compatible_flash_implementations = [*listed, REFERENCE_BACKEND]
    try:
        yield
    finally:
        for obj, listed in patched:
            obj._compatible_flash_implementations = listed


def _refuse_undeclared_flash(model: Any, backend: str) -> None:
    """packcheck's two flash-path stand-ins are registered through AttentionInterface, which transformers does not
    check against a model's declared support: a class with ``_supports_flash_attn = False`` (bloom, mpt, llama4's
    chunked attention, the BERT-style decoders: 22 causal LMs of 5.24) was built anyway and crashed on the 2-D
    flash mask. transformers refuses ``flash_attention_2`` for them; packcheck refuses its stand-ins the same way.

    Raises:
        ValueError: "... does not support flash attention ..." (the runner files it as unsupported).
    """
    from ..backends import PACKCHECK_REGISTERED

    if backend not in PACKCHECK_REGISTERED:
        return
    cls = type(model)
    declared = getattr(cls, "_supports_flash_attn", getattr(cls, "_supports_flash_attn_2", None))  # 2 before 4.48
    if declared is False:
        raise ValueError(f"{cls.__name__} does not support flash attention (it declares _supports_flash_attn = False, "
                         f"so transformers refuses flash_attention_2 for it): {backend}, packcheck's stand-in for the "
                         "flash path, is refused the same way")


def _without_overrides_builds(resolved: ResolvedModel, trust_remote_code: bool) -> bool:
    """Whether the spec has overrides and its config without them builds at full size (on the meta device): then
    a config that does not build is the overrides' doing, not the library's."""
    import dataclasses

    spec = resolved.spec
    if not spec.overrides:
        return False
    plain = dataclasses.replace(spec, raw=spec.raw.split("{", 1)[0], overrides=())
    try:
        bare = resolve_model(plain, "the spec without its overrides", trust_remote_code)
    except Exception:  # noqa: BLE001 - the default does not resolve either: not the overrides' alone
        return False
    return bare.config is not None and unshrunk_build_error(bare, trust_remote_code) is None


def _override_hint(resolved: ResolvedModel) -> str:
    spec = resolved.spec.raw.split("{", 1)[0]
    return f"'{spec}{{key=value}}' or --packcheck-config key=value"


def weight_counts(model: Any, info: dict[str, Any]) -> dict[str, int]:
    """Tensors of the model's state dict that ``from_pretrained`` loaded, left missing (randomly initialised)
    or found unexpected in the file, from its ``output_loading_info``."""
    missing = set(info.get("missing_keys") or [])
    total = len(model.state_dict())
    return {"loaded": max(0, total - len(missing)), "missing": len(missing),
            "unexpected": len(set(info.get("unexpected_keys") or [])),
            "mismatched": len(info.get("mismatched_keys") or [])}


def dtype_kwarg(torch_dtype: Any) -> dict[str, Any]:
    """``dtype=`` for ``from_pretrained`` / ``from_config`` from transformers 4.56 on, ``torch_dtype=`` before
    (4.56 renamed it and deprecated the old name)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype": torch_dtype}


def decoder_flag_needed(model: Any) -> bool:
    """Whether ``model`` (a causal-LM head) is an encoder family's that attends both ways unless its config says
    ``is_decoder=True`` (BertLMHeadModel, RobertaForCausalLM, ... warn "add `is_decoder=True`" in their
    ``__init__``): the flag is False and the class's own ``__init__`` reads it. Such a tiny model was judged
    non_causal and its planted leak, spread both ways, stayed under leak_min (bert on packcheck_flash_ref:
    7.29e-04, probe_inconclusive)."""
    import inspect

    if getattr(model.config, "is_decoder", None) is not False:
        return False
    try:
        return "is_decoder" in inspect.getsource(type(model).__init__)
    except (OSError, TypeError):  # no source to read: the flag is left as the config has it
        return False


#: The last :func:`_shrunk` answer: (key, the resolved config it was made from, a copy of it as it was, the shrunk
#: config, its parameter count, the notes the shrink wrote). One entry: a model's cell groups (one per backend) are
#: built one after another.
_LAST_SHRUNK: list[tuple[Any, Any, Any, Any, int, list[str]]] = []


def _shrunk(resolved: ResolvedModel, auto: Any, trust_remote_code: bool, sliding_window: int,
            notes: list[str]) -> tuple[Any, int]:
    """``resolved.config`` shrunk (:func:`~.shrink.shrink_config`) and counted on the meta device, with
    ``is_decoder=True`` where :func:`decoder_flag_needed` says so; the notes of both are appended to ``notes``.
    Returns (a config of its own for the build, its parameter count).

    The same model on its next backend takes the answer of the one before (issue 47: the shrink and the meta
    build were a quarter of the audit's model builds, the same work for eager and sdpa): the shrink and the count
    read the config alone, never the backend. Reused only for the same resolved model, auto class, flags and shrink /
    meta-build functions, while ``resolved.config`` still equals (``PretrainedConfig.__eq__``: every attribute) the
    copy taken when it was made; the config handed out is a fresh deep copy each time (``_from_config`` keeps the
    object it is given).

    Raises:
        Exception: whatever the shrink or the meta build raises (nothing is kept then).
    """
    key = (id(resolved), resolved.model_kind, auto, trust_remote_code, sliding_window, shrink_config, build_on_meta)
    if _LAST_SHRUNK:
        last_key, config_of, as_was, shrunk, n_params, made_notes = _LAST_SHRUNK[0]
        try:
            same = last_key == key and config_of is resolved.config and bool(as_was == resolved.config)
        except Exception:  # noqa: BLE001 - a config whose values do not compare: made again
            same = False
        if same:
            notes.extend(made_notes)
            return copy.deepcopy(shrunk), n_params
    _LAST_SHRUNK.clear()
    before = len(notes)
    config = shrink_config(copy.deepcopy(resolved.config), keep_auto_map=trust_remote_code, notes=notes,
                           sliding_window=sliding_window)
    # Count parameters on the meta device first: a config whose size keys the shrink does not know
    # would otherwise allocate a full-size model (an OOM kill on a 24 GB machine, seen with llama4).
    probe = build_on_meta(lambda: auto.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code))
    n_params = sum(p.numel() for p in probe.parameters())
    if resolved.model_kind != "encoder" and decoder_flag_needed(probe):
        config.is_decoder = True
        notes.append("is_decoder=True (the causal-LM head of an encoder family: without it the model attends "
                     "both ways, as transformers warns)")
    _LAST_SHRUNK.append((key, resolved.config, copy.deepcopy(resolved.config), copy.deepcopy(config), n_params,
                         notes[before:]))
    return config, n_params


def build_model(
    resolved: ResolvedModel,
    attn_implementation: str,
    dtype: str,
    weights: str = "random",
    device: str = "cpu",
    seed: int = 0,
    trust_remote_code: bool = False,
    shrink: bool = True,
    sliding_window: int | None = None,
) -> Any:
    """Build the model for one cell group, in eval mode, on ``device``.

    The config is deep-copied for every model: ``_from_config`` stores the object it gets, so a second model
    built from the same config would switch the first one's attention backend (transformers 5.24,
    ``PreTrainedModel._from_config`` keeps the config object it is given).
    """
    import torch

    auto = auto_model_class(resolved)  # AutoModelForCausalLM, or a multimodal model's auto class
    torch_dtype = getattr(torch, dtype)
    from ..backends import backend_build, prepare_backend_model

    backend = attn_implementation  # the cell's backend; what transformers is asked for comes from backend_build
    if weights == "pretrained" and resolved.spec.kind != "arch":
        try:
            with backend_build(backend, resolved.config) as attn:
                model, info = auto.from_pretrained(
                    resolved.spec.name,
                    revision=resolved.spec.revision,
                    attn_implementation=attn,
                    trust_remote_code=trust_remote_code,
                    output_loading_info=True,
                    **dtype_kwarg(torch_dtype),
                )
        except Exception as exc:
            unreadable = unreadable_weights(exc)
            if unreadable is None:
                raise
            # a corrupt or truncated weights file is the checkpoint's, not the library's to fix (issue 42: it was
            # "report it upstream")
            raise WeightsError(f"--packcheck-weights=pretrained: the weights of '{resolved.spec.raw}' cannot be read "
                               f"({unreadable}): re-download or replace the weights file, or run "
                               "--packcheck-weights=random", cause="weights_unreadable") from None
        model.packcheck_weights = weight_counts(model, info)
        if model.packcheck_weights["loaded"] == 0:
            where = (f"the weights files in the model folder {resolved.spec.name}" if resolved.spec.kind == "local"
                     else f"the weights of '{resolved.spec.raw}'")
            raise WeightsError(
                f"--packcheck-weights=pretrained: {where} match no tensor of {type(model).__name__}, the model its "
                f"config.json builds ({model.packcheck_weights['missing']} missing, "
                f"{model.packcheck_weights['unexpected']} unexpected): they are another model's checkpoint, and the model "
                "would run on random weights. Put this model's own weights there, or run --packcheck-weights=random")
    elif not shrink:  # full size, random weights (packcheck bench on a real config)
        torch.manual_seed(seed)
        # initialised on the device: a 1.2B model's random init takes 20 s on 2 CPU cores, well under 1 s on a GPU
        with torch.device(device), backend_build(backend, resolved.config) as attn:
            model = auto.from_config(
                copy.deepcopy(resolved.config), attn_implementation=attn, trust_remote_code=trust_remote_code,
                **dtype_kwarg(torch_dtype),
            )
    else:
        notes: list[str] = []
        mismatch = mrope_section_mismatch(resolved.config) if resolved.text_path else None
        if mismatch:  # the text model's rotary fails at full size too: the config's, not the shrink's
            spec = resolved.spec.raw.split("{", 1)[0]
            fixes = " or ".join(f"'{spec}{{{fix}}}'" for fix in mismatch[1].split(" or "))
            raise LibraryConfigError(
                f"{resolved.model_type}: the {'default ' if resolved.spec.kind == 'arch' else ''}config does not run in "
                f"transformers itself, at full size either ({mismatch[0]}); not packcheck's shrink: give the value its "
                f"checkpoints have, {fixes}, or use a checkpoint's config")
        try:
            config, n_params = _shrunk(resolved, auto, trust_remote_code, sliding_window or TINY_SLIDING_WINDOW, notes)
        except ImportError:
            raise  # a missing optional package (PIL for gemma3n's vision tower): skipped with its reason
        except Exception as exc:
            own = unshrunk_build_error(resolved, trust_remote_code)
            if own is not None and _without_overrides_builds(resolved, trust_remote_code):  # the user's override broke it
                from .specs import format_overrides

                raise OverrideConfigError(
                    f"{resolved.model_type}: the config with your overrides {format_overrides(resolved.spec.overrides)} "
                    f"does not build in transformers ({own}), while the config without them does: fix the override"
                ) from exc
            if own is not None and own.split(":", 1)[0] in ("ImportError", "ModuleNotFoundError"):
                # the full-size build names the optional package the model needs (gemma3n on 4.53 .. 4.56: its
                # TimmWrapperModel needs pillow and timm): a skip naming them, as the shrunk build's own ImportError
                import re

                said = own.split(":", 1)[1].strip()
                packages = ", ".join(dict.fromkeys(re.findall(r"pip install ([A-Za-z0-9_.\-]+)", said))) or "an optional package"
                raise ImportError(f"{resolved.model_type} needs {packages} (not installed): {said}") from exc
            code = own_module_attribute_missing(exc) if own == f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}" else None
            if code is not None:  # the library's model code fails at any size, whatever its config: not a config to fix
                raise LibraryConfigError(
                    f"{resolved.model_type}: the model's own code crashed at build ({own}), at full size too: {code}; "
                    "the library's code, not its config nor packcheck's shrink; report it upstream or use another "
                    "transformers release", cause="crash") from exc
            if own is not None:  # the config does not build at full size either: the library's, not the shrink's
                raise LibraryConfigError(
                    f"{resolved.model_type}: the {'default ' if resolved.spec.kind == 'arch' else ''}config does not "
                    f"build in transformers itself, at full size either ({own}); not packcheck's shrink: give the "
                    f"values it lacks as {_override_hint(resolved)}, or a checkpoint's config") from exc
            raise ShrinkError(f"packcheck's shrunk {resolved.model_type} config does not build: {type(exc).__name__}: {exc}") from exc
        from .batches import DEFAULT_LENGTHS

        notes += mechanism_gaps(config, DEFAULT_LENGTHS)
        resolved.notes = [*resolved.notes, *(n for n in notes if n not in resolved.notes)]
        if n_params > MAX_RANDOM_PARAMS:
            raise ShrinkError(
                f"packcheck's shrink left {resolved.model_type} at {n_params / 1e6:.0f}M parameters (limit "
                f"{MAX_RANDOM_PARAMS / 1e6:.0f}M): its config has size keys the shrink does not know"
            )
        torch.manual_seed(seed)
        with backend_build(backend, config) as attn, reference_kernel_accepted(auto, config, attn):
            model = auto.from_config(
                config, attn_implementation=attn, trust_remote_code=trust_remote_code, **dtype_kwarg(torch_dtype)
            )
    _refuse_undeclared_flash(model, backend)
    model = prepare_backend_model(model, backend)
    language = getattr(model.config, "languages", None)
    if hasattr(model, "set_default_language") and getattr(model.config, "default_language", None) is None and language:
        # X-MOD routes every token through a per-language adapter and refuses to run without one
        model.set_default_language(language[0])
        if shrink and weights != "pretrained":
            note = f"default_language={language[0]!r} (the model refuses input without a language)"
            resolved.notes = [*resolved.notes, note] if note not in resolved.notes else resolved.notes
    for module in model.modules():  # pretrained configs keep their dropout; checks need determinism
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device).eval()


#: What torch / safetensors / transformers raise on a weights file that is corrupt, truncated or not a checkpoint.
_UNREADABLE = ("deserializing header", "header too large", "invalid load key", "pytorchstreamreader failed",
               "unexpected eof", "failed finding central directory", "is not a zip file", "incomplete metadata",
               "invalid header", "unable to load weights from pytorch checkpoint", "safetensorerror")


def unreadable_weights(exc: BaseException) -> str | None:
    """One line for an exception that says the weights file itself cannot be read (a corrupt or truncated safetensors
    or torch file), else None. Read from the exception chain's types and messages."""
    seen = exc
    while seen is not None:
        text = f"{type(seen).__name__}: {' '.join(str(seen).split())}"
        if any(marker in text.lower() for marker in _UNREADABLE) or type(seen).__name__ in ("SafetensorError", "UnpicklingError"):
            return text[:200]
        seen = seen.__cause__ or seen.__context__
    return None
