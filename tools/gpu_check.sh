#!/usr/bin/env bash
# GPU check (issue 5), prepared for one run on the lent GPU machine (one H200, torch 2.11 CUDA, transformers
# 5.17, no flash-attn, no trl, no internet). Budget: under 6 minutes.
#
#   1. installs what is missing from carried wheels (.whl/, see .library/device/README.md; the device image
#      already has tabulate, rich, pytest-xdist, filelock and packaging);
#   2. runs the packcheck suite in bf16 on CUDA over the default architectures with sdpa, PyTorch's FA2 varlen
#      kernel (packcheck_flash_torch_varlen), flash_attention_2 and flash_attention_3 (each skipped with its
#      reason where the package is missing);
#   3. runs `packcheck bench` for Llama-3.2-1B (the real config, random weights, full size) on the FLAN-like
#      and OrcaMath-like profiles, padded vs packed on the same attention path (torch varlen: a padded batch is
#      unpadded from its attention_mask inside attention, but every other layer computes on the padding), with
#      the instrumentation overhead measured in the same run.
#
# Writes reports/gpu-audit/ (matrix .md / .json, journal) and reports/gpu-bench.md / .json; copies them to $OUT
# after each stage when OUT is set, with the whole log ($OUT/gpu_check.log). Worst case: ~20 s set-up + 180 s
# audit + 120 s bench (+ 20 s grace each) = 340 s, under the 6 minutes.
#
#   bash tools/gpu_check.sh              # on the device
#   bash tools/gpu_check.sh --rehearse   # on CPU: the same commands, small, with the torch varlen backend
#                                          # running through a CPU stand-in kernel (PACKCHECK_TORCH_VARLEN_STAND_IN);
#                                          # writes to ${REHEARSE_DIR:-/tmp/packcheck-gpu-rehearsal}, never reports/
set -euo pipefail
# PYTORCH_NVML_BASED_CUDA_CHECK: torch.cuda.is_available() asks NVML instead of the driver, which would "poison
# fork" (the audit forks one child per model after its controller checked the device)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
start=$SECONDS
if [ -n "${OUT:-}" ]; then  # the whole log comes back (the tool's output_tail keeps only its last 12,000 characters)
  mkdir -p "$OUT/reports/gpu-audit"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
  tee_pid=$!
fi
# copies what a stage wrote to $OUT at once: a later stage running out of time loses nothing (6 files in all)
save() {
  [ -n "${OUT:-}" ] || return 0
  # at most 8 files come back from $OUT: the matrix (md, json, html), the details, the bench (md, json), the log
  cp "$REPORTS"/gpu-audit/packcheck-matrix.* "$REPORTS"/gpu-audit/packcheck-details.md "$OUT/reports/gpu-audit/" 2>/dev/null || true
  cp "$REPORTS"/gpu-bench.* "$OUT/reports/" 2>/dev/null || true
}
if [ "${1:-}" = "--rehearse" ]; then
  export PACKCHECK_TORCH_VARLEN_STAND_IN=1
  DEVICE=cpu
  REPORTS=${REHEARSE_DIR:-/tmp/packcheck-gpu-rehearsal}
  AUDIT_SCOPE=(--packcheck-models arch:llama,arch:mistral,arch:qwen2,arch:gpt2)
  BENCH_SCOPE=(--model arch:llama --steps 2 --warmup 1 --batch-size 4 --max-length 1024)  # orcamath (~480) unclipped
  AUDIT_LIMIT=420  # 2 CPU cores, maybe shared: the rehearsal checks the plumbing, not the speed
  BENCH_LIMIT=300  # the CPU bench took 120+ s at load 10+ (CI, 2026-12-06): a rehearsal is not a speed test
else
  DEVICE=cuda
  REPORTS=reports
  AUDIT_SCOPE=()  # the embedded default audit
  AUDIT_LIMIT=180
  BENCH_LIMIT=120
  BENCH_SCOPE=(--model tests/data/hub-configs/meta-llama/Llama-3.2-1B --full-size --steps 10 --warmup 3 --batch-size 16
               --max-length 2048)
fi
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
DEVICE=$DEVICE python3 - <<'PY'
import os, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)
if os.environ["DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device"
    # in a child: the audit's controller must not initialise CUDA before it forks the per-model children
    import subprocess, sys
    subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"], check=False)
PY
mkdir -p "$REPORTS"
# 2. the suite in bf16 (one process: each model's cells in a forked child that initialises CUDA itself). At the
# limit timeout sends SIGINT: pytest stops and packcheck still writes the matrix, marked incomplete.
timeout -s INT -k 20 "$AUDIT_LIMIT" python3 -m pytest_packcheck.cli audit -q -n 0 "${AUDIT_SCOPE[@]}" --packcheck-device "$DEVICE" \
  --packcheck-dtypes bfloat16 --packcheck-weights random --packcheck-timeout 60 \
  --packcheck-attn sdpa,packcheck_flash_torch_varlen,flash_attention_2,flash_attention_3 \
  --packcheck-report-dir "$REPORTS/gpu-audit" || echo "audit exited $?"
echo "audit done at $((SECONDS - start)) s"
save
# 3. the payoff, on a ~1B Llama-class model (the files are rewritten after each profile)
timeout -s INT -k 20 "$BENCH_LIMIT" python3 -m pytest_packcheck.cli bench "${BENCH_SCOPE[@]}" --device "$DEVICE" --dtype bfloat16 \
  --attn packcheck_flash_torch_varlen --profile flan --profile orcamath -o "$REPORTS" --name gpu-bench || echo "bench exited $?"
echo "total: $((SECONDS - start)) s"
save
if [ -n "${tee_pid:-}" ]; then  # let tee write the last lines before the script (and the tool's copy) ends
  exec >&- 2>&-
  wait "$tee_pid" 2>/dev/null || true
fi
