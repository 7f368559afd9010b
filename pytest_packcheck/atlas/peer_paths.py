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
- ``verl:vlm_forward`` / ``vlm_forward_text`` (0.9.1, at transformers 5.10.4, its pin): ``apply_monkey_patch`` on the
  model types it replaces the forward / attention of (:data:`VERL_PATCHED_MODELS`), on checks/pixels.py's pixel row
  (each sample's text logits against the sample alone with its image) and on a text-only micro-batch; flash-attn's
  functions in verl's model modules bound to packcheck's reference kernels (:func:`_verl_model_patch`), every
  function verl installs counted; on Qwen3.5 (MoE) each gated-delta-net layer's ``chunk_gated_delta_rule`` bound to
  :func:`fla_chunk_gated_delta_rule_reference` (what verl runs with fla installed: :func:`_verl_fla`).
  ``verl:vlm_forward_no_fla``: the same pixel row on Qwen3.5 (MoE) without fla (transformers'
  ``torch_chunk_gated_delta_rule``, which takes the ``cu_seqlens`` verl hands it in ``**kwargs``); each cell's
  ``condition`` says which.
- ``axolotl:model_patches`` (0.19.0, at transformers 5.16.1, its pin): its per-model packing patch
  (:data:`AXOLOTL_MODEL_PATCHES`) under the multipack batch, fla's varlen kernels bound to packcheck's per-segment
  CPU references (:func:`fla_causal_conv1d_reference`, :func:`fla_chunk_gated_delta_rule_reference`); the Mamba2
  patches' refusals without mamba-ssm / causal-conv1d are ``not_run`` cells with axolotl's message.

A path pinned to another transformers than the one running (:attr:`PeerPath.transformers`) runs in packcheck's
environment of that release (``python -m pytest_packcheck.atlas.peer_paths WHEEL PEER:PATH MODELS BACKENDS``, its
results as JSON); each result records the transformers it ran on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import itertools
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
    #: run on ``models`` only (not :data:`DEFAULT_MODELS` too): a path whose patch exists for those model types alone
    only_models: bool = False
    #: ``name`` of a function here, ``(bench) -> reference``, run on stock code before the patch (default: each
    #: example alone, ``bench.solo_logits()``), and of one ``(bench, batch, reference) -> (max_abs_diff, per_example,
    #: note)`` that runs the patched forward and compares (default: ``bench.forward`` against ``diff_to_solo``)
    reference: str = ""
    compare: str = ""
    #: the transformers release the path is measured at when the one running is another (the peer's pin excludes it):
    #: :func:`measure` runs it in packcheck's environment of that release (:func:`..versions.envs.ensure_env`)
    transformers: str = ""
    #: requirements installed beside that transformers (what the path's modules import: axolotl's qwen3_5 patch imports peft)
    env: tuple[str, ...] = ()
    #: substrings of the peer's own refusals to run without a GPU package (its ``RuntimeError`` naming the package):
    #: a forward or patch that raises one is ``not_run`` with the message and where the wheel raised it, not an error
    refusals: tuple[str, ...] = ()
    #: ``(model, sentence)``: put before the reason of that model's cells when its tiny model does not build
    model_notes: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.peer}:{self.name}"

    def named_stand_ins(self) -> tuple[str, ...]:
        """The stubs and the package ``__init__`` files not run, as every result names them."""
        return self.stubs + tuple(f"{b.replace('.', '/')}/__init__.py not run" for b in self.bare)


#: The model types verl 0.9.1's apply_monkey_patch replaces the forward / attention of (monkey_patch.py:365-500), as
#: packcheck builds them: the M-RoPE VLMs on their text path (``arch:``), Qwen3.5 as its vision-language model
#: (``vlm:``: ``arch:qwen3_5`` is the causal LM, model_type qwen3_5_text, which verl does not patch); kimi_vl is not a
#: transformers model type (its modeling is the checkpoint's remote code).
VERL_PATCHED_MODELS = ("arch:qwen2_vl", "arch:qwen2_5_vl", "arch:qwen3_vl", "arch:qwen3_vl_moe", "arch:glm4v", "arch:kimi_vl",
                       "vlm:qwen3_5", "vlm:qwen3_5_moe")
#: verl 0.9.1 requires transformers >=5.5.3,<5.11,!=5.6.0: its model patches are measured at the newest release in
#: its pin packcheck's atlas measures (5.25.0's qwen2_vl module lacks Qwen2VLCausalLMOutputWithPast, which
#: verl/models/transformers/qwen2_vl.py:24 imports)
VERL_TRANSFORMERS = "5.10.4"
VERL_MODEL_NOTES = (("arch:kimi_vl", ("kimi_vl is not a transformers model type: its modeling is the checkpoint's remote code "
                     "(modeling_kimi_vl.py's DeepseekV3FlashAttention2, whose forward apply_monkey_patch replaces, "
                     "verl/models/transformers/monkey_patch.py:485-490; its _ulysses_flash_attn_forward is "
                     "verl/models/transformers/kimi_vl.py:91), not run here")),)
VERL_NOT_ON_CPU = ("flash_attn's flash_attn_varlen_func (verl/models/transformers/qwen2_vl.py:46, glm4v.py:46: imported "
                   "only with flash-attn installed) stood in by packcheck's varlen reference; fla's chunk_gated_delta_rule "
                   "with cu_seqlens (Qwen3.5: stood in by packcheck's per-segment reference; verl:vlm_forward_no_fla runs "
                   "without it); causal-conv1d's causal_conv1d_fn (not installed: verl's per-segment torch fallback, "
                   "qwen3_5.py:146, runs); ulysses_sp_size > 1")
#: the models verl's Qwen3.5 patch (qwen3_5.py) runs on: the gated-delta-net layers whose kernel fla provides
VERL_FLA_MODELS = ("vlm:qwen3_5", "vlm:qwen3_5_moe")

#: axolotl 0.19.0's per-model packing patches (loaders/patch_manager.py:543-599, model_support/qwen4_exp/__init__.py:21-31),
#: by model type: (module, the functions axolotl calls in order, their keyword arguments)
AXOLOTL_MODEL_PATCHES: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    "qwen3_next": ("axolotl.monkeypatch.models.qwen3_next.modeling", ("patch_qwen3_next_modeling_packing",), {}),
    "qwen3_5": ("axolotl.monkeypatch.models.qwen3_5.modeling", ("patch_qwen3_5_modeling_packing",), {}),
    "qwen4_exp": ("axolotl.monkeypatch.models.qwen4_exp.modeling", ("patch_qwen4_exp_qsa_indexer",
                                                                    "patch_qwen4_exp_modeling_packing"), {}),
    "granitemoehybrid": ("axolotl.monkeypatch.models.granitemoehybrid.modeling", ("patch_granitemoehybrid_modeling_packing",), {}),
    "nemotron_h": ("axolotl.monkeypatch.models.nemotron_h.modeling", ("guard_nemotron_h_fused_scan",
                                                                      "patch_nemotron_h_modeling_packing"), {"kernels_enabled": False}),
    "falcon_h1": ("axolotl.monkeypatch.models.falcon_h1.modeling", ("patch_falcon_h1_modeling_packing",), {}),
}

#: axolotl 0.19.0's own refusals to pack without a GPU package (qwen3_next/modeling.py, qwen3_5/modeling.py:147,
#: qwen4_exp/modeling.py:202: fla; nemotron_h/modeling.py:88: Mamba2 kernels; falcon_h1/modeling.py:270, 283)
AXOLOTL_REFUSALS = ("require flash-linear-attention", "requires causal_conv1d_fn", "requires the CUDA fast path",
                    "requires Mamba2 kernels")

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
    PeerPath("axolotl", "model_patches", "its per-model packing patch (monkeypatch/models/<model>/modeling.py: cu_seqlens or "
             "seq_idx derived from position_ids and threaded into the linear-attention / Mamba2 layers) under the multipack "
             "batch (position_ids, no attention_mask)", "axolotl/monkeypatch/models/<model>/modeling.py",
             ("axolotl.utils.collators.batching",), ("sdpa", REFERENCE_BACKEND), "_build_axolotl_multipack",
             around="_axolotl_model_patch", only_models=True, transformers="5.16.1",
             bare=("axolotl.utils.collators",),
             models=("qwen3_next", "qwen3_5", "qwen4_exp", "granitemoehybrid", "nemotron_h", "falcon_h1"),
             refusals=AXOLOTL_REFUSALS,
             not_on_cpu="fla's Triton kernels (fla.modules.convolution.causal_conv1d, fla.ops.gated_delta_rule."
             "chunk_gated_delta_rule with cu_seqlens: stood in by packcheck's per-segment reference over transformers' "
             "torch fallbacks); mamba-ssm's mamba_chunk_scan_combined and causal-conv1d's causal_conv1d_fn with seq_idx "
             "(CUDA)"),
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
    # verl's per-model patches: the model types apply_monkey_patch names get verl's own forward (and attention)
    PeerPath("verl", "vlm_forward", "apply_monkey_patch(use_remove_padding=True) on the model types it names (the model's "
             "forward, its text attention or its gated-delta-net layer replaced by verl's): one unpadded row of an image "
             "sample, a text sample and an image sample (pixel_values, image_grid_thw), M-RoPE position_ids (4, 1, total), "
             "cu_seqlens where the patched forward takes them; text-token logits against each sample alone with its image",
             "verl/models/transformers/monkey_patch.py:apply_monkey_patch",
             ("verl.utils.attention_utils", "verl.models.transformers.monkey_patch"), (REFERENCE_BACKEND,),
             "_build_verl_pixel_row", bare=("verl", "verl.utils", "verl.models", "verl.models.transformers"),
             beside=("einops",), around="_verl_model_patch", only_models=True, models=VERL_PATCHED_MODELS,
             reference="_pixel_row_alone", compare="_pixel_row_compare", transformers=VERL_TRANSFORMERS,
             not_on_cpu=VERL_NOT_ON_CPU, model_notes=VERL_MODEL_NOTES),
    PeerPath("verl", "vlm_forward_text", "the same patch on a text-only micro-batch (no pixel_values: verl's _get_input_embeds "
             "runs the vision tower on a dummy image and adds 0 x its mean, 'mixed text-image data')",
             "verl/models/transformers/monkey_patch.py:apply_monkey_patch",
             ("verl.utils.attention_utils", "verl.models.transformers.monkey_patch"), (REFERENCE_BACKEND,),
             "_build_verl_vlm", bare=("verl", "verl.utils", "verl.models", "verl.models.transformers"),
             beside=("einops",), around="_verl_model_patch", only_models=True, models=VERL_PATCHED_MODELS,
             transformers=VERL_TRANSFORMERS, not_on_cpu=VERL_NOT_ON_CPU, model_notes=VERL_MODEL_NOTES),
    PeerPath("verl", "vlm_forward_no_fla", "the pixel row of verl:vlm_forward on Qwen3.5 (MoE) without fla "
             "(flash-linear-attention) installed: each gated-delta-net layer's chunk_gated_delta_rule is transformers' "
             "torch_chunk_gated_delta_rule, as its __init__ binds it then",
             "verl/models/transformers/qwen3_5.py:_packed_chunk_gated_delta_rule",
             ("verl.utils.attention_utils", "verl.models.transformers.monkey_patch"), (REFERENCE_BACKEND,),
             "_build_verl_pixel_row", bare=("verl", "verl.utils", "verl.models", "verl.models.transformers"),
             beside=("einops",), around="_verl_model_patch_no_fla", only_models=True, models=VERL_FLA_MODELS,
             reference="_pixel_row_alone", compare="_pixel_row_compare", transformers=VERL_TRANSFORMERS,
             not_on_cpu="causal-conv1d's causal_conv1d_fn (not installed: verl's per-segment torch fallback, "
             "qwen3_5.py:146, runs); ulysses_sp_size > 1"),
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
    #: the transformers release the cell ran on (the document's, unless the path pins another: :attr:`PeerPath.transformers`)
    transformers: str = ""
    #: the condition the verdict is for where the peer's code branches on an optional package (verl's Qwen3.5 patch
    #: with or without fla), a sentence with the file:line of each side (:func:`_verl_fla`); empty elsewhere
    condition: str = ""

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
            "not_on_cpu": path.not_on_cpu, "transformers": _version("transformers")}

    def crashed(exc: BaseException) -> PathResult:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return PathResult(**base, verdict="error", reason=f"{type(exc).__name__}: {text}{_raised_at(exc)}")

    try:  # each example alone on stock code, before the peer patches anything
        reference = globals()[path.reference](bench) if path.reference else bench.solo_logits()
    except PeerUnavailable as exc:
        return PathResult(**base, verdict="not_run", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - the model's fault is a cell, never the run's end
        return crashed(exc)
    _PATCHED_MODEL[0], _PIXEL_BENCH[0] = bench.model, bench
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
            _PATCHED_MODEL[0] = _PIXEL_BENCH[0] = None
        try:
            if path.compare:
                worst, per, more = globals()[path.compare](bench, batch, reference)
                note += more
            else:
                worst, per = bench.diff_to_solo(bench.forward(batch).logits[0].float())
        except Exception as exc:  # noqa: BLE001 - a peer's fault is a cell, never the run's end
            if state.get("condition"):
                base["condition"] = state["condition"]("error", None)
            if any(r in str(exc) for r in path.refusals):
                return PathResult(**base, verdict="not_run", note=note, reason="the peer's own refusal: "
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())}{_raised_at(exc)}")
            return crashed(exc)
        calls = state["calls_of"]() if "calls_of" in state else None
    if state.get("note"):
        note += f"; {state['note']}"
    if calls == 0:
        return PathResult(**base, verdict="error", note=note, reason=f"{path.code.split(':')[-1]}: the patch was applied "
                          "but the forward never called it (the batch ran on stock code)")
    tol = float(bench.tol["logits_atol"])
    verdict = "pass" if worst <= tol else "fail"
    if state.get("condition"):
        base["condition"] = state["condition"](verdict, worst)
    window = getattr(bench.config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        note += f"; sliding_window {window}"
    if not path.compare:
        note += "; examples of " + ", ".join(str(len(e)) for e in bench.examples) + " tokens"
    return PathResult(**base, verdict=verdict, max_abs_diff=worst, per_example=per, tolerance=tol, note=note,
                      cause=(_cause(per, [len(e) for e in bench.examples], tol, bench.config, batch) if not path.compare else "leak")
                      if verdict == "fail" else "")


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
    the path's own ``models``; a path with ``only_models`` on its own models, those of ``models`` when given, and not
    at all where none is asked for) x the path's backends (those in ``backends`` when given); a path pinned to
    another transformers (:attr:`PeerPath.transformers`) runs in that release's environment (:func:`_measure_in_env`). ``make_bench(model_type, backend)`` builds the workbench (a built tiny model), or
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
        chosen = models or (path.models if path.only_models else DEFAULT_MODELS + path.models)
        if path.only_models:  # a patch that exists for its models alone runs on those of them asked for
            chosen = tuple(m for m in path.models if models is None or m in models or m.split(":")[-1] in models)
        if not chosen:
            continue
        if path.transformers and _version("transformers") != path.transformers:
            out += _measure_in_env(wheel, path, version, chosen, on)
        else:
            out += _measure_path(wheel, path, version, chosen, on, make_bench)
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
                        why = "".join(f"{n}; " for m, n in path.model_notes if m == model)
                        error = str(exc).split(": not a model_type")[0] if why else str(exc)  # the note says the rest
                        out.append(PathResult(path.peer, version, path.name, path.code, model.split(":")[-1], backend, "not_run",
                                              reason=f"{why}the tiny model does not build: {type(exc).__name__}: {error}",
                                              stubs=path.named_stand_ins(), not_on_cpu=path.not_on_cpu,
                                              transformers=_version("transformers")))
                        continue
                    out.append(run_path(path, mods, bench, version))
    except PeerUnavailable as exc:
        out += [PathResult(path.peer, version, path.name, path.code, m.split(":")[-1], b, "not_run", reason=str(exc), stubs=path.named_stand_ins(),
                              not_on_cpu=path.not_on_cpu)
                for m in models for b in on]
    return out


def _measure_in_env(wheel: Path, path: PeerPath, version: str, models: tuple[str, ...], on: tuple[str, ...]) -> list[PathResult]:
    """``path`` measured in packcheck's environment of transformers ``path.transformers`` (made or found by
    :func:`..versions.envs.ensure_env`; the same torch), by ``python -m pytest_packcheck.atlas.peer_paths WHEEL KEY
    MODELS BACKENDS`` there (its results as JSON on stdout, :func:`build_bench` building each model). An environment
    that cannot be made, or a run that fails, gives one ``not_run`` per cell naming why."""
    import json
    import subprocess

    from ..versions.envs import EnvError, VersionCombo, ensure_env

    def not_run(reason: str) -> list[PathResult]:
        return [PathResult(path.peer, version, path.name, path.code, m.split(":")[-1], b, "not_run", reason=reason,
                           stubs=path.named_stand_ins(), not_on_cpu=path.not_on_cpu, transformers=path.transformers)
                for m in models for b in on]

    try:
        env = ensure_env(VersionCombo((f"transformers=={path.transformers}", *path.env)))
    except EnvError as exc:
        return not_run(f"no environment of transformers {path.transformers} ({exc})")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([str(env.python), "-m", "pytest_packcheck.atlas.peer_paths", str(wheel.resolve()), path.key,
                           ",".join(models), ",".join(on)], capture_output=True, text=True, cwd=root, check=False, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if proc.returncode or not lines:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-1:])[:300]
        return not_run(f"its run in transformers {path.transformers}'s environment failed (exit {proc.returncode}: {tail})")
    return [PathResult(**{**r, "stubs": tuple(r["stubs"])}) for r in json.loads(lines[-1])]


def build_bench(model_type: str, backend: str) -> Any:
    """The workbench a peer path runs on: ``arch:<model_type>`` (or ``model_type`` itself where it is a spec:
    ``vlm:qwen3_5``) resolved, shrunk and built as every audit cell builds it (float32, CPU, ``backend`` registered
    first where packcheck registers it), with the float32 tolerances of audit/tolerances.toml. A multimodal model runs
    on its text path as the runner runs it: its text config (``vocab_size``) and the position_ids layout its text model
    reads (M-RoPE rows: :func:`..model.multimodal.position_layout`, read from the model). Raises what the build raises
    (:func:`measure` makes it a ``not_run``)."""
    from types import SimpleNamespace

    from ..backends import ensure_registered
    from ..checks.workbench import Workbench
    from ..config.tolerances import default_tolerances
    from ..model.build import build_model
    from ..model.multimodal import position_layout
    from ..model.resolve import resolve_model
    from ..model.specs import parse_model_spec
    from ..run.runner import text_config

    ensure_registered(backend)
    spec = model_type if ":" in model_type else f"arch:{model_type}"
    resolved = resolve_model(parse_model_spec(spec, "peer path"), "peer path")
    model = build_model(resolved, backend, "float32")
    config = text_config(model.config)
    layout = position_layout(model, resolved if resolved.text_path or config is model.config else
                             SimpleNamespace(text_path="peer path", model_type=model.config.model_type))
    return Workbench(model=model, config=config, backend=backend, dtype="float32", tol=default_tolerances()["float32"],
                     layout=layout)


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


#: result fields a path's cells mostly share: written once per path in the document's ``paths`` table, and in a
#: result only where it differs (:func:`dumps_document`, :func:`expand_document`)
SHARED_FIELDS = ("code", "stubs", "not_on_cpu", "transformers")


def dumps_document(doc: dict[str, Any]) -> str:
    """``doc`` (:func:`results_document`) as the JSON text peer_paths.json holds, compacted (schema_version 2): the
    fields of :data:`SHARED_FIELDS` most of a path's cells share go once into ``paths["peer:path"]``, a result keeps
    them only where its own differ, empty ``reason`` / ``note`` / ``cause`` are left out, ``per_example`` kept to 4
    significant digits (``max_abs_diff`` whole), one result per line.
    :func:`expand_document` gives back ``doc``."""
    import json
    from collections import Counter

    paths: dict[str, dict[str, Any]] = {}
    rows = []
    for r in doc.get("results", []):
        key = f"{r['peer']}:{r['path']}"
        if key not in paths:
            these = [x for x in doc["results"] if f"{x['peer']}:{x['path']}" == key]
            paths[key] = {f: json.loads(Counter(json.dumps(x.get(f)) for x in these).most_common(1)[0][0]) for f in SHARED_FIELDS}
        row = {k: v for k, v in r.items() if not (k in SHARED_FIELDS and v == paths[key][k])
               and not (k in ("reason", "note", "cause", "condition") and not v)}
        if row.get("per_example"):  # 4 significant digits: claims.md and the docs quote 2
            row["per_example"] = [float(f"{x:.4g}") for x in row["per_example"]]
        rows.append(json.dumps(row, ensure_ascii=False))
    head = {k: v for k, v in doc.items() if k != "results"}
    head.update(schema_version=2, paths=paths)
    text = json.dumps(head, indent=1, ensure_ascii=False)
    return text[:-2] + ',\n "results": [\n' + ",\n".join(rows) + "\n ]\n}\n"


def expand_document(doc: dict[str, Any]) -> dict[str, Any]:
    """A peer-paths document with every result whole (each :class:`PathResult` field): a schema_version 2 file's
    shared fields put back from its ``paths`` table; a version 1 document (or one made in memory) as it is."""
    if doc.get("schema_version", 1) < 2:
        return doc
    blank = {"reason": "", "note": "", "cause": "", "condition": ""}
    results = [{**blank, **doc.get("paths", {}).get(f"{r['peer']}:{r['path']}", {}), **r} for r in doc.get("results", [])]
    return {**{k: v for k, v in doc.items() if k != "paths"}, "schema_version": 1, "results": results}


def _short(text: str, limit: int = 240) -> str:
    """``text`` cut at ``limit`` characters (a failing cell's note in claims.md; peer_paths.json keeps it whole)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
    GPU-only part named, the condition a cell's verdict is for (:attr:`PathResult.condition`), and each not-run or
    error reason once; where the transformers measured on is outside the
    peer's ``pin`` (its wheel's requirement), that is said. No lines where ``doc`` has none for the peer."""
    norm = peer.lower().replace("-", "_")
    rows = [r for r in doc.get("results", []) if r["peer"].lower().replace("-", "_") == norm]
    if not rows:
        return []
    outside = (f" This transformers is outside {peer}'s pin `{pin}`: run `packcheck claims --run-own-paths` with a "
               "pinned transformers installed to measure it there.") if _outside_pin(doc["transformers"], pin) else ""
    lines = [(f"**Own code, run** (on CPU, float32, torch {doc['torch']}, transformers {doc['transformers']}; each "
             f"example's logits in the peer's packed batch against the example alone, max abs diff).{outside}"), ""]
    previous: dict[str, Any] = {}
    for name in dict.fromkeys(r["path"] for r in rows):
        these = [r for r in rows if r["path"] == name]
        backends = list(dict.fromkeys(r["backend"] for r in these))
        first = these[0]
        other = first.get("transformers") and first["transformers"] != doc["transformers"]
        same = previous.get("stubs") == first.get("stubs") and previous.get("not_on_cpu") == first.get("not_on_cpu")
        lines.append(f"- `{peer}:{name}`: `{first['code']}`"
                     + (f"; measured at transformers {first['transformers']} (inside the peer's pin)" if other else "")
                     + (f"; stubbed and not run on CPU as `{peer}:{previous['path']}`" if same and first.get("stubs") else
                        (f"; stubbed (never called on this path): {', '.join(first['stubs'])}" if first.get("stubs") else "")
                        + (f"; not run on CPU: {first['not_on_cpu']}" if first.get("not_on_cpu") else "")))
        previous = first
        lines += ["", "| model | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for model in dict.fromkeys(r["model"] for r in these):
            cells = {r["backend"]: r for r in these if r["model"] == model}
            lines.append(f"| {model} | " + " | ".join(_cell(cells[b]) if b in cells else "" for b in backends) + " |")
        lines.append("")
        notes = [f"Condition, {r['model']}: {r['condition']}" for r in these if r.get("condition")]
        notes += [f"Not run / error: {reason}" for reason in dict.fromkeys(r["reason"] for r in these if r.get("reason"))]
        notes += [f"Fails {r['model']}/{r['backend']}: {r['max_abs_diff']:.2e} ({r['cause']}; per example "
                  + ", ".join(f"{d:.1e}" for d in r["per_example"]) + f"; {_short(r['note'])})" for r in these if r["verdict"] == "fail"]
        lines += [f"  {n}" for n in notes] + ([""] if notes else [])
    return lines


def _build_verl_vlm(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """verl's remove-padding batch for a model whose forward :func:`_verl_model_patch` replaced (verl/workers/engine/
    fsdp/transformer_impl.py:1188-1271, ``use_remove_padding``): the examples concatenated into ``input_ids`` ``(1,
    total)``, ``attention_mask=None``, ``position_ids`` as verl lays them out for an M-RoPE model (experimental/
    agent_loop/agent_loop.py:961-964: a text row counting 0.. per example, then the model's ``get_rope_index`` rows:
    for text alone ``arange`` in each; ``(4, 1, total)`` after ``.values().unsqueeze(1)``), and ``cu_seqlens`` /
    ``cu_seqlens_cpu`` (int64 ``(examples + 1,)``) where the patched forward's signature names ``cu_seqlens``
    (transformer_impl.py:594 ``pass_packed_cu_seqlens``: qwen3_5's ``forward_with_normal_backend``)."""
    import inspect

    import torch

    model = _PATCHED_MODEL[0]
    rows = [torch.arange(len(e)) for e in examples]
    text = torch.cat(rows)
    rope = getattr(_verl_layout(model), "rows", None) or 4
    position_ids = text[None, None].expand(rope, 1, -1).contiguous()
    batch: dict[str, Any] = {"input_ids": torch.tensor([[x for e in examples for x in e]]), "position_ids": position_ids}
    takes_cu = "cu_seqlens" in inspect.signature(model.forward).parameters
    if takes_cu:
        cu = torch.tensor([0, *torch.tensor([len(e) for e in examples]).cumsum(0).tolist()], dtype=torch.long)
        batch.update(cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    return batch, (f"one row of {int(text.numel())} tokens, position_ids {tuple(position_ids.shape)}"
                   + (", cu_seqlens " + str(batch["cu_seqlens"].tolist()) if takes_cu else
                      ", no cu_seqlens (the patched forward does not name it)"))


def _verl_layout(model: Any) -> Any:
    from types import SimpleNamespace

    from ..model.multimodal import position_layout

    return position_layout(model, SimpleNamespace(text_path="peer path", model_type=model.config.model_type))


#: verl's model modules that import flash-attn's functions only when flash-attn is installed (``if
#: is_flash_attn_2_available(): from flash_attn import flash_attn_func, flash_attn_varlen_func`` and the flags set in
#: that block, verl/models/transformers/qwen2_vl.py:45-50, glm4v.py:45-50): bound to packcheck's CPU reference
#: kernels, the flags as that block computes them from the kernels' signatures (flash-attn >= 2.1: bottom-right
#: causal, no top-left mask).
VERL_FLASH_MODULES = ("verl.models.transformers.qwen2_vl", "verl.models.transformers.glm4v")
#: the transformers model families verl 0.9.1's apply_monkey_patch imports for the model types it names
VERL_PATCHED_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")


def _calls(counts: dict[str, int]) -> str:
    """``called: A x2, B x1; N more installed, not reached`` (or ``none installed``) for a note."""
    if not counts:
        return "none installed"
    called = [f"{k} x{v}" for k, v in counts.items() if v]
    idle = len(counts) - len(called)
    return "called: " + (", ".join(called) or "none") + (f"; {idle} more installed, not reached" if idle else "")


def _no_cast(query: Any, key: Any, value: Any, target_dtype: Any = None) -> tuple[Any, Any, Any]:
    """transformers' ``fa_peft_integration_check`` without its cast (float32 q/k/v stay float32)."""
    return query, key, value


#: verl 0.9.1's own docs of the no-fla case (the VeOmni engine's eager chunk_gated_delta_rule_implementation), which
#: say it raises; the FSDP engine's patch hands cu_seqlens on and nothing raises
VERL_FLA_DOCS = ("verl/workers/config/engine.py:404-410 says this case (its \"eager\" default) \"raises at runtime\"; "
                 "it does not")


def _where(fn: Any) -> str:
    """``verl/models/transformers/qwen3_5.py:158`` (the file from the package's top folder, the ``def`` line) of a
    function, or its name where its source cannot be found."""
    import inspect

    fn = inspect.unwrap(fn)
    try:
        file, line = inspect.getsourcefile(fn) or "", inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))
    parts = Path(file).parts
    top = next((i for i, part in enumerate(parts) if part in ("verl", "transformers")), len(parts) - 1)
    return f"{'/'.join(parts[top:])}:{line}"


def _verl_fla(bench: Any, fla: bool) -> tuple[list[tuple[Any, Any]], list[str], Any]:
    """The fla condition of a cell whose model has gated-delta-net layers (Qwen3.5 (MoE): each instance's
    ``chunk_gated_delta_rule``, which transformers 5.10.4 binds in ``__init__`` to fla's ``chunk_gated_delta_rule``
    where flash-linear-attention is installed, else to its own ``torch_chunk_gated_delta_rule``, modeling_qwen3_5.py:71-75,
    422; verl's ``_packed_chunk_gated_delta_rule``, qwen3_5.py:158-190, hands it ``cu_seqlens`` wherever it takes
    ``**kwargs``). ``fla``: bound to :func:`fla_chunk_gated_delta_rule_reference` (looked up when the cell runs), the
    judged condition, what verl runs with fla; else left as transformers binds it without fla. Returns ``(saved
    (layer, its function), stand-in sentences, condition(verdict, max_abs_diff) -> sentence)``; no layers: ``([],
    [], None)``."""
    layers = [m for m in bench.model.modules() if "chunk_gated_delta_rule" in vars(m)]
    if not layers:
        return [], [], None
    saved = [(m, vars(m)["chunk_gated_delta_rule"]) for m in layers]
    stock = _where(saved[0][1])
    kind = type(layers[0]).__name__
    if fla:
        reference = globals()["fla_chunk_gated_delta_rule_reference"]
        for layer in layers:
            layer.chunk_gated_delta_rule = reference
        sentence = (f"each {kind}'s chunk_gated_delta_rule: packcheck's per-segment CPU reference of fla's "
                    f"chunk_gated_delta_rule ({reference.__name__}; fla's Triton kernels need a GPU), as transformers "
                    f"binds fla's where flash-linear-attention is installed")

        def condition(verdict: str, diff: float | None) -> str:
            return (f"with fla (flash-linear-attention) installed: verl's _packed_chunk_gated_delta_rule ({_verl_packed()}) "
                    f"hands cu_seqlens to fla's chunk_gated_delta_rule, whose varlen kernel runs each sample from a zero "
                    f"state (on CPU: packcheck's per-segment reference, {reference.__name__}), not to transformers' "
                    f"torch_chunk_gated_delta_rule ({stock})")
        return saved, [sentence], condition

    def condition(verdict: str, diff: float | None) -> str:
        outcome = {"fail": f", which ignores it: leak {diff:.1e}", "pass": f", and the samples match ({diff:.1e})"}.get(verdict, "")
        return (f"without fla (flash-linear-attention), verl hands cu_seqlens ({_verl_packed()}) to transformers' "
                f"torch_chunk_gated_delta_rule ({stock}, **kwargs){outcome}; {VERL_FLA_DOCS}")
    return saved, [], condition


def _verl_packed() -> str:
    """Where verl's ``_packed_chunk_gated_delta_rule`` is (its module is imported by ``apply_monkey_patch``)."""
    fn = getattr(sys.modules.get("verl.models.transformers.qwen3_5"), "_packed_chunk_gated_delta_rule", None)
    return _where(fn) if fn else "verl/models/transformers/qwen3_5.py"


@contextlib.contextmanager
def _verl_model_patch_no_fla(mods: dict[str, Any], bench: Any) -> Iterator[dict[str, Any]]:
    """:func:`_verl_model_patch` with fla's kernel left unbound: what verl runs where flash-linear-attention is not
    installed (transformers' ``torch_chunk_gated_delta_rule``)."""
    with _verl_model_patch(mods, bench, fla=False) as state:
        yield state


def _class_attributes(classes: Any) -> dict[tuple[type, str], Any]:
    """Every attribute of each of ``classes``, keyed by (class, name): the state a peer's patch is undone to."""
    return {(c, n): v for c in classes for n, v in list(vars(c).items())}


def _count_installed(before: dict[tuple[type, str], Any], classes: Any, prefix: str, counts: dict[str, int]) -> None:
    """Wrap each function a peer's patch installed on ``classes`` (an attribute not in ``before``, from a module under
    ``prefix``, e.g. "verl.") so that ``counts["Class.name"]`` counts its calls; the wrapper keeps the function's
    signature (``functools.wraps``: a trainer may read it)."""
    for (cls, name), value in _class_attributes(classes).items():
        if (before.get((cls, name), _ABSENT) is value or not callable(value)
                or not str(getattr(value, "__module__", "") or "").startswith(prefix)):
            continue
        label = f"{cls.__name__}.{name}"
        counts[label] = 0

        def counted(*args: Any, _fn: Any = value, _label: str = label, **kwargs: Any) -> Any:
            counts[_label] += 1
            return _fn(*args, **kwargs)

        setattr(cls, name, functools.wraps(value)(counted))


def _restore_classes(before: dict[tuple[type, str], Any]) -> None:
    """Each class of ``before`` (:func:`_class_attributes`) as it was: replaced attributes put back, added ones
    deleted."""
    for cls in {c for c, _ in before}:
        for name in [n for n in vars(cls) if (cls, n) not in before]:
            with contextlib.suppress(AttributeError):
                delattr(cls, name)
    for (cls, name), value in before.items():
        if vars(cls).get(name, _ABSENT) is not value:
            setattr(cls, name, value)


@contextlib.contextmanager
def _verl_model_patch(mods: dict[str, Any], bench: Any, fla: bool = True) -> Iterator[dict[str, Any]]:
    """verl's ``apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True)`` on the cell's model, as
    :func:`_verl_monkey_patch` applies it, with every attribute it replaces on a class of transformers' model modules
    (the model's forward, its inner ``*Model.forward``, the text attention, the decoder layer, the gated delta net) put
    back on exit. Each function verl installed on a class is wrapped to count its calls (``calls_of``: their sum, so
    a patch that prints "Monkey patch ..." but installs nothing, or whose functions the forward never reaches, is
    an error, not a pass on stock code). flash-attn's names in :data:`VERL_FLASH_MODULES` are bound to packcheck's
    reference kernels for the cell (a stand-in, named); with ``fla`` each gated-delta-net layer's
    ``chunk_gated_delta_rule`` is bound to packcheck's per-segment reference of fla's (:func:`_verl_fla`: named, and
    the cell's ``condition`` says which side of verl's fla branch its verdict is for)."""
    import inspect

    from ..backends.kernels import dense_reference_kernel, varlen_reference_kernel

    for family in VERL_PATCHED_FAMILIES:  # apply_monkey_patch imports them all: snapshot each before it does
        with contextlib.suppress(Exception):
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    families = [m for n, m in list(sys.modules.items()) if n.startswith("transformers.models.") and ".modeling_" in n and m]
    classes = [cls for module in families for cls in vars(module).values()
               if isinstance(cls, type) and cls.__module__ == module.__name__]
    before = _class_attributes(classes)
    flash_saved: list[tuple[Any, str, Any]] = []
    bound_in = []
    for name in VERL_FLASH_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if "flash_attn_varlen_func" in vars(module):
                continue
            values = {"flash_attn_func": dense_reference_kernel, "flash_attn_varlen_func": varlen_reference_kernel,
                      # transformers' fa_peft_integration_check casts float32 q/k/v to verl's target_dtype bfloat16
                      # (meant for a PEFT model's float32 layers; a bf16 model is not cast): left out on a float32 cell
                      "fa_peft_integration_check": _no_cast,
                      "_flash_supports_window_size": "window_size" in inspect.signature(dense_reference_kernel).parameters,
                      "_flash_supports_deterministic": "deterministic" in inspect.signature(dense_reference_kernel).parameters,
                      "_flash_use_top_left_mask": False}
            for key, value in values.items():
                flash_saved.append((module, key, vars(module).get(key, _ABSENT)))
                setattr(module, key, value)
            bound_in.append(name.rsplit(".", 1)[-1])
    stand_ins = [(f"verl/models/transformers/{{{','.join(bound_in)}}}.py's flash_attn_func / flash_attn_varlen_func: "
                  "packcheck's reference kernels; their fa_peft_integration_check's bfloat16 cast left out (float32)")] if bound_in else []
    counts: dict[str, int] = {}
    fla_saved, fla_stand_ins, condition = _verl_fla(bench, fla)
    with _verl_monkey_patch(mods, bench) as state:
        state["stand_ins"] = state.get("stand_ins", []) + stand_ins + fla_stand_ins
        if condition:
            state["condition"] = condition
        # the signature stays verl's (inspect follows __wrapped__): its trainer reads it (cu_seqlens)
        _count_installed(before, classes, "verl.", counts)
        state["calls_of"] = lambda: sum(counts.values())
        try:
            yield state
        finally:
            _restore_classes(before)
            for module, key, value in reversed(flash_saved):
                if value is _ABSENT:
                    with contextlib.suppress(AttributeError):
                        delattr(module, key)
                else:
                    setattr(module, key, value)
            for layer, value in fla_saved:
                layer.chunk_gated_delta_rule = value
            state["note"] = "verl's own functions " + _calls(counts)


def _pixel_row_alone(bench: Any) -> list[Any]:
    """Each sample of checks/pixels.py's pixel row (image A, text only, image B: :func:`..checks.pixels.mm_samples`)
    alone on stock code, with its own pixels (the model's own ``get_rope_index``): ``[(logits, loss, labels)]``."""
    from ..checks import pixels

    why = pixels.is_pixel_model(bench.model)
    if why:
        raise PeerUnavailable(f"packcheck lays out no pixel row for it: {why}")
    samples = pixels.mm_samples(bench)
    return [pixels.alone(bench, s) for s in samples]


def _build_verl_pixel_row(mods: dict[str, Any], examples: list[list[int]], backend: str, config: Any) -> tuple[dict, str]:
    """verl's remove-padding batch of the pixel row (:func:`..checks.pixels.pack` in the ``text+mrope`` layout:
    ``input_ids`` ``(1, total)``, ``pixel_values`` and ``image_grid_thw`` of both images in sample order,
    ``position_ids`` ``(4, 1, total)``: the text row restarting per sample and each sample's own ``get_rope_index``
    rows, as verl's agent loop lays them out, experimental/agent_loop/agent_loop.py:953-964), no attention_mask, no
    labels (verl's forward_with_normal_backend returns logits only), ``cu_seqlens`` / ``cu_seqlens_cpu`` where the
    patched forward's signature names it (verl/workers/engine/fsdp/transformer_impl.py:594, 1261-1272)."""
    import inspect

    import torch

    from ..checks import pixels

    model = _PATCHED_MODEL[0]
    samples = pixels.mm_samples(_PIXEL_BENCH[0])
    batch = pixels.pack(model, samples, "text+mrope")
    batch.pop("labels", None)
    batch.pop("mm_token_type_ids", None)
    lengths = [len(s.ids) for s in samples]
    takes_cu = "cu_seqlens" in inspect.signature(model.forward).parameters
    if takes_cu:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
        batch.update(cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    return batch, (f"pixel row of {', '.join(('image ' + 'x'.join(map(str, s.grid))) if s.pixels is not None else 'text' for s in samples)}"
                   f" ({sum(lengths)} tokens), position_ids {tuple(batch['position_ids'].shape)}"
                   + (", cu_seqlens " + str(batch["cu_seqlens"].tolist()) if takes_cu else ", no cu_seqlens")
                   + "; text tokens compared")


#: the workbench of the cell :func:`run_path` runs (the pixel-row builder reads its samples)
_PIXEL_BENCH: list[Any] = [None]


def _pixel_row_compare(bench: Any, batch: dict[str, Any], reference: list[Any]) -> tuple[float, list[float], str]:
    """The patched model's forward on the pixel row; per sample the max abs diff of its text tokens' logits against
    the sample alone (image placeholder tokens left out, as :func:`..checks.pixels.parity_numbers`)."""
    import torch

    from ..checks import pixels

    samples = pixels.mm_samples(bench)
    with torch.no_grad():
        logits = bench.model(**batch, use_cache=False).logits[0].float()
    per, start = [], 0
    for s, (ref, _, _) in zip(samples, reference, strict=True):
        keep = pixels._text_mask(bench.model, s.ids)
        per.append(float((logits[start:start + len(s.ids)][keep] - ref[keep]).abs().max()))
        start += len(s.ids)
    return max(per), per, ""


def _main(argv: list[str]) -> int:
    """``python -m pytest_packcheck.atlas.peer_paths WHEEL PEER:PATH MODELS BACKENDS``: that path's results as one
    JSON line on stdout (what :func:`_measure_in_env` reads)."""
    import json

    module = importlib.import_module("pytest_packcheck.atlas.peer_paths")  # the module itself, not __main__

    wheel, key, models, backends = Path(argv[0]), argv[1], tuple(argv[2].split(",")), tuple(argv[3].split(","))
    path = next(p for p in module.PEER_PATHS if p.key == key)
    results = module._measure_path(wheel, path, wheel_version(wheel)[1], models, backends, module.build_bench)
    print(json.dumps([r.as_dict() for r in results]))
    return 0



def fla_causal_conv1d_reference(x: Any, weight: Any, bias: Any = None, residual: Any = None, initial_state: Any = None,
                                output_final_state: bool = False, activation: str | None = None, cu_seqlens: Any = None,
                                **kwargs: Any) -> tuple[Any, None]:
    """fla's ``causal_conv1d`` (fla/modules/convolution.py) on CPU: ``x`` ``(B, T, D)``, ``weight`` ``(D, W)``, a
    depthwise causal convolution run on each segment of ``cu_seqlens`` (int ``(N + 1,)``, B == 1) alone (the whole
    row without it), then ``activation`` (``silu`` / ``swish``). Returns ``(y (B, T, D), None)``.

    Raises:
        NotImplementedError: ``residual``, ``initial_state`` or ``output_final_state`` (no packing path here uses them)."""
    import torch
    import torch.nn.functional as F

    if residual is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("packcheck's fla causal_conv1d reference takes no residual / initial_state / final state")
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, x.shape[1]]
    width = weight.shape[-1]
    out = []
    for start, end in itertools.pairwise(bounds):
        seg = x[:, start:end].transpose(1, 2)
        y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=width - 1, groups=seg.shape[1])[..., : end - start]
        out.append(F.silu(y) if activation in ("silu", "swish") else y)
    return torch.cat(out, dim=-1).transpose(1, 2), None


def fla_chunk_gated_delta_rule_reference(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any = None, initial_state: Any = None,
                                         output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                         cu_seqlens: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """fla's ``chunk_gated_delta_rule`` (fla/ops/gated_delta_rule/chunk.py) on CPU: ``q``, ``k`` ``(B, T, H, K)``,
    ``v`` ``(B, T, H, V)``, ``g``, ``beta`` ``(B, T, H)``; transformers' own ``torch_chunk_gated_delta_rule``
    (models/qwen3_next/modeling_qwen3_next.py) run on each segment of ``cu_seqlens`` alone (state starting at
    ``initial_state`` or zero in each, as fla's varlen kernel). Returns ``(o (B, T, H, V), final states or None)``."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    if scale is not None and abs(float(scale) - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("packcheck's fla chunk_gated_delta_rule reference takes the default scale only")
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    outs, states = [], []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        init = initial_state[i:i + 1] if initial_state is not None and cu_seqlens is not None else initial_state
        o, state = torch_chunk_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                                beta[:, start:end], initial_state=init, output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), (torch.cat(states) if output_final_state else None)


#: the axolotl module names fla's kernels are bound under (imported at its top with fla installed, else None) and
#: qwen4_exp's loader, set to :func:`fla_causal_conv1d_reference` / :func:`fla_chunk_gated_delta_rule_reference`
_FLA_NAMES = {"fla_causal_conv1d": fla_causal_conv1d_reference, "fla_chunk_gated_delta_rule": fla_chunk_gated_delta_rule_reference,
              "_load_fla": lambda: (fla_causal_conv1d_reference, fla_chunk_gated_delta_rule_reference)}


def _axolotl_lora_constants() -> list[str]:
    """``axolotl.monkeypatch.lora_kernels`` as a module holding only its ``LINEAR_ATTN_*`` tuples, read from the
    wheel's source (the qwen3_5 patch imports ``LINEAR_ATTN_IN_PROJS`` from it, qwen3_5/modeling.py:10; the module
    imports peft, bitsandbytes and triton at its top: axolotl/monkeypatch/lora_kernels.py:10, kernels/lora.py:16,
    kernels/geglu.py:9). Returns the stand-in sentence ([] where the real module is already loaded)."""
    import ast

    name = "axolotl.monkeypatch.lora_kernels"
    sentence = ("axolotl/monkeypatch/lora_kernels.py not run: its literal LINEAR_ATTN_* name tuples read from the wheel (the "
                "module imports peft, bitsandbytes and triton at its top; the qwen3_5 patch imports LINEAR_ATTN_IN_PROJS only)")
    if name in sys.modules:
        return [sentence] if getattr(sys.modules[name], "__packcheck_stand_in__", False) else []
    spec = importlib.util.find_spec(name)
    source = spec.loader.get_source(name) if spec and spec.loader else None
    if not source:
        return []
    module = _stub(name)
    module.__packcheck_stand_in__ = True
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id.startswith("LINEAR_ATTN_"):
            with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):  # literal tuples only
                setattr(module, node.targets[0].id, ast.literal_eval(node.value))
    sys.modules[name] = module
    return [sentence]


@contextlib.contextmanager
def _axolotl_model_patch(mods: dict[str, Any], bench: Any) -> Iterator[dict[str, Any]]:
    """axolotl's packing patch of the cell's model type (:data:`AXOLOTL_MODEL_PATCHES`, the functions its patch
    manager calls with ``sample_packing``), with fla's kernels bound to packcheck's CPU references where the patch
    module reads them (a stand-in, named); every attribute it replaces on a class of the model's transformers module
    put back on exit (and its own ``unpatch`` run where it returns one). Each function axolotl installed is wrapped to
    count its calls (``calls_of``: a patch that installs nothing, or whose functions the forward never reaches, is an
    error). A patch function that raises (nemotron_h without mamba-ssm's seq_idx kernels) makes the cell ``not_run``
    with its message.

    Raises:
        PeerUnavailable: no axolotl patch for the model type, or the patch refuses to apply here."""
    model_type = bench.config.model_type.removesuffix("_text")
    if model_type not in AXOLOTL_MODEL_PATCHES:
        raise PeerUnavailable(f"axolotl 0.19.0 has no packing patch for {model_type} (AXOLOTL_MODEL_PATCHES)")
    module_name, functions, kwargs = AXOLOTL_MODEL_PATCHES[model_type]
    family = sys.modules[type(bench.model).__module__]
    classes = [c for c in vars(family).values() if isinstance(c, type) and c.__module__ == family.__name__]
    before = _class_attributes(classes)
    state: dict[str, Any] = {"note": "", "stand_ins": []}
    state["stand_ins"] += _axolotl_lora_constants()
    try:
        patch = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the module's import failure is the cell's reason
        raise PeerUnavailable(f"{module_name} does not import: {type(exc).__name__}: {exc}{_raised_at(exc)}") from None
    bound = [(n, vars(patch).get(n, _ABSENT)) for n in _FLA_NAMES if n in vars(patch)]
    for name, _ in bound:
        setattr(patch, name, _FLA_NAMES[name])
    if bound:
        state["stand_ins"].append(f"{module_name.replace('.', '/')}.py's {', '.join(n for n, _ in bound)}: packcheck's "
                                  "per-segment CPU reference of fla's causal_conv1d / chunk_gated_delta_rule (fla's Triton "
                                  "kernels need a GPU)")
    counts: dict[str, int] = {}
    undo = []
    try:
        for fn in functions:
            try:
                out = getattr(patch, fn)(**(kwargs if fn.startswith("patch_") else {}))
            except Exception as exc:
                if not any(r in str(exc) for r in AXOLOTL_REFUSALS):
                    raise  # the patch crashed: an error cell, where the wheel raised it
                raise PeerUnavailable(f"the peer's own refusal: {module_name.rsplit('.', 1)[0].replace('.', '/')}/"
                                      f"modeling.py {fn}() raised {type(exc).__name__}: {' '.join(str(exc).split())}"
                                      f"{_raised_at(exc)}") from None
            if callable(out):
                undo.append(out)
        _count_installed(before, classes, "axolotl.", counts)
        state["calls_of"] = lambda: sum(counts.values())
        yield state
    finally:
        for fn in reversed(undo):
            with contextlib.suppress(Exception):
                fn()
        _restore_classes(before)
        for name, value in bound:
            setattr(patch, name, value)
        state["note"] = "axolotl's functions " + _calls(counts)


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
