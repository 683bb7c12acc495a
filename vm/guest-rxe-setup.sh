#!/bin/bash
# guest-rxe-setup.sh — runs inside the VM (chrooted into the 9p host root; uses the host's iproute2 `ip`/`rdma`)
# and creates the soft-RoCE device rxe0.
#
#   guest-rxe-setup.sh dummy|nic [IP/PREFIX]
#     dummy  dummy netdev rxedummy0 with IP (default 192.0.2.1/24) -> rxe0. Raw verbs use GID index 1
#            (::ffff:IP); index 0 (link-local) does not reach RTR. rdma_cm works (on `lo` it does not).
#     nic    the VM's virtio-net NIC (two-VM mode) gets IP -> rxe0 on it.
# Exits non-zero if rxe0 does not come up ACTIVE with the IPv4-mapped GID.
set -u
mode=${1:-dummy}
ip_cidr=${2:-192.0.2.1/24}
ip link set lo up

case $mode in
  dummy)
    dev=rxedummy0
    ip link add "$dev" type dummy || exit 1 ;;
  nic)
    dev=
    for n in /sys/class/net/*; do
      [ -e "$n/device" ] && { dev=$(basename "$n"); break; }
    done
    [ -n "$dev" ] || { echo "no NIC found: $(ls /sys/class/net)"; exit 1; } ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
ip addr add "$ip_cidr" dev "$dev" || exit 1
ip link set "$dev" up || exit 1
rdma link add rxe0 type rxe netdev "$dev" || exit 1

# wait (<= 5 s) until the port is ACTIVE and the IPv4-mapped GID is in the table
ipv4=${ip_cidr%/*}
IFS=. read -r o1 o2 o3 o4 <<< "$ipv4"
mapped=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$o1" "$o2" "$o3" "$o4")
ok=
for _ in $(seq 1 50); do
  if grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null \
     && grep -qx "$mapped" /sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null; then ok=1; break; fi
  sleep 0.1
done
rdma link show
ip -br addr show dev "$dev"
for g in 0 1 2; do
  echo "gid[$g] $(cat /sys/class/infiniband/rxe0/ports/1/gids/$g 2>/dev/null)"
done
[ -n "$ok" ] || { echo "rxe0 not ACTIVE with GID $mapped"; exit 1; }
