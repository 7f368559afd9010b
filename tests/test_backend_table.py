"""The backend table: one record per backend, and everything else (help, labels, selection, availability and the
skip reason, call counting, bench order) derived from it. Every record is checked, so a new one (flash_attention_4
was the first added this way) shows up everywhere or fails here."""

from __future__ import annotations

import importlib.util

import pytest

from pytest_packcheck import backends as BK
from pytest_packcheck.backends import BACKENDS, availability
from pytest_packcheck.backends.counting import COUNTERS

NAMES = [b.name for b in BACKENDS]


def test_every_record_is_complete_and_named_once():
    assert len(set(NAMES)) == len(NAMES)
    for b in BACKENDS:
        assert b.label and b.family in ("eager", "sdpa", "flex", "flash") and b.registered_by in ("transformers", "packcheck")
        assert b.unavailable in ("skipped", "unsupported")
        assert b.counted_by and all(c in COUNTERS for c in b.counted_by), b.name
        assert all(n.kind in ("cuda", "gpu", "package", "module", "flash_path", "kernel_loader") for n in b.needs), b.name


@pytest.mark.parametrize("backend", BACKENDS, ids=NAMES)
def test_a_record_appears_in_every_derived_list(backend):
    from pytest_packcheck.config.options import OPT_BACKENDS, OPTIONS

    help_text = next(o.help for o in OPTIONS if o.flag == OPT_BACKENDS)
    assert backend.name in help_text and (not backend.note or f"{backend.name} ({backend.note})" in help_text)
    assert backend.name in BK.KNOWN_BACKENDS and (backend.name in BK.DEFAULT_BACKENDS) == backend.default
    assert BK.backend_labels()[backend.name] == backend.label
    assert (backend.name in BK.FLASH_FAMILY) == (backend.family == "flash")
    assert (backend.name in BK.MASKED_BACKENDS) == backend.takes_mask
    assert (backend.name in BK.BENCH_BACKEND_PREFERENCE) == (backend.bench_rank is not None)
    assert BK.needs_registration(backend.name) == (backend.registered_by == "packcheck")


@pytest.mark.parametrize("backend", BACKENDS, ids=NAMES)
def test_a_record_is_selectable_without_asking_transformers(backend, monkeypatch):
    from pytest_packcheck.config import settings

    def no_probe(name):
        raise AssertionError(f"{name} is in the table: transformers need not be asked")

    # the package's lazy attribute first: read after the module's patch, its first read would cache no_probe in the
    # package as the value monkeypatch puts back, and a later test in this process would call it (CI, xdist order)
    monkeypatch.setattr(BK, "attn_implementation_refusal", no_probe)
    monkeypatch.setattr(availability, "attn_implementation_refusal", no_probe)
    assert settings._validate_backends([backend.name], "--packcheck-attn") == (backend.name,)


@pytest.mark.parametrize("backend", BACKENDS, ids=NAMES)
def test_a_record_without_its_gpu_is_skipped_on_cpu_with_the_reason(backend):
    """A backend that needs CUDA is skipped on this CPU machine, and the cell says what is missing; the others
    run here (forward-only where the record says so)."""
    from pytest_packcheck.run.runner import Cell, CellRunner

    got = BK.backend_availability(backend.name, "cpu")
    needs_cuda = any(n.kind == "cuda" for n in backend.needs)
    if needs_cuda and not BK.stand_in_active():
        assert not got.available and got.status == "skipped"
        assert got.reason.startswith("needs a CUDA device (running on cpu)")
        cell = CellRunner([], {"float32": {}})._run(Cell(0, "llama", backend.name, "logits_parity", "float32"))
        assert cell.status == "skipped" and cell.message == f"{backend.name} {got.reason}"
    elif not needs_cuda:
        assert got.available, got.reason
        assert got.backward == backend.backward_on_cpu


@pytest.mark.parametrize("backend", BACKENDS, ids=NAMES)
def test_a_record_is_counted_the_way_its_family_carries_the_boundaries(backend, llama_sdpa, monkeypatch):
    """An attention call dispatched under the backend's name is counted on it: a flash-family call reads the
    boundaries from cu_seq_lens_q (no mask needed), a masked backend's from its attention mask (none: missing)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = getattr(ALL_ATTENTION_FUNCTIONS, "_global_mapping", ALL_ATTENTION_FUNCTIONS)
    monkeypatch.setitem(mapping, backend.name, lambda module, q, k, v, mask, **kwargs: "ran")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with BK.count_attention_calls(llama_sdpa.model, [3, 4]) as probe:
        assert mapping[backend.name](None, None, None, None, None, cu_seq_lens_q=cu) == "ran"
    assert probe.counts() == {backend.name: 1} and BK.is_call_on(backend.name, backend.name)
    assert probe.calls[0].isolated is (backend.family == "flash")
    assert mapping[backend.name](None, None, None, None, None) == "ran"  # put back: counted no more
    assert len(probe.calls) == 1


PACKCHECK_OWN = [b for b in BACKENDS if b.registered_by == "packcheck"]


@pytest.mark.parametrize("backend", PACKCHECK_OWN, ids=[b.name for b in PACKCHECK_OWN])
def test_a_record_packcheck_registers_builds_a_model_and_reaches_its_kernel(backend, tolerances):
    """Every backend packcheck registers that is available on this CPU builds a tiny llama and runs a packed row on
    its own kernel, boundaries held: a record with no kernels in ``registration.register_reference_backend``'s map
    (transformers then looks its name up on the hub and the build fails), or one whose calls are not counted on it,
    fails here. (transformers' own backends are built by the rest of the suite.)"""
    from conftest import make_bench

    from pytest_packcheck import checks as C

    if not BK.backend_availability(backend.name, "cpu").available:
        pytest.skip(f"{backend.name} does not run on this machine (its availability test covers the reason)")
    bench = make_bench("llama", backend.name, tolerances)
    result = C.check_backend(bench)
    assert result.status == "pass", result.message
    assert result.metrics["calls"] == {backend.name: result.metrics["expected_calls"]}, result.metrics
    parity = C.check_logits_parity(bench)
    assert parity.status == "pass", parity.message


def test_a_direct_torch_sdpa_call_counts_for_sdpa_only():
    assert BK.is_call_on("sdpa (direct torch call)", "sdpa")
    assert not BK.is_call_on("sdpa (direct torch call)", "eager") and not BK.is_call_on("sdpa", "flash_attention_2")


def test_flash_attention_4_needs_cuda_a_hopper_or_newer_gpu_and_the_flash_attn_4_build(monkeypatch):
    """transformers 5.x takes flash_attention_4 from the flash_attn module of the flash-attn-4 distribution (FA2
    ships the same module name) on a CUDA device of compute capability >= 9; each missing piece is named."""
    cpu = BK.backend_availability("flash_attention_4", "cpu")
    assert not cpu.available and cpu.reason.startswith("needs a CUDA device (running on cpu) and the flash-attn-4 package")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setattr(availability, "cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(availability, "_distributed_as", lambda module, dist: (module, dist) == ("flash_attn", "flash-attn-4"))
    ampere = BK.backend_availability("flash_attention_4", "cuda:0")
    assert not ampere.available and "Hopper or newer GPU" in ampere.reason and "this one is 8.0" in ampere.reason
    for capability in ((9, 0), (10, 0)):
        monkeypatch.setattr(availability, "cuda_capability", lambda device, c=capability: c)
        assert BK.backend_availability("flash_attention_4", "cuda").available
    monkeypatch.setattr(availability, "_distributed_as", lambda module, dist: False)  # flash-attn 2's flash_attn
    fa2_only = BK.backend_availability("flash_attention_4", "cuda")
    assert not fa2_only.available and "flash_attn is installed by another distribution" in fa2_only.reason


def test_flash_attention_4_is_selectable_but_not_in_the_default_matrix(monkeypatch):
    """Selecting it by name runs its cells (skipped on CPU); the default matrix keeps its columns (adding one would
    add a column of skipped cells to every committed CPU report)."""
    from test_hardening import _resolve

    assert _resolve(["--models", "arch:llama", "--packcheck-attn", "flash_attention_4"], monkeypatch).backends == ("flash_attention_4",)
    assert "flash_attention_4" not in _resolve(["--models", "arch:llama"], monkeypatch).backends
