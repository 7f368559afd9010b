"""Call counting: which backend each attention call of a forward ran on, and whether the packed boundaries reached
it (mask, cu_seq_lens or the varlen kernel's cu_seqlens inspected). :func:`count_attention_calls` installs one
counter per way of counting the backend table names (:attr:`.table.Backend.counted_by`); each counter below
patches one place transformers dispatches through and puts it back on exit. Heavy imports happen inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .contract import varlen_argument_contract
from .legacy import _MFU_LATE, FLASH_ATTN_STAND_INS
from .registration import PACKCHECK_BACKEND_ATTR
from .table import BACKENDS, counting_methods, counts_boundaries_by_cu_seqlens


@dataclass
class AttentionCall:
    """One call of an attention function, as seen by :class:`AttentionProbe`."""

    backend: str
    isolated: bool | None  # did the boundaries of the packed examples reach this call? None: not decidable


@dataclass
class AttentionProbe:
    """Counts attention calls per backend during a forward and checks that packed boundaries reached them.

    ``segments``: lengths (tokens) of the examples packed into row 0, used to decide isolation from the mask,
    the varlen cu_seqlens or the flex BlockMask that each call receives.
    """

    segments: list[int] | None = None
    calls: list[AttentionCall] = field(default_factory=list)
    #: calls of the varlen flash kernel (flash_attn_varlen_func or its stand-in) and of the dense one
    #: (flash_attn_func: the whole row as one sequence), as transformers dispatched them
    varlen_calls: int = 0
    dense_flash_calls: int = 0
    varlen_boundaries: list[list[int]] = field(default_factory=list)
    #: :func:`varlen_argument_contract` of each varlen kernel call (recorded when ``segments`` is given)
    varlen_arguments: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    _inside: int = 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.backend] = out.get(c.backend, 0) + 1
        return out

    # Pairs (query index, key index) that cross a boundary in row 0: the first token of each later example
    # against the last token of the example before it.
    def _cross_pairs(self) -> list[tuple[int, int]]:
        if not self.segments or len(self.segments) < 2:
            return []
        pairs, start = [], 0
        for length in self.segments[:-1]:
            start += length
            pairs.append((start, start - 1))
        return pairs

    def isolation_from_mask(self, mask: Any) -> bool | None:
        import torch

        pairs = self._cross_pairs()
        if not pairs:
            return None
        if mask is None:
            return False
        if type(mask).__name__ == "BlockMask":
            mod = getattr(mask, "mask_mod", None)
            if mod is None:
                return None
            z = torch.zeros((), dtype=torch.int64)
            for qi, ki in pairs:
                allowed = mod(z, z, torch.tensor(qi), torch.tensor(ki))
                if bool(allowed):
                    return False
            return True
        if isinstance(mask, torch.Tensor):
            m = mask
            while m.ndim > 2:
                m = m[0]
            for qi, ki in pairs:
                if qi >= m.shape[-2] or ki >= m.shape[-1]:
                    return None
                val = m[qi, ki]
                allowed = bool(val) if m.dtype == torch.bool else bool(val > torch.finfo(m.dtype).min / 2)
                if allowed:
                    return False
            return True
        return None

    def isolation_from_cu_seqlens(self, cu: Any) -> bool | None:
        if not self.segments or len(self.segments) < 2:
            return None
        bounds = set(cu.tolist())
        start = 0
        for length in self.segments[:-1]:
            start += length
            if start not in bounds:
                return False
        return True


@contextlib.contextmanager
def count_attention_calls(model: Any, segments: list[int] | None = None) -> Iterator[AttentionProbe]:
    """Count attention calls (per backend) while the block runs.

    Installs every counter the backend table names (:data:`COUNTERS`): every function in transformers'
    ``ALL_ATTENTION_FUNCTIONS``, the ``eager_attention_forward`` of the model's own modeling module, torch's SDPA
    called directly, and the flash kernels transformers' ``_flash_attention_forward`` dispatches to (varlen and
    dense, from ``lazy_import_flash_attention`` on 4.55.1+, the module's ``flash_attn_func`` /
    ``flash_attn_varlen_func`` before), restoring them on exit (also when installing one fails half-way). The
    model must be called inside the block. Adds two Python calls per attention layer; no tensor work except the
    isolation probe on a handful of mask entries.
    """
    probe = AttentionProbe(segments=segments)
    # the reference on 4.44 .. 4.55.0 runs under transformers' flash_attention_2 name: its calls are counted as the
    # backend the model was built for
    marked = getattr(model, PACKCHECK_BACKEND_ATTR, None)
    with contextlib.ExitStack() as restore:
        counting = _Counting(probe, model, {"flash_attention_2": marked} if marked else {}, restore)
        for method in counting_methods():
            COUNTERS[method](counting, tuple(b.name for b in BACKENDS if method in b.counted_by))
        yield probe


@dataclass
class _Counting:
    """What the counters of one :func:`count_attention_calls` block share: the probe they record into, the model,
    the names calls are counted under instead of transformers' (``alias``), and the stack of restorations."""

    probe: AttentionProbe
    model: Any
    alias: dict[str, str]
    restore: contextlib.ExitStack
    #: one wrapper per flash kernel (by id), not one per call
    kernels: dict[int, Callable] = field(default_factory=dict)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until the block ends (put back as it was: set, or absent)."""
        had, old = name in vars(owner), vars(owner).get(name)
        self.restore.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))
        setattr(owner, name, value)

    def model_modules(self) -> list[Any]:
        """The loaded modules that define the model's classes (its modeling module and its parents')."""
        return [sys.modules.get(name) for name in {type(m).__module__ for m in self.model.modules()}]


def counted_call(probe: AttentionProbe, backend: str, fn: Callable) -> Callable:
    """``fn`` (an attention function: ``(module, query, key, value, attention_mask, ...)``) recording one
    :class:`AttentionCall` on ``backend`` per call: boundaries from the mask, or from cu_seq_lens for the flash
    family (then completed by the varlen kernel's counter)."""
    def counted(module, query, key, value, attention_mask, *args, **kwargs):
        if counts_boundaries_by_cu_seqlens(backend):
            isolated = None  # decided by the varlen kernel hook (or by cu_seq_lens kwargs)
            cu = kwargs.get("cu_seq_lens_q")
            if cu is not None:
                isolated = probe.isolation_from_cu_seqlens(cu)
        else:
            isolated = probe.isolation_from_mask(attention_mask)
        probe.calls.append(AttentionCall(backend, isolated))
        probe._inside += 1
        try:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            probe._inside -= 1

    counted.__wrapped__ = fn  # type: ignore[attr-defined]
    return counted


def count_attention_interface(counting: _Counting, names: tuple[str, ...]) -> None:
    """Every function of transformers' ``ALL_ATTENTION_FUNCTIONS`` (every backend it dispatches by name, ``paged|``
    variants counted as their backend)."""
    try:  # 4.48 - 4.50: a plain dict; 4.51+: an AttentionInterface; before 4.48 none (attention classes per backend)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        ALL_ATTENTION_FUNCTIONS = {}

    mapping = getattr(ALL_ATTENTION_FUNCTIONS, "_global_mapping", ALL_ATTENTION_FUNCTIONS)
    saved = dict(mapping)

    def put_back() -> None:
        mapping.clear()
        mapping.update(saved)

    counting.restore.callback(put_back)
    for name, fn in saved.items():
        mapping[name] = counted_call(counting.probe, counting.alias.get(name, name.removeprefix("paged|")), fn)


def count_model_eager_forward(counting: _Counting, names: tuple[str, ...]) -> None:
    """The ``eager_attention_forward`` of the model's own modeling modules (models that call it directly)."""
    for module in counting.model_modules():
        fn = getattr(module, "eager_attention_forward", None)
        if callable(fn):
            counting.patch(module, "eager_attention_forward", counted_call(counting.probe, names[0], fn))


def count_torch_sdpa(counting: _Counting, names: tuple[str, ...]) -> None:
    """Models outside the AttentionInterface (falcon's legacy path in 5.24) call torch's SDPA directly: count those
    calls as "<backend> (direct torch call)", but not the ones made from inside a counted interface function."""
    import torch.nn.functional as F

    probe, label = counting.probe, f"{names[0]} (direct torch call)"
    original_sdpa = F.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        if not probe._inside:
            probe.calls.append(AttentionCall(label, probe.isolation_from_mask(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))))
        return original_sdpa(*args, **kwargs)

    counting.patch(F, "scaled_dot_product_attention", counted_sdpa)


def count_flash_kernels(counting: _Counting, names: tuple[str, ...]) -> None:
    """The flash kernels, at the point transformers dispatches to them (every flash-family backend: flash-attn
    2/3/4, hub kernels, packcheck's two): count varlen and dense calls and record the boundaries the varlen kernel
    really received. Boundaries are read (a device-to-host copy of cu_seqlens) only when the probe has segments
    to check them against: counting alone (packcheck bench's instrumentation) adds no synchronisation.

    4.55.1+: ``_flash_attention_forward`` asks ``lazy_import_flash_attention`` for the kernels on every call, so
    the loader is wrapped. Before, the flash-attn functions are module globals of
    ``modeling_flash_attention_utils`` (4.54 - 4.55.0: cached in ``_flash_fn`` / ``_flash_varlen_fn`` after the
    first call); packcheck's reference binds them at each forward from :data:`.legacy.FLASH_ATTN_STAND_INS`, and a
    model module that imports ``_flash_attention_forward`` only with flash-attn installed gets it bound from
    ``_MFU_LATE``: all of those are wrapped, and each model module's own ``_flash_attention_forward`` (its
    FlashAttention2 class calls it; before 4.48 there is no AttentionInterface) counts as one attention call.
    """
    import transformers.modeling_flash_attention_utils as mfu

    count_varlen, count_dense = _kernel_counters(counting)
    loader = getattr(mfu, "lazy_import_flash_attention", None)
    if loader is not None:
        def counted_loader(*args, **kwargs):
            kernels, *rest = loader(*args, **kwargs)  # ((flash_fn, varlen_fn, ...), process fn(s))
            dense, varlen = kernels[0], kernels[1]
            kernels = (count_dense(dense) if dense is not None else None,
                       count_varlen(varlen) if varlen is not None else None, *kernels[2:])
            return (kernels, *rest)

        counting.patch(mfu, "lazy_import_flash_attention", functools.wraps(loader)(counted_loader))
        return
    count_flash_forward = _flash_forward_counter(counting)
    for module in counting.model_modules():
        fn = vars(module).get("_flash_attention_forward") if module is not None else None
        if callable(fn):
            counting.patch(module, "_flash_attention_forward", count_flash_forward(fn))
    for name, wrapper in (("flash_attn_func", count_dense), ("flash_attn_varlen_func", count_varlen),
                          ("_flash_fn", count_dense), ("_flash_varlen_fn", count_varlen)):
        fn = getattr(mfu, name, None)
        if callable(fn):
            counting.patch(mfu, name, wrapper(fn))
    for table, entries in ((FLASH_ATTN_STAND_INS, dict(FLASH_ATTN_STAND_INS)), (_MFU_LATE, dict(_MFU_LATE))):
        counting.restore.callback(lambda table=table, entries=entries: (table.clear(), table.update(entries)))
    FLASH_ATTN_STAND_INS["flash_attn_func"] = count_dense(FLASH_ATTN_STAND_INS["flash_attn_func"])
    FLASH_ATTN_STAND_INS["flash_attn_varlen_func"] = count_varlen(FLASH_ATTN_STAND_INS["flash_attn_varlen_func"])
    if callable(getattr(mfu, "_flash_attention_forward", None)):
        _MFU_LATE["_flash_attention_forward"] = count_flash_forward(mfu._flash_attention_forward)


def _kernel_counters(counting: _Counting) -> tuple[Callable[[Callable], Callable], Callable[[Callable], Callable]]:
    """(wrap a varlen kernel, wrap a dense flash kernel), each wrapper made once per kernel."""
    probe = counting.probe

    def once_per_kernel(make: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        def get(kernel: Callable) -> Callable:
            if id(kernel) not in counting.kernels:
                counting.kernels[id(kernel)] = functools.wraps(kernel)(make(kernel))
            return counting.kernels[id(kernel)]

        return get

    @once_per_kernel
    def count_varlen(original_varlen: Callable) -> Callable:
        def counted_varlen(*args, **kwargs):
            probe.varlen_calls += 1
            cu = kwargs.get("cu_seqlens_q", args[3] if len(args) > 3 else None)
            if cu is not None and probe.segments:
                probe.varlen_boundaries.append(cu.tolist())
                try:
                    probe.varlen_arguments.append(varlen_argument_contract(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - arguments the contract cannot read: say so, call on
                    probe.varlen_arguments.append({"unreadable": {"ok": None, "received": repr(exc)[:120], "kind": "misread"}})
                if probe.calls and probe.calls[-1].isolated is None:
                    probe.calls[-1].isolated = probe.isolation_from_cu_seqlens(cu)
            return original_varlen(*args, **kwargs)

        return counted_varlen

    @once_per_kernel
    def count_dense(original_dense: Callable) -> Callable:
        def counted_dense(*args, **kwargs):
            probe.dense_flash_calls += 1
            if probe.calls and probe.calls[-1].isolated is None and probe.segments and len(probe.segments) > 1:
                probe.calls[-1].isolated = False  # one dense call over the packed row: no boundaries
            return original_dense(*args, **kwargs)

        return counted_dense

    return count_varlen, count_dense


def _flash_forward_counter(counting: _Counting) -> Callable[[Callable], Callable]:
    """Wraps a model module's own ``_flash_attention_forward``: one attention call of the flash backend
    (transformers' flash_attention_2, or the packcheck backend running under that name), unless an interface
    call counted it."""
    probe = counting.probe
    flash_backend = counting.alias.get("flash_attention_2", "flash_attention_2")

    def count_flash_forward(original_forward: Callable) -> Callable:
        def counted_flash_forward(*args, **kwargs):
            if probe._inside:
                return original_forward(*args, **kwargs)
            cu = kwargs.get("cu_seq_lens_q")
            probe.calls.append(AttentionCall(flash_backend, probe.isolation_from_cu_seqlens(cu) if cu is not None else None))
            probe._inside += 1
            try:
                return original_forward(*args, **kwargs)
            finally:
                probe._inside -= 1

        return functools.wraps(original_forward)(counted_flash_forward)

    return count_flash_forward


#: One counter per way of counting a backend's calls (:attr:`.table.Backend.counted_by`): ``counter(counting,
#: names)``, ``names`` the backends counted that way. A backend counted another way adds its counter here.
COUNTERS: dict[str, Callable[[_Counting, tuple[str, ...]], None]] = {
    "attention_interface": count_attention_interface,
    "model_eager_forward": count_model_eager_forward,
    "torch_sdpa": count_torch_sdpa,
    "flash_kernels": count_flash_kernels,
}
