"""The backend table: one :class:`Backend` record per attention backend packcheck knows, and every list the rest
of packcheck needs derived from it (names in matrix column order, labels, the flash family, the backends that
build a packed mask, the bench preference, the ones packcheck registers, the ``--packcheck-attn`` help).

Adding a backend is one record here (and its test in tests/test_backend_table.py): availability
(:mod:`.availability`), skip reasons, labels, help, call counting (:mod:`.counting`), registration and the bench
order all read it. A backend packcheck registers (``registered_by="packcheck"``) also needs its kernels: the
functions (:mod:`.kernels`) and their entry in :func:`.registration.register_reference_backend`'s ``kernels`` map
(tests/test_backend_table.py builds a model on every such record that runs here, so a missing entry fails there).
Pure data: importing this module imports nothing heavy (the plugin's option help is built from it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: attn_implementation name of the CPU varlen reference backend. It contains "flash" on purpose: transformers
#: treats any name with "flash" as a flash backend (``is_flash_attention_requested``), so models take exactly
#: the code path they take under FlashAttention-2 (no 4D mask, position_ids handed to attention).
REFERENCE_BACKEND = "packcheck_flash_ref"

#: attn_implementation name of the backend that runs PyTorch's own FlashAttention-2 varlen kernel
#: (``torch.nn.attention.varlen.varlen_attn``, CUDA only) behind transformers' flash preparation code.
TORCH_VARLEN_BACKEND = "packcheck_flash_torch_varlen"

#: Environment variable: set to 1 to run :data:`TORCH_VARLEN_BACKEND` on CPU through
#: :func:`~.torch_varlen.varlen_attn_stand_in` (torch 2.11's varlen_attn signature over the exact reference kernel). A
#: rehearsal of the GPU pipeline (tools/gpu_check.sh) that exercises every line but PyTorch's kernel; the
#: environment and the matrix label say so, and no speed or numerics claim comes from it.
STAND_IN_ENV = "PACKCHECK_TORCH_VARLEN_STAND_IN"
STAND_IN_LABEL = "torch varlen_attn CPU STAND-IN (rehearsal, not FA2)"


@dataclass(frozen=True)
class Need:
    """One thing a backend needs to run here, checked in order by :func:`.availability.backend_availability`;
    a missing one is named in the skip reason ("needs a CUDA device (running on cpu) and ...").

    ``kind``:
      - ``"cuda"``: a CUDA device; ``words`` is appended to "a CUDA device (running on cpu)"; ``stand_in``: the
        :data:`STAND_IN_ENV` rehearsal lifts it.
      - ``"gpu"``: checked on a CUDA device only: compute capability major in ``majors`` (``(9,)`` Hopper;
        ``(9, None)`` 9 or newer); ``words`` is formatted with the device's ``major, minor``.
      - ``"package"``: ``module`` importable ("``words`` (``module`` not importable)"), and, when
        ``distribution`` is given, installed by that distribution (flash-attn 2 / 3 / 4 share module names).
      - ``"module"``: ``module`` importable, else ``words``.
      - ``"flash_path"``: the installed transformers has a flash path packcheck's reference reaches
        (:func:`.registration.reference_backend_supported`: its reason, verbatim).
      - ``"kernel_loader"``: that path, through transformers' kernel loader (>= 4.55.1), not module globals.
    """

    kind: str
    words: str = ""
    module: str = ""
    distribution: str = ""
    majors: tuple[int, ...] | tuple[int, None] = ()
    stand_in: bool = False


@dataclass(frozen=True)
class Backend:
    """One attention backend (an ``attn_implementation`` value), everything packcheck needs to know about it."""

    #: the attn_implementation value
    name: str
    #: the matrix column label
    label: str
    #: "eager", "sdpa", "flex" or "flash" (runs through transformers' ``_flash_attention_forward``: a packed row
    #: must reach its varlen kernel once per attention layer and never its dense one)
    family: str
    #: "transformers" (built in) or "packcheck" (registered through ``AttentionInterface`` by
    #: :func:`.registration.register_reference_backend` before a model is built)
    registered_by: str
    #: what it needs to run, in the order the skip reason names them (:class:`Need`)
    needs: tuple[Need, ...] = ()
    #: verdict of its cells when a need is missing: "skipped" (this machine lacks something) or "unsupported"
    #: (the installed transformers cannot express it; the reason is then transformers', not "needs ...")
    unavailable: str = "skipped"
    #: False: no backward pass on CPU (forward-only there: the training checks are skipped)
    backward_on_cpu: bool = True
    #: place in ``packcheck audit --bench``'s preference (0 first: fastest kernels first); None: never benched
    bench_rank: int | None = None
    #: builds a packed (block-diagonal) mask from position_ids when no attention_mask is given (masking_utils,
    #: transformers >= 4.54): the "masked backends", whose packing breaks when a mask rides along
    takes_mask: bool = False
    #: how its calls are counted (:mod:`.counting`, one counter per name): "attention_interface" (transformers'
    #: ``ALL_ATTENTION_FUNCTIONS``), "model_eager_forward" (a modeling module's own ``eager_attention_forward``),
    #: "torch_sdpa" (direct ``F.scaled_dot_product_attention`` calls, counted as "<name> (direct torch call)"),
    #: "flash_kernels" (the varlen and dense flash kernels transformers dispatches to)
    counted_by: tuple[str, ...] = ("attention_interface",)
    #: in the default matrix (every audit that names no backends); False: selectable by name only
    default: bool = True
    #: note after the name in ``--packcheck-attn``'s help
    note: str = ""
    #: label when the results' environment records the CPU stand-in (:data:`STAND_IN_ENV`) ran instead
    stand_in_label: str = ""
    #: for a flash-family backend packcheck registers: its ``(dense, varlen)`` kernels as ``"module:function"`` in
    #: :mod:`pytest_packcheck.backends` (the signatures of flash-attn's ``flash_attn_func`` and
    #: ``flash_attn_varlen_func``); :func:`.registration.register_reference_backend` hands them to transformers'
    #: flash path under this backend's name
    kernels: tuple[str, str] | tuple[()] = ()

    def kernel_functions(self) -> tuple[Any, Any]:
        """:attr:`kernels` imported: ``(dense, varlen)``."""
        import importlib

        def load(ref: str) -> Any:
            module, name = ref.split(":")
            return getattr(importlib.import_module(f"pytest_packcheck.backends.{module}"), name)

        dense, varlen = self.kernels  # type: ignore[misc]
        return load(dense), load(varlen)


_CUDA = Need("cuda")

#: Every backend packcheck knows, in matrix column order.
BACKENDS: tuple[Backend, ...] = (
    Backend("eager", label="eager", family="eager", registered_by="transformers", bench_rank=6, takes_mask=True,
            counted_by=("attention_interface", "model_eager_forward")),
    Backend("sdpa", label="sdpa", family="sdpa", registered_by="transformers", bench_rank=4, takes_mask=True,
            counted_by=("attention_interface", "torch_sdpa")),
    # torch raises NotImplementedError for flex_attention's backward on CPU (measured on torch 2.13.0+cpu)
    Backend("flex_attention", label="flex_attention", family="flex", registered_by="transformers", backward_on_cpu=False,
            bench_rank=5, takes_mask=True),
    Backend(REFERENCE_BACKEND, label="varlen reference (CPU, not FA2)", family="flash", registered_by="packcheck",
            needs=(Need("flash_path"),), unavailable="unsupported", bench_rank=7, counted_by=("attention_interface", "flash_kernels"),
            note="CPU varlen reference", kernels=("kernels:dense_reference_kernel", "kernels:varlen_reference_kernel")),
    Backend(TORCH_VARLEN_BACKEND, label="torch varlen_attn (PyTorch FA2 kernel)", family="flash", registered_by="packcheck",
            needs=(Need("cuda", ": varlen_attn is CUDA-only", stand_in=True),
                   Need("module", "torch.nn.attention.varlen (PyTorch >= 2.10)", module="torch.nn.attention.varlen"),
                   Need("kernel_loader")),
            bench_rank=3, counted_by=("attention_interface", "flash_kernels"), note="PyTorch's varlen_attn, CUDA",
            stand_in_label=STAND_IN_LABEL, kernels=("torch_varlen:dense_torch_varlen_kernel", "torch_varlen:torch_varlen_kernel")),
    Backend("flash_attention_2", label="flash_attention_2", family="flash", registered_by="transformers",
            needs=(_CUDA, Need("package", "the flash-attn package", module="flash_attn")),
            bench_rank=2, counted_by=("attention_interface", "flash_kernels")),
    # transformers' is_flash_attn_3_available also requires the distribution's name (FA2/FA4 builds can ship a
    # flash_attn_interface module too)
    Backend("flash_attention_3", label="flash_attention_3", family="flash", registered_by="transformers",
            needs=(_CUDA, Need("gpu", "a Hopper GPU (compute capability 9.x; this one is {}.{})", majors=(9,)),
                   Need("package", "the flash-attn-3 package", module="flash_attn_interface", distribution="flash-attn-3")),
            bench_rank=0, counted_by=("attention_interface", "flash_kernels"), note="Hopper"),
    # FlashAttention-4 (flash_attn.cute): transformers 5.x's is_flash_attn_4_available wants the flash_attn module
    # from the flash-attn-4 distribution (FA2 ships the same module name) and a CUDA device;
    # FLASH_ATTENTION_COMPATIBILITY_MATRIX[4]["cuda_min_major_version"] = 9 (Hopper or newer)
    Backend("flash_attention_4", label="flash_attention_4", family="flash", registered_by="transformers",
            needs=(_CUDA, Need("gpu", "a Hopper or newer GPU (compute capability >= 9.0; this one is {}.{})", majors=(9, None)),
                   Need("package", "the flash-attn-4 package", module="flash_attn", distribution="flash-attn-4")),
            bench_rank=1, counted_by=("attention_interface", "flash_kernels"), default=False,
            note="Hopper or newer, flash-attn-4"),
)

BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}

#: Backends packcheck knows, in matrix column order (any other name transformers takes also runs).
KNOWN_BACKENDS: tuple[str, ...] = tuple(b.name for b in BACKENDS)
#: The default matrix's backends.
DEFAULT_BACKENDS: tuple[str, ...] = tuple(b.name for b in BACKENDS if b.default)
#: Backends that run through transformers' ``_flash_attention_forward``: a packed row must reach their varlen
#: kernel once per attention layer and never their dense one.
FLASH_FAMILY: tuple[str, ...] = tuple(b.name for b in BACKENDS if b.family == "flash")
#: Backends that build a packed mask from position_ids (an attention_mask beside the packed row disables it).
MASKED_BACKENDS: tuple[str, ...] = tuple(b.name for b in BACKENDS if b.takes_mask)
#: Backends packcheck registers with transformers before a model is built on them.
PACKCHECK_REGISTERED: tuple[str, ...] = tuple(b.name for b in BACKENDS if b.registered_by == "packcheck")
#: Backends that need no GPU (the CPU suite runs them).
CPU_BACKENDS: tuple[str, ...] = tuple(b.name for b in BACKENDS if not any(n.kind == "cuda" for n in b.needs))
#: Backends ``packcheck audit --bench`` prefers for a model, fastest kernels first (the first the audit ran
#: without an error / unsupported / skipped cell is benched).
BENCH_BACKEND_PREFERENCE: tuple[str, ...] = tuple(
    b.name for b in sorted((b for b in BACKENDS if b.bench_rank is not None), key=lambda b: b.bench_rank))
BACKEND_LABELS: dict[str, str] = {b.name: b.label for b in BACKENDS}


def counting_methods() -> tuple[str, ...]:
    """The call counters the table names (:attr:`Backend.counted_by`), each once, in table order."""
    return tuple(dict.fromkeys(c for b in BACKENDS for c in b.counted_by))


def counts_boundaries_by_cu_seqlens(name: str) -> bool:
    """Whether an attention call counted under ``name`` carries its boundaries as cu_seq_lens (the flash family)
    rather than in its attention mask."""
    return name in FLASH_FAMILY


def is_call_on(call_name: str, requested: str | None) -> bool:
    """Whether an attention call counted under ``call_name`` ran on the backend ``requested``: its own name, or a
    variant the counter names "<backend> (<how>)" (``sdpa (direct torch call)``, a model calling torch's SDPA
    outside the attention interface)."""
    return call_name == requested or call_name.partition(" (")[0] == requested


def needs_registration(name: str) -> bool:
    """Whether packcheck registers ``name`` with transformers before a model is built on it."""
    return name in PACKCHECK_REGISTERED


def stand_in_active() -> bool:
    """Whether :data:`STAND_IN_ENV` is set to 1 in this process."""
    return os.environ.get(STAND_IN_ENV) == "1"


def backend_labels(env: dict[str, Any] | None = None) -> dict[str, str]:
    """Matrix column labels; a backend with a CPU stand-in (torch varlen) is labelled the stand-in when ``env`` (a
    results document's environment) records that the stand-in ran."""
    stand_in = (env or {}).get("torch_varlen_kernel") == "stand-in"
    return {b.name: (b.stand_in_label if stand_in and b.stand_in_label else b.label) for b in BACKENDS}


def backends_help() -> str:
    """``--packcheck-attn``'s help text: the default backends with their notes, then those selectable by name."""
    def named(b: Backend) -> str:
        return f"{b.name} ({b.note})" if b.note else b.name

    text = ("Attention backends (attn_implementation), comma-separated. Default: "
            + ", ".join(named(b) for b in BACKENDS if b.default) + ".")
    extra = [named(b) for b in BACKENDS if not b.default]
    return text + (f" Also: {', '.join(extra)}." if extra else "")
