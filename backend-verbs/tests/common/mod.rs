#![allow(dead_code)]
//! Shared by the device tests: the gate and the device name.

/// True when the device tests should run (OMW_RXE set, as inside the rxe VM).
pub fn rxe() -> bool {
    if std::env::var_os("OMW_RXE").is_none() {
        eprintln!("skipped: set OMW_RXE=1 (scripts/verbs-ci does, inside the soft-RoCE VM)");
        return false;
    }
    true
}

/// The device under test: OMW_RXE_DEVICE or rxe0.
pub fn device() -> String {
    std::env::var("OMW_RXE_DEVICE").unwrap_or_else(|_| "rxe0".into())
}
