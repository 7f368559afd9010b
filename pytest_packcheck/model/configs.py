"""Reading a model's config: ``config.json`` from a local folder or the Hub, an architecture's default config with
its checkpoints' layer variants, the spec's overrides, and the refusal of sizes no model can have."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError
from .specs import ModelSpec

#: Layer kinds an architecture's checkpoints have that its default config leaves out, as the layer_types
#: pattern of those checkpoints (cycled over the layers). LFM2's default is all full attention, but LFM2
#: checkpoints start conv, conv, full_attention, and its conv layers are what leaks in a packed row; Bamba's and
#: Granite-4.0-H's defaults are all mamba, their checkpoints mix in attention layers.
LAYER_VARIANTS: dict[str, tuple[str, ...]] = {
    "lfm2": ("conv", "conv", "full_attention"),
    "lfm2_moe": ("conv", "conv", "full_attention"),
    "bamba": ("linear_attention", "linear_attention", "full_attention"),
    "granitemoehybrid": ("linear_attention", "linear_attention", "full_attention"),
}


def apply_layer_variant(config: Any, model_type: str) -> list[str]:
    """Give an architecture's default config every layer kind of :data:`LAYER_VARIANTS` it lacks, in place;
    returns the note for the cell's model record ([] when the default already has them all)."""
    pattern = LAYER_VARIANTS.get(model_type)
    n_layers = getattr(config, "num_hidden_layers", None)
    if not pattern or not isinstance(n_layers, int):
        return []
    current = list(getattr(config, "layer_types", None) or [])
    missing = sorted(set(pattern) - set(current))
    if not missing:
        return []
    types = [pattern[i % len(pattern)] for i in range(n_layers)]
    try:
        config.layer_types = types
    except AttributeError:  # bamba: layer types derived from attn_layer_indices (a read-only property)
        config.attn_layer_indices = [i for i, t in enumerate(types) if t == "full_attention"]
    return [(f"layer variant: layer_types cycles {', '.join(pattern)} (the default config has no {', '.join(missing)} "
             "layer; checkpoints of this architecture do)")]


def default_config(config_class: Any, spec: ModelSpec) -> Any:
    """The architecture's default config, built with the spec's top-level overrides as arguments where the class
    takes them (a default that does not validate without them: gemma4_assistant), else without."""
    fields = set(getattr(config_class, "__dataclass_fields__", None) or inspect.signature(config_class).parameters)
    plain = {k: copy.deepcopy(v) for k, v in spec.overrides if "." not in k and k in fields}  # the config may rewrite a dict
    if plain:
        with contextlib.suppress(Exception):  # refused as arguments: set on the default config afterwards
            return config_class(**plain)
    return config_class()


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    return [(name, value) for name, value in vars(config).items() if hasattr(value, "to_dict") and hasattr(value, "model_type")]


#: Size keys a model cannot have outside [1, bound]: the shrink replaces them for its tiny models, so an absurd
#: value (hidden_size=0, num_hidden_layers=-2, vocab_size=10**9) would otherwise pass under the absurd label. The
#: bounds are 16x to 64x the largest released checkpoints (vocabulary 262,144: Gemma 3; hidden 16,384 and 126
#: layers: Llama 3.1 405B; 128 heads: DeepSeek-V3).
SIZE_BOUNDS = {"vocab_size": 2**24, "hidden_size": 2**18, "intermediate_size": 2**20, "num_hidden_layers": 2**12,
               "num_attention_heads": 2**12, "num_key_value_heads": 2**12, "head_dim": 2**12,
               # a context of 0 positions cannot hold the probe row (the shrink raised it quietly before)
               "max_position_embeddings": 2**24}


#: Config keys that must be a positive finite number when a spec sets them (what each is, for the message).
POSITIVE_KEYS = {"rope_theta": "RoPE base"}


#: Config keys holding a token id (one id, or a list of ids for eos): an id outside the vocabulary has no embedding
#: row. The shrink moves ids at or above its tiny vocabulary into it (shrink.py); an id the user typed outside the
#: model's own vocabulary is refused (:func:`refuse_absurd_sizes`), as an absurd size is.
SPECIAL_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def _holder(config: Any, key: str) -> Any:
    """The (sub-)config an override ``key`` was set on (:func:`apply_overrides`' rule), or None."""
    target, parts = config, key.split(".")
    for part in parts[:-1]:
        target = target.get(part) if isinstance(target, dict) else getattr(target, part, None)
    if len(parts) == 1 and not hasattr(config, key):
        owners = [sub for _, sub in _sub_configs(config) if hasattr(sub, key)]
        target = owners[0] if len(owners) == 1 else config
    return target


#: The overrides ``--packcheck-config`` folded into every spec (set by :func:`config.settings.resolve`), so
#: an error about one names that option, not the model list the spec came from.
CONFIG_OPTION_OVERRIDES: dict[str, Any] = {}


def _same(a: Any, b: Any) -> bool:
    """``a == b``, with NaN equal to NaN: ``--packcheck-config hidden_size=NaN`` was named as typed in the model
    spec, since NaN != NaN (trial 8, 145)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _origin(key: str, value: Any, spec: ModelSpec, source: str, lead: str = "in model spec") -> str:
    """Where the override ``key=value`` came from, for a message's parenthesis, each override named by its own
    source: ``from --packcheck-config key=value, applied to model spec '<spec as typed>' from <source>`` when that
    option folded this very value in; else ``<lead> '<spec as typed>' from <source>``, followed by ``(with
    --packcheck-config k=v applied)`` when the option folded other values into it. The spec is quoted as the user
    typed it, without the values the option folded in."""
    from ..config.options import OPT_CONFIG
    from .specs import format_overrides

    folded = [(k, v) for k, v in spec.overrides if k in CONFIG_OPTION_OVERRIDES and _same(CONFIG_OPTION_OVERRIDES[k], v)]
    own = [(k, v) for k, v in spec.overrides if not any(k == f and _same(v, w) for f, w in folded)]
    typed = spec.raw.partition("{")[0] + (f"{{{format_overrides(own)}}}" if own else "") if folded else spec.raw
    if any(key == f and _same(value, w) for f, w in folded):
        return f"from {OPT_CONFIG} {format_overrides([(key, value)])}, applied to model spec '{typed}' from {source}"
    applied = f", with {OPT_CONFIG} {format_overrides(folded)} applied" if folded else ""
    return f"{lead} '{typed}' from {source}{applied}"


def _refuse_absurd_token_ids(config: Any, spec: ModelSpec, source: str) -> None:
    """Refuse a typed special token id (:data:`SPECIAL_TOKEN_KEYS`) that is not None or an id of the vocabulary
    ``[0, vocab_size)`` of the config it was set on (``arch:llama{pad_token_id=-5}``: nn.Embedding wraps a negative
    padding_idx to ``vocab_size - 5``, a pad row nobody asked for, and transformers only warns).

    Raises:
        PackcheckUsageError: naming the key, the value, the spec, its source and the vocabulary.
    """
    for key, value in spec.overrides:
        if key.split(".")[-1] not in SPECIAL_TOKEN_KEYS or value is None:
            continue
        holder = _holder(config, key)
        vocab = getattr(holder, "vocab_size", None) if holder is not None else None
        if not isinstance(vocab, int):
            getter = getattr(config, "get_text_config", None)
            vocab = getattr(getter(), "vocab_size", None) if callable(getter) else None
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (isinstance(vocab, int) and v >= vocab):
                span = f"[0, {vocab:,})" if isinstance(vocab, int) else "[0, vocab_size)"
                raise PackcheckUsageError(
                    f"Config value {key}={v!r} ({_origin(key, value, spec, source, 'in an override of model spec')}) is not a token id "
                    f"of the model's vocabulary {span}: give an id inside it, null for no such token, or leave the key out "
                    "(packcheck would otherwise run a model whose special token is not the one named).")


def size_name(config: Any | None, key: str) -> str | None:
    """The :data:`SIZE_BOUNDS` name an override or config key stands for: its own last part, or the standard name
    the (sub-)config's ``attribute_map`` gives that part (gpt2's ``n_layer`` is ``num_hidden_layers``: trial 14,
    213, ``arch:gpt2{n_layer=0}`` passed the refusal that ``num_hidden_layers=0`` met). None for another key."""
    last = key.split(".")[-1]
    if last in SIZE_BOUNDS:
        return last
    holder = _holder(config, key) if config is not None else None
    amap = getattr(holder, "attribute_map", None) or getattr(type(holder), "attribute_map", None) or {}
    standard = next((k for k, v in amap.items() if v == last and k in SIZE_BOUNDS), None) if isinstance(amap, dict) else None
    return standard


def _refuse_sizes(found: list[tuple[str, Any, str]], spec: ModelSpec, source: str, config: Any | None = None) -> None:
    """Refuse the first ``(key, value, origin)`` of ``found`` whose value is not a whole number in [1, bound]."""
    for key, value, origin in found:
        bound = SIZE_BOUNDS[size_name(config, key)]
        for v in value if isinstance(value, list | tuple) else [value]:  # per-layer sizes (gemma3n) in a list
            if v is None and origin == "config.json":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= bound:
                where = (_origin(key, value, spec, source, "in an override of model spec") if origin == "override"
                         else f"in its config.json of model spec '{spec.raw}' from {source}")
                raise PackcheckUsageError(
                    f"Config value {key}={v!r} ({where}) is not a size a model "
                    f"can have: expected a whole number from 1 to {bound:,}. packcheck replaces sizes with tiny ones for "
                    "its probes, so this value would not run and its cells would pass under its label; give a real "
                    "size or leave the key out.")


def refuse_absurd_sizes(config: Any | None, spec: ModelSpec, source: str) -> None:
    """Refuse a size (:data:`SIZE_BOUNDS`) that is not a whole number in [1, bound]: an override the user typed
    (``arch:llama{hidden_size=0}``, ``--packcheck-config``), or a value of a checkpoint's / local config.json.
    Transformers' own default configs are not judged (glm5_next's default head_dim is 0 and is derived). A typed
    special token id outside the vocabulary is refused too (:func:`_refuse_absurd_token_ids`). ``config`` None:
    only the spec's typed sizes are judged (before any config exists).

    Raises:
        PackcheckUsageError: naming the key, the value, where it came from and the range.
    """
    found: list[tuple[str, Any, str]] = [(k, v, "override") for k, v in spec.overrides if k.split(".")[-1] in SIZE_BOUNDS]
    for key, value in spec.overrides:  # a RoPE base <= 0 (rope_theta=-1) gives nan / inf rotations, not a model
        if key.split(".")[-1] in POSITIVE_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)
                                                    or not 0 < value < float("inf")):
            raise PackcheckUsageError(
                f"Config value {key}={value!r} ({_origin(key, value, spec, source, 'in an override of model spec')}) "
                f"is not a {POSITIVE_KEYS[key.split('.')[-1]]} a model can have: expected a positive number, e.g. "
                f"{key}=1e6; give a real value or leave the key out.")
    if config is None:  # the typed sizes alone (before any config is made: packcheck bisect's --model)
        _refuse_sizes(found, spec, source)
        return
    # a model's own name for a size (gpt2's n_layer, t5's d_model: the config's attribute_map)
    found += [(k, v, "override") for k, v in spec.overrides if k.split(".")[-1] not in SIZE_BOUNDS and size_name(config, k)]
    if spec.kind != "arch":
        def walk(d: dict[str, Any], path: str = "") -> Any:
            for k, v in d.items():
                if isinstance(v, dict):
                    yield from walk(v, f"{path}{k}.")
                elif size_name(config, f"{path}{k}") not in (None, "head_dim"):
                    yield f"{path}{k}", v, "config.json"

        found += list(walk(config.to_dict()))
    _refuse_sizes(found, spec, source, config)
    _refuse_absurd_token_ids(config, spec, source)
    typed = {size_name(config, k) for k, _, _ in found}
    if typed & {"num_attention_heads", "num_key_value_heads"}:  # the shrink keeps only the ratio: it must be whole
        for _, sub in [("", config), *_sub_configs(config)]:
            heads, kv = getattr(sub, "num_attention_heads", None), getattr(sub, "num_key_value_heads", None)
            if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
                typed_pairs = [(k, v) for k, v in spec.overrides if k.split(".")[-1] in ("num_attention_heads", "num_key_value_heads")]
                wheres = [_origin(k, v, spec, source) for k, v in typed_pairs] or [f"in model spec '{spec.raw}' from {source}"]
                where = next((w for w in wheres if not w.startswith("in model spec")), wheres[0])
                raise PackcheckUsageError(
                    f"Config values num_attention_heads={heads} and num_key_value_heads={kv} ({where}) "
                    "do not divide: grouped-query attention shares each key/value head "
                    f"among a whole number of query heads. Give a num_key_value_heads that divides {heads}.")


def apply_overrides(config: Any, spec: ModelSpec, source: str) -> list[str]:
    """Set the spec's overrides on ``config`` in place: a dotted key walks sub-configs; a plain key the top-level
    config lacks goes to the one sub-config that has it (``clip_qkv`` -> dbrx's ``attn_config``).

    Returns:
        One note per override that is no key of the config or its sub-configs (set as a new attribute, which the
        model may never read; also warned as a PackcheckWarning), for the cell's ``config_notes``.

    Raises:
        PackcheckUsageError: a dotted key through something that is not a sub-config.
    """
    notes: list[str] = []
    for key, value in spec.overrides:
        target, parts = config, key.split(".")
        for part in parts[:-1]:
            sub = target.get(part) if isinstance(target, dict) else getattr(target, part, None)
            if sub is None or not (hasattr(sub, "to_dict") or isinstance(sub, dict)):
                raise PackcheckUsageError(
                    f"Config override '{key}' ({_origin(key, value, spec, source)}): '{part}' is not a sub-config "
                    f"(or a dict such as rope_parameters) of {type(target).__name__}: use a key of the config (its "
                    "config.json) or subconfig.key.")
            target = sub
        name = parts[-1]
        if len(parts) == 1 and not hasattr(config, name):
            owners = [sub for _, sub in _sub_configs(config) if hasattr(sub, name)]
            target = owners[0] if len(owners) == 1 else config
            if not owners:  # a typo ({clip_qvk=8}) would otherwise be set silently and change nothing
                import warnings

                from ..errors import PackcheckWarning, closest

                known = [k for c in (config, *(sub for _, sub in _sub_configs(config))) for k in c.to_dict() if isinstance(k, str)]
                # transformers 5.x keeps rope_theta in the rope_parameters dict: name the key that works
                holders = [k for k, v in config.to_dict().items() if isinstance(v, dict) and name in v]
                hint = (f" This transformers keeps '{name}' in {holders[0]}: write {holders[0]}.{name}={value!r}."
                        if holders else closest(name, known))
                unread = (f"is not a key of {type(config).__name__} or its sub-configs: set as a new attribute, which "
                          "the model may never read")
                notes.append(f"override {key}={value!r} {unread}")
                warnings.warn(f"Config override '{key}' ({_origin(key, value, spec, source)}) {unread}.{hint}",
                              PackcheckWarning, stacklevel=2)
        # a copy: transformers rewrites a rope dict it is given in place (5.x standardises rope_scaling into
        # rope_parameters, adding rope_type / rope_theta: None), which would change the spec's own value, its label
        # and the cell IDs a version environment's results are matched by
        value = copy.deepcopy(value)
        try:
            if isinstance(target, dict):
                target[name] = value
            else:
                setattr(target, name, value)
        except Exception as exc:  # noqa: BLE001 - a strict config field (huggingface_hub dataclass validators) refuses it
            text = " ".join(str(exc).split())[:200]
            raise PackcheckUsageError(
                f"Config override '{key}={value!r}' ({_origin(key, value, spec, source)}) is refused by "
                f"{type(target).__name__} ({type(exc).__name__}: {text}): give a value of the type the config "
                "declares.") from None
    return notes


def read_config_dict(spec: ModelSpec, source: str) -> tuple[dict[str, Any], str | None]:
    if spec.kind == "local":
        path = Path(spec.name) / "config.json"
        if not path.exists():
            raise PackcheckUsageError(
                f"Local model directory '{spec.raw}' (from {source}) has no config.json: point to a saved model folder."
            )
        return _parse_config_json(path, spec, source), None

    from huggingface_hub import errors as hub_errors
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(spec.name, "config.json", revision=spec.revision)
    except hub_errors.GatedRepoError:
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is gated: accept its licence on the Hub and set HF_TOKEN "
            "(or run `hf auth login`)."
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise PackcheckUsageError(
            f"Unknown Hub model ID '{spec.name}' (from {source}): check the spelling on the Hub, or log in for a private "
            f"repo{_arch_hint(spec.name)}."
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise PackcheckUsageError(
            f"Revision '{spec.revision}' of '{spec.name}' not found (from {source}): use an existing branch, tag or commit SHA."
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        rev = f" at revision '{spec.revision}'" if spec.revision else ""
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is not in the local Hub cache{rev} and the Hub cannot be reached "
            f"(no network, or HF_HUB_OFFLINE=1): run once online or `hf download {spec.name} config.json"
            # the revision asked for, not main (trial 19, 123: without it the command fetched main and the error stayed)
            f"{f' --revision {spec.revision}' if spec.revision else ''}`"
            f"{_arch_hint(spec.name)}."
        ) from None
    except hub_errors.EntryNotFoundError:
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) has no config.json: it is not a transformers model repo."
        ) from None
    except hub_errors.HFValidationError:  # huggingface_hub's validate_repo_id (a hostile trial: an INTERNALERROR)
        shown = (f"'{spec.raw}' (from {source})" if len(spec.raw) <= 120 else
                 f"'{spec.raw[:60]}...{spec.raw[-20:]}' ({len(spec.raw)} characters, from {source})")
        raise PackcheckUsageError(
            f"Model {shown} is neither a local folder nor a Hub model ID: a Hub ID is org/name in "
            "ASCII letters, digits, '-', '_' and '.' (not starting or ending with '-' or '.', '--' or '..' inside, at "
            "most 96 characters); give one, a local directory, or arch:<model_type>."
        ) from None
    resolved = Path(path).parent.name  # .../snapshots/<commit sha>/config.json
    revision = resolved if Path(path).parent.parent.name == "snapshots" else spec.revision
    return _parse_config_json(Path(path), spec, source), revision


def _parse_config_json(path: Path, spec: ModelSpec, source: str) -> dict[str, Any]:
    """The JSON object in ``path``, through the one bounded reader (:func:`errors.read_user_text`,
    :func:`errors.parse_document`).

    Raises:
        PackcheckUsageError: not a regular file, unreadable, over the size bound, not UTF-8 text, not JSON, nested too
            deeply, or JSON that is not an object.
    """
    from ..errors import parse_document, read_user_text

    where = f"Model '{spec.raw}' (from {source}): its config.json ({path})"
    data = parse_document(read_user_text(path, where, "replace it with the model's config.json.", named=where), "json",
                          where, "fix or replace it.")
    if not isinstance(data, dict):
        raise PackcheckUsageError(
            f"{where} holds a JSON {type(data).__name__}, not an object: a config.json is one object, e.g. "
            '{"model_type": "llama", ...}.'
        )
    return data


def _arch_hint(name: str) -> str:
    from transformers import CONFIG_MAPPING

    return f" (or did you mean arch:{name})" if "/" not in name and name in CONFIG_MAPPING else ""
