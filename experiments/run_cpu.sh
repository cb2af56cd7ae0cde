#!/usr/bin/env bash
# The CPU runs behind the tables in experiments/README.md: about 35 minutes on a 2-core machine (the round-robin
# and sim runs took 3 min 41 s there on 2026-11-29, the two LLM-workload runs the rest).
# Usage: experiments/run_cpu.sh [--publish] [python]   (default python: .venv/bin/python)
#   without --publish: writes results/run_cpu/*.json and results/run_cpu/figures/*.png (git-ignored)
#   --publish: refreshes the tracked experiments/data/cpu/*.json and experiments/figures/*.png, on purpose
set -euo pipefail
cd "$(dirname "$0")/.."
PUBLISH=""
if [[ ${1:-} == --publish ]]; then
  PUBLISH=--publish
  shift
fi
PY=${1:-.venv/bin/python}
if [[ -n $PUBLISH ]]; then
  R=experiments/data/cpu F=experiments/figures
else
  R=results/run_cpu F=results/run_cpu/figures
fi
mkdir -p "$R" "$F"
# round robin, blocking, 2 models, max_loaded=1 (the paper's first table), max_tokens=1 as the paper's client
for tp_pp in "1 1" "2 1" "1 2"; do
  set -- $tp_pp
  $PY experiments/round_robin.py opt-125m -b -n 2 -t $1 -p $2 -r 12 --max-tokens 1 --out $R/rr_opt-125m_t$1_p$2.json \
    $PUBLISH
done
# simulated Gamma workloads: rates (1,1,1) with CV 0.25, 1, 4; then (10,1,1) CV 1 scaled to (3,0.3,0.3)
for c in 0 1 2; do
  $PY experiments/sim.py -c $c -d 10 --model opt-125m -b 8 --max-loaded 1 --seed 0 --out $R/sim_c${c}_opt-125m.json \
    $PUBLISH
done
$PY experiments/sim.py -c 4 -d 10 --model opt-125m -b 8 --max-loaded 1 --seed 0 --rate-scale 0.3 \
  --out $R/sim_c4_x0.3_opt-125m.json $PUBLISH
$PY experiments/plot.py --sim $R/sim_c*.json --rr $R/rr_*.json --out-dir $F $PUBLISH
# LLM workloads (about 30 minutes): request vs token level vs the multiplexing peer, then the sustainable rate;
# the second run's llm_sim_p99_vs_rate.png (4 probes, 6 s objective) replaces the first run's
$PY experiments/llm_sim.py --configs 0,1,4 --duration 40 --rate-scale 0.1 --bisect 1 --bisect-steps 3 \
  --bisect-duration 20 --bisect-hi 0.4 --out $R/llm_sim_opt-125m.json --plot-dir $F $PUBLISH
$PY experiments/llm_sim.py --configs "" --modes request,rtc,quantum,deadline --ttft-slo 6 --bisect 1 \
  --bisect-steps 4 --bisect-duration 20 --bisect-hi 1.0 --out $R/llm_sim_bisect_opt-125m.json --plot-dir $F $PUBLISH
# many engine groups, simulated (about 10 minutes): 100 models, the H200 opt-6.7b cost profile, every routing policy
$PY experiments/cluster_sim.py --ablations --out $R/cluster_sim_100m.json --plot-dir $F $PUBLISH
