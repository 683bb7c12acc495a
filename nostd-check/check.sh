#!/usr/bin/env bash
# Build a freestanding x86_64 binary that links omw-core with its own panic handler and no
# std: if omw-core (or a dependency) pulled in std or alloc, this fails (duplicate panic_impl
# lang item, missing allocator, or unresolved std symbols). memcpy/memset come from libc's
# static archive, as a firmware image would take them from its own runtime.
set -euo pipefail
cd "$(dirname "$0")"
cargo rustc -q --release --bin omw-nostd-check -- \
  -C link-arg=-nostartfiles -C link-arg=-static -C relocation-model=static -C link-arg=-lc
bin=target/release/omw-nostd-check
# std would bring its own symbols; check none made it in
if nm "$bin" | grep -qE '_ZN3std|rust_begin_unwind.*std'; then
  echo "nostd-check: std symbols found in $bin" >&2; exit 1
fi
echo "nostd-check: omw-core links without std ($(stat -c %s "$bin") bytes)"
