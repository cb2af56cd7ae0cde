#!/usr/bin/env bash
# Launch examples/opt/serve_opt.py on several processes or hosts.
#
#   examples/opt/launch.sh colossalai 4 --tp 2 --pp 2           # one node, 4 processes, via `colossalai run`
#   examples/opt/launch.sh torchrun 4 --tp 2 --pp 2             # the same via torchrun
#   HOSTFILE=examples/opt/hostfile.example MASTER=node1 \
#     examples/opt/launch.sh colossalai 4 --tp 4 --pp 2         # 2 hosts x 4 processes (ssh to each host)
#   NNODES=2 NODE_RANK=0 MASTER=node1 examples/opt/launch.sh torchrun 4 --tp 4 --pp 2   # run on every node
#
# Extra arguments go to serve_opt.py. Every host needs this repository at the same path and its .venv
# (`make demo` or `make test` creates it); this script puts .venv/bin first on PATH, no activation needed.
set -euo pipefail
launcher=${1:?usage: launch.sh colossalai|torchrun NPROC_PER_NODE [serve_opt.py args]}
nproc=${2:?usage: launch.sh colossalai|torchrun NPROC_PER_NODE [serve_opt.py args]}
shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
venv_bin="$here/.venv/bin"
# the venv first on PATH: `colossalai run` starts `torchrun` from PATH on every host
export PATH="$venv_bin:$PATH"
port=${MASTER_PORT:-29500}
case "$launcher" in
  colossalai)
    hosts=()
    if [[ -n "${HOSTFILE:-}" ]]; then hosts=(--hostfile "$HOSTFILE" --master_addr "${MASTER:?set MASTER}"); fi
    exec "$venv_bin/colossalai" run --nproc_per_node "$nproc" --master_port "$port" "${hosts[@]}" \
      "$here/examples/opt/serve_opt.py" "$@" ;;
  torchrun)
    exec "$venv_bin/torchrun" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$nproc" \
      --master_addr "${MASTER:-127.0.0.1}" --master_port "$port" "$here/examples/opt/serve_opt.py" "$@" ;;
  *) echo "unknown launcher $launcher: use colossalai or torchrun" >&2; exit 2 ;;
esac
