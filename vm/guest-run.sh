#!/bin/bash
# guest-run.sh — runs inside the VM (chrooted into the 9p host root) after rxe0 is up; started by vm/init.
#
#   guest-run.sh CONF
# CONF is this VM's config (see vm/init); its directory D holds, written by the host:
#   argv  the program and its arguments, NUL-separated      env  NAME=value entries, NUL-separated
#   cwd   the working directory
# and receives: stdout, stderr (the program's), rc (its exit code), out/ (free for results; $OMW_RXE_VM_OUT).
# Keys read from CONF (two-VM mode, scripts/rxe-vm2):
#   WAIT_FILE=<path>   wait until it exists before starting the program (side B)
#   READY_FILE=<path>  side A's "ready" token: created by vm/signal-ready ($OMW_PEER_READY_CMD), by the
#                      port watch below, and in any case when the program exits (B never waits forever)
#   READY_PORT=<port>  side A: create READY_FILE as soon as something listens on this TCP or rdma_cm port
set -u
CONF=$1
D=$(dirname "$CONF")
WAIT_FILE='' READY_FILE='' READY_PORT='' VMDIR=''
while IFS= read -r line; do
  case ${line%%=*} in
    WAIT_FILE) WAIT_FILE=${line#*=} ;; READY_FILE) READY_FILE=${line#*=} ;;
    READY_PORT) READY_PORT=${line#*=} ;; VMDIR) VMDIR=${line#*=} ;;
  esac
done < "$CONF"

mapfile -d '' -t envs < "$D/env"
for e in "${envs[@]}"; do export "${e?}"; done
export PATH=${PATH:-/usr/bin:/bin}:/usr/local/sbin:/usr/sbin:/sbin
mapfile -d '' -t argv < "$D/argv"
mkdir -p "$D/out"
export OMW_RXE_VM=1 OMW_RXE_VM_OUT="$D/out" HOME=/tmp
ulimit -l unlimited 2>/dev/null
ulimit -c 0

cwd=$(cat "$D/cwd")
cd -- "$cwd" 2>/dev/null || { echo "rxe-vm: cannot cd to $cwd inside the VM, using /" >> "$D/stderr"; cd /; }

listening() { # TCP listener (ss) or rdma_cm LISTEN id on port $1
  ss -Hltn "sport = :$1" 2>/dev/null | grep -q . && return 0
  rdma res show cm_id 2>/dev/null | grep 'state LISTEN' | grep -qE ":$1( |$)"
}

if [ -n "$WAIT_FILE" ]; then
  while [ ! -e "$WAIT_FILE" ]; do sleep 0.1; done
fi
if [ -n "$READY_FILE" ]; then
  export OMW_PEER_READY_FILE=$READY_FILE OMW_PEER_READY_CMD=$VMDIR/signal-ready
fi

"${argv[@]}" > "$D/stdout" 2>> "$D/stderr" < /dev/null &
pid=$!
if [ -n "$READY_FILE" ] && [ -n "$READY_PORT" ]; then
  while kill -0 "$pid" 2>/dev/null; do
    if listening "$READY_PORT"; then : > "$READY_FILE"; break; fi
    sleep 0.1
  done
fi
wait "$pid"
rc=$?
[ -z "$READY_FILE" ] || [ -e "$READY_FILE" ] || : > "$READY_FILE"
echo "$rc" > "$D/rc.tmp"
mv "$D/rc.tmp" "$D/rc"
sync
