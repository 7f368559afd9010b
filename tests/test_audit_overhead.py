"""The default audit's overhead against its floor (issue 47, benchmarks/bench_audit.py): what was done more than once
per audit is done once, and each shortcut still gives the same answer as the long way, with its planted fault:

- the secret values the scrubber replaces are read from the environment once per change of it (errors.secret_forms);
- a cell child's result is scrubbed once, where it leaves the child (results.io.scrub_json), and the parent writes it
  to the journal and the report property as it came;
- CellResult.to_json writes the text asdict + json wrote, without the deep copy;
- Workbench.accepted reads the forward's signature once per forward function;
- a model's shrink and meta-device count are made once for its backends (model.build._shrunk);
- SideBySide hands an idle child the next group's cells instead of forking one per model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import pytest

# ---------------------------------------------------------------------------------------------------------------
# secrets: read once per change of the environment


def test_secret_forms_follow_every_change_of_the_environment(monkeypatch):
    from pytest_packcheck.errors import scrub_secrets, secret_forms

    monkeypatch.delenv("A47_SERVICE_TOKEN", raising=False)
    assert scrub_secrets("x Zq81secretvalue y") == "x Zq81secretvalue y"
    monkeypatch.setenv("A47_SERVICE_TOKEN", "Zq81secretvalue")
    assert scrub_secrets("x Zq81secretvalue y") == "x *** y"
    monkeypatch.setenv("A47_SERVICE_TOKEN", "Other|value99")  # changed: the old value is no secret any more
    assert scrub_secrets("Zq81secretvalue Other|value99 Other\\|value99") == "Zq81secretvalue *** ***"
    monkeypatch.delenv("A47_SERVICE_TOKEN")
    assert "Other|value99" not in secret_forms()
    assert scrub_secrets("Other|value99") == "Other|value99"


def test_secret_forms_are_not_read_again_while_only_other_variables_change(monkeypatch):
    """pytest rewrites PYTEST_CURRENT_TEST for every test phase: that is no reason to rescan (it was, on every scrub
    of the audit's 650 cells). Planted: a counting name pattern sees one rescan for the secret-named change only."""
    from pytest_packcheck import errors

    calls = []

    class Counting:
        def search(self, name):
            calls.append(name)
            return errors._SECRET_NAME_PATTERN.search(name)

    monkeypatch.setattr(errors, "_SECRET_NAME_PATTERN", errors._SECRET_NAME, raising=False)
    monkeypatch.setattr(errors, "_SECRET_NAME", Counting())
    monkeypatch.setenv("A47_PLAIN", "one")
    errors.secret_forms()
    calls.clear()
    for value in ("two", "three", "four"):
        monkeypatch.setenv("A47_PLAIN", value)
        errors.secret_forms()
    assert calls == []
    monkeypatch.setenv("A47_API_KEY", "Val-8chars-1")
    assert "Val-8chars-1" in errors.secret_forms() and calls  # the secret-named variable is seen at once
    calls.clear()
    monkeypatch.setenv("A47_API_KEY", "Val-8chars-2")  # same names, a secret's value changed: read again
    assert "Val-8chars-2" in errors.secret_forms() and "Val-8chars-1" not in errors.secret_forms() and calls


# ---------------------------------------------------------------------------------------------------------------
# a result scrubbed once, where it leaves the child


def _result(message: str = "fine", cell_id: str = "llama-sdpa-isolation-float32"):
    from pytest_packcheck.results.schema import CellResult

    return CellResult(cell_id=cell_id, model={"label": "llama"}, backend="sdpa", check="isolation", dtype="float32",
                      status="pass", metrics={"max_change": 0.0, "note": message}, message=message)


def test_scrub_json_returns_the_text_itself_when_nothing_is_secret():
    from pytest_packcheck.results.io import scrub_json

    text = _result().to_json()
    assert scrub_json(text) is text


@pytest.mark.parametrize("secret", ["Plain9secret", 'quo"te9Secret', "back\\slash9S", "pässwört9Secret"])
def test_scrub_json_scrubs_every_string_and_stays_json(monkeypatch, secret):
    """A secret as typed and as JSON escapes it (a quote, a backslash, a non-ASCII letter): replacing it inside the
    text would have eaten an escape (invalid JSON) or missed it; the cell id is kept as the cell ran."""
    from pytest_packcheck.results.io import scrub_json

    monkeypatch.setenv("A47_SECRET", secret)
    text = scrub_json(_result(f"token {secret} and hf_{'Ab1' * 8}").to_json())
    data = json.loads(text)
    assert secret not in json.dumps(data, ensure_ascii=False) and data["message"] == "token *** and ***"
    assert data["metrics"]["note"] == "token *** and ***" and data["cell_id"] == "llama-sdpa-isolation-float32"
    assert text == json.dumps(data, sort_keys=True)


def test_a_child_result_goes_to_the_journal_scrubbed_once_and_as_sent(tmp_path, monkeypatch):
    """The journal line of a result a child sent (result_json, scrubbed=True) is the line the full scrub of the old
    path wrote: the same text, the home directory as ~; a cell id holding a secret still gets the whole line scrubbed."""
    from pytest_packcheck.results.io import scrub_json
    from pytest_packcheck.run.journal import Journal

    monkeypatch.setenv("A47_TOKEN", "Xy9secretvalue")
    home = os.path.expanduser("~")
    result = _result(f"read {home}/models/x with Xy9secretvalue")
    old, new = Journal(tmp_path / "old.jsonl", "fp", settings={"models": ["Xy9secretvalue"]}), \
        Journal(tmp_path / "new.jsonl", "fp", settings={"models": ["Xy9secretvalue"]})
    old.reset()
    new.reset()
    old.append(result.to_json())
    new.append(scrub_json(result.to_json()), scrubbed=True)
    line = (tmp_path / "new.jsonl").read_text()
    assert line == (tmp_path / "old.jsonl").read_text()
    assert "Xy9secretvalue" not in line and home not in line and "~/models/x" in line
    named = _result("ok", cell_id="Xy9secretvalue-sdpa-isolation-float32")  # planted: the id itself holds the secret
    new.append(scrub_json(named.to_json()), scrubbed=True)
    assert "Xy9secretvalue" not in (tmp_path / "new.jsonl").read_text()


# ---------------------------------------------------------------------------------------------------------------
# to_json without asdict's deep copy


@dataclass
class _Inner:
    size: int
    names: tuple[str, ...]


def test_to_json_is_the_text_asdict_wrote():
    import torch

    from pytest_packcheck.results.schema import CellResult, _jsonable

    result = CellResult(cell_id="c", model={"label": "m", "sub": _Inner(3, ("a", "b"))}, backend=None, check="collate",
                        dtype="float32", status="fail", metrics={"t": torch.tensor(2.5), "pair": (1, 2.0),
                                                                  "inner": [_Inner(1, ())], "path": __import__("pathlib").Path("/x")},
                        message="m", cause="collator_contract", evidence={"n": torch.tensor(7)})
    assert result.to_json() == json.dumps(asdict(result), sort_keys=True, default=_jsonable)


# ---------------------------------------------------------------------------------------------------------------
# Workbench.accepted once per forward


def test_accepted_is_read_once_per_forward_and_again_for_a_swapped_one(llama_sdpa):
    from pytest_packcheck.checks.parity import check_position_ids

    wb = llama_sdpa
    assert "position_ids" in wb.accepted and wb.accepted is wb.accepted  # read once, the same answer
    original = wb.model.forward

    def no_positions(input_ids=None, labels=None, use_cache=None, attention_mask=None):  # planted: takes no position_ids
        return original(input_ids=input_ids, labels=labels, use_cache=use_cache, attention_mask=attention_mask)

    wb.model.forward = no_positions
    assert "position_ids" not in wb.accepted
    assert check_position_ids(wb).cause == "ignores_position_ids"
    del wb.model.forward
    assert "position_ids" in wb.accepted and check_position_ids(wb).status == "pass"


# ---------------------------------------------------------------------------------------------------------------
# one shrink and meta count per model


def test_a_models_second_backend_takes_the_shrink_of_its_first(monkeypatch):
    from pytest_packcheck.model import build
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    metas = []
    real = build.build_on_meta

    def counted(make):
        metas.append(1)
        return real(make)

    monkeypatch.setattr(build, "build_on_meta", counted)
    build._LAST_SHRUNK.clear()
    resolved = resolve_model(parse_model_spec("arch:gpt2", "test"), "test")
    eager = build.build_model(resolved, "eager", "float32")
    notes = list(resolved.notes)
    sdpa = build.build_model(resolved, "sdpa", "float32")
    assert len(metas) == 1 and resolved.notes == notes
    assert eager.config is not sdpa.config and eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    assert all((a == b).all() for a, b in zip(eager.state_dict().values(), sdpa.state_dict().values(), strict=True))
    resolved.config.n_layer = 3  # planted: the resolved config changed since: shrunk and counted again
    again = build.build_model(resolved, "sdpa", "float32")
    assert len(metas) == 2 and again.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------
# SideBySide: one child runs group after group


pytestmark_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


class _Cell:
    def __init__(self, cell_id: str) -> None:
        self.cell_id = cell_id


def _pid_cell(cell):
    from pytest_packcheck.results.schema import CellResult

    if cell.cell_id == "crash":
        os.write(2, b"the crashing group's own line\n")  # the descriptor a crashing library writes to
        os._exit(3)
    os.write(1, f"ran {cell.cell_id}\n".encode())
    return CellResult(cell_id=cell.cell_id, model={"label": "m"}, backend="sdpa", check="isolation", dtype="float32",
                      status="pass", metrics={"pid": os.getpid()})


def _failure(cell, status, message, metrics):
    return SimpleNamespace(cell_id=cell.cell_id, status=status, message=message, metrics=metrics)


@pytestmark_fork
def test_an_idle_child_takes_the_next_group_and_a_crash_costs_one_cell():
    from pytest_packcheck.run.sandbox import SideBySide

    groups = [("m1", [_Cell("a"), _Cell("b")]), ("m2", [_Cell("c")]), ("m3", [_Cell("crash"), _Cell("d")]),
              ("m4", [_Cell("e")])]
    pool = SideBySide(groups, _pid_cell, _failure, lambda r: None, timeout_s=120, jobs=1)
    results = {k: v for name, _ in groups for k, v in pool.wait_for(name).items()}
    pool.close()
    assert {k: v.status for k, v in results.items()} == {"a": "pass", "b": "pass", "c": "pass", "crash": "error",
                                                         "d": "pass", "e": "pass"}
    pids = {k: v.metrics["pid"] for k, v in results.items() if v.status == "pass"}
    assert pids["a"] == pids["b"] == pids["c"] != os.getpid()  # one fork for m1 and m2
    assert pids["d"] == pids["e"] != pids["a"]  # the crash: a fresh child for the rest, reused for m4
    # the crash names its own group's output, not the lines the reused child printed for m1 and m2
    assert "the crashing group's own line" in results["crash"].message and "ran a" not in results["crash"].message
    assert not pool.idle and not pool.running


@pytestmark_fork
def test_without_reuse_or_past_the_cap_every_group_gets_its_own_fork(monkeypatch):
    """The planted fault of the test above: reuse=False (and a cap of one group per child) forks once per group."""
    from pytest_packcheck.run.sandbox import SideBySide

    groups = [(f"m{i}", [_Cell(f"c{i}")]) for i in range(3)]
    for pool in (SideBySide(groups, _pid_cell, _failure, lambda r: None, timeout_s=120, jobs=1, reuse=False),
                 SideBySide(groups, _pid_cell, _failure, lambda r: None, timeout_s=120, jobs=1)):
        if pool.queue[0][1].pool is not None:
            monkeypatch.setattr(SideBySide, "MAX_GROUPS_PER_CHILD", 1)
        pids = {pool.wait_for(name)[f"c{name[1:]}"].metrics["pid"] for name, _ in groups}
        pool.close()
        assert len(pids) == 3


# ---------------------------------------------------------------------------------------------------------------
# one counted forward of the packed row for the backend check and the isolation probe


def test_the_backend_check_reads_the_isolation_probes_counted_forward(llama_sdpa):
    import dataclasses

    from pytest_packcheck.checks.attention import check_backend
    from pytest_packcheck.checks.parity import check_isolation
    from pytest_packcheck.model import batches as B

    wb = dataclasses.replace(llama_sdpa, share_counted_forward=True, _cache={})  # as the runner builds it
    calls = []
    handle = wb.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    isolation = check_isolation(wb)
    assert isolation.status == "pass" and isolation.metrics["attention_boundaries"] == "reached"
    calls.clear()
    backend = check_backend(wb)
    assert calls == [] and backend.status == "pass" and backend.metrics["boundaries_reached"] == 2
    # planted: another collator is another row: counted again, never the first row's calls
    wb.collator_factory = lambda **kw: B.default_collator_factory(**kw)
    assert check_backend(wb).status == "pass" and calls == [1]
    # a workbench built by hand (a test planting a fault between two checks) never shares: a fresh forward each time
    hand = dataclasses.replace(llama_sdpa, _cache={})
    calls.clear()
    check_backend(hand)
    check_backend(hand)
    handle.remove()
    assert calls == [1, 1]


def test_the_runners_workbench_shares_the_counted_forward(tolerances):
    """The runner's workbench of a cell group opts in (run/runner.py): its isolation and backend cells run one counted
    forward between them; the Workbench default stays off (a planted runner that does not opt in runs two)."""
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import Cell, CellRunner

    assert Workbench.__dataclass_fields__["share_counted_forward"].default is False
    runner = CellRunner([resolve_model(parse_model_spec("arch:llama", "test"), "test")], tolerances)
    bench = runner.workbench(Cell(0, "llama", "sdpa", "isolation", "float32"))
    assert bench.share_counted_forward is True
    calls = []
    handle = bench.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        assert runner.run(Cell(0, "llama", "sdpa", "isolation", "float32")).status == "pass"
        before = len(calls)
        assert runner.run(Cell(0, "llama", "sdpa", "backend", "float32")).status == "pass"
        assert len(calls) == before  # the backend cell read the isolation probe's forward
        bench.share_counted_forward = False  # planted: the runner does not opt in
        bench._cache.clear()
        runner.run(Cell(0, "llama", "sdpa", "isolation", "float32"))
        before = len(calls)
        runner.run(Cell(0, "llama", "sdpa", "backend", "float32"))
        assert len(calls) == before + 1
    finally:
        handle.remove()
