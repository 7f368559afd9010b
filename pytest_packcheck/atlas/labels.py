"""What ``DataCollatorWithFlattening`` does with classification labels, per transformers release (issue 46, part 2):
the encoders block's ``labels`` (``support.json["encoders"]["labels"]``, reports/atlas/SCHEMA.md), measured by
``tools/collator_labels.py`` in each release's version environment, rendered as one table of atlas.md's encoder
section (:func:`labels_markdown`) and named in ``packcheck lookup encoder:bert sdpa <v>``'s notes
(:func:`labels_note`). Light: no torch / transformers import.

The probe (tools/collator_labels.py) feeds the release's collator, with its defaults, two sequence-classification
examples (``labels`` a scalar int: 1 and 0; 3 and 2 tokens) and the same ids with token-classification labels (one
per token). transformers' collator appends ``[separator_id] + labels[1:]`` per example (``data/data_collator.py``,
``DataCollatorWithFlattening.__call__``: line 1350 in 5.25.0; ``[-100] + ...`` at line 1643 in 4.44.2, before
``separator_id``): an int is not subscriptable, so scalar labels
raise TypeError on every release measured (4.44.2 .. 5.25.0), and token labels keep one label per token with each
example's first set to -100.
"""

from __future__ import annotations

from typing import Any

#: The collator keywords a record says are there or not (``kwargs``).
LABEL_KWARGS = ("return_flash_attn_kwargs", "return_seq_idx")
#: What the probe feeds: number of tokens per example (both batches) and the scalar labels.
PROBE_LENGTHS = (3, 2)


def reduce_probe(raw: dict[str, Any]) -> dict[str, Any]:
    """The probe's raw output of one release -> its compact record:

    - ``scalar``: ``{"raises": exception type, "message": its first line}``, ``{"shape": [...]}`` (labels returned,
      their tensor shape) or ``{"dropped": True}`` (no ``labels`` in the batch);
    - ``token``: the same, and where labels come back ``per_token`` (one label per packed token: len =
      sum of the examples' lengths) and ``first_masked`` (each example's first token is -100);
    - ``kwargs``: ``{keyword: present}`` for :data:`LABEL_KWARGS` in the collator's signature.
    """
    def one(got: dict[str, Any], per_token: bool) -> dict[str, Any]:
        if "raises" in got:
            return {"raises": got["raises"], "message": got.get("message", "")}
        if got.get("dropped"):
            return {"dropped": True}
        out: dict[str, Any] = {"shape": list(got.get("shape") or [])}
        if per_token:
            flat = [x for row in got.get("labels") or [] for x in (row if isinstance(row, list) else [row])]
            starts = [sum(PROBE_LENGTHS[:i]) for i in range(len(PROBE_LENGTHS))]
            out["per_token"] = len(flat) == sum(PROBE_LENGTHS)
            out["first_masked"] = out["per_token"] and all(flat[s] == -100 for s in starts)
        return out

    kwargs = set(raw.get("kwargs") or [])
    return {"scalar": one(raw["scalar"], False), "token": one(raw["token"], True),
            "kwargs": {k: k in kwargs for k in LABEL_KWARGS}}


def labels_block(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Releases -> raw probe output (:func:`reduce_probe`) -> the stored block: ``releases`` (ascending) and
    ``runs`` ``[first, last, record]`` of consecutive releases with equal records."""
    from .plan import version_key

    order = sorted(raw, key=version_key)
    runs: list[list[Any]] = []
    for version in order:
        record = reduce_probe(raw[version])
        if runs and runs[-1][2] == record:
            runs[-1][1] = version
        else:
            runs.append([version, version, record])
    return {"releases": order, "runs": runs}


def record_at(labels: dict[str, Any], version: str) -> dict[str, Any] | None:
    """The record of ``version`` (None when that release was not probed)."""
    order = labels.get("releases") or []
    if version not in order:
        return None
    index = order.index(version)
    for first, last, record in labels.get("runs") or []:
        if first in order and last in order and order.index(first) <= index <= order.index(last):
            return record
    return None


def describe(part: dict[str, Any], token: bool = False) -> str:
    """One record part (``scalar`` / ``token``) in words: ``raises TypeError ('int' object is not subscriptable)``,
    ``labels (1, 5), one per token, each example's first -100``, ``dropped``."""
    if "raises" in part:
        return f"raises {part['raises']} ({part.get('message', '')})"
    if part.get("dropped"):
        return "dropped (no labels in the batch)"
    text = f"labels {tuple(part.get('shape') or [])}"
    if token:
        text += (", one per token" if part.get("per_token") else ", not one per token")
        text += (", each example's first -100" if part.get("first_masked") else
                 ", first token of each example kept" if part.get("per_token") else "")
    return text


def labels_markdown(labels: dict[str, Any]) -> list[str]:
    """atlas.md's table: one row per run of releases with the same behaviour."""
    order = labels.get("releases") or []
    lines = ["", "### Classification labels through DataCollatorWithFlattening per release", "",
             ("`tools/collator_labels.py`, in each release's environment: the collator with its defaults on two "
              "sequence-classification examples (`labels` a scalar int per example) and on the same ids with "
              "token-classification labels (one per token; the collator sets each example's first label to -100, "
              "its `separator_id`). Its keywords `return_flash_attn_kwargs` / `return_seq_idx`: ✓ there, — not. "
              f"Probed releases: {len(order)} ({order[0] if order else '—'} .. {order[-1] if order else '—'})."), "",
             "| releases | scalar labels | token labels | return_flash_attn_kwargs | return_seq_idx |",
             "|---|---|---|---|---|"]
    for first, last, record in labels.get("runs") or []:
        span = first if first == last else f"{first} .. {last}"
        kw = record.get("kwargs") or {}
        lines.append(f"| {span} | {describe(record['scalar'])} | {describe(record['token'], True)} | "
                     + " | ".join("✓" if kw.get(k) else "—" for k in LABEL_KWARGS) + " |")
    return lines


def labels_note(labels: dict[str, Any] | None, version: str) -> str | None:
    """``packcheck lookup encoder:<m> <backend> <v>``'s note: the collator on scalar (and token) labels at ``version``,
    or which releases were probed when ``version`` was not."""
    if not labels or not labels.get("runs"):
        return None
    record = record_at(labels, version)
    if record is None:
        order = labels.get("releases") or []
        return (f"DataCollatorWithFlattening on scalar labels: {version} not probed "
                f"(probed {order[0]} .. {order[-1]}, `python tools/collator_labels.py --releases {version}`)")
    return (f"DataCollatorWithFlattening at {version} on scalar (sequence-classification) labels: "
            f"{describe(record['scalar'])}; token labels: {describe(record['token'], True)}")


def write_labels(atlas_dir: Any, labels: dict[str, Any]) -> None:
    """Put ``labels`` into ``<atlas_dir>/support.json``'s encoders block (read right before writing) and re-render
    atlas.md / atlas.html (:func:`.render.write_outputs`).

    Raises:
        PackcheckUsageError: support.json has no encoders block (`python tools/atlas_kinds.py` makes it).
    """
    from pathlib import Path

    from ..errors import PackcheckUsageError
    from .collect import load_committed
    from .render import write_outputs

    support = load_committed(Path(atlas_dir)) or {}
    if not isinstance(support.get("encoders"), dict):
        raise PackcheckUsageError(f"Support file {Path(atlas_dir) / 'support.json'} has no encoders block: run "
                                  "`python tools/atlas_kinds.py --kinds encoders` first.")
    support["encoders"]["labels"] = labels
    write_outputs(support, Path(atlas_dir))
