//! Completion queues with modelled timestamps.
//!
//! A CQ is an object of its host with a number (what an mlx5 WAIT names). A QP created by
//! [`crate::Fabric::create_qp`] gets a send CQ and a receive CQ of its own, numbered
//! `qpn << 1 | queue` and reset with it; a QP created on a device's terms
//! ([`crate::Fabric::create_qp_with`]) reports to CQs made with [`crate::Fabric::create_cq`],
//! which live on across the QP's resets. A CQ holds completions (oldest dropped past its
//! capacity, like mlx5 "ignore overrun" CQs that chains use) and a count of every CQE it ever
//! generated: polling does not decrease it, and a WAIT compares against it. A CQ may have a
//! limit (the device's ring: its consumer index plus its size): a CQE beyond it is an
//! **overrun**, after which the CQ generates nothing more. Timestamps are non-decreasing per
//! CQ (RC completes a queue's work in order); a CQE is visible to polls and WAITs only once
//! the clock has reached its time.

use omw_core::device::Completion;
use std::collections::VecDeque;

/// A completion and the modelled time (ns) at which it was generated.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct TimedCompletion {
    pub at: u64,
    pub completion: Completion,
}

/// How many recent CQE timestamps a CQ remembers for WAITs.
const HIST: usize = 64;

#[derive(Debug)]
pub(crate) struct Cq {
    /// The CQ number (24 bits) on its host.
    pub number: u32,
    /// Made with a QP and reset with it (`Fabric::create_qp`), rather than an object of its own.
    pub qp_owned: bool,
    /// CQEs may be generated while `count` is below this (`None`: no bound, ignore overrun).
    pub limit: Option<u64>,
    /// A CQE found the CQ at its limit: it generates nothing more.
    pub overrun: bool,
    entries: VecDeque<TimedCompletion>,
    cap: usize,
    /// CQEs generated since creation or the last QP reset.
    pub count: u64,
    /// CQEs handed to pollers since the last reset.
    pub polled: u64,
    /// CQEs dropped because the CQ was full.
    pub overruns: u64,
    pub last_time: u64,
    hist: [u64; HIST],
    /// QPs parked on a WAIT for this CQ (global indices); woken on the next CQE.
    pub waiters: Vec<u32>,
}

impl Cq {
    pub fn new(number: u32, cap: usize, qp_owned: bool) -> Self {
        Cq {
            number,
            qp_owned,
            limit: None,
            overrun: false,
            entries: VecDeque::new(),
            cap: cap.max(1),
            count: 0,
            polled: 0,
            overruns: 0,
            last_time: 0,
            hist: [0; HIST],
            waiters: Vec::new(),
        }
    }

    /// The completions not yet polled (a QP reset on another host leaves them in place).
    pub fn take_entries(&mut self) -> VecDeque<TimedCompletion> {
        core::mem::take(&mut self.entries)
    }
    /// Put completions back after a reset, without counting them again.
    pub fn restore_entries(&mut self, e: VecDeque<TimedCompletion>) {
        for c in e {
            self.push(c.at, c.completion);
        }
    }

    /// Append; returns the timestamp actually used (never earlier than the previous CQE's), or
    /// `None` when the CQ cannot take it (at its limit: it overran and stopped).
    pub fn push(&mut self, at: u64, c: Completion) -> Option<u64> {
        if self.overrun || self.limit.is_some_and(|l| self.count >= l) {
            self.overrun = true;
            return None;
        }
        let at = at.max(self.last_time);
        self.last_time = at;
        if self.entries.len() == self.cap {
            self.entries.pop_front();
            self.overruns += 1;
        }
        self.entries.push_back(TimedCompletion { at, completion: c });
        self.hist[(self.count % HIST as u64) as usize] = at;
        self.count += 1;
        Some(at)
    }

    /// Time of the `n`-th CQE (1-based, `n <= count`). For CQEs older than the remembered
    /// history, the oldest remembered time (an upper bound: times are non-decreasing).
    #[inline]
    pub fn time_of(&self, n: u64) -> u64 {
        debug_assert!(n >= 1 && n <= self.count);
        if self.count - n < HIST as u64 {
            self.hist[((n - 1) % HIST as u64) as usize]
        } else {
            self.hist[(self.count % HIST as u64) as usize]
        }
    }

    /// Whether `n` CQEs exist and the clock has reached the `n`-th.
    #[inline]
    pub fn reached(&self, n: u64, now: u64) -> bool {
        n == 0 || (self.count >= n && self.time_of(n) <= now)
    }

    /// Earliest queued CQE time, if any.
    pub fn next_time(&self) -> Option<u64> {
        self.entries.front().map(|e| e.at)
    }

    pub fn queued(&self) -> usize {
        self.entries.len()
    }

    /// Pop visible completions (time ≤ `now`).
    pub fn poll(&mut self, now: u64, mut f: impl FnMut(TimedCompletion) -> bool) -> usize {
        let mut n = 0;
        while let Some(e) = self.entries.front() {
            if e.at > now {
                break;
            }
            let e = *e;
            if !f(e) {
                break;
            }
            self.entries.pop_front();
            self.polled += 1;
            n += 1;
        }
        n
    }

    pub fn reset(&mut self) {
        self.overrun = false;
        self.entries.clear();
        self.count = 0;
        self.polled = 0;
        self.overruns = 0;
        self.last_time = 0;
        self.hist = [0; HIST];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omw_core::device::{WcOpcode, WcStatus};
    use omw_core::ids::Qpn;
    use omw_core::wire::wqe::Opcode;

    fn c(id: u64) -> Completion {
        Completion {
            wr_id: id,
            status: WcStatus::Success,
            opcode: WcOpcode::Send(Opcode::Nop),
            qpn: Qpn::default(),
            byte_len: 0,
            imm: None,
            invalidated: None,
        }
    }

    #[test]
    fn counts_times_and_overrun() {
        let mut q = Cq::new(1, 2, true);
        assert_eq!(q.push(10, c(1)), Some(10));
        assert_eq!(q.push(5, c(2)), Some(10), "never earlier than the previous CQE");
        q.push(20, c(3));
        assert_eq!(q.count, 3);
        assert_eq!(q.overruns, 1);
        assert_eq!(q.time_of(3), 20);
        assert!(q.reached(2, 10));
        assert!(!q.reached(3, 19));
        let mut got = vec![];
        assert_eq!(
            q.poll(15, |e| {
                got.push(e.completion.wr_id);
                true
            }),
            1
        );
        assert_eq!(got, vec![2]);
        assert_eq!(q.count, 3, "polling does not decrease the count");
        for i in 0..200 {
            q.push(100 + i, c(i));
        }
        assert!(q.time_of(5) >= q.time_of(4));
        assert!(q.time_of(5) <= 100 + 199);
    }

    #[test]
    fn a_cq_at_its_limit_overruns_and_stops() {
        let mut q = Cq::new(1, 64, false);
        q.limit = Some(2);
        assert!(q.push(1, c(1)).is_some() && q.push(2, c(2)).is_some());
        assert_eq!(q.push(3, c(3)), None);
        q.limit = Some(10);
        assert_eq!(q.push(4, c(4)), None, "an overrun CQ generates nothing more");
        assert_eq!((q.count, q.overrun), (2, true));
    }
}
