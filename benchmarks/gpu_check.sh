#!/usr/bin/env bash
# GPU check of model swapping, for one NVIDIA GPU (sized for an H200: ~141 GB device, 128 GB host).
#
# Steps (each under `timeout`; the whole run stays under GPU_CHECK_BUDGET_S, default 590 s):
#   1. nvidia-smi -L, torch / CUDA / transformers versions          -> one JSON line
#   2. host<->device copy_ bandwidth of 4 GiB, pageable and pinned  -> one JSON line
#   3. python -m benchmarks.gpu_correctness: tiny OPT and Llama on the GPU equal transformers on the CPU
#   4. benchmarks/swap.py --model opt-6.7b --dtype float16 --tp 1 --repeats 3
#      (~13.3 GB of fp16 weights; fast and paper engines in one run) -> one JSON line
#   5. experiments/llm_sim.py: 3 x ${LLM_SIM_MODEL:-opt-1.3b}, one resident, Gamma config 1, LLM-like outputs;
#      request level vs token level (each policy) vs the Ray-Serve-style multiplexing loader -> one JSON line
#   6. the disk tier: benchmarks/tiers.py --disk-rows for opt-1.3b, then opt-6.7b (2 fp16 checkpoints each,
#      written once to ${TIERS_DIR:-/tmp/computron-tiers}: 5.3 GB and 26.6 GB), tp=1, every load from disk,
#      each twice: page cache dropped (posix_fadvise, no root needed) and warm; each load paired with a bare
#      process reading the same bytes right before and after it -> one JSON line per model
#   7. decode: benchmarks/decode_step.py --device ${DECODE_DEVICE:-cuda} --compile on: a decode step eager and
#      compiled (CUDA graphs, EngineConfig.compile_decode), both KV layouts, side by side -> one JSON line
#      (DECODE_MODEL, default smollm2; DECODE_BATCH 8, DECODE_STEPS 32: the CPU-sized test runs llama-tiny)
#   8. peer: benchmarks/peer_vllm.py --device cuda --no-install (against PEER_VLLM_URL where given; without
#      a vLLM environment or server it prints {"skipped": ...}) -> one JSON line
# Every JSON line is appended to ${OUT:-.}/gpu_results.jsonl; swap.py's progress log goes to
# ${OUT:-.}/swap_opt-6.7b.log (its per-engine lines survive a timeout).
# STEPS (default "devices versions copy correctness swap llm_sim disk decode peer") picks steps, e.g.
#   STEPS=disk bash benchmarks/gpu_check.sh      # the disk-tier rows alone (about 5 minutes)
# TIERS_MODELS (default "opt-1.3b opt-6.7b") the disk-tier rows' model shapes.
#
# Python steps run as modules (-m benchmarks.NAME), from the repository root.
# Run from the repository root, nothing to install (torch + transformers preinstalled, no network):
#   bash benchmarks/gpu_check.sh
# A step that fails or times out is reported and the next one still runs; the exit status is 1
# if any step failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-.}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.jsonl"
SWAP_LOG="$OUT_DIR/swap_opt-6.7b.log"
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-590}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

STEPS=" ${STEPS:-devices versions copy correctness swap llm_sim disk decode peer} "
TIERS_DIR="${TIERS_DIR:-/tmp/computron-tiers}"

failed=()
step() { echo "== $(date +%T) [${SECONDS}s] $*" >&2; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
# seconds left for a step: its own cap, or less when the total budget is nearly spent
left() {
    local cap=$1 rest=$((BUDGET_S - SECONDS - 5))
    if ((rest < cap)); then cap=$rest; fi
    if ((cap < 1)); then cap=1; fi
    echo "$cap"
}

if want devices; then
step "devices"
if ! timeout "$(left 20)" nvidia-smi -L; then failed+=("nvidia-smi"); fi
timeout "$(left 20)" nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv >&2 || true
fi

if want versions; then
step "versions"
if ! timeout "$(left 60)" "$PY" - <<'EOF' | tee -a "$RESULTS"
import json, os, platform
import torch, transformers
print(json.dumps({
    "check": "versions", "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "transformers": transformers.__version__,
    "python": platform.python_version(), "cuda_available": torch.cuda.is_available(),
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "cpus": os.cpu_count(),
}))
EOF
then failed+=("versions"); fi
fi

if want copy; then
step "host<->device copy_ bandwidth, 4 GiB"
if ! timeout "$(left 90)" "$PY" - <<'EOF' | tee -a "$RESULTS"
import json, statistics, time
import torch

n = 4 * 2**30
dev = torch.device("cuda")


def gbps(fn, reps=5):
    fn()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(n / statistics.median(times) / 1e9, 2)


res = {"check": "copy_bandwidth", "bytes": n, "torch": torch.__version__,
       "device": torch.cuda.get_device_name(0)}
d = torch.empty(n, dtype=torch.uint8, device=dev).fill_(0)
pageable = torch.empty(n, dtype=torch.uint8).fill_(1)  # touched: no page faults in the copies
res["h2d_pageable_gbps"] = gbps(lambda: d.copy_(pageable))
res["d2h_pageable_gbps"] = gbps(lambda: pageable.copy_(d))
t0 = time.perf_counter()
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
res["pin_alloc_s"] = round(time.perf_counter() - t0, 3)
pinned.fill_(1)
res["h2d_pinned_gbps"] = gbps(lambda: d.copy_(pinned, non_blocking=True))
res["d2h_pinned_gbps"] = gbps(lambda: pinned.copy_(d, non_blocking=True))
# the paper's offload: device -> a fresh pageable host tensor each time (allocation + page faults)
res["d2h_fresh_pageable_gbps"] = gbps(lambda: d.to("cpu"), reps=3)
print(json.dumps(res))
EOF
then failed+=("copy_bandwidth"); fi
fi

if want correctness; then
step "correctness on the GPU: tiny OPT and Llama through the engine vs transformers"
if ! timeout -k 10 "$(left 90)" "$PY" -m benchmarks.gpu_correctness | tee -a "$RESULTS"; then
    failed+=("correctness")
fi
fi

if want swap; then
step "swap benchmark: opt-6.7b float16, tp=1, repeats=3 (log: $SWAP_LOG)"
if ! timeout -k 20 "$(left 330)" "$PY" -m benchmarks.swap --model opt-6.7b --dtype float16 --tp 1 --repeats 3 \
        2> >(tee -a "$SWAP_LOG" >&2) | tee -a "$RESULTS"; then
    failed+=("swap")
    sleep 1  # let the log's tee catch up
    echo "swap step failed or timed out; per-engine results so far:" >&2
    grep ' engine: ' "$SWAP_LOG" >&2 || true
fi
fi

if want llm_sim; then
step "LLM workload: 3 x ${LLM_SIM_MODEL:-opt-1.3b}, request vs token level vs a multiplexing loader"
if ! timeout -k 20 "$(left 200)" "$PY" experiments/llm_sim.py --model "${LLM_SIM_MODEL:-opt-1.3b}" --configs 1 \
        --max-loaded 1 --duration 20 --rate-scale 1 --modes request,rtc,quantum,deadline,peer \
        --out "$OUT_DIR/llm_sim.json" | tee -a "$RESULTS"; then
    failed+=("llm_sim")
fi
fi

if want disk; then
for model in ${TIERS_MODELS:-opt-1.3b opt-6.7b}; do
    step "disk tier: 2 x $model fp16 from disk, cold and warm, each paired with a bare read ($TIERS_DIR)"
    if ! timeout -k 20 "$(left 400)" "$PY" -m benchmarks.tiers --disk-rows --model "$model" --vocab 0 \
            --models 2 --tp 1 --rounds 1 --dir "$TIERS_DIR" | tee -a "$RESULTS"; then
        failed+=("disk_$model")
    fi
done
fi

if want decode; then
step "decode step on ${DECODE_DEVICE:-cuda}: eager vs compiled (CUDA graphs), dynamic and paged KV"
if ! timeout -k 10 "$(left 240)" "$PY" -m benchmarks.decode_step --device "${DECODE_DEVICE:-cuda}" --compile on \
        --model "${DECODE_MODEL:-smollm2}" --batch "${DECODE_BATCH:-8}" --steps "${DECODE_STEPS:-32}" \
        | tee -a "$RESULTS"; then
    failed+=("decode")
fi
fi

if want peer; then
step "peer: computron on cuda against vLLM (${PEER_VLLM_URL:-its own CPU build, if installed})"
if ! timeout -k 20 "$(left 300)" "$PY" benchmarks/peer_vllm.py --device cuda --no-install \
        ${PEER_VLLM_URL:+--vllm-url "$PEER_VLLM_URL"} | tee -a "$RESULTS"; then
    failed+=("peer")
fi
fi

step "done in ${SECONDS}s; results in $RESULTS"
if ((${#failed[@]})); then
    echo "failed steps: ${failed[*]}" >&2
    exit 1
fi
