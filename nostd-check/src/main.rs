//! A freestanding binary (no std, no alloc, own panic handler and entry point) that *runs* the
//! protocol: an MN provisioned by `MnPlan`, its `MnDriver` and two `CnDriver`s on the core's
//! test NIC — connect, allocate, write and read through the window, a cross-CN access and a
//! stale key refused, free (`scenario.rs`). On Linux it exits with status 0 when every step
//! held and the failing step's number otherwise (a raw `exit_group` system call: static glibc's
//! functions need its start files, which a freestanding image does not run), so `check.sh` can
//! fail. The bare-metal targets (`thumbv7em-none-eabihf`, `aarch64-unknown-none`)
//! build the same code for the footprint report; there the result is left in `OMW_RESULT`.
#![no_std]
#![no_main]

mod scenario;

use core::mem::size_of;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    exit(101)
}

/// The prebuilt libcore references the unwinding personality even with panic = "abort".
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

/// Type sizes on the target, as symbol sizes (`nm -S`) for `footprint.sh`: what a firmware
/// author reserves in static RAM.
macro_rules! footprint {
    ($($name:ident = $t:ty;)*) => {
        $(
            #[no_mangle]
            #[used]
            pub static mut $name: [u8; size_of::<$t>()] = [0; size_of::<$t>()];
        )*
        fn keep_footprint() {
            $( core::hint::black_box(&raw const $name); )*
        }
    };
}

footprint! {
    OMW_FOOTPRINT_MN_DRIVER = scenario::Mn<'static, 'static>;
    OMW_FOOTPRINT_MEMORY_NODE = omw_core::mn::MemoryNode;
    OMW_FOOTPRINT_LAP = omw_core::mn::host_engine::Lap;
    OMW_FOOTPRINT_CN_DRIVER = scenario::Cn<'static, 'static>;
    OMW_FOOTPRINT_CLIENT = omw_core::cn::Client<{ scenario::CN_LIVE }>;
    OMW_FOOTPRINT_TEST_NIC = scenario::Nic<'static>;
}

/// Where the bare-metal builds leave the result (0: every step held).
#[no_mangle]
pub static mut OMW_RESULT: u8 = 0xFF;

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn exit(code: u8) -> ! {
    // SAFETY: exit_group(2) (syscall 231 on x86_64) ends the process and never returns; it reads
    // only its integer argument.
    unsafe { core::arch::asm!("syscall", in("rax") 231, in("rdi") code as u64, options(noreturn, nostack)) }
}

#[cfg(not(target_os = "linux"))]
fn exit(code: u8) -> ! {
    // SAFETY: single-threaded bare metal; nothing else touches the cell.
    unsafe { core::ptr::write_volatile(&raw mut OMW_RESULT, code) };
    loop {
        core::hint::spin_loop();
    }
}

// Linux enters `_start` with the stack 16-byte aligned and no return address pushed; a Rust
// function expects the alignment a `call` leaves, so a trampoline makes one.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
core::arch::global_asm!(".globl _start", "_start:", "xor ebp, ebp", "and rsp, -16", "call omw_main", "ud2");

#[cfg(target_os = "linux")]
mod mem;

#[cfg_attr(target_os = "linux", export_name = "omw_main")]
#[cfg_attr(not(target_os = "linux"), export_name = "_start")]
pub extern "C" fn omw_main() -> ! {
    exit(run())
}

fn run() -> u8 {
    keep_footprint();
    let mut mn = [0u8; scenario::MN_MEM];
    let mut cn0 = [0u8; scenario::CN_MEM];
    let mut cn1 = [0u8; scenario::CN_MEM];
    match scenario::run(&mut mn, &mut cn0, &mut cn1) {
        Ok(()) => 0,
        Err(step) => step as u8,
    }
}
