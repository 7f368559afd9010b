"""The peers' own packing code, run: each peer's collator (and the mask it builds) imported from its released wheel
and fed to a tiny model on CPU, against each example alone (issue 45, part 2).

:mod:`.claims` reads what a peer says; this module runs what it does, where the code imports without a GPU stack. A
wheel is a zip, so its modules import straight from the file (``sys.path`` gets the wheel, nothing is installed);
a module the path never calls but the package imports at its top (LLaMA-Factory's ``torchaudio``, which has no
build for torch 2.13) is stubbed and named in every result. A path that cannot run here (a CUDA-only kernel, a
package that does not import) is a result with ``verdict="not_run"`` and the reason, never a silent pass.

Each :class:`PeerPath` is one record of :data:`PEER_PATHS`: the peer, the code it runs (``file:line`` in the
wheel), the backends it is run on, and its ``build`` function: ``build(peer_modules, examples, backend, config) ->
(batch, note)``, the batch the peer's trainer hands the model. :func:`measure` runs every path of a wheel on each
model x backend and returns one record per cell: the largest ``max_abs_diff`` of a packed example's logits against
the example alone (float32, CPU), the verdict against the logits tolerance, and the library versions.

Paths (the peers' newest releases read for this: axolotl 0.19.0, llamafactory 0.9.5):

- ``llamafactory:neat_packing``: the row ``data/processor/supervised.py`` builds with ``neat_packing`` (an integer
  segment-id ``attention_mask`` 1, 2, 3, ..., position_ids restarting per example, right padding to
  ``cutoff_len + 1`` with mask 0), through ``data/collator.py``'s ``prepare_4d_attention_mask`` (the call
  ``SFTDataCollatorWith4DAttentionMask`` makes when ``block_diag_attn`` is on and the backend is not
  flash_attention_2): a 4-D float mask that is block-diagonal and causal, and that every layer then uses as is.
- ``llamafactory:neat_packing_flash``: the same row on the flash path: ``_unpad_packed_features`` trims the
  padding and the collator sets ``attention_mask=None`` (collator.py, "let transformers handle causal packed
  mask"), run on packcheck's varlen reference standing in for flash_attention_2.
- ``axolotl:multipack``: ``utils/collators/batching.py``'s ``V2BatchSamplerDataCollatorForSeq2Seq`` over one bin
  (the attention_mask becomes segment ids, position_ids are concatenated), then the trainer's rule: the
  attention_mask column is dropped when ``attn_decontaminates_packing`` (``utils/schemas/config.py``: every
  backend axolotl packs on, eager and sdpa included), so the model reads the boundaries from position_ids. Its
  ``sdpa_varlen`` patch is applied only for CUDA fp16 / bf16 (``loaders/patch_manager.py``): named, not run, on CPU.
- ``nemo_automodel:neat_packing`` / ``neat_packing_flash_varlen`` (0.7.0): ``datasets/llm/neat_packing.py``'s
  ``_build_packed_sample`` (segment ids 1..n, position_ids restarting, padding to ``pack_size``) through
  ``datasets/utils.py``'s ``neat_packed_collater`` with the contract its legacy ``attn_implementation`` keyword
  selects: ``block_causal`` (a 4-D bool mask) on eager / sdpa, ``flash_varlen`` (``cu_seq_lens_q/k`` over the row,
  the padding run included, no attention_mask) on the flash path.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends.table import REFERENCE_BACKEND

#: The models a peer path is run on by default: the causal LMs the peers name first, one with a sliding window.
DEFAULT_MODELS = ("llama", "qwen2", "mistral", "gemma3_text")


@dataclass(frozen=True)
class PeerPath:
    """One peer's own packing path: ``peer`` (the distribution, as :mod:`.claims` names it), ``name``, ``summary``
    (what runs), ``code`` (``file:function`` in the wheel), ``modules`` (imported from the wheel), ``stubs``
    (modules the package imports at its top that this path never calls: stubbed, and named in every result),
    ``backends`` (the attn_implementations it is run on), ``build`` (``module:function`` here) and
    ``not_on_cpu`` (a part of the path that needs a GPU: named in every result, never run)."""

    peer: str
    name: str
    summary: str
    code: str
    modules: tuple[str, ...]
    backends: tuple[str, ...]
    build: str
    stubs: tuple[str, ...] = ()
    not_on_cpu: str = ""

    @property
    def key(self) -> str:
        return f"{self.peer}:{self.name}"


PEER_PATHS: tuple[PeerPath, ...] = (
    PeerPath("llamafactory", "neat_packing", "neat_packing's segment-id row through prepare_4d_attention_mask (block_diag_attn)",
             "llamafactory/data/collator.py:prepare_4d_attention_mask", ("llamafactory.data.collator",),
             ("eager", "sdpa"), "_build_llamafactory_4d", stubs=("torchaudio",)),
    PeerPath("llamafactory", "neat_packing_flash", "neat_packing's row on the flash path: _unpad_packed_features, attention_mask=None",
             "llamafactory/data/collator.py:SFTDataCollatorWith4DAttentionMask._unpad_packed_features",
             ("llamafactory.data.collator",), (REFERENCE_BACKEND,), "_build_llamafactory_flash", stubs=("torchaudio",)),
    PeerPath("axolotl", "multipack", "V2BatchSamplerDataCollatorForSeq2Seq over one bin, attention_mask dropped as the trainer drops it",
             "axolotl/utils/collators/batching.py:V2BatchSamplerDataCollatorForSeq2Seq", ("axolotl.utils.collators.batching",),
             ("eager", "sdpa", REFERENCE_BACKEND), "_build_axolotl_multipack",
             not_on_cpu="sdpa_varlen (torch varlen_attn: patch_manager applies it for CUDA fp16/bf16 only)"),
    PeerPath("nemo_automodel", "neat_packing", "neat_pack_dataset's packed sample through neat_packed_collater (block_causal: a 4-D bool mask)",
             "nemo_automodel/components/datasets/utils.py:neat_packed_collater",
             ("nemo_automodel.components.datasets.llm.neat_packing", "nemo_automodel.components.datasets.utils"),
             ("eager", "sdpa"), "_build_nemo_neat"),
    PeerPath("nemo_automodel", "neat_packing_flash_varlen", "the same sample through neat_packed_collater's flash_varlen contract "
             "(cu_seq_lens_q/k over the row, padding runs included, no attention_mask)",
             "nemo_automodel/components/datasets/utils.py:neat_packed_collater",
             ("nemo_automodel.components.datasets.llm.neat_packing", "nemo_automodel.components.datasets.utils"),
             (REFERENCE_BACKEND,), "_build_nemo_neat"),
    # Peers whose packing code does not import without their GPU / training stack here: each cell is "not run"
    # with the import's own error (the package it needs). Where a release does import, _build_not_driven says that
    # packcheck does not drive it yet: never a pass.
    PeerPath("ms_swift", "padding_free", "ms-swift's padding_free patches (revert_padding_free, cu_seq_lens_q handling)",
             "swift/model/patcher.py:revert_padding_free", ("swift.model.patcher",), ("eager", "sdpa", REFERENCE_BACKEND),
             "_build_not_driven"),
    PeerPath("unsloth", "packing", "unsloth's sample packing / padding_free and its varlen attention over packed rows",
             "unsloth/utils/packing.py:configure_padding_free", ("unsloth.utils.packing", "unsloth.utils.hf_packed_attention"),
             ("eager", "sdpa", REFERENCE_BACKEND), "_build_not_driven", not_on_cpu="unsloth's kernels (triton)"),
    PeerPath("verl", "remove_padding", "verl's remove-padding forward: _ulysses_flash_attention_forward replacing transformers' flash path",
             "verl/models/transformers/monkey_patch.py:apply_monkey_patch", ("verl.models.transformers.monkey_patch",),
             (REFERENCE_BACKEND,), "_build_not_driven"),
)


class PeerUnavailable(Exception):
    """The peer's path cannot run here: the message names the module that failed to import and why."""


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


@contextlib.contextmanager
def peer_modules(wheel: Path, path: PeerPath) -> Iterator[dict[str, Any]]:
    """The modules ``path.modules`` imported from ``wheel`` (a pure-Python wheel on ``sys.path``; nothing is
    installed), with ``path.stubs`` stubbed. On exit every module of the peer's packages and every stub is removed
    from ``sys.modules``, every entry the import replaced is put back and the wheel from ``sys.path``, so the next peer (or the same peer's other release) imports
    afresh.

    Raises:
        PeerUnavailable: a module does not import (its exception, with the missing module's name).
    """
    entry = str(wheel)
    tops = {m.split(".")[0] for m in path.modules}
    before = dict(sys.modules)
    sys.path.insert(0, entry)
    for name in path.stubs:
        sys.modules.setdefault(name, _stub(name))
    try:
        loaded = {}
        for name in path.modules:
            try:
                loaded[name] = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import failure is the path's reason, never a crash
                missing = getattr(exc, "name", None)
                raise PeerUnavailable(f"{name} does not import from {wheel.name}: {type(exc).__name__}: {exc}"
                                      + (f" (needs the package providing '{missing}')" if missing else "")) from None
        yield loaded
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)
        for name in [n for n in sys.modules if n.split(".")[0] in tops or n in path.stubs]:
            del sys.modules[name]
        for name, module in before.items():  # an entry the peer's import replaced (transformers itself, once)
            if sys.modules.get(name) is not module:
                sys.modules[name] = module


def _segment_row(examples: list[list[int]], pad: int, pad_id: int) -> dict[str, list[int]]:
    """LLaMA-Factory's neat_packing row (data/processor/supervised.py, the knapsack loop): token ids, segment ids
    1..n as the attention_mask, position_ids restarting at 0, then ``pad`` padding tokens (mask 0, position 0)."""
    ids, mask, pos = [], [], []
    for i, e in enumerate(examples):
        ids += e
        mask += [i + 1] * len(e)
        pos += list(range(len(e)))
    return {"input_ids": ids + [pad_id] * pad, "attention_mask": mask + [0] * pad, "position_ids": pos + [0] * pad}


def _build_llamafactory_4d(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    import torch

    collator = mods["llamafactory.data.collator"]
    row = _segment_row(examples, pad=3, pad_id=0)
    mask = collator.prepare_4d_attention_mask(torch.tensor([row["attention_mask"]]), torch.float32)
    return ({"input_ids": torch.tensor([row["input_ids"]]), "position_ids": torch.tensor([row["position_ids"]]),
             "attention_mask": mask}, "4-D float mask from prepare_4d_attention_mask, 3 padding tokens")


def _build_llamafactory_flash(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    import torch

    collator = mods["llamafactory.data.collator"]
    row = _segment_row(examples, pad=3, pad_id=0)
    features = {k: torch.tensor([v]) for k, v in row.items()}
    collator.SFTDataCollatorWith4DAttentionMask._unpad_packed_features(features)
    features["attention_mask"] = None  # collator.py: "let transformers handle causal packed mask"
    return ({k: v for k, v in features.items() if v is not None},
            f"_unpad_packed_features trimmed the row to {int(features['input_ids'].shape[1])} tokens")


def _tiny_tokenizer(pad_id: int) -> Any:
    """A tokenizer that only pads (the collators call ``tokenizer.pad`` on ids that are already tokens)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(max(pad_id, 1) + 1)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<t0>")))
    tok.pad_token = f"<t{pad_id}>"
    tok.padding_side = "right"
    return tok


def _build_axolotl_multipack(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    batching = mods["axolotl.utils.collators.batching"]
    collator = batching.V2BatchSamplerDataCollatorForSeq2Seq(tokenizer=_tiny_tokenizer(0), padding=True,
                                                             pad_to_multiple_of=8, return_tensors="pt")
    features = [{"input_ids": e, "attention_mask": [1] * len(e), "labels": e, "position_ids": list(range(len(e)))}
                for e in examples]
    batch = dict(collator([features]))
    # axolotl/core/trainers/base.py: the attention_mask column is removed when sample_packing and
    # attn_decontaminates_packing (utils/schemas/config.py: True on eager, sdpa and every packing backend)
    batch.pop("attention_mask", None)
    batch.pop("labels", None)
    return batch, f"one bin of {len(examples)}, padded to a multiple of 8 ({int(batch['input_ids'].shape[1])} tokens), attention_mask dropped"


def _build_not_driven(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """A path whose module imports but that packcheck does not drive yet: raises, so the cell says so (never a pass)."""
    raise PeerUnavailable(f"{', '.join(mods)} imports here, but packcheck does not drive this path yet")


def _build_nemo_neat(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    import warnings

    neat = mods["nemo_automodel.components.datasets.llm.neat_packing"]
    utils = mods["nemo_automodel.components.datasets.utils"]
    total = sum(len(e) for e in examples)
    pack_size = total + (-total) % 8  # padded to a multiple of 8, as a pack_size above the row gives
    sample = neat._build_packed_sample([{"input_ids": e, "labels": e} for e in examples], pack_size, 0)
    # the legacy attn_implementation keyword picks the contract (datasets/packing.py resolve_packing_contract):
    # flash_varlen for the flash names, block_causal otherwise
    name = "flash_attention_2" if backend == REFERENCE_BACKEND else backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        batch = dict(utils.neat_packed_collater([sample], attn_implementation=name))
    for key in ("labels", "_packed_seq_ids"):
        batch.pop(key, None)
    mask = batch.get("attention_mask")
    layout = f"attention_mask {tuple(mask.shape)} {mask.dtype}" if mask is not None else "cu_seq_lens_q " + str(batch.get("cu_seq_lens_q").tolist())
    return batch, f"pack_size {pack_size} ({pack_size - total} padding), contract for '{name}': {layout}"


@dataclass
class PathResult:
    """One peer path on one model x backend: ``verdict`` pass / fail (``max_abs_diff``: the largest absolute
    difference of a packed example's float32 logits against the example alone, ``per_example`` each, over
    ``tolerance``, audit/tolerances.toml's float32 ``logits_atol``; ``cause`` on a fail), ``not_run`` (``reason``
    says why) or ``error`` (building the batch or the forward raised: ``reason``)."""

    peer: str
    version: str
    path: str
    code: str
    model: str
    backend: str
    verdict: str
    max_abs_diff: float | None = None
    per_example: list[float] = field(default_factory=list)
    tolerance: float | None = None
    reason: str = ""
    note: str = ""
    #: on a fail: ``sliding_window`` (only examples longer than the window move) or ``leak`` (checks/causes.py)
    cause: str = ""
    stubs: tuple[str, ...] = ()
    not_on_cpu: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def _builder(path: PeerPath) -> Callable[..., tuple[dict, str]]:
    return globals()[path.build]


def run_path(path: PeerPath, mods: dict[str, Any], bench: Any, version: str) -> PathResult:
    """Run ``path`` on one workbench (:class:`..checks.workbench.Workbench`: the model, its examples and their solo
    logits). Never raises for the peer's or the model's faults: a batch the peer cannot build, or a forward that
    raises, is an ``error`` result with the exception."""
    base = {"peer": path.peer, "version": version, "path": path.name, "code": path.code, "model": bench.config.model_type,
                "backend": bench.backend, "stubs": path.stubs, "not_on_cpu": path.not_on_cpu}
    try:
        batch, note = _builder(path)(mods, bench.examples, bench.backend, bench.config)
    except PeerUnavailable as exc:
        return PathResult(**base, verdict="not_run", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - a peer's fault is a cell, never the run's end
        return PathResult(**base, verdict="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    try:
        worst, per = bench.diff_to_solo(bench.forward(batch).logits[0].float())
    except Exception as exc:  # noqa: BLE001 - a peer's fault is a cell, never the run's end
        return PathResult(**base, verdict="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    tol = float(bench.tol["logits_atol"])
    verdict = "pass" if worst <= tol else "fail"
    window = getattr(bench.config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        note += f"; sliding_window {window}"
    note += "; examples of " + ", ".join(str(len(e)) for e in bench.examples) + " tokens"
    return PathResult(**base, verdict=verdict, max_abs_diff=worst, per_example=per, tolerance=tol, note=note,
                      cause=_cause(per, [len(e) for e in bench.examples], tol, bench.config, batch) if verdict == "fail" else "")


def _cause(per: list[float], lengths: list[int], tol: float, config: Any, batch: dict[str, Any]) -> str:
    """``sliding_window`` where every example within the config's window matches and only longer ones move (the
    mask the path built has no window: the model attends past it); else ``segment_mask`` where the batch carries
    an attention_mask (the peer's segment mask does not keep the examples apart on this backend), else ``leak``."""
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        inside = [d for d, n in zip(per, lengths, strict=True) if n <= window]
        outside = [d for d, n in zip(per, lengths, strict=True) if n > window]
        if inside and outside and max(inside) <= tol < max(outside):
            return "sliding_window"
    return "segment_mask" if batch.get("attention_mask") is not None else "leak"


def wheel_version(wheel: Path) -> tuple[str, str]:
    """``(distribution, version)`` from a wheel's file name (``axolotl-0.19.0-py3-none-any.whl``).

    Raises:
        ValueError: the name is not a wheel's (``name-version-...whl``)."""
    parts = wheel.name.split("-")
    if not wheel.name.endswith(".whl") or len(parts) < 3:
        raise ValueError(f"'{wheel}' is not a wheel file name (name-version-tags.whl): pass what `pip download --no-deps PEER` saves")
    return parts[0].lower().replace("_", "-"), parts[1]


def measure(wheel: Path, make_bench: Callable[[str, str], Any], models: tuple[str, ...] = DEFAULT_MODELS,
            backends: tuple[str, ...] | None = None) -> list[PathResult]:
    """Every :data:`PEER_PATHS` entry of ``wheel``'s peer on each of ``models`` x the path's backends (those in
    ``backends`` when given). ``make_bench(model_type, backend)`` builds the workbench (a built tiny model), or
    raises: that cell is then ``not_run`` with the reason. A path whose modules do not import gives one ``not_run``
    result per model x backend naming the module. Returns the results in table order.

    A peer's import can change the process it runs in (LLaMA-Factory 0.9.5's import leaves a new ``transformers``
    module object in ``sys.modules``): :func:`peer_modules` puts every module entry that existed before back on
    exit, so neither the caller nor the next peer sees it. (Not a forked child: a child forked from a process whose
    OpenMP team exists can deadlock in its first parallel region, as one did in CI.)"""
    dist, version = wheel_version(wheel)
    peer = dist.replace("-", "_")
    out: list[PathResult] = []
    for path in (p for p in PEER_PATHS if p.peer == peer):
        on = tuple(b for b in path.backends if backends is None or b in backends)
        out += _measure_path(wheel, path, version, models, on, make_bench)
    return out


def _measure_path(wheel: Path, path: PeerPath, version: str, models: tuple[str, ...], on: tuple[str, ...],
                  make_bench: Callable[[str, str], Any]) -> list[PathResult]:
    out: list[PathResult] = []
    try:
        with peer_modules(wheel, path) as mods:
            for model in models:
                for backend in on:
                    try:
                        bench = make_bench(model, backend)
                    except Exception as exc:  # noqa: BLE001 - a model that does not build here is a cell
                        out.append(PathResult(path.peer, version, path.name, path.code, model, backend, "not_run",
                                              reason=f"the tiny model does not build: {type(exc).__name__}: {exc}"))
                        continue
                    out.append(run_path(path, mods, bench, version))
    except PeerUnavailable as exc:
        out += [PathResult(path.peer, version, path.name, path.code, m, b, "not_run", reason=str(exc), stubs=path.stubs)
                for m in models for b in on]
    return out


def build_bench(model_type: str, backend: str) -> Any:
    """The workbench a peer path runs on: ``arch:<model_type>`` resolved, shrunk and built as every audit cell
    builds it (float32, CPU, ``backend`` registered first where packcheck registers it), with the float32
    tolerances of audit/tolerances.toml. Raises what the build raises (:func:`measure` makes it a ``not_run``)."""
    from ..backends import ensure_registered
    from ..checks.workbench import Workbench
    from ..config.tolerances import default_tolerances
    from ..model.build import build_model
    from ..model.resolve import resolve_model
    from ..model.specs import parse_model_spec

    ensure_registered(backend)
    model = build_model(resolve_model(parse_model_spec(f"arch:{model_type}", "peer path"), "peer path"), backend, "float32")
    return Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=default_tolerances()["float32"])


def results_document(results: list[PathResult]) -> dict[str, Any]:
    """The JSON document ``packcheck claims --run-own-paths`` writes beside claims.md: the results and the
    versions they were measured on (torch, transformers, each peer)."""
    import platform

    import torch
    import transformers

    return {"schema": "packcheck-peer-paths", "schema_version": 1, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": "cpu",
            "dtype": "float32", "peers": {r.peer: r.version for r in results},
            "results": [r.as_dict() for r in results]}


def _cell(r: dict[str, Any]) -> str:
    if r["verdict"] in ("pass", "fail"):
        text = f"{'✅' if r['verdict'] == 'pass' else '❌'} {r['max_abs_diff']:.1e}"
        return text + (f" ({r['cause']})" if r.get("cause") else "")
    return "⏭️ not run" if r["verdict"] == "not_run" else "💥 error"


def _outside_pin(transformers: str, pin: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return bool(pin) and Version(transformers) not in SpecifierSet(pin)
    except (InvalidSpecifier, InvalidVersion):
        return False


def render_own_paths(doc: dict[str, Any], peer: str, pin: str = "") -> list[str]:
    """claims.md's lines for ``peer``'s own paths in ``doc`` (:func:`results_document`): a table per path (model x
    backend: the verdict and the max abs diff of logits against each example alone), its code, the stubs and the
    GPU-only part named, and each not-run or error reason once; where the transformers measured on is outside the
    peer's ``pin`` (its wheel's requirement), that is said. No lines where ``doc`` has none for the peer."""
    norm = peer.lower().replace("-", "_")
    rows = [r for r in doc.get("results", []) if r["peer"].lower().replace("-", "_") == norm]
    if not rows:
        return []
    outside = (f" This transformers is outside {peer}'s pin `{pin}`: run `packcheck claims --run-own-paths` with a "
               "pinned transformers installed to measure it there.") if _outside_pin(doc["transformers"], pin) else ""
    lines = [(f"**Own code, run** (on CPU, float32, torch {doc['torch']}, transformers {doc['transformers']}; each "
             f"example's logits in the peer's packed batch against the example alone, max abs diff).{outside}"), ""]
    for name in dict.fromkeys(r["path"] for r in rows):
        these = [r for r in rows if r["path"] == name]
        backends = list(dict.fromkeys(r["backend"] for r in these))
        first = these[0]
        lines.append(f"- `{peer}:{name}`: `{first['code']}`"
                     + (f"; stubbed (never called on this path): {', '.join(first['stubs'])}" if first.get("stubs") else "")
                     + (f"; not run on CPU: {first['not_on_cpu']}" if first.get("not_on_cpu") else ""))
        lines += ["", "| model | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for model in dict.fromkeys(r["model"] for r in these):
            cells = {r["backend"]: r for r in these if r["model"] == model}
            lines.append(f"| {model} | " + " | ".join(_cell(cells[b]) if b in cells else "" for b in backends) + " |")
        lines.append("")
        notes = [f"Not run / error: {reason}" for reason in dict.fromkeys(r["reason"] for r in these if r.get("reason"))]
        notes += [f"Fails {r['model']}/{r['backend']}: {r['max_abs_diff']:.2e} ({r['cause']}; per example "
                  + ", ".join(f"{d:.1e}" for d in r["per_example"]) + f"; {r['note']})" for r in these if r["verdict"] == "fail"]
        lines += [f"  {n}" for n in notes] + ([""] if notes else [])
    return lines
