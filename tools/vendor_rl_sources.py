"""Rebuild packcheck's vendored copies of prime-rl's and open-instruct's packing and log-prob functions (issue 44).

Neither project is on PyPI and CI reaches package registries only, so the functions the RL checks run
(:mod:`pytest_packcheck.checks.rl_packers`) are copied verbatim from a snapshot of each repository into
``pytest_packcheck/checks/vendor/*.py.txt`` (both Apache-2.0: their LICENSE files sit beside them). Each file is a
header (the licence notice, the repository URL, the commit, the source ranges), a preamble of the imports the blocks
need (written by packcheck, marked), then every block byte for byte as the commit has it, each under a
``# ---- <path>:<first>-<last>`` line. ``tests/test_rl_packers.py`` checks the blocks against the snapshot when it is
on the machine.

    python tools/vendor_rl_sources.py --prime-rl /work/.mirror/PrimeIntellect-ai+prime-rl/repo \\
        --open-instruct /work/.mirror/allenai+open-instruct/repo
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[1] / "pytest_packcheck" / "checks" / "vendor"

#: name -> (repository URL, [(path, first line, last line)], preamble)
SOURCES = {
    "prime_rl": ("https://github.com/PrimeIntellect-ai/prime-rl", [
        ("src/prime_rl/trainer/rl/loss.py", 50, 91),
        ("src/prime_rl/trainer/batch.py", 14, 14),
        ("src/prime_rl/trainer/batch.py", 461, 617),
        ("src/prime_rl/trainer/batch.py", 637, 674),
        ("src/prime_rl/trainer/batch.py", 692, 738),
    ], (
        "import copy\n"
        "from collections.abc import Callable, Sequence\n"
        "from dataclasses import dataclass\n\n"
        "import torch\n"
        "from torch import Tensor\n\n"
        "# names the blocks read from elsewhere in prime-rl or its dependencies, given by the loader:\n"
        "# jaxtyped, typechecker, Bool, Float, Int (jaxtyping / beartype: shape annotations), MicroBatch,\n"
        "# EncodedTensor, RoutedExperts (prime_rl/transports/rollouts/types.py, msgspec Structs),\n"
        "# _copy_routed_experts, _pad_routed_experts, _expand_bins_by_splitting (never reached: no routed experts,\n"
        "# one train worker)\n"
    )),
    "open_instruct": ("https://github.com/allenai/open-instruct", [
        ("open_instruct/padding_free_collator.py", 8, 0),
        ("open_instruct/tensor_utils.py", 5, 0),
        ("open_instruct/rl_utils.py", 183, 375),
        ("open_instruct/model_utils.py", 326, 334),
        ("open_instruct/model_utils.py", 587, 600),
        ("open_instruct/grpo_utils.py", 340, 344),
        ("open_instruct/grpo_utils.py", 541, 648),
        ("open_instruct/dpo_utils.py", 826, 878),
    ], (
        "from dataclasses import dataclass\n"
        "from typing import Any, Generic, TypeVar\n\n"
        "import torch\n"
        "import torch.nn as nn\n"
        "import torch.nn.functional as F\n"
        "from transformers import DefaultDataCollator\n\n"
        "T = TypeVar(\"T\")  # open_instruct/rl_utils.py\n"
        "INVALID_LOGPROB = 1.0  # open_instruct/utils.py:83\n"
        "# names the blocks read from other open-instruct modules, given by the loader: tensor_utils (this file's\n"
        "# pad_to_length), model_utils (this file's log_softmax_and_gather / entropy_from_logits), olmo_core_utils,\n"
        "# data_types (never reached: HF models, pass_olmo_core_doc_lens False)\n"
    )),
}

HEADER = """# Vendored by packcheck from {url} at commit {commit} ({date}), verbatim blocks under the
# '# ---- path:first-last' lines; the preamble above them is packcheck's. Licensed under the Apache License,
# Version 2.0 (vendor/{name}_LICENSE.txt); changes: the blocks were cut out of their files and put together here,
# nothing inside a block was changed. Rebuilt by tools/vendor_rl_sources.py.
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def build(name: str, repo: Path) -> Path:
    url, blocks, preamble = SOURCES[name]
    commit, date = git(repo, "log", "-1", "--format=%H %cs").split()
    out = [HEADER.format(url=url, commit=commit, date=date, name=name), preamble]
    for path, first, last in blocks:
        lines = git(repo, "show", f"HEAD:{path}").splitlines(keepends=True)
        last = last or len(lines)
        out.append(f"\n# ---- {path}:{first}-{last}\n")
        out.append("".join(lines[first - 1:last]))
    target = VENDOR / f"{name}_{commit[:7]}.py.txt"
    target.write_text("".join(out))
    (VENDOR / f"{name}_LICENSE.txt").write_text(git(repo, "show", "HEAD:LICENSE"))
    print(target.relative_to(VENDOR.parents[2]), hashlib.sha256(target.read_bytes()).hexdigest())
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prime-rl", type=Path, required=True)
    parser.add_argument("--open-instruct", type=Path, required=True)
    args = parser.parse_args()
    build("prime_rl", args.prime_rl)
    build("open_instruct", args.open_instruct)


if __name__ == "__main__":
    main()
