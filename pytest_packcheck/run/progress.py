"""The progress line of a packcheck run: one line per model as its cells start, with an ETA."""

from __future__ import annotations

from typing import Any

import pytest

from .items import PackcheckItem


class Progress:
    """One line per model as its cells start, on the controller (xdist's too): the model being built, models and
    cells done of the total, the time so far and an ETA from the mean time per finished cell. Nothing under
    ``-q`` (pytest's verbosity below 0) or without pytest's terminal reporter; on a terminal the line also ends
    the run of pytest's progress dots, which resume on the next line."""

    def __init__(self, config: pytest.Config, plan_size: Any = None) -> None:
        import time

        self.config = config
        self.plan_size = plan_size  # () -> (cells, groups) of this shard: the xdist controller collects nothing
        self.t0 = time.monotonic()
        self.groups: list[str] = []
        self.done: set[str] = set()
        self.total = 0
        self.n_groups = 0

    def _writer(self) -> Any:
        if self.config.get_verbosity() < 0 or hasattr(self.config, "workerinput"):
            return None
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def planned(self, items: list[pytest.Item]) -> None:
        self.total = len(items)
        self.n_groups = len({i.cell.group for i in items if isinstance(i, PackcheckItem)})

    def started(self, nodeid: str) -> None:
        group = _group_of(nodeid)
        tr = self._writer()
        if group is None or group in self.groups or tr is None:
            return
        if not self.total and self.plan_size is not None:
            self.total, self.n_groups = self.plan_size()
        if not self.groups:
            import time

            self.t0 = time.monotonic()  # from the first cell: worker start-up is not cell time
        self.groups.append(group)
        tw = getattr(tr, "_tw", None)  # end a line of progress dots first (pytest's writer knows where it is)
        if tw is not None and getattr(tw, "width_of_current_line", 0) and not getattr(tr, "currentfspath", None):
            tw.line()
        what = (f"making / running version environment {group[4:]} ({len(self.groups)}/{self.n_groups})" if group.startswith("env:")
                else f"building {group} (model {len(self.groups)}/{self.n_groups})")
        tr.write_line(f"packcheck: {what}; {self.line()}")

    def finished(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.done.add(report.nodeid)

    def line(self) -> str:
        """``120/2028 cells, 0:14 elapsed, ETA 0:41`` (ETA: the mean seconds per finished cell x the cells left)."""
        import time

        spent = time.monotonic() - self.t0
        n = len(self.done)
        eta = f"ETA {_clock(spent / n * (self.total - n))}" if n else "ETA —"
        return f"{n}/{self.total} cells, {_clock(spent)} elapsed, {eta}"


def _group_of(nodeid: str) -> str | None:
    """The group (model, or model in a version environment) of a packcheck item's node id
    ``packcheck::<group>::packcheck[<cell id>]``; None for another test."""
    parts = nodeid.split("::")
    return parts[1] if len(parts) == 3 and parts[0] == "packcheck" and parts[2].startswith("packcheck[") else None


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"
