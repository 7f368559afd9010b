"""The suite runs on pinned, tested library versions (issue 41, part 0): CI installs from constraints/test.txt, the
README's test command is the one `.ci/run` runs, and a test that asserts an upstream behaviour names the release it
holds for. A fresh install on a day the index serves a new transformers must not turn the suite red."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: the libraries whose behaviour the suite asserts: each must be pinned exactly
ASSERTED = ("torch", "transformers", "trl", "accelerate", "tokenizers", "huggingface_hub", "datasets")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / "test.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints/test.txt: {line!r} is not an exact pin (name==version)"
            pins[name.lower().replace("-", "_")] = version
    return pins


def test_the_libraries_the_suite_asserts_are_pinned_exactly():
    pins = _pins()
    missing = [name for name in ASSERTED if name not in pins]
    assert not missing, f"constraints/test.txt does not pin {missing}"
    assert pins["torch"] == "2.13.0"  # the CPU build on this disk; never an unpinned (CUDA) torch


def test_ci_runs_the_readme_test_install_with_the_pins():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    install = re.search(r"pip install -q (-c constraints/test\.txt -e '\.\[test,docs\]')", ci)
    assert install, "`.ci/run` does not install with -c constraints/test.txt"
    assert f"pip install {install.group(1)} && python -m pytest tests -n 2 -q -p no:cacheprovider" in readme
    assert "python -m pytest tests -n 2 -q -p no:cacheprovider" in ci

