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

``--whole`` measures the atlas as it stands instead of a change of one model's shrink:

    nice -n 10 python benchmarks/bench_atlas.py --whole --before-tree /tmp/before --sample 5.25.0,4.44.2,5.0.0 \\
        --floor 5.25.0 --out build/bench-atlas-whole.json

each sampled release's whole job (every architecture, as ``packcheck atlas`` runs it) with ``--before-tree``'s
packcheck and ``--after-tree``'s (default: this checkout), back to back in this run, and for the releases ``--floor``
names their floor (``atlas_floor.py`` on every architecture, the after tree); every entry of both runs reduced as the atlas reduces a release and compared with the committed
``support.json`` (verdict, deciding check and causes: a verdict change; hazards, findings, number, config: reported
beside). A release that is not sampled is extrapolated: the nearest sample's CPU per architecture times its own
architecture count (said per release). The committed ``cpu_s`` is printed beside, not used: most were measured on
2026-12-02 / 03, at load 8-18 and partly before the atlas's children got one intra-op thread (bc048ef), when two
OpenMP threads per job spun against the other jobs (4.45.2: 1044 s committed; 4.44.2, 79 architectures, measured
again at load 12: 45 s).
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


def floor(version: str, models: list[str] | None, tree: Path) -> dict:
    """CPU / wall of ``atlas_floor.py`` on ``models`` (None: every architecture of the release) in ``version``'s
    environment with ``tree``'s packcheck."""
    out = Path(tempfile.mkdtemp(prefix="bench-atlas-")) / "floor.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    only = ["--models", ",".join(models)] if models else []
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([str(_env_python(version)), str(REPO / "benchmarks" / "atlas_floor.py"), *only,
                           "--out", str(out)], env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    cpu, wall = _children_cpu() - c0, time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"atlas_floor.py failed on {version} ({tree}): {proc.stderr.strip()[-400:]}")
    record = json.loads(out.read_text())
    per_model: dict[str, float] = {}
    for key, seconds in record["per_arch_backend_s"].items():
        per_model[key.split("|")[0]] = per_model.get(key.split("|")[0], 0.0) + seconds
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "cells_wall_s": {k: round(v, 1) for k, v in per_model.items()}}


#: One release's job as ``tree``'s packcheck runs it (argv: tree, release, results folder, models as JSON, [] = all).
_JOB = """
import json, subprocess, sys
from pathlib import Path
from pytest_packcheck.atlas.release_run import release_flags, reproduce_command, run_plugin_in_env
from pytest_packcheck.versions.envs import VersionCombo, ensure_env
tree, version, folder, models = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
def runner(args, **kw):
    kw["env"] = {**kw["env"], "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, **kw)
python = ensure_env(VersionCombo((f"transformers=={version}",))).python
flags = release_flags(str(folder), None, [f"arch:{m}" for m in models] if models else None)
sys.exit(run_plugin_in_env(python, f"transformers=={version}", folder, flags, reproduce_command(version), runner).returncode)
"""


def job(version: str, models: list[str] | None, tree: Path) -> dict:
    """CPU / wall of the atlas's own run of ``models`` (None: the whole release, every architecture) on ``version``
    (the plugin in the release's environment, as ``packcheck atlas`` runs it) with ``tree``'s packcheck, the command
    line included (:data:`_JOB` runs ``tree``'s ``run_plugin_in_env``: a change of the atlas's pytest flags is
    measured on its side only); ``folder``: its results."""
    folder = Path(tempfile.mkdtemp(prefix="bench-atlas-job-"))
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _JOB, str(tree), version, str(folder), json.dumps(models or [])],
                          env={**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}, cwd=str(tree), check=False)
    cpu, wall = _children_cpu() - c0, time.perf_counter() - t0
    if proc.returncode not in (0, 1) or not (folder / "packcheck-matrix.json").exists():
        raise SystemExit(f"the atlas job failed on {version} ({tree}): see {folder / 'atlas-run.log'}")
    from pytest_packcheck.results.schema import read_results
    cells = len(read_results(folder / "packcheck-matrix.json")["cells"])
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "cells": cells, "folder": str(folder)}


def nearest(version: str, sample: list[str], releases: list[str] = ()) -> str:
    """The sampled release nearest ``version`` in the order of the atlas's ``releases`` (ties: the older one)."""
    from packaging.version import Version

    order = sorted({*releases, *sample, version}, key=Version)
    i = order.index(version)
    return min(sorted(sample, key=Version), key=lambda s: abs(order.index(s) - i))


#: What decides an atlas entry (support.json ``cells``): a difference here is a verdict change.
DECIDING = ("verdict", "check", "causes")
#: What an entry carries beside it: a difference here is reported, not counted as a verdict change.
BESIDE = ("hazards", "findings", "number", "config")


def entries(folder: str | Path) -> dict[str, dict[str, dict]]:
    """A job's results reduced as the atlas reduces a release (:func:`pytest_packcheck.atlas.collect.reduce_release`)."""
    from pytest_packcheck.atlas.collect import reduce_release
    from pytest_packcheck.results.schema import read_results
    return reduce_release(read_results(Path(folder) / "packcheck-matrix.json"))


def committed_entries(support: dict, version: str) -> dict[str, dict[str, dict]]:
    """``version``'s entries in the committed ``support.json`` (``cells[model][backend][release]``)."""
    out: dict[str, dict[str, dict]] = {}
    for model, by_backend in support.get("cells", {}).items():
        for backend, runs in by_backend.items():
            if version in runs:
                out.setdefault(model, {})[backend] = runs[version]
    return out


def entry_changes(old: dict[str, dict[str, dict]], new: dict[str, dict[str, dict]]) -> dict:
    """Every (architecture, backend) of either side whose :data:`DECIDING` fields differ (``changed``: one side
    only counts too) and those whose :data:`BESIDE` fields differ (``beside``), with both sides' values."""
    changed, beside = [], []
    keys = sorted({(m, b) for side in (old, new) for m, by_b in side.items() for b in by_b})
    for model, backend in keys:
        a, b = old.get(model, {}).get(backend), new.get(model, {}).get(backend)
        if a is None or b is None:
            changed.append({"model": model, "backend": backend, "old": a, "new": b})
            continue
        diff = {k: [a.get(k), b.get(k)] for k in DECIDING if a.get(k) != b.get(k)}
        if diff:
            changed.append({"model": model, "backend": backend, **diff})
        other = {k: [a.get(k), b.get(k)] for k in BESIDE if a.get(k) != b.get(k)}
        if other:
            beside.append({"model": model, "backend": backend, **other})
    return {"entries": len(keys), "changed": changed, "beside": beside}


def whole(ns: argparse.Namespace) -> int:
    """``--whole``: each sampled release's whole job (every architecture) with ``--before-tree``'s packcheck and this
    tree's, back to back, and its floor (``--floor``); every entry of both runs compared with the committed atlas;
    the other releases extrapolated by architecture count from the nearest sample."""
    from packaging.version import Version

    support = json.loads(ns.support.read_text())
    releases = {r["transformers"]: r for r in support["releases"]}
    sample = [s.strip() for s in ns.sample.split(",") if s.strip()]
    unknown = [s for s in sample if s not in releases]
    if unknown:
        raise SystemExit(f"--sample {','.join(unknown)}: not a release of {ns.support}; pick from {', '.join(releases)}")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; cores: {os.cpu_count()}", flush=True)
    measured: dict[str, dict] = json.loads(ns.reuse.read_text()).get("whole", {}) if ns.reuse else {}
    for version, row in measured.items():
        row["reused"] = str(ns.reuse)
        print(f"{version}: reused from {ns.reuse} (before {row['before']['cpu_s']} s CPU, after {row['after']['cpu_s']} s; "
              f"load {row.get('load')})")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    for version in sample:
        if version in measured:
            continue
        row = {"load_start": round(os.getloadavg()[0], 1), "before": job(version, None, ns.before_tree),
               "after": job(version, None, ns.after_tree)}
        if ns.floor and (ns.floor == "all" or version in ns.floor.split(",")):
            row["floor"] = floor(version, None, ns.after_tree)
        row["load"] = round(os.getloadavg()[0], 1)
        before, after = entries(row["before"]["folder"]), entries(row["after"]["folder"])
        # the support file's count, as for the releases extrapolated from it (the run's own beside it)
        row["architectures"], row["architectures_run"] = releases[version].get("architectures") or len(after), len(after)
        row["before_vs_after"] = entry_changes(before, after)
        row["committed_vs_after"] = entry_changes(committed_entries(support, version), after)
        measured[version] = row
        fl = row.get("floor")
        print(f"{version}: {row['architectures']} architectures; job before {row['before']['cpu_s']} s CPU "
              f"({row['before']['wall_s']} s wall), after {row['after']['cpu_s']} s CPU ({row['after']['wall_s']} s wall)"
              + (f"; floor {fl['cpu_s']} s CPU ({fl['wall_s']} s wall)" if fl else "")
              + f"; verdict changes before -> after: {len(row['before_vs_after']['changed'])} of "
              f"{row['before_vs_after']['entries']} entries, committed -> after: {len(row['committed_vs_after']['changed'])} "
              f"of {row['committed_vs_after']['entries']}; load {row['load_start']} -> {row['load']}", flush=True)
        ns.out.write_text(json.dumps({"whole": measured}, indent=1) + "\n")

    order = sorted(releases, key=Version)
    rows, totals = [], {"committed": 0.0, "before": 0.0, "after": 0.0}
    print(f"\n{'release':9s} {'archs':>5s} {'committed':>9s} {'before':>8s} {'after':>8s}  {'1 runner':>8s}  how")
    for version in order:
        rel, archs = releases[version], releases[version].get("architectures") or 0
        src = version if version in measured else nearest(version, list(measured), order)
        m = measured[src]
        per = {k: m[k]["cpu_s"] / max(m["architectures"], 1) for k in ("before", "after")}
        est = {k: m[k]["cpu_s"] if src == version else per[k] * archs for k in per}
        how = "measured" if src == version else f"{src}'s CPU per architecture x {archs}"
        committed = rel.get("cpu_s")
        totals["committed"] += committed or 0.0
        totals["before"] += est["before"]
        totals["after"] += est["after"]
        rows.append({"release": version, "architectures": archs, "committed_cpu_s": committed,
                     "before_cpu_s": round(est["before"], 1), "after_cpu_s": round(est["after"], 1), "how": how})
        print(f"{version:9s} {archs:5d} {committed if committed is not None else '-':>9} {est['before']:8.0f} "
              f"{est['after']:8.0f}  {est['after'] / 60:6.1f} m  {how}")
    slowest = max(rows, key=lambda r: r["after_cpu_s"])
    print(f"\ntotal of {len(rows)} releases: committed {totals['committed'] / 3600:.2f} h (each release's cpu_s in "
          f"{ns.support.name}, measured at the load of its day; seeded releases count 0), before "
          f"{totals['before'] / 3600:.2f} h, after {totals['after'] / 3600:.2f} h (sampled {', '.join(measured)}; "
          "the rest extrapolated as above)")
    print(f"slowest release after: {slowest['release']} {slowest['after_cpu_s']:.0f} s CPU: one CI runner "
          f"{slowest['after_cpu_s'] / 60:.1f} min on one worker ({slowest['how']})")
    for version, m in measured.items():
        fl = m.get("floor")
        if fl:
            print(f"{version}: job after {m['after']['cpu_s']} s CPU = {m['after']['cpu_s'] / max(fl['cpu_s'], 0.1):.2f}x "
                  f"its floor {fl['cpu_s']} s (atlas_floor.py: the same models and checks in one process, no harness)")
        for name in ("before_vs_after", "committed_vs_after"):
            for c in m[name]["changed"]:
                print(f"{version} {name}: {c}")
    ns.out.write_text(json.dumps({"whole": measured, "releases": rows, "committed_h": round(totals["committed"] / 3600, 2),
                                  "before_h": round(totals["before"] / 3600, 2), "after_h": round(totals["after"] / 3600, 2),
                                  "slowest": slowest, "load_end": os.getloadavg()}, indent=1) + "\n")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; written {ns.out}")
    return 0


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
    parser.add_argument("--whole", action="store_true",
                        help="measure each sampled release's whole job before and after (every architecture), compare "
                             "its entries with the committed atlas, extrapolate the rest by architecture count")
    parser.add_argument("--floor", nargs="?", const="all", default=None,
                        help="with --whole: also the floor of these sampled releases (comma-separated; bare: every one)")
    parser.add_argument("--after-tree", type=Path, default=REPO,
                        help="with --whole: the checkout whose packcheck is 'after' (default: this one)")
    ns = parser.parse_args()
    if ns.whole:
        return whole(ns)
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
