"""Configuration: the option table (:mod:`.options`: flag, env, ini, default, parse, to_arg, written once), the
resolved :class:`~.settings.Settings`, the audit definitions (:mod:`.audits`) and tolerances (:mod:`.tolerances`).

Importing this package imports neither torch nor transformers (the plugin imports it while pytest loads).
"""
