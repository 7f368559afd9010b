"""The key number of a check's cell, written as its registry record says (``CheckSpec.key_metric``).

``key_metric`` is (metrics key, label) or (metrics key | None, label, format): the format names one of
:data:`KEY_FORMATS`, a function of the cell's metrics. No check is named here; a new kind of number is one
entry in :data:`KEY_FORMATS` and the format's name in the check's record. Pure: metrics in, text out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import REGISTRY, SPECS
from .text import fmt_metric

#: A key-number format: (metrics, metrics key or None, label) -> the text, or None when the metrics do not hold
#: what it reads (results written before the metric existed): the cell then falls back to the generic rules.
KeyFormat = Callable[[dict[str, Any], "str | None", str], "str | None"]


def _number(m: dict[str, Any], key: str | None, label: str) -> str | None:
    """One number: ``Δ 3.1e-02``."""
    return f"{label} {fmt_metric(m[key])}" if key and key in m else None


def _attention_calls(m: dict[str, Any], key: str | None, label: str) -> str | None:
    """Attention calls counted / expected (``metrics["calls"]``: backend -> calls); for a flash-family backend,
    which kernel ran: ``2/2 calls, varlen 2 / dense 0``."""
    if "calls" not in m:
        return None
    text = f"{sum(m['calls'].values())}/{m.get('expected_calls', '?')} {label}"
    if "dense_kernel_calls" in m and (m.get("varlen_kernel_calls") or m["dense_kernel_calls"]):
        # a flash-family backend: which kernel ran (results written before dense calls were counted: neither)
        text += f", varlen {m.get('varlen_kernel_calls', 0)} / dense {m['dense_kernel_calls']}"
    return text


def _strategy_loss(m: dict[str, Any], key: str | None, label: str) -> str | None:
    """The largest per-step loss delta over the packing strategies that ran and are judged (wrapped is shown,
    not judged): ``loss Δ 1.2e-07``."""
    if not isinstance(m.get("strategies"), dict):
        return None
    deltas = [(v.get("steps") or {}).get("max_loss_delta") for k, v in m["strategies"].items() if k != "wrapped" and v.get("available")]
    deltas = [d for d in deltas if isinstance(d, float)]
    return f"{label} {fmt_metric(max(deltas))}" if deltas else ""


def _pack_tails(m: dict[str, Any], key: str | None, label: str) -> str | None:
    """TRL packer's token accounting: tails packed without their prompt (bfd / ffd) and duplicated tokens over
    the strategies that ran: ``2 bfd tails, 0 dup``."""
    if not isinstance(m.get("strategies"), dict):
        return None
    ran = {k: v for k, v in m["strategies"].items() if v.get("available")}
    tails = sum(v["tail_starts"] for k, v in ran.items() if k in ("bfd", "ffd"))
    return f"{tails} {label}, {sum(v['duplicated'] for v in ran.values())} dup" if ran else ""


#: Key-number formats by name (the third field of a registry ``key_metric``).
KEY_FORMATS: dict[str, KeyFormat] = {"number": _number, "attention_calls": _attention_calls,
                                     "strategy_loss": _strategy_loss, "pack_tails": _pack_tails}


def key_metric(check: str) -> tuple[str | None, str, str] | None:
    """(metrics key or None, label, format) of a check, from its registry record; None for a check without one
    (or unknown to this packcheck)."""
    spec = SPECS.get(check)
    km = spec.key_metric if spec else None
    if not km:
        return None
    return km[0], km[1], km[2] if len(km) > 2 else "number"


#: check -> (metrics key, label), for the checks whose key number is one metric (the atlas and bisect read it).
KEY_METRIC: dict[str, tuple[str, str]] = {s.name: (s.key_metric[0], s.key_metric[1]) for s in REGISTRY
                                          if s.key_metric and s.key_metric[0]}


def key_number(cell: dict[str, Any]) -> str:
    """The number a check's verdict rests on, as the report writes it (``Δ 3.1e-02``, ``2/2 calls``, ``5/6
    items``); "" when the cell holds none. A check's own format comes first; then a contract check's items
    (``metrics["items"]``: items held / checked); then its one metric.

    Raises:
        KeyError: the check's record names a format that is not in :data:`KEY_FORMATS`.
    """
    m = cell.get("metrics", {})
    km = key_metric(cell["check"])
    if km and km[2] != "number":
        text = KEY_FORMATS[km[2]](m, km[0], km[1])
        if text is not None:
            return text
    if isinstance(m.get("items"), dict):  # a contract check: items held / checked
        held = sum(1 for v in m["items"].values() if v.get("status") == "pass")
        return f"{held}/{len(m['items'])} items"
    if km and km[2] == "number":
        return _number(m, km[0], km[1]) or ""
    return ""
