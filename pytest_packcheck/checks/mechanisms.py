"""Mechanisms acting inside the probe row: top-k selection ties, and mechanisms the row never exercises.

The shrink (:func:`models.shrink_config`) brings every mechanism it knows below the probe row's example lengths and
records what it set in the cell's ``config_notes``; :func:`models.mechanism_gaps` names what it could not. Here:

- :func:`selection_ties`: where a sparse-attention indexer (DeepSeek-V3.2-style ``index_topk``) or any other
  ``torch.topk`` in the forward has exact ties at its cut, which tied key is kept depends on the row (its length,
  the keys' indices), so packed and alone can differ without a leak (axk2 with ``index_topk=4`` on 5.24: 4.5e-3,
  isolation exact). :func:`checks.mismatch_cause` names such a difference ``selection_ties``, not a leak and not a
  pass.
- :func:`mechanism_findings`: the gaps as cell findings (cause ``mechanism_not_exercised``), so a pass on a row
  too short for a mechanism says so.

No pytest in here; torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def has_topk_selection(config: Any) -> bool:
    """Whether ``config`` or one of its sub-configs has a sparse-attention indexer (an int ``index_topk``)."""
    subs = [config, *(v for v in getattr(config, "__dict__", {}).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))]

    def topk(sub: Any) -> Any:
        try:  # a per-layer key read globally raises on dots3_note (5.24): look in its per-layer configs
            return getattr(sub, "index_topk", None)
        except Exception:  # noqa: BLE001
            layers = vars(sub).get("per_layer_config") or {}
            return next((v.get("index_topk") if isinstance(v, dict) else getattr(v, "index_topk", None)
                         for v in (layers.values() if isinstance(layers, dict) else layers)), None)

    return any(isinstance(topk(s), int) for s in subs)


@contextlib.contextmanager
def record_topk_ties() -> Iterator[list[dict[str, Any]]]:
    """While the block runs, every ``torch.topk`` / ``Tensor.topk`` call with ``k`` below its axis length records
    ``{"k", "n", "tied", "rows"}``: ``tied`` the number of rows whose k-th and (k+1)-th largest values are equal and
    finite (a tie at the cut; ties among masked keys, -inf or an additive mask's dtype minimum, do not count). The
    calls' results are unchanged."""
    import torch

    calls: list[dict[str, Any]] = []
    original_fn, original_method = torch.topk, torch.Tensor.topk

    def record(tensor: Any, args: tuple, kwargs: dict) -> None:
        bound = {**dict(zip(("k", "dim", "largest", "sorted"), args, strict=False)), **kwargs}
        k, dim, largest = int(bound["k"]), int(bound.get("dim", -1)), bool(bound.get("largest", True))
        n = tensor.shape[dim] if tensor.ndim else 1
        if not 0 < k < n:
            return
        with torch.no_grad():
            values = original_fn(tensor.detach(), k + 1, dim=dim, largest=largest, sorted=True).values
            cut, after = values.select(dim, k - 1), values.select(dim, k)
            # masked keys (-inf, or an additive mask's dtype minimum) tie among themselves: not a cut through scores
            floor = torch.finfo(cut.dtype).min / 2 if cut.is_floating_point() else None
            tied = (cut == after) & torch.isfinite(cut) & ((cut > floor) if floor is not None else True)
        calls.append({"k": k, "n": int(n), "tied": int(tied.sum()), "rows": int(tied.numel())})

    def topk_fn(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        record(tensor, args, {k: v for k, v in kwargs.items() if k != "out"})
        return original_fn(tensor, *args, **kwargs)

    def topk_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        record(self, args, kwargs)
        return original_method(self, *args, **kwargs)

    torch.topk, torch.Tensor.topk = topk_fn, topk_method
    try:
        yield calls
    finally:
        torch.topk, torch.Tensor.topk = original_fn, original_method


def probe_rows(wb: Any) -> list[list[list[int]]]:
    """The packed rows the checks compare with the examples alone: the workbench's row and the edge-length rows
    (:func:`workbench.edge_examples`), as example lists."""
    from .workbench import edge_examples

    return [wb.examples, *edge_examples(wb.config)]


def selection_ties(wb: Any) -> dict[str, Any] | None:
    """Ties at the top-k cut in the forwards of every probe row (:func:`probe_rows`) and of their examples alone
    (cached per model and collator): ``{"topk_calls", "tied_cuts", "tied_at": [(k, axis length), ...]}``. A tie in
    either the packed or the solo forward breaks by position, and positions differ between the two. None for a model
    without a sparse-attention indexer (:func:`has_topk_selection`), where nothing is run."""
    if not has_topk_selection(wb.config):
        return None
    key = ("selection_ties", id(wb.model), id(wb.collator_factory))
    if key not in wb._cache:
        with record_topk_ties() as calls:
            for examples in probe_rows(wb):
                wb.forward(wb.packed(examples))
                for example in examples:
                    wb.solo(example)
        tied = [c for c in calls if c["tied"]]
        wb._cache[key] = {"topk_calls": len(calls), "tied_cuts": sum(c["tied"] for c in tied),
                             "tied_at": sorted({(c["k"], c["n"]) for c in tied})[:5]}
    return wb._cache[key]


def mechanism_findings(wb: Any) -> list[dict[str, Any]]:
    """The mechanisms the workbench's probe row does not exercise (:func:`models.mechanism_gap_items` on its config
    and lengths), as cell findings with cause ``mechanism_not_exercised``: ``evidence`` the whole line, ``mechanism``
    its short label (the matrix cell's qualifier, :func:`report.verdicts.pass_qualifier`)."""
    from ..model.shrink import mechanism_gap_items

    return [{"cause": "mechanism_not_exercised", "evidence": gap, "mechanism": label}
            for label, gap in mechanism_gap_items(wb.config, tuple(wb.lengths))]
