"""The flags' names, alone: what an answer that quotes a command needs (``packcheck lookup``'s reproduce line)
without the option table, whose help texts import the check registry, the stack table and the backend table
(:mod:`.options` re-exports every name here and describes each flag once)."""

from __future__ import annotations

OPT_MODELS = "--packcheck-models"
OPT_AUDIT = "--packcheck-audit"
OPT_ALL_ARCHS = "--packcheck-all-architectures"
OPT_BACKENDS = "--packcheck-attn"
OPT_CHECKS = "--packcheck-checks"
OPT_DTYPES = "--packcheck-dtypes"
OPT_WEIGHTS = "--packcheck-weights"
OPT_DEVICE = "--packcheck-device"
OPT_TRUST = "--packcheck-trust-remote-code"
OPT_REPORT_DIR = "--packcheck-report-dir"
OPT_TOLERANCES = "--packcheck-tolerances"
OPT_TOLERANCE = "--packcheck-tolerance"
OPT_BASELINE = "--packcheck-baseline"
OPT_SHARD = "--packcheck-shard"
OPT_VERSIONS = "--packcheck-versions"
OPT_TIMEOUT = "--packcheck-timeout"
#: The flag keeps its name; the value (fork / none) is how each model's cells are sandboxed, so its Settings field
#: is ``sandbox`` (the run/sandbox module), not "isolation", which is also a check.
OPT_ISOLATION = "--packcheck-isolation"
OPT_RESUME = "--packcheck-resume"
OPT_LENGTHS = "--packcheck-lengths"
OPT_SLIDING_WINDOW = "--packcheck-sliding-window"
OPT_CONFIG = "--packcheck-config"
OPT_STACK = "--packcheck-stack"
