"""Fidelity of the flash stand-ins: library code that branches on the backend's *name*.

packcheck's stand-ins (``packcheck_flash_ref``, ``packcheck_flash_torch_varlen``) run transformers' real flash
path, but a model, transformers or TRL that tests ``_attn_implementation == "flash_attention_2"`` (or a list of
flash names) sees the stand-in's own name and takes its non-flash branch. Real FA2 would take the other one, so
such a cell says nothing about FlashAttention-2: it is reported as "differs from real FA2 because <file:line>"
(status skipped, cause ``stand_in_differs``, the stand-in's own measurement kept in the evidence), never as a
verdict. The branches are read from the installed source at run time, so every release is covered as it is.

Found by grepping the wheels (README "Stand-in fidelity" lists them with their release ranges), e.g. TRL 0.19.1
``sft_trainer.py:449`` ``return_position_ids=model.config._attn_implementation == "flash_attention_2"`` and
0.21.0 - 0.23.0 ``use_flash_attention = model.config._attn_implementation in [...]`` feeding
``return_position_ids=use_flash_attention`` (TRL 0.23.1 moved to ``FLASH_ATTENTION_VARIANTS`` and sends
position_ids to every backend); transformers 4.57.1's decoders' ``_update_causal_mask`` (dbrx, bloom, ...:
``if self.config._attn_implementation == "flash_attention_2"``). transformers 5.24 and TRL 1.16 have none on
the training path.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any

from ..backends.table import PACKCHECK_REGISTERED

#: In modeling code: a test of the attention implementation's name against flash_attention_2 (==, !=, in a
#: list), on one source line (comments excluded).
_MODEL_BRANCH = re.compile(
    r"""_attn_implementation\s*(?:==|!=)\s*["']flash_attention_2["']"""
    r"""|_attn_implementation\s+(?:not\s+)?in\s*[\[\({]\s*(?:$|["']flash_attention_2)""")
#: In TRL: the lines that turn the name into behaviour (the collator's position_ids); its other name tests
#: only warn (0.16 - 0.23: "padding-free is only supported with flash_attention_2")
_TRL_BRANCH = re.compile(r"""return_position_ids\s*=\s*.*_attn_implementation|use_flash_attention\s*=\s*.*_attn_implementation""")

#: Stand-in backends whose name is not flash_attention_2 where the model is built under their own name
#: (transformers >= 4.55.1: on 4.44 .. 4.55.0 the reference is built as flash_attention_2, see
#: backends/registration.py): the backends packcheck registers, from the backend table
STAND_INS = PACKCHECK_REGISTERED


@functools.lru_cache(maxsize=64)
def _branches_in(path: str, trl: bool = False) -> tuple[str, ...]:
    """``file:line: code`` of each name branch in one source file (read once)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ()
    found = []
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    for number, line in enumerate(lines, 1):
        code = line.split("#", 1)[0]
        if (_TRL_BRANCH if trl else _MODEL_BRANCH).search(code):
            found.append(f"{short}:{number}: {code.strip()[:140]}")
    return tuple(found)


def _file_of(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    try:
        return inspect.getsourcefile(module) if module is not None else None
    except TypeError:
        return None


def name_branches(model: Any, with_trl: bool = False) -> list[str]:
    """Every branch on the flash_attention_2 name in the modeling modules of ``model``'s own classes (every
    module of its submodules: one model's branches never mark another's cell), plus, with ``with_trl``, the
    lines of TRL's SFTTrainer that build the collator from the name: ``file:line: code`` each. transformers'
    masking_utils (4.57: chunked attention only) is not read: no default decoder takes that path."""
    files: list[tuple[str, bool]] = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        if name.startswith("transformers.models.") or not name.startswith(("torch.", "transformers.", "pytest_packcheck.")):
            path = _file_of(name)
            if path and (path, False) not in files:
                files.append((path, False))
    if with_trl:
        path = _file_of("trl.trainer.sft_trainer")
        if path:
            files.append((path, True))
    return [b for f, trl in files for b in _branches_in(f, trl)]


def stand_in_differs(model: Any, backend: str | None, with_trl: bool = False) -> list[str]:
    """The name branches that make this stand-in cell differ from real FA2: empty unless ``backend`` is a
    stand-in and the model runs under the stand-in's own name (then a ``== "flash_attention_2"`` branch takes the
    non-flash side)."""
    if backend not in STAND_INS:
        return []
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "flash_attention_2":  # 4.44 .. 4.55.0: built as FA2
        return []
    return name_branches(model, with_trl)
