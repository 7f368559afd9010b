"""The meta-device twin: the unshrunk config built at full size on the meta device (no memory, no compute), to
tell a failure of the config itself from one of packcheck's shrink."""

from __future__ import annotations

import copy
from typing import Any

from .resolve import ResolvedModel, auto_model_class


def _build_unshrunk_on_meta(resolved: ResolvedModel, trust_remote_code: bool) -> tuple[Any, str | None]:
    """``resolved.config`` built unshrunk on the meta device (no memory): (model, None), or (None, its error)."""
    import torch

    try:
        with torch.device("meta"):
            return auto_model_class(resolved).from_config(copy.deepcopy(resolved.config), trust_remote_code=trust_remote_code), None
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"


def unshrunk_build_error(resolved: ResolvedModel, trust_remote_code: bool) -> str | None:
    """The error of building ``resolved.config`` unshrunk, on the meta device (no memory), or None if it builds."""
    return _build_unshrunk_on_meta(resolved, trust_remote_code)[1]


def normalised_error(error: str) -> str:
    """An error message with its numbers blanked: a crash at full size names other sizes than the tiny one."""
    import re

    return re.sub(r"\d+", "N", error)


def unshrunk_forward_reproduces(resolved: ResolvedModel, exc: BaseException, trust_remote_code: bool = False) -> str | None:
    """Why ``exc`` (raised by the tiny model packcheck built) is the config's own fault, or None.

    The unshrunk config is built at full size on the meta device (no memory, no compute) and called on a
    packed row of 31 meta tokens (position_ids restarting at 0, 11, 18; use_cache=False):
    - it does not build at all (dbrx's default: ``DbrxAttentionConfig`` without ``rope_theta``, which the shrink
      had to fill in): "the unshrunk config does not build (...)";
    - its forward raises the same exception type with the same message up to its numbers (dbrx's default
      ``clip_qkv=None`` reaching ``torch.clamp``): "the unshrunk config raises it too";
    - where the forward takes ``labels``, a second call with ``labels=input_ids`` and no position_ids (meta tensors
      cannot be read, so the packed position_ids stop most masks on meta before any loss) raises it: git's loss
      slices its logits from the image tokens on, ``logits[:, 197:-1]``, empty on a text-only row ("Expected input
      batch_size (0) to match target batch_size (30)"): "the unshrunk config raises it too (with labels)".
    Anything else (the meta run passes, or fails otherwise: a meta tensor cannot be read) -> None: the shrink
    stays suspect."""
    import torch

    if resolved.config is None:
        return None
    model, build_error = _build_unshrunk_on_meta(resolved, trust_remote_code)
    if build_error is not None:  # a default config that does not build is the library's
        return f"the unshrunk config does not build ({build_error[:160]})"
    import inspect

    with torch.device("meta"):
        ids = torch.zeros(1, 31, dtype=torch.long)
        pos = torch.cat([torch.arange(11), torch.arange(7), torch.arange(13)])[None]
        calls = [({"position_ids": pos}, "")]
        try:
            takes_labels = "labels" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # no signature to read: no labelled call
            takes_labels = False
        if takes_labels:  # the loss path (git's loss slices off image tokens a text-only row lacks)
            calls.append(({"labels": ids}, " (with labels)"))
        for kwargs, how in calls:
            try:
                model(input_ids=ids, use_cache=False, **kwargs)
            except Exception as full:  # noqa: BLE001 - any failure is compared with the tiny model's
                if type(full) is type(exc) and normalised_error(str(full)) == normalised_error(str(exc)):
                    return f"the unshrunk config raises it too{how}"
    return None
