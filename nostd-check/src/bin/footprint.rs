//! Host-side part of the footprint report: what does not depend on the target — MN metadata
//! bytes per chunk and per CN slot (they live in the MN's pool memory, from
//! `MnMemoryMap::len_for`) — printed as `key value` lines for `footprint.sh`.

use omw_core::geometry::PoolGeometry;
use omw_core::mn_memory::MnMemoryMap;

fn len(chunks: u32, cns: u32) -> u64 {
    let g = PoolGeometry::new(1 << 32, 4096, chunks, 2).expect("geometry");
    MnMemoryMap::len_for(&g, cns)
}

fn main() {
    // the free-queue ring is rounded to a power of two: measure over a range that is one
    let per_chunk = (len(2048, 1) - len(1024, 1)) as f64 / 1024.0;
    let per_cn = len(1024, 2) - len(1024, 1);
    println!("mn_meta_per_chunk {per_chunk}");
    println!("mn_meta_per_cn {per_cn}");
    println!("mn_meta_fixed_1024x1 {}", len(1024, 1));
    println!("max_cns {}", omw_core::mn::MAX_CNS);
}
