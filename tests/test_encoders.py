"""Encoders and embedding models on packed rows (issue 46): each check passes on a correct stack, catches its planted
fault, and the leaks the installed release really has are named (transformers 5.25.0, the pinned stack)."""

from __future__ import annotations

import pytest
import torch
from faults import ScalePackedLoss, collator_no_reset

from pytest_packcheck.checks import encoders as E


def enc_bench(model_type: str, backend: str, tolerances: dict, **kwargs):
    """A tiny ``encoder:<model_type>`` model on ``backend``, as the runner builds it."""
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    ensure_registered(backend)
    resolved = resolve_model(parse_model_spec(f"encoder:{model_type}", "test"), "test")
    model = build_model(resolved, backend, "float32")
    return Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tolerances["float32"], **kwargs)


@pytest.fixture(scope="module")
def bert(tolerances):
    return enc_bench("bert", "sdpa", tolerances)


def test_an_encoder_spec_builds_the_masked_lm_head_attending_both_ways():
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    spec = parse_model_spec("encoder:bert", "test")
    assert spec.kind == "arch" and spec.head == "encoder" and spec.label == "bert-encoder"
    resolved = resolve_model(spec, "test")
    assert resolved.model_class == "BertForMaskedLM" and resolved.model_kind == "encoder"
    assert resolved.record()["model_kind"] == "encoder"
    model = build_model(resolved, "eager", "float32")
    assert model.config.is_decoder is False  # arch:bert builds BertLMHeadModel with is_decoder=True
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=torch.tensor([[5, 6, 7, 9]])).logits
    assert float((a[0, 0] - b[0, 0]).abs().max()) > 1e-4  # the first token sees the last: bidirectional


def test_a_malformed_encoder_spec_is_one_line_naming_it():
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError, match="encoder:bert"):
        parse_model_spec("encoder:Bert Model", "--packcheck-models")


def test_an_encoder_spec_of_a_model_without_an_encoder_class_is_refused_naming_it():
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    # blip_text_model has a config but neither a masked-LM nor a base model class in the auto mappings (5.25.0)
    with pytest.raises(PackcheckUsageError, match=r"'encoder:blip_text_model' \(from test\) is a 'blip_text_model' model "
                       r"with neither a masked-LM nor a base model class.*an encoder: spec needs one \(encoder:bert"):
        resolve_model(parse_model_spec("encoder:blip_text_model", "test"), "test")


def test_an_encoder_spec_of_an_encoder_decoder_model_is_an_unsupported_cell_naming_why():
    """bart / mbart / mvp are in transformers' masked-LM mapping as their seq2seq class (5.25.0): --all-architectures
    reaches them, and each cell says why it is not judged (was packcheck's own crash reading last_hidden_state)."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    got = resolve_model(parse_model_spec("encoder:bart", "test"), "test")
    assert got.error_status == "unsupported" and got.config is not None
    assert got.error.startswith("bart: an encoder-decoder model (BartForConditionalGeneration, config.is_encoder_decoder=True)")
    assert "packcheck lookup bart" in got.error
    bert = resolve_model(parse_model_spec("encoder:bert", "test"), "test")
    assert bert.error is None and bert.model_kind == "encoder"


def test_segments_read_from_position_ids_and_cu_seq_lens():
    batch = {"position_ids": torch.tensor([[2, 3, 4, 2, 3, 2]]), "cu_seq_lens_q": torch.tensor([0, 3, 5, 6], dtype=torch.int32)}
    assert [(s.start, s.stop) for s in E.segments_of(batch)] == [(0, 3), (3, 5), (5, 6)]
    assert E.segment_sources(batch) == {"position_ids": [3, 2, 1], "cu_seq_lens_q": [3, 2, 1]}
    h = torch.arange(6.0)[:, None]
    assert [float(E.pool(h[0:3], how)[0]) for how in E.POOLINGS] == [1.0, 0.0, 2.0]


def test_isolation_passes_on_bert_and_catches_positions_that_never_restart(bert, tolerances):
    result = E.check_encoder_isolation(bert)
    assert result.status == "pass", result.message
    assert result.metrics["max_change"] < 1e-5 and result.metrics["negative_control_change"] > tolerances["float32"]["leak_min"]
    leaky = enc_bench("bert", "sdpa", tolerances, collator_factory=collator_no_reset)  # one sequence: no packed mask
    result = E.check_encoder_isolation(leaky)
    assert result.status == "fail" and result.cause == "leak" and result.metrics["max_change"] > 1e-3, result.message


def test_parity_and_pooling_pass_on_bert_and_catch_the_planted_fault(bert, tolerances):
    for check in (E.check_encoder_parity, E.check_encoder_pooling):
        result = check(bert)
        assert result.status == "pass", result.message
    assert bert._cache and E.parity_numbers(bert)["min_cosine_mean"] > 0.9999
    leaky = enc_bench("bert", "sdpa", tolerances, collator_factory=collator_no_reset)
    parity = E.check_encoder_parity(leaky)
    assert parity.status == "fail" and parity.cause == "leak" and parity.metrics["max_abs_diff"] > 1e-3
    pooling = E.check_encoder_pooling(leaky)  # the row reads as one segment: its pooling is not per example
    assert pooling.status == "fail" and pooling.cause == "collator_contract", pooling.message
    assert pooling.evidence["segments"]["position_ids"] == [sum(leaky.lengths)]


def test_mlm_loss_passes_on_bert_and_catches_a_packed_loss_scaled(bert, tolerances):
    result = E.check_encoder_mlm_loss(bert)
    assert result.status == "pass", result.message
    assert result.metrics["loss_delta"] < 1e-5 and result.metrics["masked_tokens"] >= len(bert.examples)
    scaled = enc_bench("bert", "sdpa", tolerances)
    scaled.model = ScalePackedLoss(scaled.model)
    result = E.check_encoder_mlm_loss(scaled)
    assert result.status == "fail" and result.cause == "loss_normalisation" and result.metrics["loss_delta"] > 1e-2


def test_positions_pass_on_roberta_and_catch_a_collator_numbering_from_0(tolerances):
    """RoBERTa numbers an example alone from padding_idx + 1 (create_position_ids_from_input_ids); a collator
    without position_ids_start numbers the row from 0."""
    roberta = enc_bench("roberta", "sdpa", tolerances)
    result = E.check_encoder_positions(roberta)
    assert result.status == "pass", result.message
    assert result.metrics["model_first_position"] == roberta.start == 2

    def from_zero(**kwargs):
        from pytest_packcheck.model.batches import default_collator_factory

        return default_collator_factory(**{**kwargs, "position_ids_start": 0})

    wrong = enc_bench("roberta", "sdpa", tolerances, collator_factory=from_zero)
    result = E.check_encoder_positions(wrong)
    assert result.status == "fail" and result.cause == "wrong_positions", result.message
    assert result.metrics["row_first_positions"] == [0, 0, 0] and result.evidence["model_first_position"] == 2
    assert result.metrics["max_abs_diff_numbering"] > 1e-3


def test_token_classification_passes_on_bert_and_catches_a_leak(bert, tolerances):
    result = E.check_encoder_token_cls(bert)
    assert result.status == "pass", result.message
    assert result.metrics["head"] == "BertForTokenClassification" and result.metrics["loss_delta"] < 1e-5
    leaky = enc_bench("bert", "sdpa", tolerances, collator_factory=collator_no_reset)
    result = E.check_encoder_token_cls(leaky)
    assert result.status == "fail" and result.cause == "leak" and result.metrics["max_abs_diff"] > 1e-3


def test_sequence_classification_head_pools_one_position_per_row_and_the_collator_refuses_scalar_labels(bert, monkeypatch):
    result = E.check_encoder_seq_cls(bert)
    assert result.status == "fail" and result.cause == "pooled_head", result.message
    assert result.metrics["head_rows"] == 1 and result.metrics["examples"] == len(bert.examples)
    # transformers 5.25.0: DataCollatorWithFlattening concatenates [separator_id] + labels[1:] per example
    assert result.metrics["collator_scalar_labels"]["outcome"] == "raises"
    assert "TypeError" in result.metrics["collator_scalar_labels"]["exception"]
    assert result.findings and result.findings[0]["cause"] == "labels_contract"

    class PerSegmentHead(torch.nn.Module):
        """A head that pools each segment of a packed row (what the probe asks of a packed classifier)."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
            rows = len(E.segments_of({"position_ids": position_ids}))
            return type("Out", (), {"logits": torch.zeros(rows, E.NUM_LABELS), "loss": torch.zeros(())})()

    real = E.head_model
    monkeypatch.setattr(E, "head_model", lambda wb, auto: PerSegmentHead(real(wb, auto)))
    result = E.check_encoder_seq_cls(bert)
    assert result.status == "pass" and result.metrics["head_rows"] == len(bert.examples), result.message


def test_scalar_labels_through_a_collator_that_keeps_them_are_flattened():
    def keeps(**kwargs):
        return lambda features, return_tensors="pt": {"labels": torch.tensor([f["labels"] for f in features])}

    assert E.scalar_label_collation(keeps) == {"outcome": "flattened", "labels": [1, 0]}


@pytest.mark.parametrize("model_type", ["modernbert", "eurobert", "nomic_bert"])
def test_the_encoders_that_leak_on_sdpa_are_exact_on_the_varlen_reference(model_type, tolerances):
    """Measured on transformers 5.25.0: ModernBERT, EuroBERT and NomicBERT do not build the packed bidirectional
    mask from position_ids on sdpa (leak), and keep the boundaries on packcheck's varlen reference fed
    cu_seq_lens_q/k (EuroBERT and NomicBERT exactly; ModernBERT's unpadded path as well)."""
    leaky = E.check_encoder_parity(enc_bench(model_type, "sdpa", tolerances))
    assert leaky.status == "fail" and leaky.cause == "leak" and leaky.metrics["max_abs_diff"] > 1e-3, leaky.message
    exact = E.check_encoder_parity(enc_bench(model_type, "packcheck_flash_ref", tolerances))
    assert exact.status == "pass", exact.message


def test_the_encoders_audit_names_checks_of_the_encoders_suite():
    from pytest_packcheck.checks.registry import SPECS, suite_checks
    from pytest_packcheck.config.audits import load_audit

    audit = load_audit("encoders")
    assert set(audit.checks) == set(suite_checks("encoders")) and all(SPECS[c].opt_in for c in audit.checks)
    assert all(m.startswith("encoder:") for m in audit.models)
