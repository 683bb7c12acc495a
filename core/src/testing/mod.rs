//! What tests, benches and the tools that play a hostile CN run the core on: the one
//! deployment harness and the hostile-CN API (always built: the loopback cluster, `omw demo`
//! and `omw cn`'s hostile subcommands use them), and behind
//! the `test-nic` feature the minimal test NIC and the fault-injecting and tracing wrappers
//! that go in front of any device.

pub mod deployment;
pub mod hostile;

#[cfg(any(test, feature = "test-nic"))]
pub mod fault;
#[cfg(any(test, feature = "test-nic"))]
pub mod test_nic;
#[cfg(any(test, feature = "test-nic"))]
pub mod trace;

#[cfg(test)]
mod wrappers;
