//! The memory-management schemes, and how each turns a workload's primitive operations into
//! simulator stages.

use super::inputs::{CtlCosts, Inputs, Measured, ALLOC_REQ_BYTES, FREE_REQ_BYTES, ODRP_TRANSLATE_PHASES};
use super::sim::{Program, Res, Stage};

/// Simulator chain ids per CN: its alloc chains (up to `MAX_ALLOC_CHAINS`), then its free chain.
const CHAIN_STRIDE: u16 = omw_core::mn::MAX_ALLOC_CHAINS as u16 + 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Offloaded alloc/free chains in the MN RNIC (real chains on the loopback model).
    OneSidedMw,
    /// An event-driven RPC server on the MN CPU binding ONE type-1 window per chunk, per
    /// request (one event per alloc: the bind and the reply are ordered on one QP).
    RpcMwType1,
    /// An event-driven RPC server binding G type-2 windows per chunk (two events per alloc:
    /// the reply waits for the binds' completions on other QPs).
    RpcMwType2,
    /// omw's portable mode: the MN CPU runs the chains' own layout (the core's host engine,
    /// laps of different CNs side by side), measured on the model.
    HostEngine,
    /// One big MR per CN, carved on the CN; no fine-grained free back to the MN.
    StaticMr,
    /// ODRP-style: a translation chain in the MN NIC on every access, 4 KiB pages.
    Odrp,
}

pub const ALL: [Scheme; 6] =
    [Scheme::OneSidedMw, Scheme::RpcMwType1, Scheme::RpcMwType2, Scheme::HostEngine, Scheme::StaticMr, Scheme::Odrp];

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::OneSidedMw => "OneSidedMW",
            Scheme::RpcMwType1 => "RPC-MW type-1",
            Scheme::RpcMwType2 => "RPC-MW type-2",
            Scheme::HostEngine => "host engine",
            Scheme::StaticMr => "Static-MR",
            Scheme::Odrp => "ODRP",
        }
    }
    pub fn key(self) -> &'static str {
        match self {
            Scheme::OneSidedMw => "onesidedmw",
            Scheme::RpcMwType1 => "rpcmw1",
            Scheme::RpcMwType2 => "rpcmw2",
            Scheme::HostEngine => "hostengine",
            Scheme::StaticMr => "staticmr",
            Scheme::Odrp => "odrp",
        }
    }
    /// How each scheme's timing is obtained.
    pub fn how(self) -> &'static str {
        match self {
            Scheme::OneSidedMw => "real chains on the loopback model (+ queueing sim for workloads)",
            Scheme::RpcMwType1 => "event-driven RPC server, 1 event per alloc (swept CPU cost) + N-core queueing sim",
            Scheme::RpcMwType2 => "event-driven RPC server, 2 events per alloc (swept CPU cost) + N-core queueing sim",
            Scheme::HostEngine => "host engine laps measured on the model + N-core queueing sim",
            Scheme::StaticMr => "no control path; one-sided ops measured on the model",
            Scheme::Odrp => "analytical translation chain on the cost model + queueing sim",
        }
    }
    pub fn ctl(self, inp: &Inputs, m: &Measured) -> CtlCosts {
        match self {
            Scheme::OneSidedMw => m.osmw,
            Scheme::RpcMwType1 => inp.type1(),
            Scheme::RpcMwType2 => inp.type2_rpc(),
            Scheme::HostEngine => m.host_engine,
            Scheme::StaticMr => CtlCosts::default(),
            Scheme::Odrp => inp.odrp_ctl(),
        }
    }
}

/// A scheme-independent step of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read { len: u32, bg: bool },
    Write { len: u32, bg: bool },
    Alloc,
    Free,
    Compute(u32),
    End(u8),
    Barrier,
}

/// Translate a workload program for a scheme, for a client thread of CN `cn` (its CN's chains
/// serve one lap at a time: OneSidedMW's allocs and frees of one CN queue for them).
pub fn compile(scheme: Scheme, inp: &Inputs, m: &Measured, ops: &[Op], cn: u16) -> Program {
    let c = &inp.cost;
    let ctl = scheme.ctl(inp, m);
    let mut p = Vec::with_capacity(ops.len() * 3);
    // the payload crosses the MN's link: inbound for a store, outbound for a load
    let link = |store: bool| if store { Res::LinkIn } else { Res::LinkOut };
    let data = |p: &mut Program, len: u64, store: bool, bg: bool| {
        let mut st: Vec<Stage> = Vec::with_capacity(6);
        let bytes = c.bytes_ns(len);
        if scheme == Scheme::Odrp {
            // request SEND in, the translation chain on a unit, then the MN moves the data
            let total = inp.odrp_access_ns(len, store);
            let nic = (2 * ODRP_TRANSLATE_PHASES + 1) * c.wqe_ns;
            let pre = c.wqe_ns + c.pcie_read_ns + c.wire_ns;
            st.push(Stage::Delay(pre));
            st.push(Stage::Use { res: Res::Rx, hold: c.responder_ns, leave: c.responder_ns });
            st.push(Stage::Use { res: Res::Nic, hold: nic, leave: nic });
            st.push(Stage::Use { res: link(store), hold: bytes, leave: bytes });
            st.push(Stage::Delay(total.saturating_sub(pre + c.responder_ns + nic + bytes)));
        } else {
            // measured round trip on the model; the MN's responder and link are the shared
            // parts (a store's payload arrives before the responder, a load's leaves after)
            let total = if store { inp.write_ns(len) } else { inp.read_ns(len) };
            let pre = c.wqe_ns + c.wire_ns + if store { c.pcie_read_ns } else { 0 };
            st.push(Stage::Delay(pre));
            if store {
                st.push(Stage::Use { res: Res::LinkIn, hold: bytes, leave: bytes });
            }
            st.push(Stage::Use { res: Res::Rx, hold: c.responder_ns, leave: c.responder_ns });
            if !store {
                st.push(Stage::Delay(c.pcie_read_ns));
                st.push(Stage::Use { res: Res::LinkOut, hold: bytes, leave: bytes });
            }
            let used = pre + bytes + c.responder_ns + if store { 0 } else { c.pcie_read_ns };
            st.push(Stage::Delay(total.saturating_sub(used)));
        }
        if bg {
            p.push(Stage::Detach(st.len() as u8));
        }
        p.extend(st);
    };
    for op in ops {
        match *op {
            Op::Read { len, bg } => data(&mut p, len as u64, false, bg),
            Op::Write { len, bg } => data(&mut p, len as u64, true, bg),
            Op::Compute(ns) => p.push(Stage::Delay(ns as u64)),
            Op::End(t) => p.push(Stage::End(t)),
            Op::Barrier => p.push(Stage::Barrier),
            Op::Alloc => match scheme {
                Scheme::StaticMr => {}
                Scheme::OneSidedMw | Scheme::Odrp => {
                    let tin = inp.transit(ALLOC_REQ_BYTES);
                    p.push(Stage::Delay(tin));
                    if scheme == Scheme::OneSidedMw {
                        // the CN's alloc chain: from this request's arrival until re-armed
                        let lap = ctl.alloc_ns.saturating_sub(tin) + ctl.alloc_rearm_ns;
                        // (any of its alloc chains: the first one free)
                        let count = inp.alloc_chains.clamp(1, CHAIN_STRIDE - 1);
                        p.push(Stage::Chain {
                            chain: CHAIN_STRIDE * cn,
                            count,
                            hold: lap,
                            leave: 0,
                            rnr: inp.rnr_timer_ns,
                        });
                    }
                    p.push(Stage::Use { res: Res::Nic, hold: ctl.alloc_nic_ns, leave: ctl.alloc_nic_ns });
                    p.push(Stage::Delay(ctl.alloc_ns.saturating_sub(tin + ctl.alloc_nic_ns)));
                }
                Scheme::RpcMwType1 | Scheme::HostEngine => {
                    // one event on a core; the device work goes on without it
                    let tin = inp.transit(ALLOC_REQ_BYTES);
                    p.push(Stage::Delay(tin));
                    p.push(Stage::Use { res: Res::Cpu, hold: ctl.alloc_cpu_ns, leave: ctl.alloc_cpu_ns });
                    p.push(Stage::Delay(ctl.alloc_ns.saturating_sub(tin + ctl.alloc_cpu_ns)));
                }
                Scheme::RpcMwType2 => {
                    // the request's event posts the binds; their completions' event the reply
                    let tin = inp.transit(ALLOC_REQ_BYTES);
                    let ev = ctl.alloc_cpu_ns / 2;
                    p.push(Stage::Delay(tin));
                    p.push(Stage::Use { res: Res::Cpu, hold: ev, leave: ev });
                    p.push(Stage::Delay(c.bind_ns));
                    p.push(Stage::Use { res: Res::Cpu, hold: ev, leave: ev });
                    p.push(Stage::Delay(ctl.alloc_ns.saturating_sub(tin + 2 * ev + c.bind_ns)));
                }
            },
            Op::Free => {
                // (resource, its occupancy, how long the MN's work lasts from its start)
                let (res, hold, last) = match scheme {
                    Scheme::StaticMr => continue,
                    // a chain occupies the NIC for its unit time but runs for its latency
                    Scheme::OneSidedMw | Scheme::Odrp => (Res::Nic, ctl.free_nic_ns, ctl.free_ns.max(ctl.free_nic_ns)),
                    // one event on a core, the invalidations on the device
                    Scheme::RpcMwType1 | Scheme::RpcMwType2 | Scheme::HostEngine => {
                        (Res::Cpu, ctl.free_cpu_ns, ctl.free_cpu_ns + ctl.free_dev_ns)
                    }
                };
                // the CN waits only for its SEND to be acknowledged; the MN works on (the CN's
                // free chain, offloaded, one lap at a time)
                let chain = scheme == Scheme::OneSidedMw;
                p.push(Stage::Detach(if chain { 3 } else { 2 }));
                p.push(Stage::Delay(inp.transit(FREE_REQ_BYTES)));
                if chain {
                    let chain = CHAIN_STRIDE * cn + CHAIN_STRIDE - 1;
                    p.push(Stage::Chain { chain, count: 1, hold: ctl.free_ns, leave: 0, rnr: inp.rnr_timer_ns });
                }
                p.push(Stage::Use { res, hold, leave: last });
                p.push(Stage::Delay(inp.write_ns(FREE_REQ_BYTES)));
            }
        }
    }
    p
}
