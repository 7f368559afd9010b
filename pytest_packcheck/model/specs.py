"""Model specs: which model a cell runs (the audit definitions read from ``audit/`` are in :mod:`pytest_packcheck.config.audits`).

A model spec is one of:
- ``org/name`` or ``org/name@revision``: a Hub model ID (branch, tag or commit SHA);
- a local directory holding ``config.json`` (and weights for ``--packcheck-weights=pretrained``);
- ``arch:<model_type>``: a tiny random model of an architecture of the installed transformers;
- ``encoder:<model_type>``: the same, built as an encoder (its masked-LM head, else its base model: the encoders
  suite, audit/encoders.toml), labelled ``<model_type>-encoder``;
- ``vlm:<model_type>``: the same, built as a vision-language model with its image tower
  (``AutoModelForImageTextToText``: LLaVA, PaliGemma, Mistral 3, Idefics3 ..., which have no causal-LM class; the
  multimodal suite feeds it pixels, audit/multimodal.toml), labelled ``<model_type>-vlm``.

Any spec may end with config overrides in braces, ``arch:dbrx{attn_config.clip_qkv=8}`` (recorded in each cell).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, has_control_character, scrub_secrets

#: What ``arch:`` takes: a transformers model_type (CONFIG_MAPPING also holds a key that is none, "EvollaModel").
ARCH_NAME = re.compile(r"[a-z0-9_\-]+")
# org/name, or a legacy ID without an org (gpt2, bert-base-uncased)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec. ``kind`` is "hub", "local" or "arch"."""

    raw: str
    kind: str
    name: str  # Hub repo ID, absolute local path, or model_type
    revision: str | None = None
    #: config overrides (``arch:dbrx{attn_config.clip_qkv=8}``): (key, value) pairs, dotted keys reach sub-configs
    overrides: tuple[tuple[str, Any], ...] = ()
    #: which head the model is built with: "causal_lm" (every decoder), "encoder" (an ``encoder:`` spec: the
    #: masked-LM head, else the base model; :func:`..model.architectures.encoder_class_name`), or "vlm" (a ``vlm:``
    #: spec: the image-text-to-text class, :func:`..model.architectures.vlm_class_name`)
    head: str = "causal_lm"

    @property
    def label(self) -> str:
        """The short label used in test ids and matrix rows (secrets scrubbed: see :func:`scrub_secrets`)."""
        if self.kind == "arch":
            base = self.name + {"encoder": "-encoder", "vlm": "-vlm"}.get(self.head, "")
        elif self.kind == "local":
            base = Path(self.name).name
        else:
            base = self.name + (f"@{self.revision}" if self.revision else "")
        return scrub_secrets(base + (f"{{{format_overrides(self.overrides)}}}" if self.overrides else ""))


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets: ``arch:a{x=[1,2]},arch:b`` is two specs."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth <= 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def format_overrides(overrides: tuple[tuple[str, Any], ...] | list[tuple[str, Any]]) -> str:
    return ",".join(f"{k}={json.dumps(v, separators=(',', ':')) if not isinstance(v, str) else v}" for k, v in overrides)


def parse_overrides(text: str, where: str) -> tuple[tuple[str, Any], ...]:
    """``key=value`` items, comma-separated; a value is JSON when it parses (8, 1e-3, true, null, ["conv", ...]),
    else a string. Keys may be dotted (attn_config.clip_qkv) to reach a sub-config.

    Raises:
        PackcheckUsageError: an item without ``=``, a key that is not a dotted identifier, or a key given twice
            (``arch:llama{a=1,a=2}``, ``--packcheck-config a=1 --packcheck-config a=2``: no silent last-wins),
            naming the key, both values and ``where``.
    """
    items: list[tuple[str, Any]] = []
    said: dict[str, str] = {}
    for item in split_top(text):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key):
            raise PackcheckUsageError(
                f"Bad config override '{item.strip()}' ({where}): write key=value with a config key, e.g. "
                "arch:dbrx{attn_config.clip_qkv=8} or --packcheck-config clip_qkv=8.")
        if key in said:
            raise PackcheckUsageError(
                f"Config key '{key}' given twice ({where}): {key}={said[key]} and {key}={value.strip()}; give each key "
                "once, with the value you mean.")
        said[key] = value.strip()
        try:
            parsed: Any = json.loads(value.strip())
        except json.JSONDecodeError:
            parsed = value.strip()
        items.append((key, parsed))
    return tuple(items)


def _first_brace_pair_end(text: str) -> int | None:
    """Index of the '}' that closes the first '{' of ``text`` (brackets inside a value nest), None when unclosed."""
    depth = 0
    for i, ch in enumerate(text[text.find("{"):], start=text.find("{")):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return i
    return None


def parse_model_spec(raw: str, source: str) -> ModelSpec:
    """Parse one model spec.

    Raises:
        PackcheckUsageError: the spec is malformed, a local path that does not exist, or a file (``./m/config.json``:
            pass its folder) (names the value and ``source``, e.g. "--packcheck-models").
    """
    text = raw.strip()
    if has_control_character(text):  # a hostile trial: a newline in a revision split the error line
        raise PackcheckUsageError(f"Model spec {text!r} (from {source}) holds a control character (a newline, tab, ...): "
                                  "write the spec on one line, org/name[@rev], a local directory or arch:<model_type>.")
    overrides: tuple[tuple[str, Any], ...] = ()
    if text.endswith("}") and "{" in text and _first_brace_pair_end(text) == len(text) - 1:
        text, _, body = text[:-1].partition("{")
        overrides = parse_overrides(body, f"in model spec '{raw.strip()}' from {source}")
        spec = parse_model_spec(text, source)
        return ModelSpec(raw=raw.strip(), kind=spec.kind, name=spec.name, revision=spec.revision, overrides=overrides,
                         head=spec.head)
    if ("{" in text or "}" in text) and not os.path.isdir(text):
        end = _first_brace_pair_end(text)
        brace = ("a '}' without its '{'" if "{" not in text else "an unclosed '{'" if end is None
                 else "a second pair of braces" if text[end + 1:].lstrip().startswith("{")
                 else "text after the closing '}'")
        raise PackcheckUsageError(f"Malformed model spec '{raw}' (from {source}): {brace}; write the overrides last, in one pair "
                                  "of braces, e.g. arch:llama{num_hidden_layers=2,tie_word_embeddings=true}.")
    if not text:
        raise PackcheckUsageError(f"Empty model spec in {source}. Give org/name[@rev], a local directory or arch:<model_type>.")
    if text.startswith("arch:"):
        model_type = text.removeprefix("arch:").strip()
        if not ARCH_NAME.fullmatch(model_type):
            raise PackcheckUsageError(
                f"Malformed model spec '{raw}' (from {source}): arch: takes a transformers model_type such as arch:llama."
            )
        return ModelSpec(raw=text, kind="arch", name=model_type)
    for head, example in (("encoder", "bert"), ("vlm", "llava")):
        if text.startswith(f"{head}:"):
            model_type = text.removeprefix(f"{head}:").strip()
            if not ARCH_NAME.fullmatch(model_type):
                raise PackcheckUsageError(f"Malformed model spec '{raw}' (from {source}): {head}: takes a transformers "
                                          f"model_type such as {head}:{example}.")
            return ModelSpec(raw=text, kind="arch", name=model_type, head=head)
    if os.path.isdir(text):
        return ModelSpec(raw=text, kind="local", name=str(Path(text).resolve()))
    if os.path.isfile(text) and (_looks_local(text) or text.endswith(".json")):  # trial 7, 204: it exists, as a file
        folder = os.path.dirname(text) or "."
        raise PackcheckUsageError(
            f"Model spec '{raw}' (from {source}) is a file, not a model folder: pass the model's folder (the one holding "
            f"config.json), e.g. '{folder}'."
        )
    if _looks_local(text):
        raise PackcheckUsageError(
            f"No such folder '{raw}' (from {source}): the path does not exist here (checked before the Hub, since it "
            "looks like a local path). Fix the path, or write a Hub ID as org/name."
        )
    repo, _, revision = text.partition("@")
    if "@" in text and not revision:
        raise PackcheckUsageError(
            f"Model spec '{raw}' (from {source}) ends with '@' but names no revision: write org/name@<branch|tag|sha> or drop the '@'."
        )
    if not _HUB_ID.match(repo):
        raise PackcheckUsageError(
            f"Malformed model spec '{raw}' (from {source}): expected a Hub ID org/name[@rev], an existing local "
            "directory, or arch:<model_type>."
        )
    return ModelSpec(raw=text, kind="hub", name=repo, revision=revision or None)


def _looks_local(text: str) -> bool:
    """A spec that can only be a path (./x, ../x, /x, ~/x, a.b/c/d), or whose first part is a local folder
    (``models/llama`` with ``models/`` here): asking the Hub for it would only retry for half a minute."""
    if text.startswith(("./", "../", "/", "~", ".\\")) or text.count("/") > 1 or "\\" in text:
        return True
    first = text.split("/", 1)[0]
    return "/" in text and "@" not in text and os.path.isdir(first)


def parse_model_list(value: str | list[str], source: str) -> list[ModelSpec]:
    """Parse a comma-separated list (or a list of strings) of specs, dropping duplicates, keeping order.

    Raises:
        PackcheckUsageError: a malformed spec, an empty list, or two specs with one :attr:`ModelSpec.label` (the
            label keys a model's matrix rows, cell ids and test ids: ``arch:llama`` beside a folder ``./m/llama``,
            or two folders of one name, kept only one of them without a word; trial 11, 84 / 85).
    """
    items = split_top(value) if isinstance(value, str) else list(value)
    specs: list[ModelSpec] = []
    by_label: dict[str, ModelSpec] = {}
    for item in items:
        if not item.strip():
            continue
        spec = parse_model_spec(item, source)
        if spec in specs:
            continue
        other = by_label.setdefault(spec.label, spec)
        if other is not spec:
            raise PackcheckUsageError(
                f"Model specs {scrub_secrets(other.raw)!r} and {scrub_secrets(spec.raw)!r} (from {source}) have one label, "
                f"{spec.label!r}, which names a model's matrix rows, cell ids and test ids: give one of them, or copy or "
                "link a local folder under another name (a local folder is labelled by its folder name).")
        specs.append(spec)
    if not specs:
        raise PackcheckUsageError(
            f"The model list from {source} is empty: give at least one model, e.g. --packcheck-models=arch:llama."
        )
    return specs
