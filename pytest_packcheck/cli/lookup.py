"""``packcheck lookup``: does packing work for MODEL_TYPE on ATTN at this transformers? Answered offline from the
atlas (``reports/atlas/support.json``)."""

from __future__ import annotations

import argparse


def configure(lookup: argparse.ArgumentParser) -> None:
    lookup.description = "Answers offline from reports/atlas/support.json (the committed atlas)."
    lookup.add_argument("model_type", help="config.model_type (e.g. qwen2), or a Hub model ID in the local cache, a model "
                        "folder or a config.json path (read offline).")
    lookup.add_argument("attn_implementation", help="eager, sdpa, flash_attention_2 (answered from packcheck_flash_ref), ...")
    lookup.add_argument("transformers_version", help="e.g. 4.56.2; a bare minor (4.53) is answered for each of its patches.")
    lookup.add_argument("--trl", default=None, help="TRL version: also answer SFTTrainer's packing=True and padding_free "
                        "paths from the atlas's TRL axis (e.g. 0.24.0).")
    from ..analysis.axis_table import LIBRARY_AXES

    for library, axis in LIBRARY_AXES.items():  # one flag per library axis of the atlas (the one table)
        if library != "trl":
            lookup.add_argument(f"--{library}", default=None, metavar="VERSION", help=(
                f"{library} release: also answer its own packed path ({axis.check}, {axis.source})" if axis.kind == "rl_trainer"
                else f"{library} release: also answer the stack elements through the trainers ({axis.source}; --stack picks one)"))
    lookup.add_argument("--stack", default=None, metavar="ELEMENT", help="A stack element (lora, dora, prompt_tuning, "
                        "prefix_tuning, cp) asked of --peft / --accelerate / --trl's stack axis (reports/atlas/stack.json).")
    lookup.add_argument("--support-file", default=None, help="support.json to read (default: the packaged atlas).")
    lookup.add_argument("--json", action="store_true", help="Print the answer as JSON.")


def run(ns: argparse.Namespace) -> int:
    """``packcheck lookup``: exit 0 with a measured answer, 1 when not measured, as :data:`pytest_packcheck.cli.EXIT_CODES` says
    (``packcheck --help``'s list, the one source)."""
    import json

    from ..analysis.axis_table import LIBRARY_AXES
    from ..errors import scrub_secrets
    from ..support import is_bare_minor, lookup_releases

    libraries = {k: getattr(ns, k.replace("-", "_")) for k in LIBRARY_AXES if k != "trl" and getattr(ns, k.replace("-", "_"), None)}
    answers = lookup_releases(ns.model_type, ns.attn_implementation, ns.transformers_version, ns.trl, path=ns.support_file,
                              libraries=libraries or None, stack=ns.stack)
    outside = list(dict.fromkeys(a["line"] for answer in answers for a in answer.axes if a["outside"]))
    if outside and not ns.json:  # a library release outside what its axis measured: one line naming the range, nothing else
        print(scrub_secrets("\n".join(outside)))
        return 1
    if ns.json:
        body = answers[0].as_dict() if len(answers) == 1 and not is_bare_minor(ns.transformers_version) else {
            "minor": ns.transformers_version, "answers": [a.as_dict() for a in answers]}
        text = json.dumps(body, indent=1)
    else:
        text = "\n\n".join(str(a) for a in answers)
    # a token typed where the model type belongs is not echoed back (the answer names the model type it was asked)
    print(scrub_secrets(text))
    return 0 if all(a.answered and (not ns.trl or a.trl.get("measured")) and all(x["measured"] for x in a.axes)
                    for a in answers) else 1
