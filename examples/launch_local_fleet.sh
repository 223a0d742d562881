#!/usr/bin/env bash
# Start K rpc-reading-worker servers on this host with a freshly generated shared key,
# print the RPCReadingService line a trainer should use, and stop every worker on
# Ctrl-C (or SIGTERM).
#
#   examples/launch_local_fleet.sh [-n K] [--host HOST] [--port-base PORT]
#                                  [--store HOST:PORT [--job NAME]] [--dir DIR]
#
#   -n K              number of worker servers (default 2)
#   --host HOST       address to listen on (default 127.0.0.1; 0.0.0.0 serves other hosts too)
#   --port-base PORT  worker i listens on PORT+i (default 0: free ports picked by the OS)
#   --store HOST:PORT also register every worker in this TCPStore, under --job NAME
#   --dir DIR         where the key, hostfile and logs go (default: a new private temp dir,
#                     removed on exit)
#
# The worker command is $RPC_READING_WORKER if set, else rpc-reading-worker if on PATH,
# else "$PYTHON -m rpc_reading_service.worker" (PYTHON defaults to python3).
set -euo pipefail

# A shell started with SIGINT ignored (a background job of another script, some CI runners)
# cannot trap it, and Ctrl-C would not stop the workers: start again with SIGINT at its
# default where env can (GNU coreutils), else say how to stop them.
if [ -n "$(trap -p INT)" ]; then
    if [ -z "${_RRS_FLEET_SIGINT:-}" ] && env --default-signal=INT true 2>/dev/null; then
        _RRS_FLEET_SIGINT=1 exec env --default-signal=INT "$BASH" "$0" "$@"
    fi
    echo "launch_local_fleet.sh: SIGINT is ignored in this shell (started in the background?), so Ctrl-C" \
        "cannot stop it: stop it with kill -TERM $$" >&2
fi
unset _RRS_FLEET_SIGINT

count=2
host=127.0.0.1
port_base=0
store=""
job=default
dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--workers) count="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        --port-base) port_base="$2"; shift 2 ;;
        --store) store="$2"; shift 2 ;;
        --job) job="$2"; shift 2 ;;
        --dir) dir="$2"; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "launch_local_fleet.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -n "${RPC_READING_WORKER:-}" ]; then
    read -r -a worker_cmd <<<"$RPC_READING_WORKER"
elif command -v rpc-reading-worker >/dev/null 2>&1; then
    worker_cmd=(rpc-reading-worker)
else
    python="${PYTHON:-python3}"
    venv_hint=".venv"
    here="$(cd "$(dirname "$0")/.." && pwd)"
    [ -x "$here/.venv/bin/python" ] && venv_hint="$here/.venv"
    # find_spec imports nothing, so this check takes milliseconds (not torch's seconds).
    check='import importlib.util as u; print(" ".join(m for m in ("rpc_reading_service", "torch", "torchdata", "cloudpickle") if u.find_spec(m) is None))'
    problem=""
    if ! command -v "$python" >/dev/null 2>&1; then
        problem="there is no $python"
    else
        missing="$("$python" -c "$check" 2>&1 || echo "(it failed to start)")"
        [ -n "$missing" ] && problem="$python cannot import $missing"
    fi
    if [ -n "$problem" ]; then
        echo "launch_local_fleet.sh: rpc-reading-worker is not on PATH, and $problem." >&2
        echo "Activate the project's virtualenv (source $venv_hint/bin/activate; 'make demo' creates it), or set" >&2
        echo "PYTHON=/path/to/venv/bin/python (or RPC_READING_WORKER='command ...') and run this again." >&2
        exit 2
    fi
    worker_cmd=("$python" -m rpc_reading_service.worker)
fi

own_dir=0
if [ -z "$dir" ]; then
    dir="$(mktemp -d "${TMPDIR:-/tmp}/rrs-fleet.XXXXXX")"  # mode 0700
    own_dir=1
fi
mkdir -p "$dir"

pids=()
cleanup() {
    trap - INT TERM EXIT
    if [ ${#pids[@]} -gt 0 ]; then
        echo "stopping ${#pids[@]} workers" >&2
        # SIGINT stops a worker at once (SIGTERM would drain it: its sessions move to other servers first).
        kill -INT "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 50); do  # up to 5 s for a clean stop (sessions reaped, store entries deleted)
            alive=0
            for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [ "$alive" = 0 ] && break
            sleep 0.1
        done
        kill -KILL "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
    if [ "$own_dir" = 1 ]; then rm -rf "$dir"; fi
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

key_file="$dir/key"
(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$key_file")

store_args=()
[ -n "$store" ] && store_args=(--store "$store" --job "$job")

for i in $(seq 0 $((count - 1))); do
    port=0
    [ "$port_base" != 0 ] && port=$((port_base + i))
    "${worker_cmd[@]}" --host "$host" --port "$port" --auth-key-file "$key_file" "${store_args[@]}" \
        >"$dir/worker-$i.out" 2>"$dir/worker-$i.log" </dev/null &
    pids+=($!)
done

# Each worker prints "listening on HOST:PORT" once it is ready.
addresses=()
for i in $(seq 0 $((count - 1))); do
    for _ in $(seq 600); do  # up to 60 s per worker (importing torch takes a few)
        grep -q '^listening on ' "$dir/worker-$i.out" 2>/dev/null && break
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "worker $i exited before listening; its log:" >&2
            cat "$dir/worker-$i.log" >&2
            exit 1
        fi
        sleep 0.1
    done
    line="$(grep -m1 '^listening on ' "$dir/worker-$i.out" || true)"
    [ -n "$line" ] || { echo "worker $i did not start within 60 s; see $dir/worker-$i.log" >&2; exit 1; }
    address="${line#listening on }"
    case "$address" in  # a wildcard address is not dialable: print this host's name instead
        0.0.0.0:*|\[::\]:*) address="$(hostname):${address##*:}" ;;
    esac
    addresses+=("$address")
done
printf '%s\n' "${addresses[@]}" >"$dir/workers.txt"

quoted="$(printf '"%s", ' "${addresses[@]}")"
echo "started $count workers: ${addresses[*]}"
echo "key file: $key_file"
echo "hostfile: $dir/workers.txt"
echo "logs: $dir/worker-*.log"
echo
echo "Use them from a trainer:"
echo
echo "RPCReadingService(workers=[${quoted%, }], auth_key=open(\"$key_file\").read().strip())"
echo "RPCReadingService(workers=Hostfile(\"$dir/workers.txt\"), auth_key=open(\"$key_file\").read().strip())"
if [ -n "$store" ]; then
    echo "RPCReadingService(workers=StoreDiscovery(\"$store\", job=\"$job\", min_workers=$count), auth_key=open(\"$key_file\").read().strip())"
fi
echo
echo "Press Ctrl-C to stop them."

# Wait until interrupted, or until every worker has exited by itself.
wait "${pids[@]}" || true
echo "all workers exited" >&2
