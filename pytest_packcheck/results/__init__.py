"""Results: the cell records and the results JSON (``schema``: schema, load, upgrade), the environment record
(``environment``: read from the libraries table) and safe writing (``io``).

The names callers import from ``pytest_packcheck.results`` (the module this package replaces) are re-exported.
The environment record is imported from ``results.environment`` itself: its function shares the module's name.
"""

from __future__ import annotations

from .io import atomic_write, dumps_results, probe_folder, write_failure, write_set
from .schema import STATUSES, SYMBOLS, CheckResult, load_document

__all__ = ["STATUSES", "SYMBOLS", "CheckResult", "atomic_write", "dumps_results", "load_document", "probe_folder", "write_failure",
           "write_set"]
