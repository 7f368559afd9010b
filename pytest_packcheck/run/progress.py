"""The progress line of a packcheck run: one line per model as its cells start, with an ETA."""

from __future__ import annotations

from typing import Any

import pytest

from .items import PackcheckItem


class Progress:
    """One line per model as its cells start, on the controller (xdist's too): the model being built (or that
    --packcheck-resume takes its cells from the journal), models and cells done of the total, the time so far and
    an ETA from the mean time per cell measured in this run. Nothing under
    ``-q`` (pytest's verbosity below 0) or without pytest's terminal reporter; on a terminal the line also ends
    the run of pytest's progress dots, which resume on the next line."""

    def __init__(self, config: pytest.Config, plan: Any = None, journaled: Any = ()) -> None:
        import time

        self.config = config
        self.plan_of = plan  # () -> {cell_id: group} of this shard: the xdist controller collects nothing
        self.journaled = journaled  # cell ids --packcheck-resume takes from the journal (none is built or timed)
        self.t0 = time.monotonic()
        self.groups: list[str] = []
        self.done: set[str] = set()
        self.plan: dict[str, str] = {}

    def _writer(self) -> Any:
        if self.config.get_verbosity() < 0 or hasattr(self.config, "workerinput"):
            return None
        return self.config.pluginmanager.get_plugin("terminalreporter")

    @property
    def total(self) -> int:
        return len(self.plan)

    @property
    def n_groups(self) -> int:
        return len(set(self.plan.values()))

    def planned(self, items: list[pytest.Item]) -> None:
        self.plan = {i.cell.cell_id: i.cell.group for i in items if isinstance(i, PackcheckItem)}

    def started(self, nodeid: str) -> None:
        group = _group_of(nodeid)
        tr = self._writer()
        if group is None or group in self.groups or tr is None:
            return
        if not self.plan and self.plan_of is not None:
            self.plan = dict(self.plan_of())
        if not self.groups:
            import time

            self.t0 = time.monotonic()  # from the first cell: worker start-up is not cell time
        self.groups.append(group)
        tw = getattr(tr, "_tw", None)  # end a line of progress dots first (pytest's writer knows where it is)
        if tw is not None and getattr(tw, "width_of_current_line", 0) and not getattr(tr, "currentfspath", None):
            tw.line()
        place = f"({len(self.groups)}/{self.n_groups})" if group.startswith("env:") else f"(model {len(self.groups)}/{self.n_groups})"
        cells = [c for c, g in self.plan.items() if g == group]
        reused = sum(c in self.journaled for c in cells)
        # a model whose cells all come from the journal is not built (trial 19, 67: "building llama" on a resume)
        if cells and reused == len(cells):
            what = f"{group} {place}: its {reused} cell{'' if reused == 1 else 's'} from the journal (--packcheck-resume), nothing to build"
        else:
            what = (f"making / running version environment {group[4:]} {place}" if group.startswith("env:")
                    else f"building {group} {place}") + (f", {reused} of its {len(cells)} cells from the journal" if reused else "")
        tr.write_line(f"packcheck: {what}; {self.line()}")

    def finished(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.done.add(report.nodeid)

    def line(self) -> str:
        """``120/2028 cells, 0:14 elapsed, ETA 0:41`` (ETA: the mean seconds per cell run here x the cells left);
        with --packcheck-resume, the journal's cells count as done from the start and are named ("50/75 cells (50
        from the journal)"), and the ETA rests on the cells measured in this run only."""
        import time

        spent = time.monotonic() - self.t0
        reused = {c for c in self.plan if c in self.journaled}
        measured = {d for d in self.done if _cell_of(d) not in reused}
        n = len(reused) + len(measured)
        eta = f"ETA {_clock(spent / len(measured) * (self.total - n))}" if measured else "ETA —"
        journal = f" ({len(reused)} from the journal)" if reused else ""
        return f"{n}/{self.total} cells{journal}, {_clock(spent)} elapsed, {eta}"


def _group_of(nodeid: str) -> str | None:
    """The group (model, or model in a version environment) of a packcheck item's node id
    ``packcheck::<group>::packcheck[<cell id>]``; None for another test."""
    parts = nodeid.split("::")
    return parts[1] if len(parts) == 3 and parts[0] == "packcheck" and parts[2].startswith("packcheck[") else None


def _cell_of(nodeid: str) -> str:
    """The cell id of a packcheck item's node id (``...::packcheck[<cell id>]``)."""
    return nodeid.rsplit("packcheck[", 1)[-1].removesuffix("]")


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"
