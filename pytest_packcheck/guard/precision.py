"""Which tolerance row judges a run: the dtype the forward really computes in (:class:`_ComputeProbe`: autocast,
bf16 / fp16 weights, the LM head's output) and the rows of ``audit/tolerances.toml`` with the user's overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"

_REDUCED = ("bfloat16", "float16")


class _ComputeProbe:
    """How the forward really computes, read inside it: the autocast state where the first submodule runs (any
    wrapper's autocast: accelerate's mixed-precision wrapper of ``model.forward``, ``Trainer(bf16=True)``,
    ``torch.autocast`` around the call), the LM head's output dtype (its forward hook never fires under TRL's
    fused LM head, trl 1.16 ``add_fused_lm_head``: the head's weight is used in a chunked matmul), the weights'."""

    def __init__(self, model: Any, device_type: str) -> None:
        self.device_type = device_type
        self.autocast: Any = None
        self.seen_autocast = False
        self.head: Any = None
        self.handles: list[Any] = []
        params = [p for p in model.parameters() if p.is_floating_point()]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        self.weights = _dtype_name(weight.dtype if weight is not None else params[0].dtype if params else "float32")
        first = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if first is None:
            first = next((m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))), None)
        if first is not None:
            self.handles.append(first.register_forward_pre_hook(self._pre))
        if head is not None:
            self.handles.append(head.register_forward_hook(self._post))

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if not self.seen_autocast:
            self.seen_autocast = True
            on = torch.is_autocast_enabled(self.device_type)
            self.autocast = _dtype_name(torch.get_autocast_dtype(self.device_type)) if on else None

    def _post(self, module: Any, args: Any, out: Any) -> None:
        if self.head is None and hasattr(out, "dtype"):
            self.head = _dtype_name(out.dtype)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def decide(self, fused: bool) -> tuple[str, str]:
        """(tolerance row, what it was read from): the first reduced precision among autocast, the weights and the
        LM head's output, else float32."""
        if self.autocast in _REDUCED:
            return self.autocast, f"autocast {self.autocast} over {self.weights} weights"
        if self.weights in _REDUCED:
            return self.weights, f"{self.weights} weights"
        if self.head in _REDUCED:
            return self.head, f"{self.weights} weights, LM head output {self.head}"
        fused_note = ", TRL's fused LM head" if fused else ""
        return "float32", f"float32 weights, no autocast{fused_note}"


def _tolerances(tolerances: Any, caller: str = "verify_packed_batch") -> dict[str, dict[str, float]]:
    """The tolerance rows: ``audit/tolerances.toml``, each row given in ``tolerances`` replacing its dtype's.
    ``caller``: the public name the error lines start with (``verify_packed_batch``, ``PackcheckCallback``).

    Raises:
        PackcheckUsageError: ``tolerances`` is not ``{dtype: {"logits_atol": x, "loss_atol": y}}`` with a known
            dtype, both keys, and each value a finite number >= 0 (a string, a negative or NaN value is named).
    """
    from numbers import Real

    from ..config.tolerances import tolerance_problem
    from ..errors import PackcheckUsageError

    def refuse(message: str) -> PackcheckUsageError:
        return PackcheckUsageError(f"{caller}: {message}")

    defaults = _default_tolerances()
    out = {k: dict(v) for k, v in defaults.items()}
    if tolerances is None:
        return out
    shape = "{'float32': {'logits_atol': 1e-4, 'loss_atol': 1e-5}, ...}"
    if not isinstance(tolerances, Mapping):
        raise refuse(f"tolerances is a {type(tolerances).__name__} ({tolerances!r:.60}): expected a dict of dtype rows, {shape}.")
    for dtype, row in tolerances.items():
        if dtype not in defaults:
            raise refuse(f"tolerances has an unknown dtype row {dtype!r}: expected {', '.join(map(repr, defaults))}, as {shape}.")
        if not isinstance(row, Mapping):
            raise refuse(f"tolerances[{dtype!r}] is a {type(row).__name__} ({row!r:.60}): expected a dict like "
                         "{'logits_atol': 1e-4, 'loss_atol': 1e-5}.")
        missing = [k for k in ("logits_atol", "loss_atol") if k not in row]
        if missing:
            raise refuse(f"tolerances[{dtype!r}] has no {' or '.join(map(repr, missing))} (given: {', '.join(map(repr, row)) or 'none'}): "
                         "give both logits_atol and loss_atol for each dtype row you set.")
        for key, value in row.items():
            if key not in defaults[dtype]:
                raise refuse(f"tolerances[{dtype!r}] has an unknown key {key!r}: expected {', '.join(map(repr, defaults[dtype]))}.")
            problem = tolerance_problem(key, float(value) if isinstance(value, Real) and not isinstance(value, bool) else value)
            if problem:
                raise refuse(f"tolerances[{dtype!r}][{key!r}] = {value!r}: a tolerance {problem.replace('must be', 'is')} "
                             f"(nats for the atols), e.g. {defaults[dtype][key]!r}.")
        out[dtype] = {**defaults[dtype], **{k: float(v) for k, v in row.items()}}
    return out


def _default_tolerances() -> dict[str, dict[str, float]]:
    """audit/tolerances.toml, read once per process (:func:`config.tolerances.default_tolerances`)."""
    from ..config.tolerances import default_tolerances

    return default_tolerances()


def _pick(tols: dict[str, dict[str, float]], dtype: str) -> dict[str, float]:
    table = tols.get(dtype) or tols["float32"]
    return {"logits_atol": table["logits_atol"], "loss_atol": table["loss_atol"]}
