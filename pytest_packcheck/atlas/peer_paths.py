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

Paths (the peers' newest releases read for this: axolotl 0.19.0, llamafactory 0.9.5, nemo_automodel 0.7.0, ms-swift
4.6.0, verl 0.9.1, unsloth 2026.10.9):

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
- ``ms_swift:padding_free`` (4.6.0): ``swift/template/base.py``'s ``Template._data_collator`` with
  ``padding_free=True`` (``packing_row``: one row, position_ids restarting, no attention_mask), on the flash path only
  (``swift/arguments/sft_args.py`` refuses padding_free on any other attn_impl); ``swift/__init__.py`` not run,
  ``modelscope`` stubbed (:func:`_swift_stand_ins`).
- ``verl:remove_padding`` (0.9.1): the rows unpadded by ``verl/utils/attention_utils.py``'s ``unpad_input``, the model
  patched by ``apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True)``
  (``_ulysses_flash_attention_forward`` over the varlen reference, its calls counted: :func:`_verl_monkey_patch`).
- ``unsloth:packing`` (2026.10.9): ``utils/packing.py``'s ``enable_sample_packing`` over TRL's padding-free collator
  (``packed_seq_lengths``, boundary labels masked, attention_mask dropped), on stock attention;
  ``unsloth:hf_packed_attention``: the "sdpa" wrapper it installs, whose packed branch imports
  ``utils/attention_dispatch.py`` -> ``device_type.py:124`` "You need a GPU": not run on CPU, named.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
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
    #: packages whose ``__init__`` is not run (each registered as a bare namespace over the wheel's folder first):
    #: their ``__init__`` imports what the path never calls (verl's ray, unsloth's GPU check); named in every result
    bare: tuple[str, ...] = ()
    #: distributions whose wheels, found beside the peer's wheel, go on ``sys.path`` too (what its modules import)
    beside: tuple[str, ...] = ()
    #: ``name`` of a context manager here, entered around the import and every cell (``() -> list of sentences``,
    #: each a stand-in named in every result): ms-swift's modelscope stub
    stand_in: str = ""
    #: ``name`` of a context manager here, entered around each cell's batch and forward (``(mods, bench) -> dict``):
    #: applies the peer's patch to the model and takes it off after; the dict's ``calls`` (how often the patched
    #: function ran) makes a patch that never ran an error, and its ``note`` joins the cell's
    around: str = ""
    #: models run beside :data:`DEFAULT_MODELS` by default: those the peer's claims name for this path (its
    #: refusals; a multimodal model's text model, ``gemma4_text`` for LLaMA-Factory's ``gemma4``)
    models: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.peer}:{self.name}"

    def named_stand_ins(self) -> tuple[str, ...]:
        """The stubs and the package ``__init__`` files not run, as every result names them."""
        return self.stubs + tuple(f"{b.replace('.', '/')}/__init__.py not run" for b in self.bare)


PEER_PATHS: tuple[PeerPath, ...] = (
    PeerPath("llamafactory", "neat_packing", "neat_packing's segment-id row through prepare_4d_attention_mask (block_diag_attn)",
             "llamafactory/data/collator.py:prepare_4d_attention_mask", ("llamafactory.data.collator",),
             ("eager", "sdpa"), "_build_llamafactory_4d", stubs=("torchaudio",), models=("gemma4_text", "gpt_oss")),
    PeerPath("llamafactory", "neat_packing_flash", "neat_packing's row on the flash path: _unpad_packed_features, attention_mask=None",
             "llamafactory/data/collator.py:SFTDataCollatorWith4DAttentionMask._unpad_packed_features",
             ("llamafactory.data.collator",), (REFERENCE_BACKEND,), "_build_llamafactory_flash", stubs=("torchaudio",),
             models=("gemma4_text", "gpt_oss")),
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
    # ms-swift's SFT padding_free: its template's own collator. ms-swift refuses padding_free / packing unless the
    # attn_impl is a flash one (swift/arguments/sft_args.py _check_padding_free), so it runs on the flash path only.
    PeerPath("ms_swift", "padding_free", "Template._data_collator with padding_free=True (packing_row: one row, position_ids "
             "restarting, no attention_mask), the batch the trainer hands the model",
             "swift/template/base.py:Template._data_collator", ("swift.template.base",), (REFERENCE_BACKEND,),
             "_build_swift_padding_free", bare=("swift", "swift.template"), beside=("json_repair", "einops"),
             stand_in="_swift_stand_ins"),
    # unsloth: enable_sample_packing's collator over TRL's padding-free collator; its varlen attention needs a GPU
    PeerPath("unsloth", "packing", "enable_sample_packing's torch_call over TRL's DataCollatorForLanguageModeling(padding_free=True): "
             "packed_seq_lengths added, boundary labels masked, attention_mask dropped",
             "unsloth/utils/packing.py:enable_sample_packing", ("unsloth.utils.packing",), ("eager", "sdpa", REFERENCE_BACKEND),
             "_build_unsloth_packing", bare=("unsloth", "unsloth.utils"), around="_unsloth_stock_attention",
             models=("gemma2", "gpt_oss"),
             not_on_cpu="unsloth:hf_packed_attention (the varlen attention enable_sample_packing installs over 'sdpa' "
             "is taken out for this path's forward)"),
    PeerPath("unsloth", "hf_packed_attention", "the same batch through the 'sdpa' wrapper enable_sample_packing installs "
             "(hf_packed_attention._sdpa_packed_varlen: torch varlen_attn / flash / xformers over cu_seqlens)",
             "unsloth/utils/hf_packed_attention.py:_sdpa_packed_varlen",
             ("unsloth.utils.packing", "unsloth.utils.hf_packed_attention", "unsloth.utils.attention_dispatch"), ("sdpa",),
             "_build_unsloth_packing", bare=("unsloth", "unsloth.utils", "unsloth_zoo"), beside=("unsloth_zoo",),
             around="_unsloth_sdpa_entry",
             not_on_cpu="its varlen kernels: CUDA sm80+, fp16 / bf16 (_static_window); its packed branch imports "
             "attention_dispatch, whose unsloth/device_type.py asks for a GPU"),
    # verl's remove padding: rows unpadded with its own helpers, the model patched by apply_monkey_patch
    PeerPath("verl", "remove_padding", "unpad_input into one row (position_ids gathered), apply_monkey_patch(use_remove_padding=True): "
             "transformers' _flash_attention_forward replaced by _ulysses_flash_attention_forward at ulysses_sp_size 1",
             "verl/models/transformers/monkey_patch.py:_ulysses_flash_attention_forward",
             ("verl.utils.attention_utils", "verl.models.transformers.monkey_patch"), (REFERENCE_BACKEND,),
             "_build_verl_rmpad", bare=("verl", "verl.utils", "verl.models", "verl.models.transformers"),
             beside=("einops",), around="_verl_monkey_patch",
             not_on_cpu="ulysses_sp_size > 1 (its all-to-all needs a process group per rank)"),
)


class PeerUnavailable(Exception):
    """The peer's path cannot run here: the message names the module that failed to import and why."""


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def _beside(wheel: Path, dist: str) -> Path | None:
    """The newest wheel of ``dist`` in ``wheel``'s folder (``json_repair-*.whl`` beside ``ms_swift-*.whl``)."""
    hits = sorted(wheel.parent.glob(f"{dist}-*.whl"))
    return hits[-1] if hits else None


def _wheel_tops(wheel: Path) -> set[str]:
    """The top-level import names a wheel holds (its packages and modules; dist-info left out)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    return {n.split("/")[0].removesuffix(".py") for n in names
            if not n.split("/")[0].endswith((".dist-info", ".data")) and (n.endswith(".py") or "/" in n)}


def _bare_package(package: str) -> None:
    """``package`` as a bare namespace over its folder on ``sys.path`` (its ``__init__`` not run).

    Raises:
        PeerUnavailable: the package is not on ``sys.path`` (named)."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"the package '{package}' is not here (needs the package providing '{package}': "
                              "its wheel beside the peer's)")
    bare = types.ModuleType(package)
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__spec__ = spec
    sys.modules[package] = bare
    parent, _, child = package.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, bare)


def _raised_at(exc: BaseException) -> str:
    """`` (raised at FILE:LINE)``: the innermost frame of ``exc`` inside a wheel, as the wheel names the file."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if ".whl/" in f.filename]
    return f" (raised at {frames[-1].filename.split('.whl/', 1)[1]}:{frames[-1].lineno})" if frames else ""


@contextlib.contextmanager
def peer_modules(wheel: Path, path: PeerPath) -> Iterator[dict[str, Any]]:
    """The modules ``path.modules`` imported from ``wheel`` (a pure-Python wheel on ``sys.path``; nothing is
    installed), with ``path.stubs`` stubbed, the wheels of ``path.beside`` found beside it on ``sys.path`` too, the
    packages of ``path.bare`` registered without their ``__init__`` and ``path.stand_in`` entered around the import. Yields the modules by name and, under ``"__stand_ins__"``, the stand-in sentences. On exit
    every module of the peer's packages (and the beside wheels') and every stub is removed from ``sys.modules``,
    every entry the import replaced is put back and the wheels leave ``sys.path``, so the next peer (or the same
    peer's other release) imports afresh.

    Raises:
        PeerUnavailable: a module does not import (its exception, with the missing module's name and where the
            wheel raised it), or a ``beside`` wheel is not there.
    """
    extra = []
    for dist in path.beside:
        found = _beside(wheel, dist)
        if found is None:
            raise PeerUnavailable(f"{path.key} needs the package '{dist}': no {dist}-*.whl beside {wheel.name} "
                                  f"(pip download --no-deps {dist} -d {wheel.parent})")
        extra.append(found)
    entries = [str(w) for w in (wheel, *extra)]
    tops = {m.split(".")[0] for m in path.modules} | {t for w in extra for t in _wheel_tops(w)}
    before = dict(sys.modules)
    sys.path[:0] = entries
    for name in path.stubs:
        sys.modules.setdefault(name, _stub(name))
    try:
        # the stand-in is entered around the import only: it puts back what the import patched in transformers, and
        # must not take back what a cell does later (packcheck registering its flash reference on first use)
        with contextlib.ExitStack() as stack:
            sentences = list(stack.enter_context(globals()[path.stand_in]())) if path.stand_in else []
            for package in path.bare:
                _bare_package(package)
            loaded: dict[str, Any] = {}
            for name in path.modules:
                try:
                    loaded[name] = importlib.import_module(name)
                except Exception as exc:  # noqa: BLE001 - any import failure is the path's reason, never a crash
                    missing = getattr(exc, "name", None)
                    raise PeerUnavailable(f"{name} does not import from {wheel.name}: {type(exc).__name__}: {exc}{_raised_at(exc)}"
                                          + (f" (needs the package providing '{missing}')" if missing else "")) from None
        loaded["__stand_ins__"] = [s for s in sentences if s]
        yield loaded
    finally:
        for entry in entries:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)
        for name in [n for n in sys.modules if (n.split(".")[0] in tops and n not in before) or n in path.stubs]:
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


@contextlib.contextmanager
def _swift_stand_ins() -> Iterator[list[str]]:
    """ms-swift's modules with ``modelscope`` stubbed (:data:`..checks.rl_trainers.MODELSCOPE_NAMES`: its logger and
    the hub functions ``swift.utils`` binds at import; a hub function called raises naming modelscope), and every
    attribute of a loaded transformers / trl module or class the import replaces put back on exit."""
    from ..checks.rl_trainers import MODELSCOPE_NAMES, _modelscope_logger, _undo_import_patches
    from ..checks.stand_ins import never_called, stub_tree

    attrs = {module: {n: (_modelscope_logger if n == "get_logger" else never_called(f"{module}.{n}", "modelscope"))
                      for n in names} for module, names in MODELSCOPE_NAMES.items()}
    with _undo_import_patches(), stub_tree("modelscope", "only its logger and hub functions are bound at import, "
                                           "none called on this path", attrs) as ms:
        yield [ms]


def _build_swift_padding_free(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """ms-swift's own ``Template._data_collator`` (swift/template/base.py; what ``Template.data_collator`` calls for
    a causal LM in train mode) on a template with ``padding_free=True``: ``packing_row`` concatenates the encoded
    examples and their position_ids (0.. per example), no attention_mask. The template is made without its
    ``__init__`` (which needs a processor and a template_meta), with the attributes the collator reads."""
    base = mods["swift.template.base"]
    template = object.__new__(base.Template)
    template.processor = _tiny_tokenizer(0)
    vars(template).update(padding_free=True, packing=False, padding_side="right", mode="train", use_megatron=False,
                          sequence_parallel_size=1, task_type="causal_lm")
    encoded = [{"input_ids": list(e), "labels": list(e), "length": len(e)} for e in examples]
    batch = dict(template._data_collator(encoded))
    batch.pop("labels", None)
    keys = ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())
    return batch, f"one row: {keys}; ms-swift refuses padding_free off the flash path (swift/arguments/sft_args.py _check_padding_free)"


def _trl_padding_free_collator() -> Any:
    """TRL's DataCollatorForLanguageModeling with ``padding_free=True`` and ``return_position_ids=True`` (what
    unsloth's SFT trainer wraps), pad id 0."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, return_position_ids=True)


def _build_unsloth_packing(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """unsloth's ``enable_sample_packing(model, trainer)`` (unsloth/utils/packing.py) on a trainer holding TRL's
    padding-free collator: its ``torch_call`` wrapper adds ``packed_seq_lengths`` (int32, one per example), masks
    the labels at each example's first token and drops ``attention_mask``. The batch is what that wrapper returns
    for one packed example list (``seq_lengths`` given, as TRL's packing gives them)."""
    import types as _types

    packing = mods["unsloth.utils.packing"]
    collator = _trl_padding_free_collator()
    trainer = _types.SimpleNamespace(data_collator=collator, args=_types.SimpleNamespace(remove_unused_columns=True))
    model = _PATCHED_MODEL[0]
    packing.enable_sample_packing(model, trainer)
    row = [x for e in examples for x in e]
    batch = dict(collator.torch_call([{"input_ids": row, "seq_lengths": [len(e) for e in examples]}]))
    batch.pop("labels", None)
    lengths = batch.get("packed_seq_lengths")
    return batch, (f"packed_seq_lengths {lengths.tolist() if lengths is not None else None}, "
                   f"keys {', '.join(sorted(batch))}")


#: The model of the cell being run (set by :func:`run_path` for builders that patch it: unsloth, verl).
_PATCHED_MODEL: list[Any] = [None]


@contextlib.contextmanager
def _unsloth_sdpa_entry(mods: dict[str, Any], bench: Any) -> Iterator[dict[str, Any]]:
    """transformers' ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` as it was, put back on exit (``enable_sample_packing``
    replaces it with unsloth's ``_sdpa_packed_varlen`` once per process). For ``unsloth:packing`` the entry is put
    back before the forward (:data:`_RESTORE_BEFORE_FORWARD`): its forward is the collator's batch on stock
    attention; ``unsloth:hf_packed_attention`` keeps unsloth's wrapper for the forward and counts its calls."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping  # where ``ALL_ATTENTION_FUNCTIONS["sdpa"] = ...`` writes

    saved = local.get("sdpa", _ABSENT)

    def restore() -> None:
        if saved is _ABSENT:
            local.pop("sdpa", None)
        else:
            local["sdpa"] = saved

    attention = mods.get("unsloth.utils.hf_packed_attention")
    state: dict[str, Any] = {"note": "", "restore": restore}
    if attention is not None:
        stats = attention.HF_PACKED_ATTENTION_STATS
        start = dict(stats)
        state["calls_of"] = lambda: sum(stats[k] - start.get(k, 0) for k in ("fast", "fallback"))
    try:
        yield state
    finally:
        restore()
        if attention is not None:
            state["note"] = "unsloth's sdpa wrapper: " + ", ".join(f"{k} {v - start.get(k, 0)}" for k, v in stats.items())


@contextlib.contextmanager
def _unsloth_stock_attention(mods: dict[str, Any], bench: Any) -> Iterator[dict[str, Any]]:
    """:func:`_unsloth_sdpa_entry` with transformers' own "sdpa" entry put back before the forward."""
    with _unsloth_sdpa_entry(mods, bench) as state:
        state["before_forward"] = state["restore"]
        state.pop("calls_of", None)
        yield state


def _build_verl_rmpad(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """verl's remove-padding batch (``use_remove_padding=True``, verl/workers/actor/dp_actor.py): the examples
    right-padded into ``(B, S)`` with an attention_mask and ``position_ids`` counted over each row, then verl's own
    ``unpad_input`` (verl/utils/attention_utils.py) -> ``input_ids`` ``(1, nnz)`` and ``position_ids`` gathered at the
    same indices by ``index_first_axis``; no attention_mask."""
    import torch

    au = mods["verl.utils.attention_utils"]
    width = max(len(e) for e in examples)
    ids = torch.tensor([e + [0] * (width - len(e)) for e in examples])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in examples])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids_rmpad, indices, *_ = au.unpad_input(ids.unsqueeze(-1), mask)
    pos_rmpad = au.index_first_axis(au.rearrange(pos.unsqueeze(-1), "b s ... -> (b s) ..."), indices).transpose(0, 1)
    return ({"input_ids": ids_rmpad.transpose(0, 1), "position_ids": pos_rmpad},
            f"{len(examples)} rows of {width} unpadded to one row of {int(indices.numel())} tokens")


@contextlib.contextmanager
def _verl_monkey_patch(mods: dict[str, Any], bench: Any) -> Iterator[dict[str, Any]]:
    """verl's ``apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True)`` on the cell's model, its
    prints kept out of the output: transformers' ``integrations.flash_attention._flash_attention_forward`` becomes
    verl's ``_ulysses_flash_attention_forward``, which hands the call on to the ``_flash_attention_forward`` it
    imported (counted: ``calls``). Everything it replaced is put back on exit: that attribute (and a model
    module's own), and ``AutoModelForCausalLMWithValueHead.state_dict`` (trl), which it replaces too."""
    import io
    from contextlib import redirect_stdout

    from transformers.integrations import flash_attention

    patch = mods["verl.models.transformers.monkey_patch"]
    owners: list[tuple[Any, str]] = [(flash_attention, "_flash_attention_forward"),
                                     (sys.modules[type(bench.model).__module__], "_flash_attention_forward")]
    state: dict[str, Any] = {"calls": 0, "note": "", "stand_ins": []}
    for where in ("trl.experimental.ppo", "trl"):  # monkey_patch.py's own order
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            owners.append((importlib.import_module(where).AutoModelForCausalLMWithValueHead, "state_dict"))
            break
    else:  # trl 1.x has no value-head model: the patch's `from trl import ...` raises, before the flash patch
        owners.append((patch, "is_trl_available"))
        state["stand_ins"].append(f"is_trl_available() answered False: trl {_version('trl')} has no "
                                  "AutoModelForCausalLMWithValueHead, whose state_dict apply_monkey_patch replaces "
                                  "(a value-head patch, not on this path)")
    saved = [(o, n, vars(o).get(n, _ABSENT)) for o, n in owners]
    if state["stand_ins"]:
        patch.is_trl_available = lambda: False
    inner = patch._flash_attention_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        state["calls"] += 1
        return inner(*args, **kwargs)

    patch._flash_attention_forward = counted
    try:
        with redirect_stdout(io.StringIO()) as printed:
            patch.apply_monkey_patch(bench.model, ulysses_sp_size=1, use_remove_padding=True)
        applied = [line for line in printed.getvalue().splitlines() if "_flash_attention_forward" in line]
        state["note"] = "verl: " + (applied[0] if applied else "no _flash_attention_forward patch printed")
        state["calls_of"] = lambda: state["calls"]
        yield state
    finally:
        patch._flash_attention_forward = inner
        for owner, name, value in saved:
            if value is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
        state["note"] += f"; _ulysses_flash_attention_forward handed on {state['calls']} calls"


_ABSENT = object()


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


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
    logits), inside ``path.around`` where it has one. Never raises for the peer's or the model's faults: a batch the
    peer cannot build, or a forward that raises, is an ``error`` result with the exception; a patch the peer applied
    whose function the forward never called (``around``'s ``calls_of``) is an ``error`` too (the batch would have
    been judged on stock code)."""
    base = {"peer": path.peer, "version": version, "path": path.name, "code": path.code, "model": bench.config.model_type,
            "backend": bench.backend, "stubs": path.named_stand_ins() + tuple(mods.get("__stand_ins__", ())),
            "not_on_cpu": path.not_on_cpu}

    def crashed(exc: BaseException) -> PathResult:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return PathResult(**base, verdict="error", reason=f"{type(exc).__name__}: {text}{_raised_at(exc)}")

    try:
        bench.solo_logits()  # each example alone on stock code, before the peer patches anything
    except Exception as exc:  # noqa: BLE001 - the model's fault is a cell, never the run's end
        return crashed(exc)
    _PATCHED_MODEL[0] = bench.model
    with contextlib.ExitStack() as stack:
        try:
            state = stack.enter_context(globals()[path.around](mods, bench)) if path.around else {}
            base["stubs"] += tuple(state.get("stand_ins", ()))
            batch, note = _builder(path)(mods, bench.examples, bench.backend, bench.config)
            state.get("before_forward", lambda: None)()
        except PeerUnavailable as exc:
            return PathResult(**base, verdict="not_run", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - a peer's fault is a cell, never the run's end
            return crashed(exc)
        finally:
            _PATCHED_MODEL[0] = None
        try:
            worst, per = bench.diff_to_solo(bench.forward(batch).logits[0].float())
        except Exception as exc:  # noqa: BLE001 - a peer's fault is a cell, never the run's end
            return crashed(exc)
        calls = state["calls_of"]() if "calls_of" in state else None
    if state.get("note"):
        note += f"; {state['note']}"
    if calls == 0:
        return PathResult(**base, verdict="error", note=note, reason=f"{path.code.split(':')[-1]}: the patch was applied "
                          "but the forward never called it (the batch ran on stock code)")
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


def measure(wheel: Path, make_bench: Callable[[str, str], Any], models: tuple[str, ...] | None = None,
            backends: tuple[str, ...] | None = None) -> list[PathResult]:
    """Every :data:`PEER_PATHS` entry of ``wheel``'s peer on each of ``models`` (default :data:`DEFAULT_MODELS` and
    the path's own ``models``) x the path's backends (those in ``backends`` when given). ``make_bench(model_type, backend)`` builds the workbench (a built tiny model), or
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
        out += _measure_path(wheel, path, version, models or DEFAULT_MODELS + path.models, on, make_bench)
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
        out += [PathResult(path.peer, version, path.name, path.code, m, b, "not_run", reason=str(exc), stubs=path.named_stand_ins(),
                              not_on_cpu=path.not_on_cpu)
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
