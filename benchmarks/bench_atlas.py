"""The atlas's CPU per release and in total, before and after a change of the shrink (issue 47), beside its floor.

    nice -n 10 python benchmarks/bench_atlas.py --before-tree /tmp/before --sample 5.14.1,5.15.1 \\
        --models nemotron_h,zamba2 --out build/bench-atlas.json

What is measured, in this run, on each sampled release (its version environment, ``~/.cache/packcheck/envs``):
- the floor of the re-shrunk ``--models`` (``benchmarks/atlas_floor.py``: the same tiny models and atlas checks
  through the runner's CellRunner, one process, no harness) with the shrink of ``--before-tree`` (a checkout of the
  commit before the change: ``git worktree add --detach /tmp/before <rev>``) and with this tree's;
- the atlas's own job for those models with this tree's shrink (the plugin as ``packcheck atlas`` runs a release:
  :func:`pytest_packcheck.atlas.release_run.run_plugin_in_env`); with ``--before-job`` the job with the old shrink
  too, else the old job is taken as its floor plus the new job's harness overhead (job - floor), said in the output.

What is read, not measured: each release's committed atlas CPU (``reports/atlas/support.json``, the release record's
``cpu_s``, measured when that release ran, at the load of the day) and the re-measured CPU of the models on every
release (the ``remeasured`` records ``tools/atlas_refix.py`` wrote, the ``--why`` text containing ``--why``).

Extrapolated: a release that is not sampled takes a model's old cost from the sampled release nearest in version
order (sample each side of a change of the model's code: nemotron_h's SSD scan moved at 5.15). The after-estimate of
a release is its committed CPU minus the models' old cost plus their measured new cost; the job time on one CI
runner is that CPU (one worker, one intra-op thread, as the atlas runs) and half of it with two workers.
CPU figures are user + system seconds of the child processes; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env_python(version: str) -> Path:
    from pytest_packcheck.versions.envs import VersionCombo, ensure_env

    return Path(ensure_env(VersionCombo((f"transformers=={version}",))).python)


def floor(version: str, models: list[str], tree: Path) -> dict:
    """CPU / wall of ``atlas_floor.py`` on ``models`` in ``version``'s environment with ``tree``'s packcheck."""
    out = Path(tempfile.mkdtemp(prefix="bench-atlas-")) / "floor.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([str(_env_python(version)), str(REPO / "benchmarks" / "atlas_floor.py"), "--models", ",".join(models),
                           "--out", str(out)], env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    cpu, wall = _children_cpu() - c0, time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"atlas_floor.py failed on {version} ({tree}): {proc.stderr.strip()[-400:]}")
    record = json.loads(out.read_text())
    per_model: dict[str, float] = {}
    for key, seconds in record["per_arch_backend_s"].items():
        per_model[key.split("|")[0]] = per_model.get(key.split("|")[0], 0.0) + seconds
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "cells_wall_s": {k: round(v, 1) for k, v in per_model.items()}}


def job(version: str, models: list[str], tree: Path) -> dict:
    """CPU / wall of the atlas's own run of ``models`` on ``version`` (the plugin in the release's environment, as
    ``packcheck atlas`` runs it) with ``tree``'s packcheck."""
    from pytest_packcheck.atlas.release_run import release_flags, reproduce_command, run_plugin_in_env

    folder = Path(tempfile.mkdtemp(prefix="bench-atlas-job-"))

    def runner(args, **kw):
        kw["env"] = {**kw["env"], "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        return subprocess.run(args, **kw)  # noqa: PLW1510 - run_plugin_in_env passes check=False

    c0, t0 = _children_cpu(), time.perf_counter()
    proc = run_plugin_in_env(_env_python(version), f"transformers=={version}", folder,
                             release_flags(str(folder), None, [f"arch:{m}" for m in models]), reproduce_command(version), runner)
    cpu, wall = _children_cpu() - c0, time.perf_counter() - t0
    if proc.returncode not in (0, 1) or not (folder / "packcheck-matrix.json").exists():
        raise SystemExit(f"the atlas job failed on {version} ({tree}): see {folder / 'atlas-run.log'}")
    cells = len(json.loads((folder / "packcheck-matrix.json").read_text())["cells"])
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "cells": cells}


def nearest(version: str, sample: list[str], releases: list[str] = ()) -> str:
    """The sampled release nearest ``version`` in the order of the atlas's ``releases`` (ties: the older one)."""
    from packaging.version import Version

    order = sorted({*releases, *sample, version}, key=Version)
    i = order.index(version)
    return min(sorted(sample, key=Version), key=lambda s: abs(order.index(s) - i))


def main() -> int:
    from packaging.version import Version

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", type=Path, required=True, help="a checkout of the commit before the change")
    parser.add_argument("--sample", default="5.14.1,5.15.1", help="releases measured (comma-separated)")
    parser.add_argument("--models", default="nemotron_h,zamba2", help="the re-shrunk architectures")
    parser.add_argument("--why", default="issue 47", help="text of the re-measure records of the models")
    parser.add_argument("--before-job", action="store_true", help="also run the atlas job with the old shrink")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier run's --out: its measured figures are taken for the releases and models it holds "
                             "(said in the output) instead of measuring them again")
    parser.add_argument("--support", type=Path, default=REPO / "reports" / "atlas" / "support.json")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "bench-atlas.json")
    ns = parser.parse_args()
    models, sample = [m.strip() for m in ns.models.split(",") if m.strip()], [s.strip() for s in ns.sample.split(",")]
    support = json.loads(ns.support.read_text())
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; cores: {os.cpu_count()}", flush=True)

    # model -> release -> figures (each model in its own processes); written after each model, so a killed run's
    # figures can be --reuse'd
    measured: dict[str, dict[str, dict]] = json.loads(ns.reuse.read_text())["measured"] if ns.reuse else {}
    for model, by_release in measured.items():
        for version, row in by_release.items():
            row["reused"] = str(ns.reuse)
            print(f"{version} {model}: reused from {ns.reuse} (floor before {row['floor_before']['cpu_s']} s CPU, after "
                  f"{row['floor_after']['cpu_s']} s; atlas job after {row['job_after']['cpu_s']} s; load {row.get('load')})")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    for version in sample:
        for model in (m for m in models if any(version in b for b in support["cells"].get(m, {}).values())):
            if version in measured.get(model, {}):
                continue
            row = {"floor_before": floor(version, [model], ns.before_tree), "floor_after": floor(version, [model], REPO),
                   "job_after": job(version, [model], REPO)}
            if ns.before_job:
                row["job_before"] = job(version, [model], ns.before_tree)
            row["load"] = round(os.getloadavg()[0], 1)
            measured.setdefault(model, {})[version] = row
            print(f"{version} {model}: floor before {row['floor_before']['cpu_s']} s CPU, after {row['floor_after']['cpu_s']} s; "
                  f"atlas job after {row['job_after']['cpu_s']} s CPU ({row['job_after']['wall_s']} s wall)"
                  + (f", before {row['job_before']['cpu_s']} s CPU ({row['job_before']['wall_s']} s wall)" if "job_before" in row else "")
                  + f"; load {row['load']}", flush=True)
            ns.out.write_text(json.dumps({"measured": measured}, indent=1) + "\n")

    def old_job(model: str, version: str) -> tuple[float, str]:
        """``model``'s old job CPU on ``version``: measured, or the nearest sampled release's (said)."""
        by_release = measured[model]
        src = version if version in by_release else nearest(version, list(by_release), [r["transformers"] for r in support["releases"]])
        row = by_release[src]
        cpu = row["job_before"]["cpu_s"] if "job_before" in row else (
            row["floor_before"]["cpu_s"] + row["job_after"]["cpu_s"] - row["floor_after"]["cpu_s"])
        how = ("measured" if "job_before" in row else "floor + overhead") + ("" if src == version else f" of {src}")
        return cpu, f"{model} old: {how}"

    support = json.loads(ns.support.read_text())  # read again: the re-measure records may have been merged meanwhile
    rows, total_before, total_after = [], 0.0, 0.0
    print(f"\n{'release':9s} {'committed':>9s} {'models old':>10s} {'models new':>10s} {'after':>8s}  {'1 runner':>8s}  how")
    for rel in sorted(support["releases"], key=lambda r: Version(r["transformers"])):
        version, committed = rel["transformers"], rel.get("cpu_s")
        if committed is None or rel.get("resumed"):
            print(f"{version:9s} {'-':>9s}  (no whole-run CPU recorded: {'resumed' if rel.get('resumed') else 'seeded'}; left out)")
            continue
        present = [m for m in models if m in measured and any(version in b for b in support["cells"].get(m, {}).values())]
        olds = [old_job(m, version) for m in present]
        old_cpu, how = sum(c for c, _ in olds), "; ".join(h for _, h in olds)
        # each model was re-measured alone on every release (tools/atlas_refix.py): that record is its new cost
        new = {m: [r for r in rel.get("remeasured", []) if ns.why in r.get("why", "") and m in r["architectures"]] for m in present}
        new_cpu = sum(r[-1].get("cpu_s") or 0.0 for r in new.values() if r)
        lacking = [m for m, r in new.items() if not r]
        if lacking:
            how += f"; not re-measured on this release: {', '.join(lacking)} (its old cost kept)"
            old_cpu -= sum(c for (c, _), m in zip(olds, present, strict=True) if m in lacking)
        if old_cpu > committed:  # a sample's old cost above this release's whole run: it cannot have been paid here
            how += f"; old cost {old_cpu:.0f} s capped at the release's committed CPU"
            old_cpu = committed
        after = committed - old_cpu + new_cpu
        total_before, total_after = total_before + committed, total_after + after
        rows.append({"release": version, "committed_cpu_s": committed, "models": present, "models_old_cpu_s": round(old_cpu, 1),
                     "models_new_cpu_s": round(new_cpu, 1), "after_cpu_s": round(after, 1), "how": how})
        print(f"{version:9s} {committed:9.0f} {old_cpu:10.0f} {new_cpu:10.0f} {after:8.0f}  {after / 60:6.1f} m  {how}")
    slowest = max(rows, key=lambda r: r["after_cpu_s"])
    n = len(rows)
    print(f"\ntotal of {n} releases (committed CPU, measured at each run's load): before {total_before / 3600:.2f} h, "
          f"after {total_after / 3600:.2f} h (extrapolated as above)")
    print(f"slowest release after: {slowest['release']} {slowest['after_cpu_s']:.0f} s CPU: one CI runner "
          f"{slowest['after_cpu_s'] / 60:.1f} min on one worker, {slowest['after_cpu_s'] / 120:.1f} min with -n 2")
    for model, by_release in measured.items():
        for version, row in by_release.items():
            fa, ja = row["floor_after"]["cpu_s"], row["job_after"]["cpu_s"]
            print(f"{model} on {version}: floor before {row['floor_before']['cpu_s']} s CPU, after {fa} s; atlas job after "
                  f"{ja} s = {ja / max(fa, 0.1):.1f}x its floor (the job's fixed cost: a pytest process, forks, journal)")
    ns.out.write_text(json.dumps({"measured": measured, "releases": rows, "before_h": round(total_before / 3600, 2),
                                  "after_h": round(total_after / 3600, 2), "slowest": slowest,
                                  "load_end": os.getloadavg()}, indent=1) + "\n")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; written {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
