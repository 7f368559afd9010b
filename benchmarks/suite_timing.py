"""What the suite benchmarks share: an audit suite timed in a child process, its definition, the load average, and
runs repeated with their medians.

``bench_rl.py``, ``bench_stack.py``, ``bench_encoders.py`` and ``bench_multimodal.py`` each time
``packcheck audit -q --audit <suite>`` beside a floor computed in their own process; ``bench_audit.py`` uses
:func:`load_average` and :func:`repeated` for its CPU-time figures. Imported as ``suite_timing`` (the scripts run as
``python benchmarks/<script>.py``, which puts this folder first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parent.parent


def audit_seconds(suite: str) -> float:
    """Wall seconds of ``packcheck audit -q --audit <suite>`` in a child process, its reports in a temporary folder.

    Raises:
        subprocess.CalledProcessError: the audit exited non-zero.
    """
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "-q", "--audit", suite,
                        "--packcheck-report-dir", out], check=True, capture_output=True)
        return time.perf_counter() - t0


def suite_definition(suite: str) -> dict[str, Any]:
    """The ``[audit]`` table of ``audit/<suite>.toml`` (models, backends, checks, ...), as the floors read it."""
    return tomllib.loads((REPO / "audit" / f"{suite}.toml").read_text())["audit"]


def load_average() -> tuple[float, int]:
    """(the one-minute load average, the cores): say which load a number was taken at."""
    return os.getloadavg()[0], os.cpu_count() or 1


def repeat_parser(doc: str) -> argparse.ArgumentParser:
    """The scripts' argument parser: the first line of ``doc`` as its description and ``--repeat N``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="Runs of each (default 1).")
    return parser


def repeated(repeat: int, measures: dict[str, Callable[[], float]],
             line: Callable[[dict[str, float]], str]) -> dict[str, float]:
    """Run every measure of ``measures`` once per round, in their order, ``repeat`` rounds; after each round print
    ``line`` of that round's figures (name -> value). Returns each measure's median over the rounds."""
    runs: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeat):
        for name, measure in measures.items():
            runs[name].append(measure())
        print(line({name: values[-1] for name, values in runs.items()}), flush=True)
    return {name: statistics.median(values) for name, values in runs.items()}
