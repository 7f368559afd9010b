"""What a results document means: why a cell failed and what to do (:mod:`.diagnose`, reading the cause records
of :mod:`pytest_packcheck.checks.causes` and ``audit/known_faults.toml``), the verdict rules (:mod:`.verdict_rules`),
the gate (two results compared), bisect (the release that changed a cell) and where packcheck's CPU stand-in for a
flash backend may take another branch than the real one (:mod:`.fidelity`)."""
