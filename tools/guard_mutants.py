"""Plant each fault in the guard (pytest_packcheck/guard/*.py) in turn, run the tests of tests/test_guard.py and
tests/test_guard_reference.py meant to catch it (-k), expect a failure, restore the file. Every guard decision branch has a row here; a row names its
source text, which must occur exactly once in the guard's modules (the file is found, not named).

The mutants are planted in a private copy of the checkout (a temporary folder: the package, tests/ and audit/),
never in the working tree, so a concurrent edit of guard/ is neither broken by a planted fault nor overwritten by
the restore; the tests run there with PYTHONPATH at the copy.

Usage: python tools/guard_mutants.py [MUTANT NAME ...]   (~1 min per mutant on 2 shared CPU cores)
Exit 1 when a mutant survives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUARD = ROOT / "pytest_packcheck" / "guard"
#: the tests the mutants run against (each mutant selects its own with -k)
TEST_FILES = ("tests/test_guard.py", "tests/test_guard_reference.py")
#: (name, source text in one of the guard's modules, its replacement, the -k expression of the tests that must fail)
MUTANTS = [
 ("autocast ignored", 'if self.autocast in _REDUCED:\n            return self.autocast', 'if False:\n            return self.autocast', "trl_default_sftconfig or row_it_computes"),
 ("bf16 weights ignored", 'if self.weights in _REDUCED:\n            return self.weights, f"{self.weights} weights"', 'if False:\n            return self.weights, ""', "bf16_weights"),
 ("head ignored", 'if self.head in _REDUCED:', 'if False:', "bf16_weights"),
 ("plain print", '    tqdm.write(line, file=sys.stderr)', '    print(line, file=sys.stderr)', "own_line"),
 ("restart unchecked", 'wrong = [s for s in pos_starts if p[s] < first]', 'wrong = []', "contract_item"),
 ("cu agree unchecked", 'if other != starts0:', 'if False:', "contract_item"),
 ("labels unchecked", 'if unmasked:\n            items.append', 'if False:\n            items.append', "contract_item"),
 ("cu form unchecked", 'if wrong_form:\n            items.append', 'if False:\n            items.append', "contract_item or malformed_cu_seq_lens"),
 ("empty unchecked", 'if any(b == a for a, b in itertools.pairwise(cu_q)):', 'if False:', "contract_item"),
 ("cu_k unchecked", 'if cu_k is not None and cu_k != cu_q:', 'if False:', "contract_item"),
 ("max_length unchecked", 'if number is not None and number < longest:', 'if False:', "contract_item"),
 ("lengths unchecked", "value.ndim >= 2 and value.shape[-2:] != ids.shape:", "value.ndim >= 2 and False:", "off_the_rows_length"),
 ("reference from row ids", 'inputs["position_ids"] = position_ids_alone(row.continued.get(s.start, row.first), s.stop - s.start, like=pos)', 'inputs["position_ids"] = pos[..., s]', "true_positions"),
 ("contract ignored", '    if row.items:\n        result.cause = contract_cause', '    if False:\n        result.cause = contract_cause', "contract_item"),
 ("swap uncounted", 'if others:\n            result.verdict, result.cause = "fallback", "backend_swap"', 'if False:\n            result.verdict, result.cause = "fallback", "backend_swap"', "backend_swap"),
 ("no mask rerun", 'if "attention_mask" in inputs and fixed(rerun("without_attention_mask", attention_mask=None)):', 'if False:', "mask_override"),
 ("no cache rerun", 'if fixed(rerun("use_cache_false", use_cache=False)):', 'if False:', "cache_trap"),
 ("no layout rerun", 'if layout is not None and fixed(rerun("laid_out_position_ids", position_ids=layout.apply(pos))):', 'if False:', "position_layout"),
 ("no ignore rerun", 'if same is not None and abs(same - worst) <= 1e-6 * max(1.0, worst):', 'if False:', "ignores_position"),
 ("isolation unread", 'isolated = not missing and (moved <= atol if moved is not None else attention["boundaries_reached"] > 0)', 'isolated = not missing', "leak_where or wrong_positions"),
 ("always leak", '    if not isolated:\n        detail', '    if True:\n        detail', "wrong_positions"),
 ("no float32 rerun", 'if f32 <= f32_atol:\n            return _NUMERICS_PASS', 'if False:\n            return _NUMERICS_PASS', "numerics_band"),
 ("band float32 none-needed", '        if dtype not in _REDUCED:\n            return "kernel_numerics"', '        if dtype not in _REDUCED:\n            return "wrong_positions"', "numerics_band_float32"),
 ("nan passes", '    if not cmp["finite"]:\n        result.cause = "non_finite"', '    if False:\n        result.cause = "non_finite"', "nan_weights"),
 ("zero fails", '(cmp["max"] is not None and not cmp["max"] <= tol["logits_atol"])', '(cmp["max"] is not None and not cmp["max"] < tol["logits_atol"])', "zero_difference"),
 ("all -100 judged", '    if not bool((targets != IGNORE_INDEX).any()):\n        return _finish', '    if False:\n        return _finish', "all_labels"),
 ("not packed aborts", '        except NotPackedError as exc:  # a run that does not pack: nothing to check, training goes on', '        except ZeroDivisionError as exc:', "does_not_pack"),
 ("negative tol ok", '            if problem:\n                raise refuse', '            if False:\n                raise refuse', "bad_tolerances"),
 ("one key ok", '        if missing:\n            raise refuse', '        if False:\n            raise refuse', "bad_tolerances"),
 ("empty row ok", '    if int(ids.shape[1]) == 0:', '    if False:', "malformed"),
 ("float ids ok", '    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or str(ids.dtype).rsplit(".", 1)[-1] not in _ID_DTYPES:', '    if False:', "malformed"),
 ("labels out of range ok", "if scored.numel() and (int(scored.min()) < 0 or", "if False and (int(scored.min()) < 0 or", "malformed"),
 ("leak remedy generic", '(cause == "leak" and result.probes.get("batch_has_position_ids") is False', '(False', "names_the_missing_key"),
 ("exception escapes", '    except Exception as exc:  # noqa: BLE001 - the model refuses the batch as given: a verdict, with the exception', '    except ZeroDivisionError as exc:', "int64"),
 ("cu dtype not contract", '        if not contract_cause and any(n.startswith("cu_seq_lens") for n in row.notes):', '        if False:', "int64"),
 ("stateful unnamed", 'if stateful and not attention["boundaries_missing"]:', 'if False:', "stateful_layers"),
 ("refusal is a crash", 'if stateful_layers(model) and any(m in str(exc) for m in STATEFUL_REFUSALS):', 'if False:', "stateful_layers_refused"),
 ("rows unseen", '    if not bool(restarts.any()):\n        return None', '    if True:\n        return None', "packed_rows"),
 ("rows together unread", 'if batched is not None and not batched <= result.tolerance["logits_atol"]:', 'if False:', "packed_rows"),
 ("fused keeps cache", '        cache = False  # trl 1.16 add_fused_lm_head', '        pass  # trl 1.16 add_fused_lm_head', "fused_lm_head_runs"),
 # the padded per-example reference (verify._measure / forward._reference, issue 47): it may only pass a row
 ("padded positions from the row", 'alone = torch.where(real, first[:, None] + offsets[None], 0).to(pos.dtype)', 'alone = torch.where(real, (pos[0, 0] if pos.ndim == 3 else pos[0])[where], 0).to(pos.dtype)', "true_positions"),
 ("padded continuation at the first position", 'first = torch.tensor([row.continued.get(row.slices[i].start, row.first) for i in group], device=pos.device)', 'first = torch.tensor([row.first for i in group], device=pos.device)', "padded_reference"),
 ("padded mask dropped", '"attention_mask": real.long(),', '', "padded_reference"),
 ("padded targets of the pads", 'scored = real[:, 1:] & (wanted != IGNORE_INDEX)', 'scored = wanted != IGNORE_INDEX', "padded_reference"),
 ("fallback never", 'if row.items or not cmp["finite"] or _bad(cmp, {k: v / 2 for k, v in tol.items()}):', 'if False:', "disagrees_falls_back"),
 ("fallback inverted", 'if row.items or not cmp["finite"] or _bad(cmp', 'if row.items or not cmp["finite"] or not _bad(cmp', "disagrees_falls_back"),
 ("fallback at the full tolerance", 'row.items or not cmp["finite"] or _bad(cmp, {k: v / 2 for', 'row.items or not cmp["finite"] or _bad(cmp, {k: v for', "half_the_tolerance"),
 ("contract judged on padded", 'if row.items or not cmp["finite"] or _bad(', 'if not cmp["finite"] or _bad(', "contract_item_is_judged"),
 ("reduced precision padded", 'why = _batchable(model, row, fused) or (None if dtype == "float32" else f"{dtype} compute")', 'why = _batchable(model, row, fused)', "reduced_precision_row_is_judged"),
 ("stateful padded", '    if stateful_layers(model):\n        return "stateful layers"', '    if False:\n        return "stateful layers"', "stateful_layers_keep"),
 ("fused padded", '    if fused:\n        return "TRL\'s fused LM head"', '    if False:\n        return "TRL\'s fused LM head"', "bit_identical"),
 ("no-mask forward padded", 'if accepted is not None and "attention_mask" not in accepted:', 'if False:', "padded_reference"),
 ("padded batch refusal escapes", '            except Exception as exc:  # noqa: BLE001 - a model that refuses a padded batch: one at a time decides', '            except ZeroDivisionError as exc:', "refuses_a_padded_batch"),
 # a contract item beside a difference: the probes name the other cause only above the tolerance
 ("zero fails beside a contract item", 'not cmp["max"] <= tol["logits_atol"]\n                and all(', 'not cmp["max"] < tol["logits_atol"]\n                and all(', "zero_difference"),
 # the count the trainer divides by: one row, and the accumulation window (callback)
 ("count below the row ok", '        if count < scored:', '        if False:', "below_the_rows_own"),
 ("window unchecked", 'if result.ok and self._accumulation > 1 and count is not None:', 'if False:', "accumulation_window"),
 ("window of the first micro-batch", 'sum(window["scored"]), window["count"]', 'window["scored"][0], window["count"]', "accumulation_window"),
 ("window divided count fails", '        if _count_may_be_divided():\n            result.notes.append(f"{said}, unless the Trainer divided it over processes")', '        if False:\n            result.notes.append(f"{said}, unless the Trainer divided it over processes")', "accumulation_window"),
]

#: Mutants that change no verdict, no number and no probe the tests can read, each with the reason: still planted
#: (a listed mutant that gets caught is said, so a stale reason is seen) but left out of the score.
EQUIVALENT = {
    "padded positions from the row": (
        "with no contract item the row's own position_ids are each example's true ones: every break in +1 steps is a "
        "boundary, an example starting above the first position is a continuation chunk run at the same positions, "
        "one below it or a segmentation that disagrees is a contract item, and a row with a contract item is judged "
        "one example at a time (test_contract_reference_uses_true_positions reaches that path)"),
    "padded mask dropped": (
        "the reference's right-padded rows of a causal LM: each real token attends only to earlier tokens, all real, so "
        "the pads after it and a mask over them move no scored log-prob; transformers 5.x derives packed boundaries "
        "from position_ids for a batch of one row only (equal to 2e-6 on llama, opt, gpt2, gemma3_text: "
        "test_padded_reference_agrees_with_each_example_alone)"),
    "no-mask forward padded": (
        "a forward without attention_mask runs the padded rows without one: as 'padded mask dropped', the pads follow "
        "every real token of a causal LM"),
    "padded targets of the pads": (
        "each example keeps lp[r, :length - 1], exactly the positions whose next token is real; the mask only zeroes "
        "positions that slice drops"),
}


def _home(name: str, old: str, sources: dict[Path, str]) -> Path:
    """The one guard module that holds ``old``, exactly once."""
    counts = {path: text.count(old) for path, text in sources.items() if old in text}
    if list(counts.values()) != [1]:
        where = ", ".join(f"{p.name} x{n}" for p, n in counts.items()) or "nowhere"
        raise SystemExit(f"mutant {name!r}: its source text occurs in {where} of {GUARD} (expected once in one module)")
    return next(iter(counts))


#: what the copy holds: the guard's tests import the package, tests/conftest.py and read audit/ and pyproject.toml
_COPIED = ("pytest_packcheck", "tests", "audit", "pyproject.toml")


def main(only: list[str]) -> int:
    unknown = set(only) - {name for name, *_ in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="guard-mutants-") as tmp:
        root = Path(tmp)
        for name in _COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, root / name)
        guard = root / GUARD.relative_to(ROOT)
        sources = {path: path.read_text() for path in sorted(guard.glob("*.py"))}
        homes = {name: _home(name, old, sources) for name, old, _, _ in MUTANTS}  # every row checked before any is planted
        env = {**os.environ, "PYTHONPATH": str(root)}
        survived, equivalent, stale = [], [], []
        planted = 0
        for name, old, new, tests in MUTANTS:
            if only and name not in only:
                continue
            path = homes[name]
            path.write_text(sources[path].replace(old, new))
            planted += 1
            try:
                run = subprocess.run([sys.executable, "-m", "pytest", *TEST_FILES, "-q", "-x", "-p", "no:cacheprovider",
                                      "-k", tests], check=False, capture_output=True, text=True, cwd=root, env=env)
            finally:
                path.write_text(sources[path])
            tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-200:]
            caught = run.returncode == 1
            if name in EQUIVALENT:
                (stale if caught else equivalent).append(name)
                print("CAUGHT   (listed as equivalent: drop it from EQUIVALENT)" if caught else "EQUIVALENT",
                      name, f"({path.name})", "|", tail if caught else EQUIVALENT[name], flush=True)
                continue
            print("CAUGHT  " if caught else "SURVIVED", name, f"({path.name})", "|", tail, flush=True)
            if not caught:
                survived.append(name)
    scored = planted - len(equivalent) - len(stale)
    print(f"{scored - len(survived)} of {scored} caught, {len(survived)} survived" + (f": {', '.join(survived)}" if survived else "")
          + (f"; {len(equivalent)} equivalent (not scored)" if equivalent else "")
          + (f"; listed as equivalent but caught: {', '.join(stale)}" if stale else ""))
    return 1 if survived or stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
