//! What tests and benches run the core on, behind the `test-nic` feature: the minimal test
//! NIC, and the fault-injecting and tracing wrappers that go in front of any device.

pub mod fault;
pub mod test_nic;
pub mod trace;

#[cfg(test)]
mod wrappers;
