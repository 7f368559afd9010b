"""packcheck's own faults are never the model's: every accepted --packcheck-lengths shape runs, the others are
refused up front, a crash in packcheck's own probe code is packcheck_error (traceback in the details), and a
reference that cannot be computed or carries no signal is "not checked: reference ...", never a verdict."""

from __future__ import annotations

import pytest
import torch
from faults import ScalePackedLoss

from pytest_packcheck import checks as C
from pytest_packcheck.config.options import parse_lengths
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.model import batches as B


@pytest.fixture(scope="module")
def _llama(tolerances):
    from conftest import make_bench

    return make_bench("llama", "sdpa", tolerances).model


def _bench(model, tolerances, lengths, **kw):
    return C.Workbench(model=model, config=model.config, backend="sdpa", dtype="float32", tol=dict(tolerances["float32"]),
                       examples=B.make_examples(model.config, tuple(lengths)), **kw)


@pytest.mark.parametrize("value", ["1,1,1", "1,1"])
def test_lengths_without_a_next_token_are_refused_up_front(value):
    with pytest.raises(PackcheckUsageError) as err:
        parse_lengths(value, "--packcheck-lengths")
    text = str(err.value)
    assert f"'{value}'" in text and "--packcheck-lengths" in text and "2 or more tokens" in text and "\n" not in text


@pytest.mark.parametrize("lengths", [(8, 3), (11, 13), (5, 1), (1, 5, 2), (2, 1, 1, 1)])
def test_every_accepted_shape_judges_loss_and_gradients(_llama, tolerances, lengths):
    """8,3 and 11,13 crashed loss_parity with 'max() arg is an empty sequence' (the second of two gradient
    accumulation micro-batches was empty). Each shape passes on the correct stack and fails on a planted fault
    (the packed loss scaled by 28/31), so the pass is a measured one."""
    assert parse_lengths(",".join(map(str, lengths)), "test") == lengths
    bench = _bench(_llama, tolerances, lengths)
    loss, grad = C.check_loss_parity(bench), C.check_grad_parity(bench)
    assert loss.status == "pass" and loss.metrics["loss_delta"] < 1e-4, loss.message
    assert grad.status == "pass" and grad.metrics["grad_rel_err"] < 1e-4, grad.message
    planted = _bench(ScalePackedLoss(_llama), tolerances, lengths)
    got = C.check_loss_parity(planted)
    assert got.status == "fail" and got.metrics["loss_delta"] > 1e-3, got.message


def test_all_zero_reference_gradients_are_not_judged(_llama, tolerances):
    """Every example one token (no label token): the padded run's gradients are all zero. Before: grad_parity
    'failed' with rel err 0.00e+00, cosine 0.000000, cause kernel_numerics, remedy 'none needed'. Now: not
    checked, cause reference_unavailable, with the label count; loss_parity likewise."""
    bench = _bench(_llama, tolerances, (1, 1, 1))
    grad = C.check_grad_parity(bench)
    assert grad.status == "skipped" and grad.cause == "reference_unavailable", grad.message
    assert grad.evidence["why"] == "zero_reference" and grad.evidence["label_tokens"] == 0
    assert grad.message.startswith("not checked: reference gradients")
    loss = C.check_loss_parity(bench)
    assert loss.status == "skipped" and loss.cause == "reference_unavailable" and loss.evidence["num_items_expected"] == 0


def _runner():
    from pytest_packcheck.run.runner import CellRunner

    runner = CellRunner([], {"float32": {}})
    runner._key = (0, "sdpa", "float32")
    return runner



def _failed_inside_the_model(model, error: Exception):
    """The runner's record of ``error`` raised from the model's own forward (a pre-hook on its first layer, so a
    transformers frame is in the traceback)."""
    def boom(*_a, **_k):
        raise error

    handle = model.model.layers[0].register_forward_pre_hook(boom)
    try:
        model(input_ids=torch.tensor([[5, 6, 7]]))
    except type(error) as exc:
        return _runner()._failed("check", exc)
    finally:
        handle.remove()
    raise AssertionError("the planted error was not raised")

def test_a_crash_in_packchecks_own_code_is_packchecks_error():
    """Planted: max() over an empty sequence raised inside packcheck's batches.padded_batch (what 8,3 did), with
    no model frame in the traceback. Before: shrunk_crash, blamed on the model. Now: packcheck_error, with the
    frames in the details."""
    try:
        B.padded_batch([], 0, "right", 0, "cpu")
    except ValueError as exc:
        got = _runner()._failed("check", exc)
    assert got.status == "error" and got.cause == "packcheck_error", got.message
    assert "packcheck's own code crashed" in got.message and "not the model" in got.message
    assert any("batches.py" in f and "padded_batch" in f for f in got.evidence["traceback"])
    assert got.metrics["traceback"] == got.evidence["traceback"]


def test_a_crash_inside_the_model_stays_the_models(_llama):
    """The same kind of error raised from the model's own forward (a transformers frame in the traceback) is not
    packcheck's: shrunk_crash on a shrunk model, as before."""
    got = _failed_inside_the_model(_llama, ValueError("max() arg is an empty sequence"))
    assert got.cause == "shrunk_crash", got.message


class _OldForward(torch.nn.Module):
    """transformers 4.44's decoders as packcheck meets them: BartForCausalLM.forward takes no position_ids,
    OpenAIGPTLMHeadModel / XLMWithLMHeadModel no use_cache (and no ``**kwargs``)."""

    def __init__(self, inner, position_ids: bool):
        super().__init__()
        self.inner, self.config = inner, inner.config
        if position_ids:
            self.forward = self._with_positions

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)

    def _with_positions(self, input_ids=None, attention_mask=None, position_ids=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          labels=labels, use_cache=False)


def test_a_forward_that_takes_no_use_cache_is_not_handed_one(_llama, tolerances):
    """The atlas on 4.44.2: every check of openai-gpt and xlm "crashed in packcheck's own code" on
    ``forward() got an unexpected keyword argument 'use_cache'``, a key packcheck added itself; a collator never
    hands it over. It is passed only to a forward that takes it."""
    bench = _bench(_OldForward(_llama, position_ids=True), tolerances, (5, 6))
    out = bench.forward(bench.packed())
    assert out.logits.shape[:2] == (1, 11)


def test_a_forward_that_refuses_position_ids_is_the_models_not_packchecks(_llama, tolerances):
    """The atlas on 4.44.2: BartForCausalLM.forward() takes no position_ids, so the packed row a collator gives
    raises a TypeError while Python binds the call: no frame of the model, only torch's _call_impl under
    packcheck's. It was packcheck_error ("report it to packcheck"); the model's signature refused the row."""
    bench = _bench(_OldForward(_llama, position_ids=False), tolerances, (5, 6))
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'position_ids'") as info:
        bench.forward(bench.packed())
    from pytest_packcheck.run.runner import own_fault

    assert own_fault(info.value) is None
    got = _runner()._failed("check", info.value)
    # no config explains a forward without position_ids (issue 41: 366 atlas entries filed it as library_config,
    # "the config does not build", though the config built): the model class cannot take a packed row's positions
    assert got.status == "unsupported" and got.cause == "no_position_ids" and "position_ids" in got.message, got.message


@pytest.mark.parametrize("message", [
    # transformers <= 4.53 (modeling_utils._check_and_enable_flash_attn_2), capitalised
    "BertLMHeadModel does not support Flash Attention 2.0 yet. Please request to add support where the model is hosted",
    "OPTForCausalLM does not support Flash Attention 3 yet. Please request to add support where the model is hosted"])
def test_the_librarys_flash_attention_refusal_is_unsupported_in_any_case(message):
    """The library refusing the flash path is its own verdict (unsupported), never a crash of the model packcheck
    shrank: on <= 4.53 the refusal reads "Flash Attention" and a case-sensitive marker classed it shrunk_crash."""
    from pytest_packcheck.run.runner import _classify_exception

    assert _classify_exception(ValueError(message)) == "unsupported"
    got = _runner()._failed("build", ValueError(message))
    assert got.status == "unsupported" and got.cause != "shrunk_crash" and "does not support Flash Attention" in got.message


def test_a_non_finite_reference_is_not_checked(tolerances):
    """gemma3n_text on the varlen reference: the padded run's gradients are NaN while every forward check passes.
    Planted: NaN in the padded (reference) run's lm_head gradient. Not checked: reference ..., with the tensor
    named; NaN in the packed run only stays a fail (tests/test_checks.py)."""
    from conftest import make_bench

    bench = make_bench("llama", "sdpa", tolerances)
    calls = []

    def poison(grad):
        calls.append(1)
        return torch.full_like(grad, float("nan")) if len(calls) == 2 else grad

    handle = bench.model.lm_head.weight.register_hook(poison)
    try:
        got = C.check_grad_parity(bench)
    finally:
        handle.remove()
    assert got.status == "skipped" and got.cause == "reference_unavailable", got.message
    assert got.message.startswith("not checked: reference gradients (padded run) are non-finite")
    assert got.evidence["non_finite_padded"] == ["lm_head.weight"] and got.evidence["why"] == "non_finite"


def test_fast_mamba_kernels_not_available_is_a_missing_package(_llama):
    """jamba (transformers 4.44 .. 4.57) and zamba (.. 5.5) raise ValueError("Fast Mamba kernels are not available
    ...") from their forward: the default config asks for mamba-ssm / causal-conv1d, which are not installed. A
    missing package (skipped, named), never shrunk_crash (26 atlas entries were). Planted from the model's forward."""
    from pytest_packcheck.run.runner import _classify_exception

    text = ("Fast Mamba kernels are not available. Make sure to they are installed and that the mamba module is on a "
            "CUDA device")

    got = _failed_inside_the_model(_llama, ValueError(text))
    assert _classify_exception(ValueError(text)) == "skipped" and got.status == "skipped" and got.cause is None
    assert got.message.startswith("missing package mamba-ssm / causal-conv1d (not installed here): ValueError: Fast Mamba")
    assert got.metrics["missing"] == ["mamba-ssm", "causal-conv1d"]
    assert _classify_exception(ValueError("Fast kernels are slow")) == "error"  # only the marker


def test_a_loss_tolerance_below_float_rounding_fails_as_numerics_not_normalisation(_llama, tolerances):
    """--packcheck-tolerance float32.loss_atol=1e-12 on llama: loss_parity failed with cause loss_normalisation ("do
    not pack", a num_items_in_batch remedy) on a 6.8e-08 difference, where the logits case says kernel_numerics
    (trial 6, 163). Counts right, logits matching, the loss within 10 ulps: kernel_numerics; a real normalisation
    fault (the packed loss scaled) stays loss_normalisation at the same tight tolerance."""
    tight = {**tolerances, "float32": {**tolerances["float32"], "loss_atol": 1e-12}}
    got = C.check_loss_parity(_bench(_llama, tight, (11, 7, 13)))
    assert got.status == "fail" and got.cause == "kernel_numerics", got.message
    assert got.evidence["tolerance"] == "loss_atol" and got.evidence["below_rounding"] is True
    planted = C.check_loss_parity(_bench(ScalePackedLoss(_llama), tight, (11, 7, 13)))
    assert planted.status == "fail" and planted.cause == "loss_normalisation", planted.message


def test_an_isolation_tolerance_that_hides_the_planted_leak_names_no_cause_past_it(tolerances):
    """--packcheck-tolerance float32.isolation_atol=10 on opt / sdpa (a leak of 6.4e-03 at the default): isolation is
    rightly inconclusive, but logits_parity blamed wrong_positions with a position_ids remedy (trial 6, 69), then
    probe_inconclusive with "run in float32" on a float32 run (trial 17, 129). opt's attention calls are seen without
    the packed boundaries, which the tolerance does not hide: leak, as at the default. Where no such evidence is
    there, the cause is probe_inconclusive naming the raised tolerance (tests/test_diagnose.py)."""
    from conftest import make_bench

    loose = {**tolerances, "float32": {**tolerances["float32"], "isolation_atol": 10.0}}
    got = C.check_logits_parity(make_bench("opt", "sdpa", loose))
    assert got.status == "fail" and got.cause == "leak", got.message
    assert got.evidence["attention_boundaries"] == "missing" and got.evidence["negative_control_change"] <= 10.0
    assert C.check_logits_parity(make_bench("opt", "sdpa", tolerances)).cause == "leak"


def test_site_packages_below_the_standard_library_is_not_the_standard_library(monkeypatch, _llama, tolerances):
    """A system or Docker Python keeps site-packages below the standard library (/usr/local/lib/python3.11/
    site-packages). A prefix test took transformers' frames there for the standard library's, so a crash inside the
    model, called from a packcheck check, looked like packcheck's own (packcheck_error). Planted: sysconfig reports
    that layout around the installed transformers, and token ids past the vocabulary crash inside the model."""
    import sysconfig
    from pathlib import Path

    import transformers

    from pytest_packcheck.errors import is_stdlib_file

    site = Path(transformers.__file__).resolve().parent.parent  # .../site-packages
    real = sysconfig.get_paths

    def docker_layout(*a, **kw):
        return {**real(*a, **kw), "stdlib": str(site.parent)}  # site-packages now lies below "stdlib"

    monkeypatch.setattr(sysconfig, "get_paths", docker_layout)
    assert is_stdlib_file(str(site.parent / "json" / "decoder.py"))
    assert not is_stdlib_file(transformers.__file__)
    bench = _bench(_llama, tolerances, (5, 4))
    bench.examples = [[10**6] * 5, [10**6] * 4]
    with pytest.raises(IndexError) as err:
        C.check_logits_parity(bench)
    got = _runner()._failed("check", err.value)
    assert any("transformers" in f.filename for f in __import__("traceback").extract_tb(err.value.__traceback__))
    assert got.cause == "shrunk_crash", got.message


@pytest.mark.parametrize("error", [
    UnboundLocalError("cannot access local variable 'seq_len' where it is not associated with a value"),
    TypeError("_flash_attention_forward() got an unexpected keyword argument 'num_items_in_batch'"),
    ValueError("Got unexpected arguments: {'num_items_in_batch': tensor(28)}"),
])
def test_a_code_error_in_the_model_is_the_librarys_crash_not_the_shrink(_llama, error):
    """transformers 4.47.1's Gemma2 flash path reads seq_len, bound only when an attention_mask is given (a
    padding-free row has none); its llama flash path hands num_items_in_batch to _flash_attention_forward; BLOOM
    refuses it. The atlas counted these as shrunk_crash, packcheck's own ("Where packcheck itself stopped"); no
    config size explains them: cause crash, the library's, with where it was raised."""
    got = _failed_inside_the_model(_llama, error)
    assert got.cause == "crash", got.message
    assert "no config size explains it" in got.message and "test_own_faults.py" in got.evidence["code_error"]


def test_a_size_dependent_crash_in_the_model_stays_shrunk_crash(_llama):
    got = _failed_inside_the_model(_llama, RuntimeError("The size of tensor a (4) must match the size of tensor b (8)"))
    assert got.cause == "shrunk_crash", got.message
