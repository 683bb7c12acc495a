//! Access rights of memory regions and windows, bit-for-bit `ibv_access_flags`, so a backend
//! hands them to libibverbs unchanged.

bitflags::bitflags! {
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct AccessFlags: u32 {
        const LOCAL_WRITE = 1 << 0;
        const REMOTE_WRITE = 1 << 1;
        const REMOTE_READ = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
        const MW_BIND = 1 << 4;
        const ZERO_BASED = 1 << 5;
        const ON_DEMAND = 1 << 6;
    }
}

impl AccessFlags {
    /// Rights a window grants to a CN's access QP: read and write, never atomics on data
    /// chunks (the pool MR is not registered with them) and never bind.
    pub const DATA_WINDOW: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);
    /// Rights that only make sense on an MR, not on a window.
    pub const MR_ONLY: AccessFlags = AccessFlags::MW_BIND.union(AccessFlags::ON_DEMAND);
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn bit_values_match_ibverbs() {
        // values from <infiniband/verbs.h> enum ibv_access_flags
        assert_eq!(AccessFlags::LOCAL_WRITE.bits(), 1);
        assert_eq!(AccessFlags::REMOTE_WRITE.bits(), 2);
        assert_eq!(AccessFlags::REMOTE_READ.bits(), 4);
        assert_eq!(AccessFlags::REMOTE_ATOMIC.bits(), 8);
        assert_eq!(AccessFlags::MW_BIND.bits(), 16);
        assert_eq!(AccessFlags::ZERO_BASED.bits(), 32);
    }
}
