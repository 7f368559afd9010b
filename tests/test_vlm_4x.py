"""The multimodal text path on transformers 4.x layouts, run on the installed 5.x with stand-in modules.

CI has no 4.x environment, so the 4.x layouts are mimicked: class names and ``get_rope_index`` signatures of
Qwen2-VL in 4.45 .. 4.51 (``get_rope_index`` on the ForConditionalGeneration, ``model.model`` the text model) and
4.52 on (``get_rope_index`` on the inner ``Qwen2VLModel``, ``model.model.language_model`` the text model), and the
three ways a 4.x text model takes M-RoPE position_ids: exactly 3 rows, its rotary's hard-coded 3 (4.45 .. 4.53);
a 4th, text row first, else row 0 as the text row (4.54 .. 4.56); a text row first, else no packed mask at all
(4.57). A planted wrong layout (3 rows where the model wants 4, 4 where it takes 3, a text row read as a rotary
row, a get_rope_index packcheck cannot call) must be caught. Measured on the real releases: README "Vision-language
models: the text path (M-RoPE)".
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

VOCAB, WIDTH = 32, 8


class FakeTextModel(torch.nn.Module):
    """A 4.x M-RoPE text model in miniature: one attention layer whose rotary angle sums 3 sections with
    frequencies hard-coded for 3 rows (``(3, 1, 1) * (R, batch, n)``: a shape error for R = 4, as 4.45 .. 4.53's
    ``inv_freq ... .expand(3, ...)``), and a causal mask split where the text row restarts when the model has a
    text row and no attention_mask is given (``create_causal_mask`` + ``find_packed_sequence_indices``).

    ``mode``: "refuse" (4.45 .. 4.53: no text row), "row0" (4.54 .. 4.56: 4 rows -> text row first, 3 rows ->
    row 0 is the text row), "none" (4.57: 4 rows -> text row first, 3 rows -> no packed mask), "misread" (planted:
    takes 4 rows but uses the first 3 as rotary rows)."""

    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        n = input_ids.shape[-1]
        if position_ids is None:
            position_ids = torch.arange(n)[None]
        if position_ids.ndim == 2:  # "the hard coded `3` is for temporal, height and width"
            position_ids = position_ids[None].expand(3, position_ids.shape[0], -1)
        text = None
        if self.mode != "refuse" and position_ids.shape[0] == 4:
            text, position_ids = position_ids[0], (position_ids[:3] if self.mode == "misread" else position_ids[1:])
        elif self.mode == "row0":
            text = position_ids[0]
        angle = (torch.tensor([1.0, 0.3, 0.1])[:, None, None] * position_ids.float()).sum(0)  # (batch, n)
        q, k, v = self.qkv(self.emb(input_ids)).chunk(3, dim=-1)
        cos, sin = angle.cos()[..., None], angle.sin()[..., None]

        def rotate(x):
            a, b = x[..., ::2], x[..., 1::2]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
        if text is not None and attention_mask is None:
            seg = (torch.diff(text, prepend=text[:, :1] - 2) != 1).cumsum(-1)
            allowed = allowed & (seg[:, :, None] == seg[:, None, :])
        scores = (rotate(q) @ rotate(k).transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        return SimpleNamespace(logits=self.out(scores.softmax(-1) @ v))


def _rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
    """Qwen2-VL's get_rope_index on a text-only row (every 4.x release): 0..n-1 in all 3 rows, and the deltas."""
    n = input_ids.shape[-1]
    return torch.arange(n)[None, None].expand(3, input_ids.shape[0], n), torch.zeros(input_ids.shape[0], 1)


class Qwen2VLModel(torch.nn.Module):
    """4.52 on: the inner model holds get_rope_index and the text model (``language_model``)."""

    def __init__(self, mode: str):
        super().__init__()
        self.language_model = FakeTextModel(mode)
        self.rope_deltas = None

    def get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        self.rope_deltas = "set by get_rope_index"
        return _rope_index(input_ids, image_grid_thw, video_grid_thw, attention_mask)

    def forward(self, **kwargs):
        return self.language_model(**kwargs)


class Qwen2VLForConditionalGeneration(torch.nn.Module):
    """4.45 .. 4.51 (``inner=False``): get_rope_index on this class, ``model`` the text model itself; 4.52 on
    (``inner=True``): ``model`` the inner Qwen2VLModel. No ``_prepare_position_ids_for_generation`` (5.0 added it)."""

    def __init__(self, mode: str, inner: bool):
        super().__init__()
        self.model = Qwen2VLModel(mode) if inner else FakeTextModel(mode)
        self.rope_deltas = None

    def forward(self, **kwargs):
        return self.model(**kwargs)


def _old_release(mode: str) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration(mode, inner=False)
    model.get_rope_index = _rope_index  # 4.45's signature: (input_ids, image_grid_thw, video_grid_thw, attention_mask)
    return model


def _raising(model: Qwen2VLForConditionalGeneration) -> Qwen2VLForConditionalGeneration:
    """A model whose forward raises on any row (GLM-4.5V on 4.57.6's flash path): the layout reading goes on."""
    def forward(**kwargs):
        raise ValueError("cu_seqlens_q=[0, 5, 10, 15] for a row of 5 tokens")

    model.forward = forward
    return model


RESOLVED = SimpleNamespace(text_path="mrope", model_type="qwen2_vl")


@pytest.mark.parametrize(("build", "rows", "owner", "said"), [
    (lambda: _old_release("refuse"), 3, "Qwen2VLForConditionalGeneration", "refuses a text row first (4 rows: RuntimeError"),
    (lambda: Qwen2VLForConditionalGeneration("refuse", inner=True), 3, "Qwen2VLModel", "refuses a text row first"),
    (lambda: Qwen2VLForConditionalGeneration("row0", inner=True), 4, "Qwen2VLModel", "takes a text row first"),
    (lambda: Qwen2VLForConditionalGeneration("none", inner=True), 4, "Qwen2VLModel", "takes a text row first"),
    (lambda: Qwen2VLForConditionalGeneration("misread", inner=True), 3, "Qwen2VLModel", "reads a 4th row as a rotary row"),
    (lambda: _raising(Qwen2VLForConditionalGeneration("none", inner=True)), 3, "Qwen2VLModel", "raised on its 3 M-RoPE rows alone"),
], ids=["4.45-flat", "4.52-inner", "4.54-row0", "4.57-text-row-only", "planted-misread", "raises-on-its-own-rows"])
def test_layout_follows_each_release(build, rows, owner, said):
    """The row count, the get_rope_index owner and whether a text row goes first are read from the model; the
    get_rope_index cache (rope_deltas) is put back."""
    from pytest_packcheck.model.multimodal import position_layout

    model = build()
    layout = position_layout(model, RESOLVED)
    assert layout.rows == rows, layout.source
    assert f"the 3 rows of {owner}.get_rope_index" in layout.source and said in layout.source
    assert layout.source.startswith("text row + ") == (rows == 4)
    assert getattr(model.model, "rope_deltas", None) is None and model.rope_deltas is None


def _packed_vs_solo(model, rows: int | None) -> float:
    """Max abs logits difference between a packed row of two examples (restarting ids, laid out in ``rows``
    rows; None: the collator's (1, N) ids) and each example run alone."""
    from pytest_packcheck.model.batches import PositionLayout

    torch.manual_seed(1)
    lengths = (5, 7)
    examples = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    layout = PositionLayout(rows=rows)
    ids = torch.cat(examples, dim=-1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=layout.apply(pos)).logits
        solo = [model(input_ids=e, position_ids=layout.apply(torch.arange(e.shape[-1])[None])).logits for e in examples]
    return float((packed - torch.cat(solo, dim=1)).abs().max())


def test_planted_wrong_row_count_is_caught():
    """4.57-like: the read layout (4 rows) keeps the examples apart; 3 rows, or the collator's (1, N) ids, leak
    (no text row, no packed mask). 4.53-like: the read layout (3 rows) runs, and 4 rows raise instead of
    running on a misread row."""
    from pytest_packcheck.model.multimodal import position_layout

    late = Qwen2VLForConditionalGeneration("none", inner=True)
    rows = position_layout(late, RESOLVED).rows
    assert _packed_vs_solo(late, rows) < 1e-5
    assert _packed_vs_solo(late, 3) > 1e-2 and _packed_vs_solo(late, None) > 1e-2
    middle = Qwen2VLForConditionalGeneration("row0", inner=True)  # 4.54: row 0 of 3 rows is the text row too
    assert _packed_vs_solo(middle, position_layout(middle, RESOLVED).rows) < 1e-5 and _packed_vs_solo(middle, None) < 1e-5
    early = Qwen2VLForConditionalGeneration("refuse", inner=True)
    rows = position_layout(early, RESOLVED).rows
    assert rows == 3 and _packed_vs_solo(early, rows) > 1e-2  # no packed mask in 4.53's text model: a real leak
    with pytest.raises(RuntimeError, match="size of tensor"):
        _packed_vs_solo(early, 4)


def test_get_rope_index_packcheck_cannot_call_is_named():
    """A get_rope_index with another signature (a required grid argument): no layout is guessed; the one-line
    TextPathError names what get_rope_index raised."""
    from pytest_packcheck.model.build_errors import TextPathError
    from pytest_packcheck.model.multimodal import position_layout

    model = Qwen2VLForConditionalGeneration("none", inner=True)
    model.model.get_rope_index = lambda input_ids, grid_thw: _rope_index(input_ids)
    with pytest.raises(TextPathError, match=r"get_rope_index raised TypeError: .*grid_thw") as err:
        position_layout(model, RESOLVED)
    assert "\n" not in str(err.value)


def test_4x_config_layout():
    """4.x keeps mrope_section in ``rope_scaling`` (5.0 renamed it rope_parameters), 4.45 .. 4.51 flat (no
    text_config): the shrink scales the section there and shrinks a flat config's vision tower to the text
    width; a 4.x default config with rope_scaling None is named as the library's, with the override."""
    from pytest_packcheck.model.multimodal import (
        mrope_section_mismatch,
        rope_key,
        scale_mrope_sections,
        shrink_towers,
        text_config_of,
    )

    flat = {"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16}}
    scale_mrope_sections(flat, "hidden_size", "num_attention_heads", {"hidden_size": 8192, "num_attention_heads": 64})
    assert flat["rope_scaling"]["mrope_section"] == [2, 3, 3]  # head 16: 8 frequencies, 2:3:3 as 16:24:24
    shrink_towers(flat)
    assert flat["vision_config"]["depth"] == 2 and flat["vision_config"]["hidden_size"] == 64

    class OldConfig:  # a 4.x config: rope_scaling, no rope_parameters, get_text_config() without ``decoder``
        rope_scaling = None
        num_attention_heads, hidden_size = 4, 64

        def get_text_config(self):
            return self

    old = OldConfig()
    assert text_config_of(old) is old and rope_key(old) == "rope_scaling"
    why, fix = mrope_section_mismatch(old)
    assert "rope_scaling is None" in why and fix.startswith('rope_scaling={"type":"mrope","mrope_section":')
    old.rope_scaling = {"type": "mrope", "mrope_section": [4, 6, 6]}  # 16 frequencies for 8-frequency heads
    assert "sums to 16" in mrope_section_mismatch(old)[0]
    old.rope_scaling = {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert mrope_section_mismatch(old) is None


def test_text_path_found_without_the_generate_hook(monkeypatch):
    """Without GenerationMixin._prepare_position_ids_for_generation (transformers before 5.0), a text-path model is
    one whose module defines get_rope_index: Qwen2-VL yes, LLaVA no; and the real 5.24 Qwen2-VL, asked through the
    forward probe instead of its generate() hook, gives the same 4 rows."""
    import transformers

    from pytest_packcheck.model.architectures import mrope_text_path
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import position_layout
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    resolved = resolve_model(parse_model_spec("arch:qwen2_vl", "test"), "test")
    model = build_model(resolved, "sdpa", "float32")
    monkeypatch.delattr(transformers.GenerationMixin, "_prepare_position_ids_for_generation")
    for cls in type(model).__mro__:
        if "_prepare_position_ids_for_generation" in vars(cls):
            monkeypatch.delattr(cls, "_prepare_position_ids_for_generation")
    assert mrope_text_path("qwen2_vl")[0] == "Qwen2VLForConditionalGeneration"
    assert mrope_text_path("llava") is None
    layout = position_layout(model, resolved)
    assert layout.rows == 4 and "takes a text row first" in layout.source


def test_composite_config_without_top_level_vocab_size(monkeypatch):
    """transformers 4.52 .. 4.54: ``Qwen2VLForConditionalGeneration.forward`` reads ``config.vocab_size`` for the
    loss and the default composite ``Qwen2VLConfig()`` keeps it only in ``text_config``; measured on 4.52.4 every
    labelled cell was an AttributeError ("shrunk crash"), and with the value copied the cells are judged (leak,
    logits 8.8e-1: no packed mask before 4.53). The copy is named in config_notes; a flat config, or one that has
    the value, is left alone; the 5.24 resolve path sets nothing."""
    import transformers

    from pytest_packcheck.model.multimodal import flat_vocab_size
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    class Composite:  # 4.52's shape: get_text_config(decoder=True) is text_config, no top-level vocab_size
        def __init__(self):
            self.text_config = SimpleNamespace(vocab_size=152064)

        def get_text_config(self, decoder=False):
            return self.text_config

    class Reads452(torch.nn.Module):  # 4.52.4's Qwen2VLForConditionalGeneration.forward, the line that raised
        def forward(self, logits, labels):
            return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)

    class Reads524(torch.nn.Module):  # 5.24's: reads the text config
        def forward(self, logits, labels):
            return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.text_config.vocab_size)

    monkeypatch.setattr(transformers, "Reads452", Reads452, raising=False)
    monkeypatch.setattr(transformers, "Reads524", Reads524, raising=False)
    config = Composite()
    with pytest.raises(AttributeError):
        config.vocab_size  # noqa: B018 - what 4.52's forward does with labels
    assert flat_vocab_size(config, "Reads524") == []  # 5.x reads text_config: nothing set
    assert not hasattr(config, "vocab_size")
    notes = flat_vocab_size(config, "Reads452")
    assert config.vocab_size == 152064
    assert len(notes) == 1 and notes[0].startswith("vocab_size=152064 copied from text_config")
    assert "Reads452.forward reads config.vocab_size" in notes[0]
    assert flat_vocab_size(config, "Reads452") == []  # already there: nothing set twice

    class Flat:  # 4.45 .. 4.51: the config is its own text config
        vocab_size = 99

        def get_text_config(self, decoder=False):
            return self

    assert flat_vocab_size(Flat(), "Reads452") == []
    resolved = resolve_model(parse_model_spec("arch:qwen2_vl", "test"), "test")
    assert not any("vocab_size" in n for n in resolved.notes)
