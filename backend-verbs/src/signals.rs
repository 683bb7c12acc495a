//! SIGINT/SIGTERM → a flag the daemon's loop checks, so every exit runs the orderly teardown
//! (windows invalidated and deallocated before QPs; rxe stalls ~51 s otherwise).

use crate::error::{Result, VerbsError};
use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Install the handlers; returns the flag they set.
pub fn install() -> Result<&'static AtomicBool> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe); sigaction is
        // zero-initialised plain data with the handler and an empty mask set.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(VerbsError::last("sigaction"));
        }
    }
    Ok(&STOP)
}
