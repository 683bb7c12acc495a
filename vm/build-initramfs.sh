#!/bin/bash
# build-initramfs.sh — tiny initramfs for the soft-RoCE VM: static busybox, vm/init, and the kernel modules for
# virtio/9p, rdma_rxe and the two-host NIC, in dependency order (kmod's `modprobe --show-depends`).
#
#   vm/build-initramfs.sh KROOT KVER OUT
#     KROOT  root dir holding lib/modules/KVER (the unpacked linux-image package; depmod'ed if needed)
#     OUT    output .cpio.gz (written atomically)
#
# Environment:
#   OMW_RXE_VM_MODULES  modules to include (default below). crc32_generic is REQUIRED: without it
#                       `rdma link add` fails with "No such file or directory" (rxe needs the crc32 shash and
#                       busybox cannot load it on demand).
#   OMW_RXE_VM_BUSYBOX  static busybox to use (default /bin/busybox from busybox-static)
set -euo pipefail
[ $# = 3 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
KROOT=$1 KVER=$2 OUT=$3
VMDIR=$(cd "$(dirname "$0")" && pwd)
MODULES=${OMW_RXE_VM_MODULES:-virtio_pci virtio_mmio 9pnet_virtio 9p crc32_generic rdma_rxe ib_uverbs rdma_ucm dummy veth virtio_net failover net_failover}
BUSYBOX=${OMW_RXE_VM_BUSYBOX:-/bin/busybox}
MODDIR=$KROOT/lib/modules/$KVER

[ -d "$MODDIR" ] || { echo "no $MODDIR" >&2; exit 1; }
[ -x "$BUSYBOX" ] || { echo "no $BUSYBOX (install busybox-static)" >&2; exit 1; }
if ldd "$BUSYBOX" >/dev/null 2>&1; then echo "$BUSYBOX is not static (install busybox-static)" >&2; exit 1; fi
[ -f "$MODDIR/modules.dep" ] || depmod -b "$KROOT" "$KVER"

STAGE=$(mktemp -d "$(dirname "$OUT")/.initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,sbin,proc,sys,dev,host,scratch,tmp,run,etc,"lib/modules/$KVER"}
cp "$BUSYBOX" "$STAGE/bin/busybox"
for a in $("$STAGE/bin/busybox" --list); do
  [ "$a" = busybox ] || ln -sf busybox "$STAGE/bin/$a"   # a "busybox" link would make init loop
done
ln -sf ../bin/busybox "$STAGE/sbin/modprobe"   # the kernel's request_module() helper

: > "$STAGE/modules.load"
for m in $MODULES; do
  modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  rel=${ko#"$MODDIR"/}
  mkdir -p "$STAGE/lib/modules/$KVER/$(dirname "$rel")"
  cp "$ko" "$STAGE/lib/modules/$KVER/$rel"
  echo "$rel" >> "$STAGE/modules.load"
done
for f in modules.builtin modules.builtin.modinfo modules.order; do
  [ -f "$MODDIR/$f" ] && cp "$MODDIR/$f" "$STAGE/lib/modules/$KVER/"
done
depmod -b "$STAGE" "$KVER"
install -m 0755 "$VMDIR/init" "$STAGE/init"
(cd "$STAGE" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "built $OUT ($(du -h "$OUT" | cut -f1), $(wc -l < "$STAGE/modules.load") modules)"
