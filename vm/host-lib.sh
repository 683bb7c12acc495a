# shellcheck shell=bash
# Host-side helpers shared by scripts/rxe-vm-setup, scripts/rxe-vm and scripts/rxe-vm2 (sourced, not run).
#
# Environment (all optional):
#   OMW_RXE_VM_DIR   cache dir (default: <repo>/target/rxe-vm)
#   OMW_KVER         kernel version to use (default: what rxe-vm-setup last prepared, recorded in
#                    $OMW_RXE_VM_DIR/current-kver; rxe-vm-setup itself resolves it from linux-image-amd64)
#   OMW_RXE_VM_QEMU  qemu-system-x86_64 binary (default: the one unpacked into the cache)

RXE_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RXE_VMDIR=$RXE_REPO/vm
RXE_CACHE=${OMW_RXE_VM_DIR:-$RXE_REPO/target/rxe-vm}
RXE_QEMU_ROOT=$RXE_CACHE/qemu/root
RXE_PROG=${RXE_PROG:-$(basename "$0")}

rxe_die() { echo "$RXE_PROG: $*" >&2; exit "${RXE_DIE_RC:-1}"; }
rxe_log() { [ -n "${OMW_RXE_VM_QUIET:-}" ] || echo "$RXE_PROG: $*" >&2; }
rxe_now() { date +%s.%N; }
rxe_elapsed() { awk -v a="$1" -v b="$(rxe_now)" 'BEGIN{printf "%.1f", b-a}'; }

# Files that go into the initramfs: if any is newer than the initramfs, it is rebuilt.
RXE_INITRAMFS_INPUTS=("$RXE_VMDIR/init" "$RXE_VMDIR/build-initramfs.sh")

# Sets RXE_KVER, RXE_KDIR, RXE_VMLINUX, RXE_INITRD, RXE_QEMU for an already prepared cache.
rxe_paths() {
  RXE_KVER=${1:-${OMW_KVER:-}}
  if [ -z "$RXE_KVER" ] && [ -f "$RXE_CACHE/current-kver" ]; then RXE_KVER=$(cat "$RXE_CACHE/current-kver"); fi
  RXE_KDIR=$RXE_CACHE/kernel/${RXE_KVER:-unknown}
  RXE_VMLINUX=$RXE_KDIR/vmlinux
  RXE_INITRD=$RXE_KDIR/initramfs.cpio.gz
  RXE_QEMU=${OMW_RXE_VM_QEMU:-$RXE_QEMU_ROOT/usr/bin/qemu-system-x86_64}
}

# True if the cache holds everything needed to boot (and the initramfs is not older than its inputs).
rxe_cache_ok() {
  rxe_paths "$@"
  [ -n "$RXE_KVER" ] && [ -x "$RXE_QEMU" ] && [ -s "$RXE_VMLINUX" ] && [ -s "$RXE_INITRD" ] || return 1
  local f
  for f in "${RXE_INITRAMFS_INPUTS[@]}"; do [ "$f" -nt "$RXE_INITRD" ] && return 1; done
  return 0
}

# Make sure the cache is ready, running rxe-vm-setup if not. Then sets the RXE_* paths.
rxe_ensure_setup() {
  if ! rxe_cache_ok ""; then
    rxe_log "VM cache missing or stale in $RXE_CACHE, running rxe-vm-setup"
    "$RXE_REPO/scripts/rxe-vm-setup" >&2 || { RXE_DIE_RC=125 rxe_die "rxe-vm-setup failed"; }
    rxe_cache_ok "" || { RXE_DIE_RC=125 rxe_die "VM cache still incomplete after rxe-vm-setup (kernel ${RXE_KVER:-?})"; }
  fi
}

# qemu option values: a comma must be doubled.
rxe_qesc() { printf '%s' "${1//,/,,}"; }

# Common qemu arguments; appends to the array named by $1. Args: array-name mem cpus
rxe_qemu_base() {
  local -n _a=$1
  # shellcheck disable=SC2054  # commas belong to qemu option values
  _a+=("$RXE_QEMU" -L "$RXE_QEMU_ROOT/usr/share/qemu" -L "$RXE_QEMU_ROOT/usr/share/seabios" -accel tcg -cpu max -m "$2" -smp "$3"
       -nodefaults -no-reboot -display none -serial stdio -monitor none -no-user-config
       -kernel "$RXE_VMLINUX" -initrd "$RXE_INITRD"
       -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap)
}

# Adds a writable 9p share. Args: array-name tag host-dir
rxe_qemu_share() {
  # shellcheck disable=SC2178
  local -n _a=$1
  _a+=(-virtfs "local,path=$(rxe_qesc "$3"),mount_tag=$2,security_model=none,multidevs=remap")
}

# Environment passed into the guest: NUL-separated NAME=value list written to file $1.
# Passed: PATH, LANG, LC_*, TZ, RUST_*, CARGO_*, OMW_*, PROPTEST_*, plus names listed in $OMW_RXE_VM_ENV.
rxe_write_env() {
  local out=$1 name
  local extra=" ${OMW_RXE_VM_ENV:-} "
  : > "$out"
  while IFS= read -r name; do
    case $name in
      PATH|LANG|LC_*|TZ|RUST_*|CARGO_*|OMW_*|PROPTEST_*) ;;
      *) [[ $extra == *" $name "* ]] || continue ;;
    esac
    printf '%s=%s\0' "$name" "${!name}" >> "$out"
  done < <(compgen -e)
}

# Host cwd if it is visible in the guest, else /. The guest's /tmp is its own tmpfs, but the host's
# /tmp directories are bound back into it read-only (vm/init), so a checkout under /tmp works.
rxe_guest_cwd() {
  local d; d=$(pwd -P)
  case $d/ in
    /run/*|/proc/*|/sys/*|/dev/*) echo "$RXE_PROG: warning: cwd $d is not visible in the VM, using /" >&2; echo / ;;
    *) echo "$d" ;;
  esac
}

# Validate a --rw directory and print its physical path.
rxe_rw_dir() {
  [ -d "$1" ] || rxe_die "--rw $1: not a directory"
  (cd "$1" && pwd -P)
}

# Print the last lines of a console log to stderr.
rxe_show_console() {
  local log=$1 n=${2:-40}
  [ -f "$log" ] || return 0
  echo "$RXE_PROG: ---- last $n lines of the VM console ($log) ----" >&2
  tail -n "$n" "$log" | sed 's/\r$//' >&2
  echo "$RXE_PROG: ----" >&2
}

# Two free UDP ports on 127.0.0.1 (for the dgram netdev); prints "P1 P2".
rxe_free_udp_ports() {
  /usr/bin/python3 - <<'EOF'
import socket
ss = []
for _ in range(2):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    ss.append(s)
print(" ".join(str(s.getsockname()[1]) for s in ss))
EOF
}
