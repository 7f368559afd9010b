#!/usr/bin/env bash
# The release as users get it (issue 43): build the sdist and the wheel, install the wheel (not editable) in a fresh
# venv, and run it from a folder with no checkout on the path: `packcheck --version`, `packcheck lookup` (the atlas
# shipped in the wheel) and a one-model audit (the audits, tolerances, known faults and hub configs it reads).
# Usage: bash tools/check_wheel.sh [DIST_DIR]      (.ci/run runs it; about a minute with a warm pip cache)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
dist=${1:-$repo/.ci-dist}
rm -rf "$dist" && python -m build --sdist --wheel --outdir "$dist" . > "$dist.log" 2>&1 || { tail -20 "$dist.log"; exit 1; }
wheel=$(ls "$dist"/packcheck-*.whl)
ls "$dist"/packcheck-*.tar.gz > /dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# the wheel's own dependencies at the tested versions (torch's CPU build): never a CUDA torch
"$work/venv/bin/pip" install -q -c constraints/test.txt "$wheel" > "$work/pip.log" 2>&1 || { tail -20 "$work/pip.log"; exit 1; }
cd "$work"
export PYTHONPATH= HF_HUB_OFFLINE=1 HF_HOME="$work/hf" PACKCHECK_CACHE_DIR="$work/cache"
"$work/venv/bin/python" -c "import pytest_packcheck, sys; assert '$repo' not in pytest_packcheck.__file__, pytest_packcheck.__file__"
"$work/venv/bin/packcheck" --version
"$work/venv/bin/packcheck" lookup llama sdpa 4.53.1 > lookup.txt || { cat lookup.txt; exit 1; }
grep -q "Trainer: fail" lookup.txt
"$work/venv/bin/packcheck" audit -q --models arch:llama --packcheck-attn sdpa --packcheck-report-dir out > audit.log 2>&1 \
    || { tail -30 audit.log; exit 1; }
grep -q "✅" out/packcheck-matrix.md
echo "wheel $(basename "$wheel"): installs, answers lookup, audits arch:llama from $work"
