#!/usr/bin/env bash
# The footprint a firmware author asks for, measured on the nostd-check binary (an MN with
# MnDriver + host engine + MnPlan provisioning, two CnDrivers and the test NIC, all linked):
# code size (.text + .rodata of the linked image, llvm-size -A) per target, static RAM of the
# core's state types on each target (symbol sizes of OMW_FOOTPRINT_* statics, nm -S: size_of
# on that target), and MN metadata bytes per chunk and per CN slot (MnMemoryMap::len_for; that
# metadata lives in the MN's pool memory, not in static RAM). Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")"
size_tool=$(command -v llvm-size || command -v size)
cargo rustc -q --release --bin omw-nostd-check -- \
  -C link-arg=-nostartfiles -C link-arg=-static -C relocation-model=static
targets=(x86_64-unknown-linux-gnu thumbv7em-none-eabihf aarch64-unknown-none)
declare -A bin
bin[x86_64-unknown-linux-gnu]=target/release/omw-nostd-check
for t in thumbv7em-none-eabihf aarch64-unknown-none; do
  cargo build -q --release --bin omw-nostd-check --target "$t"
  bin[$t]=target/$t/release/omw-nostd-check
done
sect() { "$size_tool" -A "$1" | awk -v s="$2" '$1 == s { print $2 }'; }
sym() { local h; h=$(nm -S --defined-only "$1" | awk -v s="$2" '$4 == s { print $2 }'); echo $((16#$h)); }
echo "| target | .text | .rodata | code (.text+.rodata) | MnDriver | MemoryNode | host-engine Lap | CnDriver<_,16> | Client<16> | TestNic (scenario) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for t in "${targets[@]}"; do
  b=${bin[$t]}
  tx=$(sect "$b" .text); ro=$(sect "$b" .rodata); ro=${ro:-0}
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$t" "$tx" "$ro" $((tx + ro)) \
    "$(sym "$b" OMW_FOOTPRINT_MN_DRIVER)" "$(sym "$b" OMW_FOOTPRINT_MEMORY_NODE)" "$(sym "$b" OMW_FOOTPRINT_LAP)" \
    "$(sym "$b" OMW_FOOTPRINT_CN_DRIVER)" "$(sym "$b" OMW_FOOTPRINT_CLIENT)" "$(sym "$b" OMW_FOOTPRINT_TEST_NIC)"
done
echo
cargo run -q --release --bin footprint | while read -r k v; do
  case $k in
    mn_table_per_chunk) echo "MN metadata per chunk, in MN pool memory: MWTable entry $v bytes" ;;
    mn_slot) echo "  + one free-queue slot of $v bytes (the ring holds a power of two >= chunks + CNs + 1 slots)" ;;
    mn_meta_per_cn) echo "MN metadata per CN slot (chain scratch, request and send buffers, in MN pool memory): $v bytes" ;;
    mn_meta_1024x8) echo "MN metadata for 1024 chunks and 8 CN slots (MnMemoryMap::len_for): $v bytes" ;;
    max_cns) echo "MnDriver/MemoryNode are sized for MAX_CNS = $v CN slots (static RAM per CN slot = their size / $v)" ;;
  esac
done
