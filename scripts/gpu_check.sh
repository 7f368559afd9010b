#!/usr/bin/env bash
# GPU check (issue 5), prepared for one run on the lent GPU machine (one H200, torch 2.11 CUDA, transformers
# 5.17, no flash-attn, no trl, no internet). Budget: under 6 minutes.
#
#   1. installs what is missing from carried wheels (.whl/, see .library/device/README.md: tabulate, rich,
#      pytest-xdist, filelock, uv are the packages packcheck needs beyond torch / transformers / pytest);
#   2. runs the packcheck suite in bf16 on CUDA over the default architectures with sdpa, PyTorch's FA2 varlen
#      kernel (packcheck_flash_torch_varlen) and flash_attention_2 (skipped with its reason: no flash-attn);
#   3. runs `packcheck bench` for Llama-3.2-1B (the real config, random weights, full size) on the FLAN-like
#      and OrcaMath-like profiles, padded vs packed on the same attention path (torch varlen: a padded batch is
#      unpadded from its attention_mask inside attention, but every other layer computes on the padding), with
#      the instrumentation overhead measured in the same run.
#
# Writes reports/gpu-audit/ (matrix .md / .json) and reports/gpu-bench.md / .json; copies them to $OUT when set.
# Usage on the device: bash scripts/gpu_check.sh
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))
PY
start=$SECONDS
# 2. the suite in bf16 (one process: each model's cells in a forked child that initialises CUDA itself)
timeout 200 python3 -m pytest_packcheck.cli audit -q -n 0 --packcheck-device cuda --packcheck-dtypes bfloat16 \
  --packcheck-weights random --packcheck-timeout 60 \
  --packcheck-attn sdpa,packcheck_flash_torch_varlen,flash_attention_2 \
  --packcheck-report-dir reports/gpu-audit || echo "audit exited $?"
echo "audit: $((SECONDS - start)) s"
# 3. the payoff, on a ~1B Llama-class model
timeout 150 python3 -m pytest_packcheck.cli bench --model tests/data/hub-configs/meta-llama/Llama-3.2-1B --full-size \
  --device cuda --dtype bfloat16 --attn packcheck_flash_torch_varlen --profile flan --profile orcamath \
  --steps 10 --warmup 3 --batch-size 16 --max-length 2048 -o reports --name gpu-bench || echo "bench exited $?"
echo "total: $((SECONDS - start)) s"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/reports" && cp -r reports/gpu-audit reports/gpu-bench.* "$OUT/reports/" 2>/dev/null || true
fi
