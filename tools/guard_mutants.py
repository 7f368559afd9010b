"""Plant each fault in the guard (pytest_packcheck/guard/*.py) in turn, run the tests of tests/test_guard.py meant to
catch it (-k), expect a failure, restore the file. Every guard decision branch has a row here; a row names its
source text, which must occur exactly once in the guard's modules (the file is found, not named).

Usage: python tools/guard_mutants.py [MUTANT NAME ...]   (PYTHONPATH at this checkout; ~5 min on 2 CPU cores)
Exit 1 when a mutant survives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUARD = ROOT / "pytest_packcheck" / "guard"
#: (name, source text in one of the guard's modules, its replacement, the -k expression of the tests that must fail)
MUTANTS = [
 ("autocast ignored", 'if self.autocast in _REDUCED:\n            return self.autocast', 'if False:\n            return self.autocast', "trl_default_sftconfig or row_it_computes"),
 ("bf16 weights ignored", 'if self.weights in _REDUCED:\n            return self.weights, f"{self.weights} weights"', 'if False:\n            return self.weights, ""', "bf16_weights"),
 ("head ignored", 'if self.head in _REDUCED:', 'if False:', "bf16_weights"),
 ("plain print", '    tqdm.write(line, file=sys.stderr)', '    print(line, file=sys.stderr)', "own_line"),
 ("restart unchecked", 'wrong = [s for s in pos_starts if p[s] != first]', 'wrong = []', "contract_item"),
 ("cu agree unchecked", 'if pos_starts is not None and pos_starts != cu_starts:', 'if False:', "contract_item"),
 ("labels unchecked", 'if unmasked:\n            items.append', 'if False:\n            items.append', "contract_item"),
 ("cu form unchecked", 'if not ok:\n            items.append', 'if False:\n            items.append', "contract_item"),
 ("empty unchecked", 'if any(b == a for a, b in itertools.pairwise(cu_q)):', 'if False:', "contract_item"),
 ("cu_k unchecked", 'if cu_k is not None and cu_k != cu_q:', 'if False:', "contract_item"),
 ("max_length unchecked", 'if value is not None and number is not None and number < longest:', 'if False:', "contract_item"),
 ("lengths unchecked", "        if tuple(value.shape[-2:]) != (1, total):", "        if False:", "contract_item"),
 ("reference from row ids", 'inputs["position_ids"] = position_ids_alone(row.first, s.stop - s.start, like=pos)', 'inputs["position_ids"] = pos[..., s]', "true_positions"),
 ("contract ignored", '    if row.items:\n        result.cause = contract_cause', '    if False:\n        result.cause = contract_cause', "contract_item"),
 ("swap uncounted", 'if others:\n            result.verdict, result.cause = "fallback", "backend_swap"', 'if False:\n            result.verdict, result.cause = "fallback", "backend_swap"', "backend_swap"),
 ("no mask rerun", 'if probes["without_attention_mask"] <= atol:', 'if False:', "mask_override"),
 ("no cache rerun", 'if probes["use_cache_false"] <= atol:', 'if False:', "cache_trap"),
 ("no layout rerun", 'if probes["laid_out_position_ids"] <= atol:', 'if False:', "position_layout"),
 ("no ignore rerun", 'if abs(probes["plain_position_ids"] - worst) <= 1e-6 * max(1.0, worst):', 'if False:', "ignores_position"),
 ("isolation unread", 'isolated = not missing and (moved <= atol if moved is not None else attention["boundaries_reached"] > 0)', 'isolated = not missing', "leak_where or wrong_positions"),
 ("always leak", '    if not isolated:\n        detail', '    if True:\n        detail', "wrong_positions"),
 ("no float32 rerun", 'if f32 <= f32_atol:\n            return _NUMERICS_PASS', 'if False:\n            return _NUMERICS_PASS', "numerics_band"),
 ("band float32 none-needed", '        if dtype not in _REDUCED:\n            return "kernel_numerics"', '        if dtype not in _REDUCED:\n            return "wrong_positions"', "numerics_band_float32"),
 ("nan passes", '    if not cmp["finite"]:', '    if False:', "nan_weights"),
 ("zero fails", 'not cmp["max"] <= tol["logits_atol"]', 'not cmp["max"] < tol["logits_atol"]', "zero_difference"),
 ("all -100 judged", '    if not bool((targets != IGNORE_INDEX).any()):\n        return _finish', '    if False:\n        return _finish', "all_labels"),
 ("not packed aborts", '        except NotPackedError as exc:  # a run that does not pack: nothing to check, training goes on\n            result = _not_packed(module, batch, str(exc))', '        except ZeroDivisionError as exc:\n            result = _not_packed(module, batch, str(exc))', "does_not_pack"),
 ("negative tol ok", 'or float(value) < 0:', 'or float(value) < -1:', "bad_tolerances"),
 ("one key ok", '        if missing:\n            raise _usage', '        if False:\n            raise _usage', "bad_tolerances"),
 ("empty row ok", '    if total == 0:', '    if False:', "malformed"),
 ("float ids ok", '    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:', '    if False:', "malformed"),
 ("labels out of range ok", "if scored.numel() and (int(scored.min()) < 0 or", "if False and (int(scored.min()) < 0 or", "malformed"),
 ("leak remedy generic", 'result.cause == "leak" and result.probes.get("batch_has_position_ids") is False', 'False', "names_the_missing_key"),
 ("exception escapes", '    except Exception as exc:  # noqa: BLE001 - the model refuses the batch as given: a verdict, with the exception', '    except ZeroDivisionError as exc:', "int64"),
 ("cu dtype not contract", '        if not contract_cause and any(n.startswith("cu_seq_lens") for n in row.notes):', '        if False:', "int64"),
 ("stateful unnamed", 'if stateful and not attention["boundaries_missing"]:', 'if False:', "stateful_layers"),
 ("refusal is a crash", 'if stateful_layers(model) and any(m in str(exc) for m in STATEFUL_REFUSALS):', 'if False:', "stateful_layers_refused"),
 ("rows unseen", '    if not bool(restarts.any()):\n        return None', '    if True:\n        return None', "packed_rows"),
 ("rows together unread", 'if batched is not None and not batched <= result.tolerance["logits_atol"]:', 'if False:', "packed_rows"),
 ("fused keeps cache", '        cache = False  # trl 1.16 add_fused_lm_head', '        pass  # trl 1.16 add_fused_lm_head', "fused_lm_head_runs"),
]


def _home(name: str, old: str, sources: dict[Path, str]) -> Path:
    """The one guard module that holds ``old``, exactly once."""
    counts = {path: text.count(old) for path, text in sources.items() if old in text}
    if list(counts.values()) != [1]:
        where = ", ".join(f"{p.name} x{n}" for p, n in counts.items()) or "nowhere"
        raise SystemExit(f"mutant {name!r}: its source text occurs in {where} of {GUARD} (expected once in one module)")
    return next(iter(counts))


def main(only: list[str]) -> int:
    sources = {path: path.read_text() for path in sorted(GUARD.glob("*.py"))}
    unknown = set(only) - {name for name, *_ in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    homes = {name: _home(name, old, sources) for name, old, _, _ in MUTANTS}  # every row checked before any is planted
    survived = []
    planted = 0
    try:
        for name, old, new, tests in MUTANTS:
            if only and name not in only:
                continue
            path = homes[name]
            path.write_text(sources[path].replace(old, new))
            planted += 1
            run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_guard.py", "-q", "-x", "-p", "no:cacheprovider",
                                  "-k", tests], check=False, capture_output=True, text=True, cwd=ROOT)
            tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-200:]
            caught = run.returncode == 1
            print("CAUGHT  " if caught else "SURVIVED", name, f"({path.name})", "|", tail, flush=True)
            if not caught:
                survived.append(name)
            path.write_text(sources[path])
    finally:
        for path, text in sources.items():
            path.write_text(text)
    print(f"{planted - len(survived)} of {planted} caught, {len(survived)} survived" + (f": {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
