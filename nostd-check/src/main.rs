//! Links omw-core into a freestanding binary and exercises a few entry points so the linker
//! keeps them (what is not referenced is not checked).
#![no_std]
#![no_main]

use omw_core::chain_builder::ChainEnv;
use omw_core::geometry::PoolGeometry;
use omw_core::mn_memory::{MnKeys, MnMemoryMap};

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The prebuilt libcore references the unwinding personality even with panic = "abort".
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let geo = PoolGeometry::new(1 << 32, 4096, 64, 3);
    let ok = match geo {
        Ok(g) => match MnMemoryMap::new(g, 4, 64 << 20) {
            Some(map) => {
                let env = ChainEnv {
                    map,
                    slot: 0,
                    cn: match omw_core::ids::CnId::new(1) {
                        Ok(c) => c,
                        Err(_) => loop {},
                    },
                    loop_qpn: 1,
                    mgmt_qpn: 2,
                    free_qpn: 3,
                    keys: MnKeys {
                        meta_lkey: 1,
                        meta_rkey: 2,
                        table_rkey: 3,
                        ring_lkey: 4,
                        ring_rkey: 5,
                        cn_meta_lkey: 1,
                        cn_ring_lkey: 4,
                        ..MnKeys::default()
                    },
                    queue_depth: 128,
                    window_access: omw_core::access::AccessFlags::DATA_WINDOW,
                    owner_window_access: omw_core::access::AccessFlags::REMOTE_READ,
                };
                omw_core::alloc_chain::build_alloc_chain(&env).map(|c| c.validate().is_ok()).unwrap_or(false)
                    && omw_core::free_chain::build_free_chain(&env).map(|c| c.validate().is_ok()).unwrap_or(false)
            }
            None => false,
        },
        Err(_) => false,
    };
    let w = omw_core::wqe::Wqe::decode(&[0u8; 64]).is_ok();
    let _ = omw_core::wire::FreeRequest::decode(&[0u8; 16]);
    let code = if ok && w { 0 } else { 1 };
    loop {
        core::hint::black_box(code);
    }
}
