#!/usr/bin/env bash
# Build and RUN a freestanding x86_64 binary (no std, no alloc, own _start and panic handler)
# that provisions an MN with MnPlan, drives MnDriver and two CnDrivers over omw-core's test NIC
# and exits 0 only if every step of the scenario held (src/scenario.rs; otherwise the failing
# step's number). If omw-core (or a dependency) pulled in std or alloc the build fails
# (duplicate panic_impl lang item, missing allocator, unresolved std symbols). Then the same
# code is built for the bare-metal targets (thumbv7em-none-eabihf, aarch64-unknown-none).
set -euo pipefail
cd "$(dirname "$0")"
cargo rustc -q --release --bin omw-nostd-check -- \
  -C link-arg=-nostartfiles -C link-arg=-static -C relocation-model=static
bin=target/release/omw-nostd-check
# std would bring its own symbols; check none made it in
if nm "$bin" | grep -qE '_ZN3std|rust_begin_unwind.*std'; then
  echo "nostd-check: std symbols found in $bin" >&2; exit 1
fi
set +e
"$bin"; rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "nostd-check: the freestanding MN+CN scenario failed at step $rc (src/scenario.rs Step)" >&2; exit 1
fi
for t in thumbv7em-none-eabihf aarch64-unknown-none; do
  if rustup target list --installed 2>/dev/null | grep -q "^$t\$"; then
    cargo build -q --release --bin omw-nostd-check --target "$t"
  else
    echo "nostd-check: target $t not installed (scripts/setup adds it)" >&2; exit 1
  fi
done
echo "nostd-check: freestanding MN + 2 CNs on the test NIC ran and passed ($(stat -c %s "$bin") bytes); built for thumbv7em-none-eabihf and aarch64-unknown-none"
