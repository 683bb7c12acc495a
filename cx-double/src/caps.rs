//! What the double says about itself when asked (QUERY_HCA_CAP) and the limits its commands
//! are checked against. Defaults: a ConnectX-5/6 that passes omw's offload gate — CORE-Direct,
//! type-2B windows, RC, the four 8-byte atomics in host endianness, free-running and real-time
//! timestamps, RoCE.

/// The double's capabilities and the numbers it hands out.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CxCaps {
    pub cd: bool,
    pub imaicl: bool,
    pub rc: bool,
    pub atomic: bool,
    /// `atomic_operations` bits (`MLX5_ATOMIC_OPS_*`).
    pub atomic_operations: u16,
    pub atomic_size_qp: u16,
    /// `atomic_req_8B_endianness_mode` (1: host endianness).
    pub atomic_8b_endianness_mode: u8,
    pub log_max_qp_sz: u8,
    pub log_max_cq_sz: u8,
    pub log_max_mkey: u8,
    pub log_max_msg: u8,
    pub umr_fence: u8,
    /// `roce_caps.qp_ts_format` (`MLX5_HCA_CAP_TIMESTAMP_FORMAT_*`): which `qpc.ts_format`
    /// CREATE_QP may ask for.
    pub qp_ts_format: u8,
    /// The EQ `mlx5dv_devx_query_eqn` names for vector 0 (a CQ's `c_eqn` must be it).
    pub eqn: u32,
}

impl CxCaps {
    pub const CONNECTX: CxCaps = CxCaps {
        cd: true,
        imaicl: true,
        rc: true,
        atomic: true,
        atomic_operations: crate::prm::atomic_caps::OPS_ALL as u16,
        atomic_size_qp: crate::prm::atomic_caps::SIZE_8 as u16,
        atomic_8b_endianness_mode: 1,
        log_max_qp_sz: 15,
        log_max_cq_sz: 22,
        log_max_mkey: 24,
        log_max_msg: 30,
        umr_fence: 0,
        qp_ts_format: crate::prm::roce_caps::TS_FR_RT,
        eqn: 7,
    };
}

impl Default for CxCaps {
    fn default() -> Self {
        Self::CONNECTX
    }
}
