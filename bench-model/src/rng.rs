//! The workloads' only randomness: the core's seeded xorshift64*, so every trace — and with it
//! every number `omw bench` prints — is the same on every run and machine. `omw demo` draws
//! from it too.

pub use omw_core::rng::SeededRng as Rng;
