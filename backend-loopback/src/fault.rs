//! Fault injection around the model, in the style of smoltcp's `phy` middlewares: every
//! request message one NIC sends another (QPs of the same host included) passes through the
//! fabric's [`FaultPlan`] and then through any [`Middleware`] a test installed, each of which
//! may drop it, delay it, or rewrite its payload.
//!
//! What a verdict does:
//! * `Drop`: the requester retries until `CostModel::retry_timeout_ns` and completes with
//!   `RetryExcErr`; both QPs of the pair go to the error state. Nothing reaches the responder.
//! * `Delay(ns)`: the request arrives `ns` later (and so does its completion).
//! * A payload rewrite lands as rewritten (the model has no ICRC: this is how a *malicious*
//!   or buggy request is modelled, not line noise).
//!
//! Host-level faults (crash, RNIC reset) are operations on [`crate::Fabric`]; a test can post
//! arbitrary bytes with [`crate::Fabric::post_send_raw`] / [`crate::Fabric::post_recv_raw`].

use crate::addr::{HostId, QpAddr};
use omw_core::wire::wqe::Opcode;
use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

/// One request from a requester QP to its peer.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Message {
    /// Modelled time the requester issued it.
    pub at: u64,
    pub src: QpAddr,
    pub dst: QpAddr,
    pub opcode: Opcode,
    /// Payload bytes carried (SEND/WRITE data; requested length for READ; 8 for atomics).
    pub len: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Verdict {
    Deliver,
    Drop,
    Delay(u64),
}

/// A message filter/rewriter. `payload` is the SEND/WRITE data (empty for READ and atomics).
pub trait Middleware: fmt::Debug {
    fn on_message(&mut self, msg: &Message, payload: &mut [u8]) -> Verdict;
}

/// Which messages a rule applies to (`None` = any).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct MessageFilter {
    pub src_host: Option<HostId>,
    pub src_qpn: Option<u32>,
    pub dst_host: Option<HostId>,
    pub dst_qpn: Option<u32>,
    pub opcode: Option<Opcode>,
}

impl MessageFilter {
    pub const ANY: MessageFilter =
        MessageFilter { src_host: None, src_qpn: None, dst_host: None, dst_qpn: None, opcode: None };
    /// Messages sent by QP `qpn` of `host`.
    pub const fn from_qp(qp: QpAddr) -> Self {
        MessageFilter {
            src_host: Some(qp.host),
            src_qpn: Some(qp.qpn.get()),
            dst_host: None,
            dst_qpn: None,
            opcode: None,
        }
    }
    /// Messages from `src` host to `dst` host.
    pub const fn between(src: HostId, dst: HostId) -> Self {
        MessageFilter { src_host: Some(src), src_qpn: None, dst_host: Some(dst), dst_qpn: None, opcode: None }
    }
    pub const fn with_opcode(mut self, op: Opcode) -> Self {
        self.opcode = Some(op);
        self
    }
    pub fn matches(&self, m: &Message) -> bool {
        self.src_host.is_none_or(|h| h == m.src.host)
            && self.src_qpn.is_none_or(|q| q == m.src.qpn.get())
            && self.dst_host.is_none_or(|h| h == m.dst.host)
            && self.dst_qpn.is_none_or(|q| q == m.dst.qpn.get())
            && self.opcode.is_none_or(|o| o == m.opcode)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum FaultAction {
    /// Drop the next `count` matching messages.
    Drop { count: u32 },
    /// Delay the next `count` matching messages by `ns`.
    Delay { ns: u64, count: u32 },
    /// Corrupt (XOR with non-zero pseudo-random bytes) the next `bytes` payload bytes of
    /// matching SEND / SEND_WITH_IMM / SEND_WITH_INV messages, from the start of each payload.
    CorruptSend { bytes: u32 },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct FaultRule {
    pub filter: MessageFilter,
    pub action: FaultAction,
}

impl FaultRule {
    fn exhausted(&self) -> bool {
        matches!(
            self.action,
            FaultAction::Drop { count: 0 }
                | FaultAction::Delay { count: 0, .. }
                | FaultAction::CorruptSend { bytes: 0 }
        )
    }
}

/// The built-in fault middleware: a list of rules, each consumed as it fires. Deterministic:
/// corruption bytes come from a xorshift generator seeded by `NicConfig::seed`.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    rules: Vec<FaultRule>,
    rng: u64,
    /// Messages dropped / delayed / corrupted so far.
    pub dropped: u64,
    pub delayed: u64,
    pub corrupted_bytes: u64,
}

impl FaultPlan {
    pub fn new(seed: u64) -> Self {
        FaultPlan { rules: Vec::new(), rng: seed | 1, ..Default::default() }
    }
    pub fn push(&mut self, rule: FaultRule) {
        self.rules.push(rule);
    }
    pub fn drop_next(&mut self, filter: MessageFilter, count: u32) {
        self.push(FaultRule { filter, action: FaultAction::Drop { count } });
    }
    pub fn delay_next(&mut self, filter: MessageFilter, ns: u64, count: u32) {
        self.push(FaultRule { filter, action: FaultAction::Delay { ns, count } });
    }
    /// Corrupt the next `bytes` bytes of SEND payloads from `qp`.
    pub fn corrupt_sends(&mut self, qp: QpAddr, bytes: u32) {
        self.push(FaultRule { filter: MessageFilter::from_qp(qp), action: FaultAction::CorruptSend { bytes } });
    }
    /// Rules not yet used up.
    pub fn pending(&self) -> &[FaultRule] {
        &self.rules
    }
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
    pub fn clear(&mut self) {
        self.rules.clear();
    }

    fn next_byte(&mut self) -> u8 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        (x % 255) as u8 + 1
    }
}

impl Middleware for FaultPlan {
    fn on_message(&mut self, msg: &Message, payload: &mut [u8]) -> Verdict {
        let mut verdict = Verdict::Deliver;
        let is_send = matches!(msg.opcode, Opcode::Send | Opcode::SendWithImm | Opcode::SendWithInv);
        let mut i = 0;
        while i < self.rules.len() {
            let r = self.rules[i];
            if r.filter.matches(msg) {
                match r.action {
                    FaultAction::Drop { count } => {
                        if verdict != Verdict::Drop {
                            verdict = Verdict::Drop;
                            self.dropped += 1;
                            self.rules[i].action = FaultAction::Drop { count: count - 1 };
                        }
                    }
                    FaultAction::Delay { ns, count } => {
                        if let Verdict::Deliver | Verdict::Delay(_) = verdict {
                            let d = match verdict {
                                Verdict::Delay(d) => d,
                                _ => 0,
                            };
                            verdict = Verdict::Delay(d.saturating_add(ns));
                            self.delayed += 1;
                            self.rules[i].action = FaultAction::Delay { ns, count: count - 1 };
                        }
                    }
                    FaultAction::CorruptSend { bytes } if is_send => {
                        let n = (bytes as usize).min(payload.len());
                        for b in payload[..n].iter_mut() {
                            *b ^= self.next_byte();
                        }
                        self.corrupted_bytes += n as u64;
                        self.rules[i].action = FaultAction::CorruptSend { bytes: bytes - n as u32 };
                    }
                    FaultAction::CorruptSend { .. } => {}
                }
            }
            if self.rules[i].exhausted() {
                self.rules.remove(i);
            } else {
                i += 1;
            }
        }
        verdict
    }
}

/// A middleware that records every message (a `phy::Tracer` analogue). Keep a clone of
/// `log` before installing it to read what passed.
#[derive(Clone, Debug, Default)]
pub struct Recorder {
    pub log: Rc<RefCell<Vec<Message>>>,
}

impl Middleware for Recorder {
    fn on_message(&mut self, msg: &Message, _payload: &mut [u8]) -> Verdict {
        self.log.borrow_mut().push(*msg);
        Verdict::Deliver
    }
}
