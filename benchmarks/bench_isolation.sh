#!/usr/bin/env bash
# Benchmark: cost of crash isolation (each model's cells in a forked child) on the default audit, 2 workers.
# Usage: benchmarks/bench_isolation.sh   Prints wall seconds with --packcheck-isolation=fork and =none and the
# difference per model (issue target: under 1.5 s per model on CPU). Verdicts must be identical.
set -euo pipefail
declare -A wall
for mode in none fork; do
  out=$(mktemp -d)
  start=$(date +%s.%N)
  packcheck audit -q --packcheck-isolation "$mode" --packcheck-report-dir "$out" > "$out/log.txt" 2>&1 || { tail -20 "$out/log.txt"; exit 1; }
  end=$(date +%s.%N)
  wall[$mode]=$(echo "$end - $start" | bc)
  python3 -c "import json; d=json.load(open('$out/packcheck-matrix.json')); print('$mode', len(d['cells']), 'cells')" >&2
  cp "$out/packcheck-matrix.json" "/tmp/packcheck-bench-isolation-$mode.json"
done
models=$(python3 -c "import json; print(len({c['model']['label'] for c in json.load(open('/tmp/packcheck-bench-isolation-fork.json'))['cells']}))")
python3 - <<PY
import json
a = {c["cell_id"]: c["status"] for c in json.load(open("/tmp/packcheck-bench-isolation-none.json"))["cells"]}
b = {c["cell_id"]: c["status"] for c in json.load(open("/tmp/packcheck-bench-isolation-fork.json"))["cells"]}
diff = [k for k in a if a[k] != b.get(k)]
print(f"verdicts identical: {not diff} ({len(diff)} differ: {diff[:5]})")
PY
printf 'isolation none: %.1f s, fork: %.1f s wall; %s models; overhead %.2f s per model (%s cores)\n' \
  "${wall[none]}" "${wall[fork]}" "$models" "$(echo "(${wall[fork]} - ${wall[none]}) / $models" | bc -l)" "$(nproc)"
