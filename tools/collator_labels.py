"""Measure, per cached transformers release, what ``DataCollatorWithFlattening`` does with classification labels
(issue 46, part 2), and write the result into ``reports/atlas/support.json``'s encoders block (``labels``, SCHEMA.md)
and re-render atlas.md / atlas.html.

Per release, that release's version environment (``~/.cache/packcheck/envs/transformers-<v>-*/``) runs this file's
``--probe`` (torch and that transformers only, no packcheck import), which prints one JSON record
(:func:`pytest_packcheck.atlas.labels.probe_record` documents the fields):

    nice -n 10 env HF_HUB_OFFLINE=1 python tools/collator_labels.py            # every cached release
    python tools/collator_labels.py --releases 5.24.0,5.25.0 --no-write          # print only

The probe's batches: sequence classification, two examples ``{"input_ids": [5, 6, 7], "labels": 1}`` and
``{"input_ids": [8, 9], "labels": 0}``; token classification, the same ids with labels ``[11, 12, 13]`` and
``[14, 15]``; ``DataCollatorWithFlattening()`` with its defaults (``return_tensors="pt"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENVS = Path(os.environ.get("PACKCHECK_ENVS", Path.home() / ".cache" / "packcheck" / "envs"))
SEQ = [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8, 9], "labels": 0}]
TOK = [{"input_ids": [5, 6, 7], "labels": [11, 12, 13]}, {"input_ids": [8, 9], "labels": [14, 15]}]
KWARGS = ("return_flash_attn_kwargs", "return_seq_idx", "return_position_ids", "separator_id")


def probe() -> dict:
    """Run in a release's environment: the raw record (see the module docstring)."""
    import inspect

    import transformers
    from transformers import DataCollatorWithFlattening

    params = set(inspect.signature(DataCollatorWithFlattening.__init__).parameters)
    out: dict = {"transformers": transformers.__version__, "kwargs": [k for k in KWARGS if k in params]}
    for name, batch in (("scalar", SEQ), ("token", TOK)):
        try:
            got = DataCollatorWithFlattening()([dict(e) for e in batch])
        except Exception as exc:  # noqa: BLE001 - the exception is the measurement
            out[name] = {"raises": type(exc).__name__, "message": (str(exc).strip().splitlines() or [""])[0][:160]}
            continue
        labels = got.get("labels")
        if labels is None:
            out[name] = {"dropped": True, "keys": sorted(got)}
        else:
            out[name] = {"shape": list(labels.shape), "labels": labels.tolist()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="run the probe here and print its JSON")
    parser.add_argument("--releases", default=None, help="comma-separated releases (default: every cached env)")
    parser.add_argument("--no-write", action="store_true")
    ns = parser.parse_args()
    if ns.probe:
        print(json.dumps(probe(), sort_keys=True))
        return 0
    sys.path.insert(0, str(REPO))
    from pytest_packcheck.atlas.labels import labels_block, write_labels
    from pytest_packcheck.atlas.plan import version_key

    envs = {}
    for folder in sorted(ENVS.glob("transformers-*")):
        if folder.is_dir() and (folder / "bin" / "python").exists():
            envs.setdefault(folder.name.split("-")[1], folder)
    wanted = ns.releases.split(",") if ns.releases else sorted(envs, key=version_key)
    raw = {}
    for version in wanted:
        if version not in envs:
            print(f"{version}: no cached environment under {ENVS}", file=sys.stderr)
            continue
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", OMP_NUM_THREADS="1")
        t0 = time.monotonic()
        proc = subprocess.run([str(envs[version] / "bin" / "python"), str(Path(__file__).resolve()), "--probe"],
                              check=False, capture_output=True, text=True, env=env, cwd="/tmp", timeout=300)
        if proc.returncode:
            print(f"{version}: probe exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        raw[version] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{version}: {json.dumps(raw[version], sort_keys=True)} ({time.monotonic() - t0:.1f} s)", flush=True)
    block = labels_block(raw)
    print(json.dumps(block, sort_keys=True))
    if not ns.no_write:
        write_labels(REPO / "reports" / "atlas", block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
