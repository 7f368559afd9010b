"""Benchmark: `packcheck audit --audit rl` against its floor, in the same run (issue 44: at most 3 minutes wall on 2
quiet cores; the default audit's time does not grow, since the RL suite is opt in).

    python benchmarks/bench_rl.py [--repeat N]

The floor: the same models built once per backend and the same check functions called directly in one process
(no pytest, no forked children, no reports). Prints each run's wall seconds, their medians and the ratio.
"""

from __future__ import annotations

import time

from suite_timing import audit_seconds, repeat_parser, repeated, suite_definition


def floor_seconds() -> float:
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.registry import SPECS
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    audit = suite_definition("rl")
    tol = load_tolerances(None, None, "bench")[0]["float32"]
    t0 = time.perf_counter()
    for spec in audit["models"]:
        resolved = resolve_model(parse_model_spec(spec, "bench"), "bench")
        for i, backend in enumerate(audit["backends"]):
            ensure_registered(backend)
            try:
                model = build_model(resolved, backend, "float32")
            except Exception:  # noqa: BLE001, S112 - a backend the model refuses costs the floor nothing either
                continue
            wb = Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tol)
            for check in audit["checks"]:
                if SPECS[check].level == "model" and i:
                    continue
                try:
                    SPECS[check].load()(wb)
                except Exception:  # noqa: BLE001, S110 - a crash is the cell verdict in the audit too
                    pass
    return time.perf_counter() - t0


def main() -> int:
    ns = repeat_parser(__doc__).parse_args()
    median = repeated(ns.repeat, {"audit": lambda: audit_seconds("rl"), "floor": floor_seconds},
                      lambda run: f"audit --audit rl {run['audit']:.1f} s wall; floor {run['floor']:.1f} s")
    a, f = median["audit"], median["floor"]
    print(f"median: audit {a:.1f} s, floor {f:.1f} s, ratio {a / f:.2f}x (target: audit <= 180 s on 2 quiet cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
