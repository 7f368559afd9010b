"""The checks: plain functions ``check(wb: Workbench) -> CheckResult`` over one shared workbench.

Read :mod:`.registry` first (every check described once: level, role, key number, tolerance, causes, suite,
requirements), then :mod:`.causes` (every cause code's meaning and remedy), then a family module:

- :mod:`.workbench`: the :class:`Workbench` (one built model, its examples, cached reference runs);
- :mod:`.reference`: each example alone, the one reference every comparison is made against;
- :mod:`.probes`: the probes a parity difference reads its cause from (leak, positions, sliding window);
- :mod:`.mechanisms`: top-k selection ties and mechanisms the probe row never exercises;
- :mod:`.collate`, :mod:`.parity`, :mod:`.attention`, :mod:`.traps`, :mod:`.variants`: the model checks;
- :mod:`.training`, :mod:`.sft`, :mod:`.sft_probes`, :mod:`.packing`: transformers' Trainer and TRL's SFTTrainer;
- :mod:`.listing`: ``packcheck checks``.

Importing this package imports neither torch nor transformers nor the registry (the plugin reads the registry while
pytest loads; ``lookup`` needs only :mod:`.causes`): the names below are resolved on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKS", "DEFAULT_CHECKS", "MODEL_LEVEL_CHECKS", "SPECS", "Workbench", "expected_attention_calls",
           "mismatch_cause", "stateful_layers"]

# what callers outside the package use, by module (the check functions are found through the registry)
_LAZY = {"Workbench": "workbench", "mismatch_cause": "probes", "stateful_layers": "probes",
         "expected_attention_calls": "attention", "CHECKS": "registry", "DEFAULT_CHECKS": "registry",
         "MODEL_LEVEL_CHECKS": "registry", "SPECS": "registry"}


def __getattr__(name: str) -> Any:
    """``checks.Workbench``, ``checks.check_isolation`` (any registered check's function), ...: imported on first
    use, so importing the package stays light."""
    import importlib

    if name in _LAZY:  # the registry too: ``checks.causes`` (lookup's cause words) needs none of it
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    from .registry import SPECS

    spec = next((s for s in SPECS.values() if s.function.partition(":")[2] == name), None)
    if spec is not None:  # the function itself, as its module defines it (not CheckSpec.load, which tests wrap)
        module, _, attr = spec.function.partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
