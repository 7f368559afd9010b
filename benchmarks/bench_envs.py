"""Benchmark: version-environment creation, cold and warm (issue target: warm under 10 s per environment).

    python benchmarks/bench_envs.py [transformers==4.51.3,4.56.2,5.14.1]

Three passes over the same combinations, in a fresh packcheck cache:
- cold: empty uv cache and no environment (downloads the wheels from the package index);
- rebuilt: environments deleted, uv cache kept (what a new requirement set costs once wheels are cached);
- warm: the environments exist (what every later audit pays).
Prints one line per environment and pass, then the medians. torch is never installed (checked).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "transformers==4.51.3,4.56.2,5.14.1"
    root = Path(tempfile.mkdtemp(prefix="packcheck-bench-envs-"))
    os.environ["PACKCHECK_CACHE_DIR"] = str(root)
    os.environ.pop("UV_CACHE_DIR", None)  # uv's cache goes under the fresh packcheck cache: a cold start
    from pytest_packcheck.versions import envs

    torch_before = metadata.distribution("torch").version
    combos = envs.parse_versions([spec], "argv")
    figures: dict[str, list[float]] = {"cold": [], "rebuilt": [], "warm": []}
    try:
        for phase in ("cold", "rebuilt", "warm"):
            if phase == "rebuilt":
                shutil.rmtree(root / "envs")
            for combo in combos:
                env = envs.ensure_env(combo)
                figures[phase].append(env.seconds)
                print(f"{phase:8s} {combo.label:28s} {env.seconds:6.2f} s  ({'made' if env.created else 'found'}; "
                      f"{', '.join(f'{k} {v}' for k, v in sorted(env.versions.items()))})")
        assert metadata.distribution("torch").version == torch_before, "torch changed"
        print(" ".join(f"{k} median {statistics.median(v):.2f} s (max {max(v):.2f});" for k, v in figures.items())
              + f" {len(combos)} environments, {os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
