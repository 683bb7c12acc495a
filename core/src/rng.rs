//! A seeded xorshift64*: the one source of reproducible choices — the benchmark workloads (so
//! every figure `omw bench` prints is the same on every run and machine), the conformance
//! oracle's operation sequences, the differential test's schedules. Not for keys or anything a
//! peer must not predict: nothing in the protocol rests on unpredictability (DESIGN.md §9).

/// xorshift64* (Vigna, "An experimental exploration of Marsaglia's xorshift generators",
/// 2016), seeded through a multiplicative hash so that nearby seeds give unrelated sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeededRng(u64);

impl SeededRng {
    pub const fn new(seed: u64) -> Self {
        SeededRng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (multiply-shift on the high 32 bits; `0` for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() >> 32) * n) >> 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let (mut a, mut b) = (SeededRng::new(7), SeededRng::new(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = SeededRng::new(8);
        assert_ne!(SeededRng::new(7).next_u64(), c.next_u64());
        for n in [1u64, 2, 3, 1000, u32::MAX as u64] {
            assert!((0..1000).all(|_| c.below(n) < n));
        }
        assert_eq!(c.below(0), 0);
    }
}
