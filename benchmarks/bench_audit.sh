#!/usr/bin/env bash
# Benchmark: wall time of `packcheck audit` on the default set (and optionally --all-architectures), 2 workers.
# Usage: benchmarks/bench_audit.sh [--all]   Prints the seconds; the brief's targets are 180 s (default) and 900 s (all).
# The CPU ratio against the floor (the same models and backends built by packcheck, each pair once forward +
# backward packed and alone, one padded and one perturbed forward): python benchmarks/bench_audit.py
set -euo pipefail
out=$(mktemp -d)
args=()
[[ "${1:-}" == "--all" ]] && args+=(--all-architectures)
start=$(date +%s.%N)
packcheck audit -q --packcheck-report-dir "$out" "${args[@]}" > "$out/log.txt" 2>&1 || { tail -20 "$out/log.txt"; exit 1; }
end=$(date +%s.%N)
cells=$(python3 -c "import json,sys; print(len(json.load(open('$out/packcheck-matrix.json'))['cells']))")
printf 'packcheck audit %s: %.1f s wall, %s cells (%s)\n' "${args[*]:-default}" "$(echo "$end - $start" | bc)" "$cells" "$(nproc) cores"
