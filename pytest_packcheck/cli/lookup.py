"""``packcheck lookup``: does packing work for MODEL_TYPE on ATTN at this transformers? Answered offline from the
atlas (``reports/atlas/support.json``)."""

from __future__ import annotations

import argparse


def configure(lookup: argparse.ArgumentParser) -> None:
    lookup.description = "Answers offline from reports/atlas/support.json (the committed atlas)."
    lookup.add_argument("model_type", help="config.model_type, e.g. qwen2.")
    lookup.add_argument("attn_implementation", help="eager, sdpa, flash_attention_2 (answered from packcheck_flash_ref), ...")
    lookup.add_argument("transformers_version", help="e.g. 4.56.2.")
    lookup.add_argument("--trl", default=None, help="TRL version: also answer SFTTrainer's packing=True and padding_free "
                        "paths from the atlas's TRL axis (e.g. 0.24.0).")
    lookup.add_argument("--support-file", default=None, help="support.json to read (default: the packaged atlas).")
    lookup.add_argument("--json", action="store_true", help="Print the answer as JSON.")


def run(ns: argparse.Namespace) -> int:
    """``packcheck lookup``: exit 0 with a measured answer, 1 when not measured, as :data:`pytest_packcheck.cli.EXIT_CODES` says
    (``packcheck --help``'s list, the one source)."""
    import json

    from ..errors import scrub_secrets
    from ..support import lookup

    answer = lookup(ns.model_type, ns.attn_implementation, ns.transformers_version, ns.trl, path=ns.support_file)
    # a token typed where the model type belongs is not echoed back (the answer names the model type it was asked)
    print(scrub_secrets(json.dumps(answer.as_dict(), indent=1) if ns.json else str(answer)))
    return 0 if answer.answered and (not ns.trl or answer.trl.get("measured")) else 1
