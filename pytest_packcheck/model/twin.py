"""The meta-device twin: the unshrunk config built at full size on the meta device (no memory, no compute), to
tell a failure of the config itself from one of packcheck's shrink."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .resolve import ResolvedModel, auto_model_class

T = TypeVar("T")

#: What torch raises where a module reads a tensor's value while it is built on the meta device (``.item()``):
#: Apertus's XIELU activation in transformers 4.56 .. 5.0.0 (``float(self.beta.detach().cpu().float().item())``,
#: activations.py:250 in 5.0.0; 5.1.0 reads the float it was given).
META_READ = "Cannot copy out of meta tensor"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in the block is moved to the meta device; buffers and plain tensors stay where torch
    makes them (the CPU). How transformers 4.x's ``from_pretrained`` builds a model (accelerate's
    ``init_empty_weights()``, buffers not included: ``get_init_context``, modeling_utils.py:4497 in 4.56.2), so a
    module that reads a buffer's value at build runs; the parameters take no memory (each is made on the CPU
    uninitialised, then moved)."""
    import torch

    register = torch.nn.Module.register_parameter

    def to_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        made = module._parameters[name]
        if made is not None and made.device.type != "meta":
            extra = {} if type(made) is torch.nn.Parameter else made.__dict__  # a subclass's own fields (accelerate's way)
            module._parameters[name] = type(made)(made.to("meta"), **{**extra, "requires_grad": made.requires_grad})

    torch.nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_on_meta(build: Callable[[], T]) -> T:
    """``build()`` on the meta device (no memory); where a module reads a tensor's value at build (torch's
    :data:`META_READ`), again with :func:`parameters_on_meta`, as transformers' own loader builds it: that failure is
    the meta device's, not the config's.

    Raises:
        Exception: whatever the build raises otherwise (the config's or the library's)."""
    import torch

    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError as exc:
        if META_READ not in str(exc):
            raise
    with parameters_on_meta():
        return build()


#: What torch's ``Module.__getattr__`` (and Python) say of an attribute an object does not have.
_NO_ATTRIBUTE = re.compile(r"^'(\w+)' object has no attribute '(\w+)'$")


def own_module_attribute_missing(exc: BaseException) -> str | None:
    """Where the library's model code reads an attribute of one of its own modules that the module does not have, or
    None: an ``AttributeError`` naming an ``nn.Module`` class of the module whose code is the deepest frame outside
    torch (speech_to_text_2 on 4.51 .. 4.57: ``_init_weights`` reads ``weight`` of its
    ``Speech2Text2SinusoidalPositionalEmbedding``, whose ``__init__`` no longer makes it; modeling_speech_to_text_2.py:402
    in 4.51.3). No config value gives a module an attribute its class never sets: the library's code, not its config.
    A None config value (``'NoneType' object has no attribute``) is no such module."""
    import os

    import torch

    if not isinstance(exc, AttributeError):
        return None
    said = _NO_ATTRIBUTE.match(str(exc))
    if said is None:
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    torch_dir = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")
    for tb in reversed(frames):
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if path.startswith(torch_dir):
            continue
        cls = tb.tb_frame.f_globals.get(said.group(1))
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == tb.tb_frame.f_globals.get("__name__"):
            return (f"its own code reads {said.group(2)} of its module {said.group(1)}, which has none, at "
                    f"{os.path.basename(path)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}")
        return None
    return None


def _build_unshrunk_on_meta(resolved: ResolvedModel, trust_remote_code: bool) -> tuple[Any, str | None]:
    """``resolved.config`` built unshrunk on the meta device (no memory, :func:`build_on_meta`): (model, None), or
    (None, its error)."""
    try:
        auto = auto_model_class(resolved)
        return build_on_meta(lambda: auto.from_config(copy.deepcopy(resolved.config), trust_remote_code=trust_remote_code)), None
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
