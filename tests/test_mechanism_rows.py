"""The mechanism probes' rows (checks/mechanisms.py) on planted configs and a planted forward, no model: which configs
have a top-k selection (a sub-config's, a per-layer config's where the global read raises), and what the tie probe
counts over the probe rows and their examples alone. The tests tools/mutation.sh runs against the mechanism
probes (issue 41: tests that catch a broken checker)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pytest_packcheck.checks import mechanisms as M


class _Config:
    def __init__(self, **values):
        self.__dict__.update(values)


class _SubConfig(_Config):
    """A sub-config as transformers holds one (text_config): it has ``to_dict`` and ``model_type``."""

    model_type = "sub"

    def to_dict(self):
        return dict(self.__dict__)


class _PerLayer:
    """dots3_note on transformers 5.24: reading a per-layer key globally raises; its per-layer configs hold it."""

    def __init__(self, layers):
        self.__dict__["per_layer_config"] = layers

    @property
    def index_topk(self):
        raise ValueError("index_topk is a per-layer key")


class _Slotted:
    """A config-like object without ``__dict__`` (slots): nothing to search for sub-configs."""

    __slots__ = ("index_topk",)

    def __init__(self, index_topk):
        self.index_topk = index_topk


class _TypedOnly(_Config):
    """Has a model_type but no to_dict: not a sub-config."""

    model_type = "typed"


@pytest.mark.parametrize(("config", "expected"), [
    (_Config(), False),
    (_Config(index_topk=4), True),
    (_Config(index_topk=None), False),
    (_Config(index_topk=4.0), False),  # an int only
    (_Config(text_config=_SubConfig(index_topk=4)), True),
    (_Config(text_config=_SubConfig(index_topk=None)), False),
    (_Config(text_config=_Config(index_topk=4)), False),  # not a config: no to_dict / model_type
    (_Config(index_topk=None, text_config=_SubConfig(), vision_config=_SubConfig(index_topk=2)), True),
    (_PerLayer({"0": {"index_topk": 4}}), True),
    (_PerLayer({"0": _Config(index_topk=4)}), True),
    (_PerLayer([{"index_topk": 4}]), True),
    (_PerLayer([_Config(index_topk=4)]), True),
    (_PerLayer({}), False),
    (_PerLayer({"0": {"other": 1}}), False),
    (_PerLayer({"0": _Config()}), False),  # a per-layer config object without the key
    (_Slotted(4), True),
    (_Config(text_config=_TypedOnly(index_topk=4)), False),
    (_Config(text_config=type("_DictOnly", (), {"to_dict": lambda self: {}, "index_topk": 4})()), False),
], ids=["plain", "index_topk", "none", "float", "sub_config", "sub_config_none", "not_a_config", "second_sub_config",
        "per_layer_dict", "per_layer_object", "per_layer_list", "per_layer_list_object", "per_layer_empty",
        "per_layer_without", "per_layer_object_without", "slots", "model_type_only", "to_dict_only"])
def test_has_topk_selection_reads_every_place_a_config_holds_index_topk(config, expected):
    assert M.has_topk_selection(config) is expected


def _bench(forward_scores, solo_scores, config=None):
    """A workbench whose forward of a packed row calls torch.topk on ``forward_scores`` and whose examples alone call
    Tensor.topk on ``solo_scores`` (each a list of (tensor, k)); counts the forwards."""
    runs = {"forward": 0, "solo": 0, "packed": []}

    def forward(batch):
        runs["forward"] += 1
        runs["packed"].append(batch["examples"])
        for scores, k in forward_scores:
            torch.topk(scores, k)

    def solo(example):
        runs["solo"] += 1
        for scores, k in solo_scores:
            scores.topk(k, dim=-1)

    wb = SimpleNamespace(config=config or _Config(index_topk=2), model=object(), collator_factory=object(), _cache={},
                         examples=[[1, 2], [3]], forward=forward, solo=solo,
                         packed=lambda examples=None: {"examples": examples})
    return wb, runs


def test_selection_ties_counts_the_tied_cuts_of_every_probe_row_and_example(monkeypatch):
    monkeypatch.setattr(M, "probe_rows", lambda wb: [[[1, 2], [3]], [[4]]])
    tied_rows = torch.tensor([[3.0, 1.0, 1.0, 0.0], [5.0, 2.0, 2.0, 1.0]])  # k=2: both rows tie at the cut
    masked = torch.tensor([[1.0, float("-inf"), float("-inf")]])  # -inf keys tie among themselves: no cut
    wb, runs = _bench([(tied_rows, 2), (masked, 1)], [(torch.tensor([[3.0, 2.0, 1.0]]), 1)])
    found = M.selection_ties(wb)
    # 2 probe rows x 2 calls, 3 examples x 1 call; one tied call per probe row, 2 tied rows each
    assert found == {"topk_calls": 7, "tied_cuts": 4, "tied_at": [(2, 4)]}, found
    assert (runs["forward"], runs["solo"]) == (2, 3) and runs["packed"] == [[[1, 2], [3]], [[4]]]  # each probe row
    assert M.selection_ties(wb) is found and (runs["forward"], runs["solo"]) == (2, 3)  # cached per model and collator
    wb.collator_factory = object()  # another collator: measured again
    assert M.selection_ties(wb) == found and (runs["forward"], runs["solo"]) == (4, 6)
    wb.model = object()  # another model: measured again
    assert M.selection_ties(wb) == found and (runs["forward"], runs["solo"]) == (6, 9)


def test_selection_ties_names_at_most_five_cuts_sorted(monkeypatch):
    monkeypatch.setattr(M, "probe_rows", lambda wb: [[[1]]])
    calls = [(torch.tensor([[1.0] * n]), k) for n, k in ((9, 3), (8, 2), (7, 1), (6, 4), (5, 2), (4, 1), (9, 3))]
    wb, _ = _bench(calls, [])
    found = M.selection_ties(wb)
    assert found["tied_cuts"] == 7 and found["topk_calls"] == 7
    assert found["tied_at"] == [(1, 4), (1, 7), (2, 5), (2, 8), (3, 9)], found


def test_selection_ties_runs_nothing_without_a_topk_selection(monkeypatch):
    monkeypatch.setattr(M, "probe_rows", lambda wb: [[[1]]])
    wb, runs = _bench([(torch.tensor([[1.0, 1.0]]), 1)], [], config=_Config())
    assert M.selection_ties(wb) is None and (runs["forward"], runs["solo"]) == (0, 0) and wb._cache == {}
