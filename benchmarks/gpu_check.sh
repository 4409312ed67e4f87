#!/usr/bin/env bash
# The GPU check, run on a lent CUDA machine in one go: the gpu-marked tests, then
# benchmarks/gpu_speed.py on one shape with chain and an EAGLE-3 head, both with the synthetic
# acceptance a real CPU bench recorded (so rounds accept what the real pair and head accepted).
#   benchmarks/gpu_check.sh OUT [SHAPE]     (SHAPE: q15 or q7, default q7)
# The tests run in one process (-o addopts=: the device need not have pytest-xdist).
# KS and SKIP override gpu_speed's --ks and --skip. Each step has its own time limit, so that
# one hang leaves the others' output in OUT.
set -u
out=${1:?usage: gpu_check.sh OUT [SHAPE]}
shape=${2:-q7}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench=benchmarks/results/eagle-prompts-all-xeon-amx-2026-11-26/bench.json
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  date -u; } > "$out/env.txt" 2>&1
timeout "${GPU_TESTS_TIMEOUT:-200}" python3 -m pytest -o addopts= -m gpu tests/test_compiled.py tests/test_eagle.py -q \
  -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"; tail -3 "$out/gpu-tests.log"
timeout "${GPU_SPEED_TIMEOUT:-330}" python3 benchmarks/gpu_speed.py "$out/$shape.json" --shapes "$shape" \
  --modes inductor --ks "${KS:-1,2,3,4}" --skip "${SKIP:-hf-eager,costs,eager}" \
  --synthetic "$bench:chain" --eagle "$bench:eagle/k2@/work/heads/coder-1.5b" > "$out/$shape.log" 2>&1
echo "gpu_speed $shape: exit $?"; grep -v '^ \|^{\|^}' "$out/$shape.log" | tail -20
