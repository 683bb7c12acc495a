//! `memcpy` & co. for the freestanding Linux build. Static glibc's versions are IFUNCs, resolved
//! by IRELATIVE relocations that only its start files apply; this binary has its own `_start`
//! (as firmware does), so it brings its own — byte loops through volatile accesses, so LLVM
//! cannot turn them back into calls to themselves. Speed is not the point here.
#![allow(clippy::missing_safety_doc)]

use core::ptr::{read_volatile, write_volatile};

#[no_mangle]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    for i in 0..n {
        // SAFETY: the caller guarantees `n` valid bytes at both, not overlapping.
        unsafe { write_volatile(dst.add(i), read_volatile(src.add(i))) };
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) < (src as usize) {
        for i in 0..n {
            // SAFETY: the caller guarantees `n` valid bytes at both; forward copy is safe here.
            unsafe { write_volatile(dst.add(i), read_volatile(src.add(i))) };
        }
    } else {
        for i in (0..n).rev() {
            // SAFETY: as above; backward copy for an overlapping destination above the source.
            unsafe { write_volatile(dst.add(i), read_volatile(src.add(i))) };
        }
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    for i in 0..n {
        // SAFETY: the caller guarantees `n` valid bytes at `dst`.
        unsafe { write_volatile(dst.add(i), c as u8) };
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        // SAFETY: the caller guarantees `n` valid bytes at both.
        let (x, y) = unsafe { (read_volatile(a.add(i)), read_volatile(b.add(i))) };
        if x != y {
            return x as i32 - y as i32;
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}
