"""A flattening collator that refuses what a check asks of it is a cell with the library's reason, not a gap (issue 41
part 4): transformers 4.51.3's ``DataCollatorWithFlattening.__init__(*args, return_position_ids=True,
separator_id=-100, **kwargs)`` hands ``return_flash_attn_kwargs`` to ``DefaultDataCollator``, which raises
TypeError, and it returns no cu_seq_lens_q. Planted: that collator in place of the installed one."""

from __future__ import annotations

import pytest
import transformers
from transformers import DefaultDataCollator

from pytest_packcheck.model import batches as B
from pytest_packcheck.run.runner import CellRunner

REFUSED = "DefaultDataCollator.__init__() got an unexpected keyword argument 'return_flash_attn_kwargs'"


def _release_4_51_3(real):
    class DataCollatorWithFlattening(real):
        """transformers 4.51.3's constructor (data/data_collator.py), on the installed __call__ with its later
        options off: return_flash_attn_kwargs reaches DefaultDataCollator through **kwargs."""

        def __init__(self, *args, return_position_ids=True, separator_id=-100, **kwargs):
            DefaultDataCollator.__init__(self, *args, **kwargs)
            real.__init__(self, *args, return_position_ids=return_position_ids, separator_id=separator_id, **kwargs)

    return DataCollatorWithFlattening


@pytest.fixture
def release_4_51_3(monkeypatch):
    import sys

    # the transformers packcheck imports now (sys.modules), not the object this file bound at collection: a test
    # that ran before in this process may have left another module object there
    current = sys.modules["transformers"]
    planted = _release_4_51_3(current.DataCollatorWithFlattening)
    monkeypatch.setattr(current, "DataCollatorWithFlattening", planted)
    with pytest.raises(TypeError, match="return_flash_attn_kwargs"):
        planted(return_flash_attn_kwargs=True)  # the planted fault, as 4.51.3 raises it
    return planted


def test_the_4_51_3_collator_gives_a_plain_row_and_refuses_the_flash_kwargs_with_its_reason(release_4_51_3):
    examples = [[5, 6, 7], [8, 9]]
    assert "return_flash_attn_kwargs" not in B.collator_supports()
    plain = B.packed_batch(examples)  # the arguments it takes: a packed row with position_ids
    assert sorted(plain) == ["input_ids", "labels", "position_ids"] and plain["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(B.CollatorUnsupported) as info:
        B.packed_batch(examples, flash_kwargs=True)
    said = str(info.value)
    assert REFUSED in said and f"transformers {transformers.__version__}'s DataCollatorWithFlattening" in said, said
    assert "is not supported" in said and "from 4.52" in said


def test_a_refused_collator_is_an_unsupported_cell_naming_the_library(release_4_51_3):
    """Through the runner: "unsupported" with the library's words (before: a KeyError on the missing cu_seq_lens_q in
    packcheck's own probe code, or a crash blamed on the model packcheck shrank)."""
    runner = CellRunner([], {"float32": {}})
    runner._key = (0, "packcheck_flash_ref", "float32")
    try:
        B.packed_batch([[5, 6, 7], [8, 9]], flash_kwargs=True)
    except B.CollatorUnsupported as exc:
        cell = runner._failed("check", exc)
    assert cell.status == "unsupported" and REFUSED in cell.message, (cell.status, cell.message)
    assert cell.cause not in ("packcheck_error", "shrunk_crash", "crash")


def test_a_collator_that_refuses_an_argument_its_signature_names_is_refused_with_its_words(monkeypatch):
    """A release whose constructor names an argument and still raises on it: the factory's TypeError is the
    library's refusal, an unsupported cell, not a crash."""
    import sys

    current = sys.modules["transformers"]  # as in the fixture above
    real = current.DataCollatorWithFlattening

    class Refusing(real):
        def __init__(self, *args, return_seq_idx=False, **kwargs):
            if return_seq_idx:
                raise TypeError("return_seq_idx needs a newer tokenizer")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(current, "DataCollatorWithFlattening", Refusing)
    with pytest.raises(B.CollatorUnsupported, match="return_seq_idx needs a newer tokenizer") as info:
        B.default_collator_factory(return_position_ids=True, return_seq_idx=True)
    assert CellRunner([], {"float32": {}})._failed("check", info.value).status == "unsupported"
    assert B.default_collator_factory(return_position_ids=True)  # without it, the collator is built
