#!/usr/bin/env bash
# Mutation testing of the functions that decide verdicts (issue 14): mutmut 3.8.1 (pip install -e '.[mutation]')
# over the checks, the training verdicts, the gate (its comparison and its counting of new, missing and changed
# cells), the mechanism probes' rows and findings, the cause classification, the report's headline and the
# tolerance resolution, each mutant run against the fast targeted tests of [tool.mutmut] in pyproject.toml
# (test_branches.py, test_decisions.py and a few unit tests: planted faults, planted probe numbers, one tiny llama
# per module), never the whole suite. Prints the score per module and overall, and the survivors.
#
# Measured (2 CPU cores shared with 3 other developers, load average 5-8): 2845 mutants in 22 functions; one full
# run (mutant generation ~8 min, stats, every mutant) took 2602 s = 43 min 22 s. Re-running only the survivors
# after a test change (mutmut run <names>): 678 s for 833 of them. Score and equivalents: README, "Mutation testing".
#
# Usage: tools/mutation.sh            all scoped functions
#        tools/mutation.sh 'pytest_packcheck.analysis.gate.*'   a subset (mutmut name globs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MUTMUT=${MUTMUT:-$(dirname "$(command -v "$PY")")/mutmut}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH  # mutmut imports the mutated copy under mutants/, never another checkout

# The verdict-deciding functions (mutmut names: module.x_function). Left out, with the reason: the report-only
# parts of check_logits_parity (padded and two-row notes), check_cross_backend / causality / edge_lengths (their
# verdicts are tested in test_probes.py with models too slow to rebuild per mutant), the SFT / packing_content
# bodies (whole TRL runs; their verdict helpers _compare_steps and _cause are in), rendering and remedies.
SCOPE=(
  'pytest_packcheck.checks.collate.x__items_result__mutmut_*'
  'pytest_packcheck.checks.collate.x__describe_empty__mutmut_*'
  'pytest_packcheck.checks.collate.x_check_collate__mutmut_*'
  'pytest_packcheck.checks.parity.x_check_position_ids__mutmut_*'
  'pytest_packcheck.checks.probes.x_mismatch_cause__mutmut_*'
  'pytest_packcheck.checks.parity.x_check_isolation__mutmut_*'
  'pytest_packcheck.checks.parity.x_check_loss_parity__mutmut_*'
  'pytest_packcheck.checks.parity.x_check_grad_parity__mutmut_*'
  'pytest_packcheck.checks.attention.x_check_backend__mutmut_*'
  'pytest_packcheck.checks.traps.x_check_cache_trap__mutmut_*'
  'pytest_packcheck.checks.traps.x_check_mask_trap__mutmut_*'
  'pytest_packcheck.checks.training.x_check_trainer__mutmut_*'
  'pytest_packcheck.checks.sft_probes.x__compare_steps__mutmut_*'
  'pytest_packcheck.checks.sft_probes.x__cause__mutmut_*'
  'pytest_packcheck.analysis.gate.x_compare__mutmut_*'
  'pytest_packcheck.analysis.gate.x_allowed_reason__mutmut_*'
  'pytest_packcheck.analysis.gate.x__planned_in__mutmut_*'
  'pytest_packcheck.analysis.gate.x_verdict_label__mutmut_*'
  'pytest_packcheck.analysis.gate.x_regressions__mutmut_*'
  'pytest_packcheck.analysis.gate.x_compared__mutmut_*'
  'pytest_packcheck.analysis.gate.x_missing_note__mutmut_*'
  'pytest_packcheck.analysis.gate.x_cell_causes__mutmut_*'
  'pytest_packcheck.checks.mechanisms.x_has_topk_selection__mutmut_*'
  'pytest_packcheck.checks.mechanisms.x_record_topk_ties__mutmut_*'
  'pytest_packcheck.checks.mechanisms.x_probe_rows__mutmut_*'
  'pytest_packcheck.checks.mechanisms.x_selection_ties__mutmut_*'
  'pytest_packcheck.checks.mechanisms.x_mechanism_findings__mutmut_*'
  'pytest_packcheck.analysis.diagnose.x_classify__mutmut_*'
  'pytest_packcheck.analysis.diagnose.x_diagnose_document__mutmut_*'
  'pytest_packcheck.report.verdicts.x_headline__mutmut_*'
  'pytest_packcheck.report.verdicts.x_cell_status__mutmut_*'
  'pytest_packcheck.config.tolerances.x_load_tolerances__mutmut_*'
)
[ $# -gt 0 ] && SCOPE=("$@")

rm -rf mutants
start=$(date +%s)
"$MUTMUT" run --max-children "${MUTATION_CHILDREN:-2}" "${SCOPE[@]}" || true
echo "mutmut run: $(( $(date +%s) - start )) s"
"$MUTMUT" results --all true > mutants/results.txt 2>&1 || true
"$PY" tools/mutation_score.py mutants/results.txt
