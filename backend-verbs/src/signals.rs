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

static DRAIN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_drain_signal(_sig: libc::c_int) {
    // SIGUSR1 turns draining on, SIGUSR2 off (a pool MN: no new placements while it drains)
    DRAIN.store(_sig == libc::SIGUSR1, Ordering::SeqCst);
}

/// SIGUSR1 / SIGUSR2 → the MN's own drain flag (on / off), which a pool MN publishes in its
/// registry record; returns the flag.
pub fn install_drain() -> Result<&'static AtomicBool> {
    for sig in [libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: as in `install`: the handler only stores to an atomic; the sigaction is
        // zero-initialised plain data with the handler and an empty mask set.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_drain_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(VerbsError::last("sigaction"));
        }
    }
    Ok(&DRAIN)
}
