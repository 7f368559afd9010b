"""``python -m pytest_packcheck.cli``: the ``packcheck`` console script."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
