#!/usr/bin/env bash
# The CPU runs behind the tables in experiments/README.md (about 35 minutes on a 2-core machine).
# Usage: experiments/run_cpu.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
R=experiments/data/cpu
mkdir -p "$R" experiments/figures
# round robin, blocking, 2 models, max_loaded=1 (the paper's first table), max_tokens=1 as the paper's client
for tp_pp in "1 1" "2 1" "1 2"; do
  set -- $tp_pp
  $PY experiments/round_robin.py opt-125m -b -n 2 -t $1 -p $2 -r 12 --max-tokens 1 --out $R/rr_opt-125m_t$1_p$2.json
done
# simulated Gamma workloads: rates (1,1,1) with CV 0.25, 1, 4; then (10,1,1) CV 1 scaled to (3,0.3,0.3)
for c in 0 1 2; do
  $PY experiments/sim.py -c $c -d 10 --model opt-125m -b 8 --max-loaded 1 --seed 0 --out $R/sim_c${c}_opt-125m.json
done
$PY experiments/sim.py -c 4 -d 10 --model opt-125m -b 8 --max-loaded 1 --seed 0 --rate-scale 0.3 \
  --out $R/sim_c4_x0.3_opt-125m.json
$PY experiments/plot.py --sim $R/sim_c*.json --rr $R/rr_*.json --out-dir experiments/figures
# LLM workloads (about 25 minutes): request vs token level vs the multiplexing peer, then the sustainable rate
$PY experiments/llm_sim.py --configs 0,1,4 --duration 40 --rate-scale 0.1 --bisect 1 --bisect-steps 3 \
  --bisect-duration 20 --bisect-hi 0.4 --out $R/llm_sim_opt-125m.json --plot-dir experiments/figures
$PY experiments/llm_sim.py --configs "" --modes request,rtc,quantum,deadline --ttft-slo 6 --bisect 1 \
  --bisect-steps 4 --bisect-duration 20 --bisect-hi 1.0 --out $R/llm_sim_bisect_opt-125m.json
