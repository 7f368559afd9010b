"""The measured examples of docs/encoders.md and docs/multimodal.md (issue 46: "README / docs give one measured
example each") against the committed atlas blocks (reports/atlas/support.json, ``encoders`` / ``multimodal`` on the
newest release, 5.25.0): each number the pages quote for a model / backend / layout is the block's entry, written to
two significant digits; a verdict the page states is the entry's. Planted: a page with one number or one verdict
changed is caught, naming the row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from packaging.version import Version

from pytest_packcheck.atlas.kinds_render import unpack

REPO = Path(__file__).resolve().parents[1]
RELEASE = "5.25.0"
#: the pages' model names -> the blocks' model_types
ENCODER_NAMES = {"ModernBERT": "modernbert", "EuroBERT": "eurobert", "NomicBERT": "nomic_bert",
                 "DistilBERT": "distilbert", "DeBERTa-v2": "deberta-v2"}
EXACT_ENCODERS = ("bert", "roberta", "xlm-roberta", "electra")
VLM_NAMES = {"Qwen2-VL": "qwen2_vl", "Qwen2.5-VL": "qwen2_5_vl", "Qwen3-VL": "qwen3_vl"}
#: docs/multimodal.md's M-RoPE layout table: column -> (layout, the backend whose entry it quotes)
LAYOUT_COLUMNS = (("mrope", "sdpa"), ("flat", "sdpa"), ("mrope+cu_seq_lens", "sdpa"), ("mrope+cu_seq_lens", "packcheck_flash_ref"))


def _block(name: str) -> dict:
    return unpack(json.loads((REPO / "reports" / "atlas" / "support.json").read_text())[name])


def _entry(block: dict, model_type: str, backend: str) -> dict:
    return block["cells"][model_type][backend][RELEASE]


def _same(page: str, value: float | None) -> bool:
    """Whether ``page`` (a number as the pages write it: two significant digits, ``0.0`` for zero) is the block's
    ``value`` (three significant digits) rounded: within half a unit of the page's last digit (8.1e-03 is 0.00805,
    whose own digits the block rounded from 0.008054)."""
    if not isinstance(value, (int, float)):
        return False
    if page == "0.0":
        return value == 0
    import math

    shown = float(page)
    return abs(shown - value) <= 0.55 * 10 ** (math.floor(math.log10(abs(shown))) - 1)


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``heading``, its header and rule left out."""
    section = text.split(heading, 1)[1]
    lines = []
    for line in section.splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    assert lines, f"no table after {heading!r}"
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def encoder_problems(text: str, block: dict) -> list[str]:
    """What docs/encoders.md's measured example says that the encoders block does not: each table row's
    ``encoder_isolation`` number (eager, the backend every row has), its varlen-reference column (``refused`` =
    unsupported, a number = a pass), the models that leak on eager and sdpa (the row's model on sdpa: a fail, unless
    the row says sdpa is refused), the count of them, and the exact models (a pass on eager, sdpa and the varlen
    reference)."""
    out = []
    rows = _table(text, "## One measured example")
    for model, _parity, isolation, varlen in rows:
        name = ENCODER_NAMES.get(model.split(" (")[0])
        if name is None:
            out.append(f"row {model!r}: not a model of the page's names")
            continue
        eager = _entry(block, name, "eager")
        if eager["verdict"] != "fail" or not _same(isolation, eager.get("number")):
            out.append(f"{name} eager: page {isolation}, block {eager['verdict']} {eager.get('number')}")
        sdpa = _entry(block, name, "sdpa")
        if sdpa["verdict"] != ("unsupported" if "sdpa" in model and "refused" in model else "fail"):
            out.append(f"{name} sdpa: block {sdpa['verdict']}")
        ref = _entry(block, name, "packcheck_flash_ref")
        if ref["verdict"] != ("unsupported" if varlen == "refused" else "pass"):
            out.append(f"{name} varlen reference: page {varlen}, block {ref['verdict']}")
    words = {"Five": 5, "Four": 4, "Six": 6, "Three": 3}
    said = re.search(r"(\w+) of the default set still leak", text)
    if said is None or words.get(said.group(1)) != len(rows):
        out.append(f"the count of leaking models: page {said and said.group(1)}, table {len(rows)}")
    leaking = sorted(m for m, by in block["cells"].items() if f"encoder:{m}" in block["models"]
                     and by["eager"][RELEASE]["verdict"] == "fail")
    if leaking != sorted(ENCODER_NAMES[r[0].split(" (")[0]] for r in rows if r[0].split(" (")[0] in ENCODER_NAMES):
        out.append(f"the default set's models that leak on eager in the block: {leaking}")
    for name in EXACT_ENCODERS:
        verdicts = {b: _entry(block, name, b)["verdict"] for b in ("eager", "sdpa", "packcheck_flash_ref")}
        if set(verdicts.values()) != {"pass"}:
            out.append(f"{name}: the page says exact, the block {verdicts}")
    return out


def multimodal_problems(text: str, block: dict) -> list[str]:
    """What docs/multimodal.md's measured example says that the multimodal block does not: each M-RoPE layout table
    cell (``verdict: isolation / text logits / loss``: the verdict and the text-logits number, :data:`LAYOUT_COLUMNS`),
    the release layout's text logits quoted per model and backend, and Gemma 3's fail (``non_causal``, the text-only
    sample's number)."""
    out = []
    for row in _table(text, "## One measured example"):
        name = VLM_NAMES.get(row[0])
        if name is None:
            out.append(f"row {row[0]!r}: not a model of the page's names")
            continue
        for cell, (layout, backend) in zip(row[1:], LAYOUT_COLUMNS, strict=True):
            verdict, numbers = cell.split(":", 1)
            logits = numbers.split("/")[1].strip()
            got = (_entry(block, name, backend).get("layouts") or {}).get(layout)
            if got is None or got[0] != verdict.strip() or not _same(logits, got[1]):
                out.append(f"{name} {layout} on {backend}: page {verdict.strip()} {logits}, block {got}")
    example = text.split("## One measured example", 1)[1].split("| model", 1)[0]
    quoted = re.search(r"Qwen2-VL text logits (\S+) \(eager, varlen reference\) / (\S+) \(sdpa\)", example)
    for name, backend, value in (("qwen2_vl", "eager", quoted and quoted.group(1)),
                                 ("qwen2_vl", "packcheck_flash_ref", quoted and quoted.group(1)),
                                 ("qwen2_vl", "sdpa", quoted and quoted.group(2))):
        got = (_entry(block, name, backend).get("layouts") or {}).get("text+mrope")
        if value is None or got is None or got[0] != "holds" or not _same(value, got[1]):
            out.append(f"{name} text+mrope on {backend}: page {value}, block {got}")
    for label, name in (("Qwen2.5-VL", "qwen2_5_vl"), ("Qwen3-VL", "qwen3_vl")):
        said = re.search(rf"{re.escape(label)} (\S+), loss delta", example)
        got = (_entry(block, name, "sdpa").get("layouts") or {}).get("text+mrope")
        if said is None or got is None or got[0] != "holds" or not _same(said.group(1), got[1]):
            out.append(f"{name} text+mrope on sdpa: page {said and said.group(1)}, block {got}")
    gemma = re.search(r"the text-only\s+sample (\S+), loss delta", text)
    for backend in ("eager", "sdpa"):
        got = _entry(block, "gemma3", backend)
        if gemma is None or (got["verdict"], got["causes"]) != ("fail", ["non_causal"]) or not _same(gemma.group(1), got.get("number")):
            out.append(f"gemma3 {backend}: page {gemma and gemma.group(1)} non_causal, block {got}")
    return out


@pytest.fixture(scope="module")
def pages():
    return {name: (REPO / "docs" / f"{name}.md").read_text() for name in ("encoders", "multimodal")}


def test_the_encoder_pages_measured_example_is_the_committed_atlas(pages):
    assert encoder_problems(pages["encoders"], _block("encoders")) == []


def test_the_multimodal_pages_measured_example_is_the_committed_atlas(pages):
    assert multimodal_problems(pages["multimodal"], _block("multimodal")) == []


def test_a_page_with_one_number_or_verdict_changed_is_caught(pages):
    enc, mm = _block("encoders"), _block("multimodal")
    planted = pages["encoders"].replace("| EuroBERT | 7.8e-01 | 3.6e-01 |", "| EuroBERT | 7.8e-01 | 3.7e-01 |")
    assert planted != pages["encoders"] and encoder_problems(planted, enc) == ["eurobert eager: page 3.7e-01, block fail 0.363"]
    planted = pages["encoders"].replace("Five of the default set", "Four of the default set")
    assert any("count" in p for p in encoder_problems(planted, enc))
    planted = pages["multimodal"].replace("differs: 0.0 / 7.3e-02", "holds: 0.0 / 7.3e-02")
    assert planted != pages["multimodal"]
    assert [p.split(":")[0] for p in multimodal_problems(planted, mm)] == ["qwen3_vl flat on sdpa"]
    planted = pages["multimodal"].replace("sample 3.9e-01, loss delta", "sample 3.8e-01, loss delta")
    assert planted != pages["multimodal"] and len(multimodal_problems(planted, mm)) == 2  # eager and sdpa
    enc["cells"]["bert"]["sdpa"][RELEASE] = {"verdict": "fail", "causes": ["leak"], "number": 0.0042}  # a block that moved
    assert encoder_problems(pages["encoders"], enc) == [("bert: the page says exact, the block "
                                                        "{'eager': 'pass', 'sdpa': 'fail', 'packcheck_flash_ref': 'pass'}")]


def tiles_problems(text: str, block: dict) -> list[str]:
    """What docs/multimodal.md says of the LLaVA-NeXT row with several tiles per release that the block does not:
    the row's verdict and causes equal the one-tile row's on every release and backend ("does what the one-tile row
    does"), its eager / sdpa transitions placed at the first releases the page names, its ``mm_isolation`` number on
    4.52.4, and its collator layouts' largest number from 4.53.1 on."""
    out = []
    para = text.split("`multimodal:llava_next_tiles`", 1)[1].split("## ", 1)[0]
    said = re.search(r"leaks from (\S+)\s+\(`mm_isolation` (\S+) on (\S+)\) and holds from (\S+) \(the collator layouts "
                     r"`flat` and `flat\+cu_seq_lens` within\s+(\S+) through", para)
    if said is None:
        return ["the paragraph's sentence on eager and sdpa is not found"]
    bad, number, at, good, layouts = said.groups()
    order = [r["transformers"] for r in block["releases"]]
    tiles, family = block["cells"]["llava_next_tiles"], block["cells"]["llava_next"]
    for backend in block["backends"]:
        for version in order:
            a, b = tiles[backend].get(version), family[backend].get(version)
            if (a and (a["verdict"], a["causes"])) != (b and (b["verdict"], b["causes"])):
                out.append(f"{backend} {version}: the tiled row {a and a['verdict']}, the one-tile row {b and b['verdict']}")
        if backend == "packcheck_flash_ref":
            continue
        entry = tiles[backend].get(at) or {}
        if (entry.get("verdict"), entry.get("causes")) != ("fail", ["leak"]) or not _same(number, entry.get("number")):
            out.append(f"{backend} {at}: page leak {number}, block {entry}")
        firsts = sorted((t["bisected"]["first"], t["after"]["verdict"]) for t in block["transitions"]
                        if t["model_type"] == "llava_next_tiles" and t["backend"] == backend and t.get("bisected")
                        and t["after"]["verdict"] in ("fail", "pass") and t["before"]["verdict"] != "error")
        if (bad, "fail") not in firsts or (good, "pass") not in firsts:
            out.append(f"{backend}: page leaks from {bad}, holds from {good}; block placed {firsts}")
        later = [n for v in order if Version(v) >= Version(good) for _, n in (tiles[backend][v].get("layouts") or {}).values()]
        if not later or max(later) > float(layouts) * 1.05:
            out.append(f"{backend}: page layouts within {layouts}, block up to {max(later, default=None)}")
    return out


def test_the_several_tiles_row_per_release_is_the_committed_atlas(pages):
    assert tiles_problems(pages["multimodal"], _block("multimodal")) == []
    mm = _block("multimodal")
    planted = pages["multimodal"].replace("holds from 4.53.1 (the collator", "holds from 4.53.2 (the collator")
    assert planted != pages["multimodal"] and len(tiles_problems(planted, mm)) == 2  # eager and sdpa
    mm["cells"]["llava_next_tiles"]["sdpa"]["5.0.0"] = {"verdict": "fail", "causes": ["leak"], "number": 0.2}
    assert tiles_problems(pages["multimodal"], mm) == ["sdpa 5.0.0: the tiled row fail, the one-tile row pass"]


def heads_problems(text: str, block: dict) -> list[str]:
    """What docs/encoders.md says of the classification heads per release that the encoders block does not: the four
    exact encoders' token-classification head leaks on sdpa on 5.24.0 and passes on 5.25.0 (BERT's number), the
    quoted 5.25.0 leaks (model, backend, number), and the sequence-classification head's rows on every release."""
    out = []
    para = text.split("The classification heads per release", 1)[1].split("\n\n", 1)[0]
    bert = re.search(r"exact on 5\.25\.0 \(BERT (\S+)\)", para)
    for name in EXACT_ENCODERS:
        before, after = (block["cells"][name]["sdpa"][v].get("token_cls") for v in ("5.24.0", RELEASE))
        if not before or before[::2] != ["fail", "leak"] or not after or after[0] != "pass":
            out.append(f"{name} token_cls on sdpa: 5.24.0 {before}, 5.25.0 {after}")
    got = block["cells"]["bert"]["sdpa"][RELEASE].get("token_cls") or [None, None]
    if bert is None or not _same(bert.group(1), got[1]):
        out.append(f"bert token_cls 5.25.0: page {bert and bert.group(1)}, block {got}")
    names = {v: k for k, v in ENCODER_NAMES.items()}
    for name, backend in (("modernbert", "sdpa"), ("eurobert", "sdpa"), ("nomic_bert", "sdpa"), ("distilbert", "sdpa"),
                          ("deberta-v2", "eager")):
        said = re.search(rf"{re.escape(names[name])}(?: on {backend})? \((\S+)\)", para)
        entry = block["cells"][name][backend][RELEASE]
        field = entry.get("token_cls") or (block["cells"][name]["sdpa"][RELEASE].get("token_cls") if backend == "eager" else None)
        if said is None or not field or field[::2] != ["fail", "leak"] or not _same(said.group(1), field[1]):
            out.append(f"{name} token_cls on {backend} 5.25.0: page {said and said.group(1)}, block {field}")
    for spec in block["models"]:
        name = spec.split(":", 1)[1]
        for version, entry in block["cells"][name]["sdpa"].items():
            if entry["verdict"] == "absent":
                continue
            want = (["error", None, "shrunk_crash"] if name == "deberta-v2" else
                    ["unsupported", None, "no_position_ids"] if name == "distilbert" and Version(version) < Version("5.0.0")
                    else ["fail", 1, "pooled_head"])
            if entry.get("seq_cls") != want:
                out.append(f"{name} seq_cls {version}: page {want}, block {entry.get('seq_cls')}")
    return out


def test_the_classification_heads_per_release_are_the_committed_atlas(pages):
    enc = _block("encoders")
    assert heads_problems(pages["encoders"], enc) == []
    planted = pages["encoders"].replace("NomicBERT (1.8e-03)", "NomicBERT (2.8e-03)")
    assert planted != pages["encoders"] and heads_problems(planted, enc) == [
        "nomic_bert token_cls on sdpa 5.25.0: page 2.8e-03, block ['fail', 0.0018, 'leak']"]
    enc["cells"]["bert"]["sdpa"]["5.3.0"] = {**enc["cells"]["bert"]["sdpa"]["5.3.0"], "seq_cls": ["pass", 3]}  # per segment
    assert heads_problems(pages["encoders"], enc) == ["bert seq_cls 5.3.0: page ['fail', 1, 'pooled_head'], block ['pass', 3]"]
