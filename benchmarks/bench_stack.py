"""Benchmark: `packcheck audit --audit stack` against its floor, in the same run (issue 45: at most 5 minutes wall on
2 quiet cores; the default audit's time does not grow, since the stack elements are opt in).

    python benchmarks/bench_stack.py [--repeat N]

Two floors, in the same run as the audit: ``checks``, the same models built once per backend and element
(model/stack.py's apply_element) and the same check functions called directly in one process (no pytest, no forked
children, no reports); ``compute``, the same models and elements with only the work every verdict needs: one packed
fwd+bwd of the default row and each example alone (forward). Prints each run's wall seconds, their medians, the
ratios and the load average (the machine is shared: say which load a number was taken at).
"""

from __future__ import annotations

import contextlib
import time

from suite_timing import audit_seconds, load_average, repeat_parser, repeated, suite_definition


def floor_seconds(compute: bool = False) -> float:
    """Seconds of the ``checks`` floor, or with ``compute`` of the ``compute`` floor (one packed fwd+bwd and each
    example alone per model, element and backend)."""
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.registry import SPECS
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.model.stack import apply_element

    audit = suite_definition("stack")
    tol = load_tolerances(None, None, "bench")[0]["float32"]
    t0 = time.perf_counter()
    for spec in audit["models"]:
        resolved = resolve_model(parse_model_spec(spec, "bench"), "bench")
        for element in audit["stack"]:
            for backend in audit["backends"]:
                ensure_registered(backend)
                try:
                    model = apply_element(build_model(resolved, backend, "float32"), element, backend)
                except Exception:  # noqa: BLE001, S112 - an element that cannot run costs the floor nothing either
                    continue
                wb = Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tol)
                if compute:
                    with contextlib.suppress(Exception):  # an element that crashes is an error cell in the audit
                        wb.param_grads(wb.packed())
                        [wb.solo(e) for e in wb.examples]
                    continue
                for check in audit["checks"]:
                    try:
                        SPECS[check].load()(wb)
                    except Exception:  # noqa: BLE001, S110 - a crash is the cell verdict in the audit too
                        pass
    return time.perf_counter() - t0


def main() -> int:
    ns = repeat_parser(__doc__).parse_args()
    median = repeated(ns.repeat, {"audit": lambda: audit_seconds("stack"), "checks": floor_seconds,
                                  "compute": lambda: floor_seconds(compute=True)},
                      lambda run: "audit --audit stack {:.1f} s wall; checks floor {:.1f} s; compute floor {:.1f} s; load "
                                  "{:.1f} on {} cores".format(run["audit"], run["checks"], run["compute"], *load_average()))
    a, f, c = median["audit"], median["checks"], median["compute"]
    print(f"median: audit {a:.1f} s, checks floor {f:.1f} s (ratio {a / f:.2f}x), compute floor {c:.1f} s (ratio "
          f"{a / c:.2f}x; target: audit <= 300 s on 2 quiet cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
