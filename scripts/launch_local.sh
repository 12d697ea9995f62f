#!/usr/bin/env bash
# N training processes on this machine, talking over 127.0.0.1: a multi-host run without the hosts.
#
#   scripts/launch_local.sh N CONFIG [--config.KEY=VALUE ...]
#   scripts/launch_local.sh 2 configs/tiny_llama.py --config.mesh.dcn.data=2 --config.mesh.ici.fsdp=4
#
# Each process gets DEVICES/N fake CPU devices (DEVICES defaults to 8), so the mesh spans
# N "hosts" of DEVICES/N devices each: mesh.dcn.* must multiply to N, mesh.ici.* to DEVICES/N.
# Process 0 prints and writes the run directory; every process's output goes to
# LOG_DIR/process_<i>.log (default: a fresh temporary directory) and process 0's also to the terminal.
# Environment: DEVICES, PORT (default: a free one), LOG_DIR, PYTHON (default: python).
# Exit status: the first non-zero status of any process, else 0. If one process fails, the others
# are stopped too.
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N CONFIG.py[:VARIANT] [--config.GROUP.KEY=VALUE ...]" >&2
  exit 2
fi
n=$1
shift
devices=${DEVICES:-8}
if (( devices % n )); then
  echo "error: DEVICES=$devices fake CPU devices do not split evenly over $n processes" >&2
  exit 2
fi
python=${PYTHON:-python}
cd "$(dirname "$0")/.."
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${LOG_DIR:-$(mktemp -d -t launch_local.XXXXXX)}
mkdir -p "$log_dir"

pids=()
# SIGTERM to the launcher goes on to every process (stop at the next step, as on preemption);
# Ctrl-C reaches them all anyway (they share the terminal's process group).
forward() {
  for pid in "${pids[@]}"; do kill "-$1" "$pid" 2>/dev/null || true; done
}
trap 'forward TERM' TERM

for ((i = 0; i < n; i++)); do
  log="$log_dir/process_$i.log"
  # The XLA flag replaces any inherited device count: the last occurrence of a flag wins.
  env JAX_PLATFORMS=cpu \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$((devices / n))" \
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i" \
    PYTHONUNBUFFERED=1 \
    "$python" -m maxtext_rocm.train "$@" >"$log" 2>&1 &
  pids+=($!)
done
echo "launched $n processes (coordinator 127.0.0.1:$port, $((devices / n)) CPU devices each); logs in $log_dir" >&2
tail -n +1 -f "$log_dir/process_0.log" --pid="${pids[0]}" &
tailer=$!

# Wait for all; as soon as one fails, stop the rest (the heartbeat timeout would too, later).
status=0
running=("${pids[@]}")
while (( ${#running[@]} > 0 )); do
  set +e
  wait -n -p done_pid "${running[@]}"
  rc=$?
  set -e
  still=()
  for pid in "${running[@]}"; do [[ "$pid" == "$done_pid" ]] || still+=("$pid"); done
  running=("${still[@]}")
  if (( rc != 0 && status == 0 )); then
    status=$rc
    for ((i = 0; i < n; i++)); do
      if [[ "${pids[$i]}" == "$done_pid" ]]; then
        echo "process $i exited with status $rc; stopping the others (its log: $log_dir/process_$i.log)" >&2
        tail -n 5 "$log_dir/process_$i.log" >&2 || true
      fi
    done
    forward KILL  # the survivors cannot finish without it
  fi
done
wait "$tailer" 2>/dev/null || true
exit "$status"
