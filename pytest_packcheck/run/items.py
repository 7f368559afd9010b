"""The pytest nodes of a packcheck run: one item per cell, under one collector per group (a model, or a model in
a version environment), and how a cell's result becomes pytest's outcome (pass, skip, xfail or a failure that
leads with its cause and remedy)."""

from __future__ import annotations

import json
from typing import Any

import pytest

#: The user property a cell's result (JSON) travels in, on every report of its item (xdist, --junitxml).
RESULT_PROPERTY = "packcheck"


class PackcheckItem(pytest.Item):
    """One cell of the matrix as a test item."""

    def __init__(self, *, cell: Any, session_state: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.state = session_state

    def runtest(self) -> None:
        result = self.state.result_for(self)
        # On the item's user_properties the result reaches every report of this item (so the xdist controller
        # and --junitxml get it as a property).
        from .sandbox import from_child, result_json

        # scrubbed (a cell child's result was, where it left the child): what the controller, --junitxml's <property>
        # and other plugins' logs read carries no token
        self.user_properties.append((RESULT_PROPERTY, result_json(result)))
        message = result.message
        if not from_child(result):
            from ..errors import scrub_secrets

            message = scrub_secrets(message)  # the terminal gets what the files get: no token
        if result.status in ("skipped", "unsupported"):
            pytest.skip(f"{result.status}: {message}")
        if result.status in ("fail", "fallback") and result.role != "correctness":
            # a usage hazard or a fact of the library stack (registry role): true and reported once in the summary
            # and the matrix, never a failure of the model under test
            pytest.xfail(f"{result.role} ({result.cause or result.status}): {message}")
        if result.status != "pass":
            raise PackcheckCellFailure(result.status, message, *cause_and_remedy(result))

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if isinstance(excinfo.value, PackcheckCellFailure):
            return str(excinfo.value)
        if isinstance(excinfo.value, pytest.xfail.Exception):
            # pytest formats the traceback of an xfail too (then shows only the reason): with source lines that
            # was 0.35 s per hazard / finding item, 440 s of CPU in the all-architectures audit
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return "packcheck", 0, f"packcheck cell {self.cell.cell_id}"


class PackcheckCellFailure(Exception):
    """A cell that did not pass. Its text leads with the cause and the remedy, so pytest's one-line short summary
    (``FAILED ... - fail (leak; remedy: ...): ...``), which it cuts at the terminal width, still carries them."""

    def __init__(self, status: str, message: str, cause: str | None = None, remedy: str | None = None) -> None:
        why = f" ({cause}{'; remedy: ' + remedy if remedy else ''})" if cause else ""
        super().__init__(f"{status}{why}: {message}")
        self.status = status
        self.message = message
        self.cause = cause
        self.remedy = remedy


def cause_and_remedy(result: Any) -> tuple[str | None, str | None]:
    """The cause code of a cell result and its remedy (:func:`diagnose.remedy`, read from codes, never the
    message); (None, None) when the result names no cause. The remedy is judged without the document's
    environment (the versions it names may read "this stack")."""
    from ..analysis.diagnose import classify, remedy

    cell = json.loads(result.to_json())
    cause, _ = classify(cell)
    if not cause:
        return None, None
    try:
        return cause, remedy(cause, cell, {})
    except Exception:  # noqa: BLE001 - a remedy that cannot be written never hides the verdict
        return cause, None


class PackcheckCollector(pytest.Collector):
    """Parent node of the packcheck items (they are planned from the options, not from files)."""

    def collect(self) -> list[pytest.Item]:
        return []
