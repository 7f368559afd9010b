"""``packcheck-matrix.json``: the results document itself (schema in :mod:`results`), the file ``gate``,
``merge``, ``--packcheck-resume`` and the atlas read back. Pure: a :class:`model.Report` in, text out."""

from __future__ import annotations

from ..results import dumps_results
from .model import Report


def render(rep: Report) -> str:
    """The document as written by every packcheck (:func:`results.dumps_results`: keys in the document's order,
    a cell a line)."""
    return dumps_results(rep.doc)
