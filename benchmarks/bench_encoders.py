"""Benchmark: `packcheck audit --audit encoders` against its floor, in the same run (issue 46: at most 3 minutes wall
on 2 quiet cores for the default set; the default audit's time does not grow, since the suite is opt in).

    python benchmarks/bench_encoders.py [--repeat N]

The floor: the same models built (every model x backend of audit/encoders.toml, as the audit builds them) and, on
each, one forward of the packed row and one forward of each example alone: the least any packed-vs-alone
comparison costs. Prints each run's wall seconds, their medians and the ratio, and the load average.
"""

from __future__ import annotations

import time

from suite_timing import audit_seconds, load_average, repeat_parser, repeated, suite_definition


def floor_seconds() -> float:
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.encoders import alone_hidden, hidden_states, packed_row
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import _no_compile_on_cpu

    audit = suite_definition("encoders")
    tol = load_tolerances(None, None, "bench")[0]["float32"]
    t0 = time.perf_counter()
    for spec in audit["models"]:
        resolved = resolve_model(parse_model_spec(spec, "bench"), "bench")
        for backend in audit["backends"]:
            ensure_registered(backend)
            try:
                model = build_model(resolved, backend, "float32")
            except Exception:  # noqa: BLE001, S112 - a backend the model refuses costs the floor nothing either
                continue
            wb = Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tol)
            with _no_compile_on_cpu(backend, "cpu"):
                hidden_states(wb, packed_row(wb))
                for example in wb.examples:
                    alone_hidden(wb, example)
    return time.perf_counter() - t0


def main() -> int:
    ns = repeat_parser(__doc__).parse_args()
    median = repeated(ns.repeat, {"audit": lambda: audit_seconds("encoders"), "floor": floor_seconds},
                      lambda run: "audit --audit encoders {:.1f} s wall; floor {:.1f} s; load average {:.1f} on {} "
                                  "cores".format(run["audit"], run["floor"], *load_average()))
    a, f = median["audit"], median["floor"]
    print(f"median: audit {a:.1f} s, floor {f:.1f} s, ratio {a / f:.2f}x (target: audit <= 180 s on 2 quiet cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
