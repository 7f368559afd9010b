"""Where one audit's CPU goes: every process it starts profiled, on CPU time, and the time split into phases.

    python benchmarks/profile_audit.py [--backends eager,sdpa] [--keep DIR] [-- extra audit arguments]

Runs ``packcheck audit -q --packcheck-attn <backends>`` as the audit runs (``-n 2``: one process, two models' cell
children side by side, each child taking model after model (up to ``SideBySide.MAX_GROUPS_PER_CHILD``; a fresh fork
after a crash or a timeout); ``-- -n 2`` with ``--packcheck-isolation`` none or a CUDA device:
the controller and two xdist workers), with a ``sitecustomize`` on ``PYTHONPATH`` that profiles every one of those
processes under cProfile on ``time.process_time`` (CPU seconds: waiting on a pipe or a lock costs nothing): each
process from its start, each forked cell child from its fork (its own profiler; the parent's is dropped), written
to ``DIR/<role>-<pid>.prof`` when the process ends (``atexit``, or the ``os._exit`` the sandbox's child and xdist's
workers end with). Then prints per role (controller, worker, cell child) the processes, their CPU and the phases:

- ``imports``: module imports (``importlib``'s ``_find_and_load``, outermost only);
- ``warm_up``: :func:`pytest_packcheck.run.sandbox.warm_up` (a tiny llama through the checks, once per worker);
- ``model builds``: :func:`pytest_packcheck.model.build.build_model` (inside cells: its cell group's first cell);
- ``checks``: the check functions and the non-finite gate (``CellRunner._run`` minus the build), forwards included;
- ``forwards``: the part of ``checks`` spent in the model's ``nn.Module`` calls from :class:`Workbench`;
- ``fork + pipe``: :meth:`SideBySide.wait_for` (or :func:`run_isolated`) in the parent: forks, pipes, results decoded
  and journaled;
- ``resolve``: the model specs resolved (their configs made, shrunk and counted), once per process;
- ``collection``: pytest's collection (cells planned, items made);
- ``journal``, ``report``: the journal appends, the report files written;
- ``scrub``: :func:`pytest_packcheck.errors.scrub_secrets` (terminal lines, results where they leave a child, labels).

Profiling adds its own overhead (Python calls cost several times more under cProfile): the phases' shares are
what to read, not the seconds; ``benchmarks/bench_audit.py`` gives the unprofiled figure.
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

#: The sitecustomize written on PYTHONPATH: one profiler per process, CPU time, dumped on any exit.
SITECUSTOMIZE = textwrap.dedent('''
    import atexit, cProfile, os, sys, time

    _DIR = os.environ["PACKCHECK_PROFILE_DIR"]
    _PROFILE = os.environ.get("PACKCHECK_PROFILE_CPU_ONLY") != "1"

    def _new():
        return cProfile.Profile(time.process_time) if _PROFILE else None

    _state = {"prof": _new(), "role": None, "done": False}

    def _role():
        if _state["role"]:
            return _state["role"]
        if os.environ.get("PYTEST_XDIST_WORKER"):
            return "worker"
        return "worker" if "execnet" in " ".join(sys.argv) or sys.argv[:1] == ["-c"] else "controller"

    def _dump():
        if _state["done"]:
            return
        _state["done"] = True
        prof, cpu = _state["prof"], time.process_time()
        try:
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(_DIR, f"{_role()}-{os.getpid()}.prof"))
            with open(os.path.join(_DIR, f"{_role()}-{os.getpid()}.cpu"), "w") as f:
                f.write(f"{cpu}\\n")
        except Exception:
            pass

    def _child():
        old = _state["prof"]
        if old is not None:
            old.disable()
        _state["role"], _state["done"] = "child", False
        _state["prof"] = _new()
        if _state["prof"] is not None:
            _state["prof"].enable()

    _real_exit = os._exit

    def _exit(code):
        _dump()
        _real_exit(code)

    os._exit = _exit
    os.register_at_fork(after_in_child=_child)
    atexit.register(_dump)
    if _state["prof"] is not None:
        _state["prof"].enable()
''')

#: phase -> the functions whose cumulative CPU it is (file suffix, function name); outermost calls only, since
#: cProfile's cumulative time counts a recursive function once.
PHASES = {
    "imports": [("<frozen importlib._bootstrap>", "_find_and_load")],
    "warm_up": [("run/sandbox.py", "warm_up")],
    "model builds": [("model/build.py", "build_model")],
    "checks": [("run/runner.py", "_run")],
    "forwards": [("checks/workbench.py", "forward"), ("checks/workbench.py", "solo"),
                 ("checks/workbench.py", "param_grads")],
    "fork + pipe": [("run/sandbox.py", "wait_for"), ("run/sandbox.py", "run_isolated")],
    "resolve": [("run/session.py", "resolved_models")],
    "collection": [("_pytest/main.py", "perform_collect")],
    "journal": [("run/journal.py", "append")],
    "report": [("run/session.py", "finish"), ("report/formats.py", "write_reports")],
    "scrub": [("pytest_packcheck/errors.py", "scrub_secrets")],
}


def _cum(stats: pstats.Stats, where: list[tuple[str, str]]) -> float:
    """Cumulative seconds of the first function of ``where`` found in ``stats`` (by file suffix and name)."""
    total = 0.0
    for suffix, name in where:
        for (path, _, func), (_, _, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            if func == name and path.endswith(suffix):
                total += ct
        if total:
            return total
    return total


def cpu_table(folder: Path) -> str:
    """Processes and CPU seconds per role from the ``*.cpu`` files of ``folder`` (unprofiled when run with
    ``--cpu-only``)."""
    roles: dict[str, list[float]] = {}
    for path in sorted(folder.glob("*.cpu")):
        roles.setdefault(path.name.split("-", 1)[0], []).append(float(path.read_text()))
    lines = [f"{'role':<11} {'procs':>5} {'cpu s':>8}   per process"]
    for role in ("controller", "worker", "child"):
        if role in roles:
            each = sorted(roles[role], reverse=True)
            lines.append(f"{role:<11} {len(each):>5} {sum(each):>8.1f}   " + " ".join(f"{c:.2f}" for c in each[:8])
                         + (" ..." if len(each) > 8 else ""))
    lines.append(f"{'all':<11} {sum(len(v) for v in roles.values()):>5} {sum(sum(v) for v in roles.values()):>8.1f}")
    return "\n".join(lines)


def summarise(folder: Path) -> str:
    """The table of CPU per role and phase from the ``*.prof`` files of ``folder``."""
    roles: dict[str, list[pstats.Stats]] = {}
    for path in sorted(folder.glob("*.prof")):
        roles.setdefault(path.name.split("-", 1)[0], []).append(pstats.Stats(str(path)))
    lines = [f"{'role':<11} {'procs':>5} {'cpu s':>8}  " + "  ".join(f"{p:>12}" for p in PHASES)]
    grand = 0.0
    for role in ("controller", "worker", "child"):
        stats = roles.get(role, [])
        if not stats:
            continue
        cpu = sum(s.total_tt for s in stats)  # type: ignore[attr-defined]
        grand += cpu
        cells = [sum(_cum(s, where) for s in stats) for where in PHASES.values()]
        lines.append(f"{role:<11} {len(stats):>5} {cpu:>8.1f}  " + "  ".join(f"{c:>12.1f}" for c in cells))
    lines.append(f"{'all':<11} {sum(len(v) for v in roles.values()):>5} {grand:>8.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="eager,sdpa")
    parser.add_argument("--keep", type=Path, default=None, help="write the .prof files here (default: a temporary folder)")
    parser.add_argument("--summarise", type=Path, default=None, help="only print the table of an earlier run's folder")
    parser.add_argument("--cpu-only", action="store_true", help="no profiler: each process's CPU seconds only")
    parser.add_argument("extra", nargs="*", help="more arguments for packcheck audit (after --)")
    ns = parser.parse_args()
    if ns.summarise:
        print(cpu_table(ns.summarise))
        if any(ns.summarise.glob("*.prof")):
            print(summarise(ns.summarise))
        return 0
    folder = ns.keep or Path(tempfile.mkdtemp(prefix="profile-audit-"))
    folder.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="profile-site-"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PACKCHECK_PROFILE_DIR": str(folder),
           "PACKCHECK_PROFILE_CPU_ONLY": "1" if ns.cpu_only else "0",
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    reports = Path(tempfile.mkdtemp(prefix="profile-reports-"))
    argv = [sys.executable, "-m", "pytest_packcheck.cli", "audit", "-q", "--packcheck-attn", ns.backends,
            "--packcheck-report-dir", str(reports), *ns.extra]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        print((done.stdout + done.stderr)[-2000:], file=sys.stderr)
        return done.returncode
    print(f"profiles in {folder}; load {os.getloadavg()[0]:.2f}")
    print(cpu_table(folder))
    if not ns.cpu_only:
        print(summarise(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
