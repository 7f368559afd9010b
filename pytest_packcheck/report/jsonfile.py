"""``packcheck-matrix.json``: the results document itself (schema in :mod:`results`), the file ``gate``,
``merge``, ``--packcheck-resume`` and the atlas read back. Pure: a :class:`model.Report` in, text out."""

from __future__ import annotations

import json

from .model import Report


def render(rep: Report) -> str:
    """The document as written by every packcheck (one-space indent, keys in the document's order)."""
    return json.dumps(rep.doc, indent=1, sort_keys=False) + "\n"
