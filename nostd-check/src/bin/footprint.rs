//! Host-side part of the footprint report: what does not depend on the target — MN metadata
//! bytes per chunk and per CN slot (they live in the MN's pool memory, from
//! `MnMemoryMap::len_for`) — printed as `key value` lines for `footprint.sh`.

use omw_core::geometry::PoolGeometry;
use omw_core::wire::memory_map::MnMemoryMap;

fn len(chunks: u32, cns: u32) -> u64 {
    let g = PoolGeometry::new(1 << 32, 4096, chunks, 2).expect("geometry");
    MnMemoryMap::len_for(&g, cns)
}

fn main() {
    // one more chunk under the same (power-of-two) ring: the MWTable entry alone
    let table = len(1000, 1) - len(999, 1);
    let g = PoolGeometry::new(1 << 32, 4096, 1000, 2).expect("geometry");
    let slot = MnMemoryMap::required_alignment(&g, 1) / MnMemoryMap::ring_capacity(&g, 1) as u64;
    let per_cn = len(1000, 2) - len(1000, 1);
    println!("mn_table_per_chunk {table}");
    println!("mn_slot {slot}");
    println!("mn_meta_per_cn {per_cn}");
    println!("mn_meta_1024x8 {}", len(1024, 8));
    println!("max_cns {}", omw_core::mn::MAX_CNS);
}
