"""The workbench every check runs on. Each check is a plain function ``check(wb) -> CheckResult``; no pytest in here.

A :class:`Workbench` holds one built model (one model x backend x dtype) plus the examples, and caches the
per-example reference logits, so all checks of a cell group share one model build and one reference run.
Faults can be planted by handing the workbench another model or collator factory (see tests/).

Upstream behaviour the checks rely on (transformers 5.24, read in its source; file names below):
- eager / sdpa / flex build a packed (block-diagonal) mask from ``position_ids`` only when there is no
  attention_mask and no cache (``masking_utils.find_packed_sequence_indices``, transformers >= 4.54);
- the flash path derives varlen boundaries from ``cu_seq_lens_q/k`` or from packed ``position_ids``
  (``modeling_flash_attention_utils._flash_attention_forward``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..model import batches as B
from .reference import alone_batch


@dataclass
class Workbench:
    """Everything the checks of one cell group share.

    ``model``: a causal LM in eval mode, no dropout (or a multimodal model run on its text path).
    ``examples``: token id lists, lengths :data:`batches.DEFAULT_LENGTHS`. ``tol``: the dtype's tolerances (see
    audit/tolerances.toml). ``layout``: how position_ids reach the model (:class:`batches.PositionLayout`: as
    the collator gives them, or M-RoPE rows for a multimodal model's text path); every forward goes through it.
    """

    model: Any
    config: Any
    backend: str | None
    dtype: str
    tol: dict[str, float]
    device: str = "cpu"
    collator_factory: Callable[..., Any] = B.default_collator_factory
    trl_collator_factory: Callable[..., Any] = B.trl_collator_factory
    examples: list[list[int]] = field(default_factory=list)
    layout: B.PositionLayout = B.PLAIN_POSITIONS
    #: the runner's workbench of one cell group (run/runner.py), whose model nothing changes between its checks: the
    #: backend check and the isolation probe share one counted forward (:func:`.attention.counted_packed_forward`).
    #: Off for a workbench built by hand, where a caller may change the model or a kernel between two checks (a
    #: planted fault) and must see a fresh forward.
    share_counted_forward: bool = False
    _cache: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.examples:
            self.examples = B.make_examples(self.config)

    @property
    def lengths(self) -> list[int]:
        return [len(e) for e in self.examples]

    @property
    def start(self) -> int:
        return B.position_ids_start(self.config)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def packed(self, examples: list[list[int]] | None = None, **kwargs: Any) -> dict[str, Any]:
        return B.packed_batch(examples or self.examples, self.collator_factory, self.start, device=self.device, **kwargs)

    def forward(self, batch: dict[str, Any], grad: bool = False, layout: B.PositionLayout | None = None, **kwargs: Any) -> Any:
        """Call the model as a packed-training user would, minus the cache (``use_cache=False``, where the forward
        takes it) unless ``kwargs`` says otherwise. Keys the forward does not take are dropped, except position_ids,
        which go through ``layout`` (default: the workbench's): a collator hands them over and the Trainer passes
        them, so a forward without them (transformers 4.44's BartForCausalLM) fails as it would in training."""
        import torch

        accepted = self.accepted
        inputs = {k: v for k, v in batch.items() if accepted is None or k in accepted or k == "position_ids"}
        inputs.update(kwargs)
        if accepted is None or "use_cache" in accepted:  # 4.44's OpenAIGPTLMHeadModel / XLMWithLMHeadModel take none
            inputs.setdefault("use_cache", False)
        if "position_ids" in inputs:
            inputs["position_ids"] = (layout or self.layout).apply(inputs["position_ids"])
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            return self.model(**inputs)

    @property
    def accepted(self) -> frozenset[str] | None:
        """Keyword arguments the model's forward takes by name; None when it takes ``**kwargs`` only. Read once per
        model and forward function (issue 47: ``inspect.signature`` on every forward was 3% of an audit's cells): a
        forward swapped on the model (a planted fault, the guard's wrappers) is read again."""
        forward = self.model.forward
        key = ("accepted", id(self.model), getattr(forward, "__func__", forward))
        if key not in self._cache:
            self._cache[key] = self._accepted(forward)
        return self._cache[key]

    @staticmethod
    def _accepted(forward: Any) -> frozenset[str] | None:
        params = inspect.signature(forward).parameters
        named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if "input_ids" not in named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            # what a **kwargs forward hands on to its decoder (transformers 5.x's LlamaForCausalLM takes use_cache there)
            named |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "num_items_in_batch",
                      "use_cache"}
        return frozenset(named)

    def solo(self, example: list[int], model: Any = None, first: int | None = None) -> Any:
        """Logits ``(len, vocab)`` float32 of one example run alone (:mod:`.reference`: positions from ``first``,
        default the workbench's ``start``), ``use_cache=False``, no grad; on ``model`` when given (cross_backend's
        eager twin), else as :meth:`forward` calls the workbench's."""
        import torch

        batch = alone_batch(example, self.start if first is None else first, self.device)
        if model is None:
            return self.forward(batch).logits[0].float()
        with torch.no_grad():
            return model(**{**batch, "position_ids": self.layout.apply(batch["position_ids"])}, use_cache=False).logits[0].float()

    def solo_logits(self) -> list[Any]:
        """:meth:`solo` of each of the workbench's examples (cached per model)."""
        key = ("solo", id(self.model))
        if key not in self._cache:
            self._cache[key] = [self.solo(e) for e in self.examples]
        return self._cache[key]

    def packed_logits(self, batch: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Logits ``(total_tokens, vocab)`` float32 of the flattened row (the default row's are cached, keyed by
        the model and collator in use, so a planted fault swapped in by a test is never served stale logits)."""
        if batch is None and not kwargs:
            key = ("packed", id(self.model), id(self.collator_factory))
            if key not in self._cache:
                self._cache[key] = self.packed_output().logits[0].float()
            return self._cache[key]
        return self.forward(batch or self.packed(), **kwargs).logits[0].float()

    def packed_output(self) -> Any:
        """The model's output (``logits``, and ``loss`` where its forward takes ``labels``) on the default packed
        row, no grad, as :meth:`forward` gives it: one forward shared by every check of the cell group that reads
        the row (its logits through :meth:`packed_logits`, loss_parity its token-mean loss). Cached like
        :meth:`packed_logits`, keyed by the model and collator in use."""
        key = ("packed_output", id(self.model), id(self.collator_factory))
        if key not in self._cache:
            self._cache[key] = self.forward(self.packed())
        return self._cache[key]

    def padded_output(self, side: str = "right") -> Any:
        """The model's output on the examples as one ``side``-padded batch (:func:`batches.padded_batch`: its
        ``attention_mask``, ``position_ids`` from ``start`` on the real tokens and ``labels`` with -100 on the
        padding), no grad, as :meth:`forward` gives it (``logits`` ``(examples, longest, vocab)``, ``loss`` where the
        forward takes ``labels``): shared by logits_parity and loss_parity. Cached per model and side."""
        key = ("padded_output", id(self.model), side)
        if key not in self._cache:
            self._cache[key] = self.forward(B.padded_batch(self.examples, self.pad_id, side, self.start, self.device))
        return self._cache[key]

    def takes_labels(self) -> bool:
        """Whether :meth:`forward` hands a batch's ``labels`` to the model (its forward names them or takes
        ``**kwargs`` only): then the cached outputs carry the loss the model computes from them."""
        accepted = self.accepted
        return accepted is None or "labels" in accepted

    def plain_row_logits(self) -> Any:
        """Logits ``(total_tokens, vocab)`` float32 of the default packed row with plain ``start .. start + n - 1``
        position_ids and none of the flash kwargs (:data:`batches.FLASH_KWARGS`): the row with no boundary at all,
        read by position_ids (where the row carries no flash kwargs) and the isolation probe's negative control.
        Cached like :meth:`packed_logits`."""
        import torch

        key = ("plain_row", id(self.model), id(self.collator_factory))
        if key not in self._cache:
            batch = {k: v for k, v in self.packed().items() if k not in B.FLASH_KWARGS}
            total = sum(self.lengths)
            batch["position_ids"] = torch.arange(self.start, self.start + total, device=self.device)[None]
            self._cache[key] = self.packed_logits(batch)
        return self._cache[key]

    def param_grads(self, batch: dict[str, Any]) -> list[tuple[str, Any]]:
        """``(name, gradient)`` of every parameter that requires grad after the backward of ``batch``'s token-mean
        loss (``labels``) in train mode (a parameter with no gradient: zeros), float32 copies; the model is back in
        eval mode and its gradients cleared on return."""
        import torch

        model = self.model
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        model.train()
        try:
            self.forward(batch, grad=True, labels=batch["labels"]).loss.backward()
        finally:
            model.eval()
        out = [(n, p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
               for n, p in params]
        model.zero_grad(set_to_none=True)
        return out

    def non_finite(self) -> dict[str, Any] | None:
        """Evidence that the model computes NaN / +inf logits on the default packed row and on the examples alone
        (``non_finite_logits`` of ``logits`` entries, packed and solo), or None where both are finite or the forward
        raised (the check then reports that crash itself). Read from the cached :meth:`packed_logits` /
        :meth:`solo_logits`: no forward of its own. -inf alone is a masked logit, not a fault."""
        import torch

        key = ("non_finite", id(self.model), id(self.collator_factory))
        if key not in self._cache:
            try:
                with torch.no_grad():
                    packed = self.packed_logits()
                    solo = self.solo_logits()
            except Exception:  # noqa: BLE001 - the check runs the same forward and reports its error
                self._cache[key] = None
                return None

            def bad(t: Any) -> int:
                return int((torch.isnan(t) | torch.isposinf(t)).sum())

            counts = {"packed": bad(packed), "solo": sum(bad(t) for t in solo)}
            self._cache[key] = ({"non_finite_logits": counts, "logits": int(packed.numel())}
                                if counts["packed"] or counts["solo"] else None)
        return self._cache[key]

    def diff_to_solo(self, logits: Any, skip_first: bool = False) -> tuple[float, list[float]]:
        """Max abs diff of a packed row's logits against the solo runs, overall and per example."""
        per = [
            float((logits[s] - ref).abs().max())
            for s, ref in zip(B.segment_slices(self.lengths), self.solo_logits(), strict=True)
        ]
        return max(per[1:] if skip_first else per), per


def trainer_passes_num_items(model: Any, transformers_version: str | None = None) -> tuple[bool, str]:
    """Whether transformers' ``Trainer`` hands ``num_items_in_batch`` to ``model``'s forward, and the rule that
    decided it (a short text for the evidence). Mirrors ``Trainer.__init__``'s ``model_accepts_loss_kwargs`` of
    the release (``transformers_version``, default the installed one), read in ``trainer.py`` of each:

    - before 4.46.0 Trainer has no ``num_items_in_batch`` at all (gradient accumulation divides each micro-batch's
      mean by the steps);
    - 4.46.0 and 4.46.1: the forward has a ``loss_kwargs`` parameter; 4.46.2 and 4.46.3: a ``**loss_kwargs``;
    - 4.47.0+: the forward has any ``**kwargs``; from 4.48.0 a model's ``accepts_loss_kwargs`` attribute, when it
      has one, decides instead (5.24.0 still reads it first).

    A forward that only names ``num_items_in_batch`` does not get it (Trainer adds it through loss kwargs alone).
    ``model``: an ``nn.Module`` (its ``forward`` is inspected, never called). Raises nothing: an uninspectable
    forward counts as not taking it."""
    from packaging.version import Version

    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    release = Version(Version(transformers_version).base_version)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False, "its forward cannot be inspected"
    if release < Version("4.46.0"):
        return False, f"transformers {transformers_version}: Trainer passes no num_items_in_batch before 4.46.0"
    var_kw = [n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if release < Version("4.47.0"):
        takes = "loss_kwargs" in params and (release < Version("4.46.2") or "loss_kwargs" in var_kw)
        return takes, (f"transformers {transformers_version} Trainer's model_accepts_loss_kwargs: "
                       + ("its forward has **loss_kwargs" if takes else "its forward has no **loss_kwargs"))
    if release >= Version("4.48.0") and hasattr(model, "accepts_loss_kwargs"):
        takes = bool(model.accepts_loss_kwargs)
        return takes, f"transformers {transformers_version} Trainer's model_accepts_loss_kwargs: accepts_loss_kwargs = {takes}"
    takes = bool(var_kw)
    return takes, (f"transformers {transformers_version} Trainer's model_accepts_loss_kwargs: "
                   + (f"its forward has **{var_kw[0]}" if takes else "its forward has no **kwargs"))


def _fmt(x: float) -> str:
    return f"{x:.2e}"


@contextlib.contextmanager
def capture_warnings() -> Iterator[list[str]]:
    """Collect Python warnings and transformers logger warnings raised in the block (messages only)."""
    messages: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Handler()
    logger = logging.getLogger("transformers")
    # transformers' warning_once is an lru_cache: clear it, so a warning an earlier model already emitted in this
    # process is seen again (otherwise the verdict would depend on the order cells run in).
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield messages
        finally:
            logger.removeHandler(handler)
            messages.extend(str(w.message) for w in caught)


#: Rows of the edge-length probe: one-token examples (two adjacent), an example exactly at the sliding window
#: (``w``, replaced by the window or 8), and one example much longer than the rest.
EDGE_ROWS = ((1, 1, 9), ("w", 5), (40, 2, 3))


def edge_examples(config: Any) -> list[list[list[int]]]:
    """The examples of each :data:`EDGE_ROWS` row (``w``: the config's sliding window when within 2 < w <= 64,
    else 8), made from ``config``'s vocabulary with seeds 10, 11, 12: one example list per row."""
    window = getattr(config, "sliding_window", None)
    w = window if isinstance(window, int) and 2 < window <= 64 else 8
    return [B.make_examples(config, tuple(w if n == "w" else n for n in spec), seed=10 + r) for r, spec in enumerate(EDGE_ROWS)]
