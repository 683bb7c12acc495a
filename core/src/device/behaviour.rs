//! What the public sources leave open about a CORE-Direct device (DESIGN.md §6.4, docs/MLX5.md
//! "open questions"): each question a chain layout may depend on, its possible answers, what one
//! device answered (a bring-up profile, [`DeviceAnswers`]) and what a layout needs
//! ([`Needs`]).
//!
//! Nothing here is a capability a device declares: these are behaviours no vendor document
//! states, so the model executes every combination ([`DeviceBehaviour::ALL`]), a chain layout
//! says under which ones it is correct, and the MN picks a layout that is correct under every
//! behaviour the device's answers leave possible — an unknown answer counts as "any".

use core::fmt;

/// Does an unsatisfied WAIT stop the NIC fetching the WQEs queued behind it?
///
/// No source says it does; mlx4's `stamp_send_wqe` ("invalid if prefetched") shows these NICs
/// fetch ahead. The documented fetch bound is a `cd_slave_send` queue's send-enable limit.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum WaitPrefetch {
    /// The NIC fetches nothing behind an unsatisfied WAIT.
    Stops,
    /// The NIC may fetch (and so read the bytes of) WQEs behind an unsatisfied WAIT, up to the
    /// queue's enable limit.
    FetchesPast,
}

/// What makes a posted receive available to the NIC on a `cd_slave_receive` queue.
///
/// RECV_EN (opcode 0x16) exists only in MLNX_OFED's libmlx5, whose own RECV_EN tests are
/// disabled "because of issue in FW" (`tests/api/gtest_cd_tc8.cc`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum RecvEnable {
    /// The doorbell record's receive counter alone (RECV_EN is not needed, and may not work).
    Doorbell,
    /// Only a RECV_EN raising the queue's receive-enable limit.
    RecvEnOnly,
}

/// The unit a SEND_EN's index counts.
///
/// WQEBBs in Mellanox PCX (`qp_ctx::cd_send_enable` uses the slave's `write_cnt`); WQEs in
/// MLNX_OFED libmlx5 (`sq.head`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub enum SendEnUnit {
    /// 64-byte basic blocks: a 3-WQEBB bind advances the index by 3 (the default: the
    /// paper's device).
    #[default]
    Wqebb,
    /// Work requests, whatever their size.
    Wqe,
}

/// A queue that SEND_ENs itself, or a QP holding more than one CORE-Direct role.
///
/// DPDK uses one role per QP (`mlx5_txpp.c`, `mlx5_crypto_gcm.c`); no public source shows a
/// QP releasing its own send queue.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum SelfEnable {
    Honoured,
    /// The enable has no effect on the posting queue (it stalls at its limit).
    Ignored,
}

/// A type-2 bind posted on one QP that names another QP in its `qpn_mkey`.
///
/// rdma-core (`providers/mlx5/qp.c`) and libmlx5 always pass the posting QP's number; the paper's
/// premise is that firmware honours another (ConnectX-5, MLNX_OFED 4.9).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ForeignBind {
    /// The window is bound to the QP the WQE names.
    Honoured,
    /// The bind completes in error (the posting QP goes to the error state).
    Refused,
    /// The window is bound, silently, to the posting QP.
    BoundToPoster,
}

/// Does a receive doorbell record written by the HCA's own DMA publish the receive, as the
/// driver's store does? The chains publish each next receive so
/// (`Capabilities::RECV_DOORBELL_RECORD`). Not a question a chain layout varies over: where
/// it is not honoured (or not known) the MN's device hands receives back itself instead, and
/// pipelined requests on one chain under doorbell-enabled receives can land in a running lap
/// (docs/MLX5.md question 20).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum RecvPublish {
    Honoured,
    /// Only the CPU's store of the record publishes a receive.
    Ignored,
}

/// Does a UMR invalidate **without** `CHECK_QPN` revoke a type-2 window bound to another QP?
///
/// The free chain unbinds a group's access windows from the CN's Free QP, and the MN's repair
/// and reclaim unbind windows bound to any CN's QPs, with the UMR rdma-core uses for
/// LOCAL_INV (`set_bind_wr(qp, IBV_MW_TYPE_2, 0, …)`) less its `CHECK_QPN` flag and the QPN
/// in its mask (`mlx5::umr::Umr::invalidate(false)`) — a form rdma-core never emits, and
/// mlx5 checks the QPN on a local invalidate that asks it to. Not a question a chain layout
/// varies over: every layout unbinds so, and so does the MN itself; where it is refused (or not
/// known) the MN does not offload (`omw mn --offload mlx5` names the profile key
/// `unchecked_unbind`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub enum UncheckedUnbind {
    /// The window is revoked whichever QP it was bound to.
    #[default]
    Honoured,
    /// The device checks the QPN anyway: the invalidate completes in error unless the window
    /// is bound to the posting QP (which then enters the error state).
    Refused,
}

/// One open question.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Question {
    WaitPrefetch,
    RecvEnable,
    SendEnUnit,
    SelfEnable,
    ForeignBind,
}

impl Question {
    pub const ALL: [Question; 5] = [
        Question::WaitPrefetch,
        Question::RecvEnable,
        Question::SendEnUnit,
        Question::SelfEnable,
        Question::ForeignBind,
    ];
    /// The profile key and the bring-up step that answers it.
    pub const fn key(self) -> &'static str {
        match self {
            Question::WaitPrefetch => "wait_prefetch",
            Question::RecvEnable => "recv_enable",
            Question::SendEnUnit => "send_en_unit",
            Question::SelfEnable => "self_enable",
            Question::ForeignBind => "foreign_bind",
        }
    }
}

impl fmt::Display for Question {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Question::WaitPrefetch => "does an unsatisfied WAIT stop WQE prefetch",
            Question::RecvEnable => "are receives enabled by the doorbell or only by RECV_EN",
            Question::SendEnUnit => "does SEND_EN count WQEBBs or WQEs",
            Question::SelfEnable => "is a queue's SEND_EN of itself honoured",
            Question::ForeignBind => "is a bind naming another QP honoured",
        })
    }
}

/// One concrete behaviour: an answer to every question. The model executes one of these.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct DeviceBehaviour {
    pub wait_prefetch: WaitPrefetch,
    pub recv_enable: RecvEnable,
    pub send_en_unit: SendEnUnit,
    pub self_enable: SelfEnable,
    pub foreign_bind: ForeignBind,
}

impl DeviceBehaviour {
    /// What the chains were first written for, and the paper's ConnectX-5 with MLNX_OFED 4.9
    /// presumably did: WAIT stops prefetch, the doorbell enables receives, SEND_EN counts
    /// WQEBBs, self-enables and foreign binds are honoured.
    pub const PAPER: DeviceBehaviour = DeviceBehaviour {
        wait_prefetch: WaitPrefetch::Stops,
        recv_enable: RecvEnable::Doorbell,
        send_en_unit: SendEnUnit::Wqebb,
        self_enable: SelfEnable::Honoured,
        foreign_bind: ForeignBind::Honoured,
    };

    /// Every combination (2 × 2 × 2 × 2 × 3 = 48), in a fixed order.
    pub const ALL: [DeviceBehaviour; 48] = {
        let mut out = [DeviceBehaviour::PAPER; 48];
        let mut i = 0;
        while i < 48 {
            out[i] = DeviceBehaviour {
                wait_prefetch: if i & 1 == 0 { WaitPrefetch::Stops } else { WaitPrefetch::FetchesPast },
                recv_enable: if i & 2 == 0 { RecvEnable::Doorbell } else { RecvEnable::RecvEnOnly },
                send_en_unit: if i & 4 == 0 { SendEnUnit::Wqebb } else { SendEnUnit::Wqe },
                self_enable: if i & 8 == 0 { SelfEnable::Honoured } else { SelfEnable::Ignored },
                foreign_bind: match i / 16 {
                    0 => ForeignBind::Honoured,
                    1 => ForeignBind::Refused,
                    _ => ForeignBind::BoundToPoster,
                },
            };
            i += 1;
        }
        out
    };

    /// Whether this behaviour is one `answers` leave possible.
    pub fn consistent_with(&self, a: &DeviceAnswers) -> bool {
        a.wait_prefetch.is_none_or(|x| x == self.wait_prefetch)
            && a.recv_enable.is_none_or(|x| x == self.recv_enable)
            && a.send_en_unit.is_none_or(|x| x == self.send_en_unit)
            && a.self_enable.is_none_or(|x| x == self.self_enable)
            && a.foreign_bind.is_none_or(|x| x == self.foreign_bind)
    }
}

/// What one device answered (`None`: not known — the bring-up step did not run or could not
/// tell). A layout chosen for these answers must be correct under every behaviour they leave
/// possible.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
pub struct DeviceAnswers {
    pub wait_prefetch: Option<WaitPrefetch>,
    pub recv_enable: Option<RecvEnable>,
    pub send_en_unit: Option<SendEnUnit>,
    pub self_enable: Option<SelfEnable>,
    pub foreign_bind: Option<ForeignBind>,
}

impl DeviceAnswers {
    /// Nothing known.
    pub const UNKNOWN: DeviceAnswers = DeviceAnswers {
        wait_prefetch: None,
        recv_enable: None,
        send_en_unit: None,
        self_enable: None,
        foreign_bind: None,
    };

    /// Every answer known: exactly `b`.
    pub const fn exactly(b: DeviceBehaviour) -> DeviceAnswers {
        DeviceAnswers {
            wait_prefetch: Some(b.wait_prefetch),
            recv_enable: Some(b.recv_enable),
            send_en_unit: Some(b.send_en_unit),
            self_enable: Some(b.self_enable),
            foreign_bind: Some(b.foreign_bind),
        }
    }

    /// The behaviours these answers leave possible.
    pub fn possible(&self) -> impl Iterator<Item = DeviceBehaviour> + '_ {
        DeviceBehaviour::ALL.into_iter().filter(move |b| b.consistent_with(self))
    }
}

/// The behaviours a layout is correct under: for each question, the answers it tolerates (a
/// bit per answer, in declaration order).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Needs {
    wait_prefetch: u8,
    recv_enable: u8,
    send_en_unit: u8,
    self_enable: u8,
    foreign_bind: u8,
}

impl Needs {
    /// Correct whatever the device does.
    pub const ANY: Needs =
        Needs { wait_prefetch: 0b11, recv_enable: 0b11, send_en_unit: 0b11, self_enable: 0b11, foreign_bind: 0b111 };

    /// Only under `w`.
    pub const fn wait_prefetch(mut self, w: WaitPrefetch) -> Needs {
        self.wait_prefetch = 1 << w as u8;
        self
    }
    pub const fn recv_enable(mut self, r: RecvEnable) -> Needs {
        self.recv_enable = 1 << r as u8;
        self
    }
    pub const fn send_en_unit(mut self, u: SendEnUnit) -> Needs {
        self.send_en_unit = 1 << u as u8;
        self
    }
    pub const fn self_enable(mut self, s: SelfEnable) -> Needs {
        self.self_enable = 1 << s as u8;
        self
    }
    /// Only under the foreign-bind answers in `ok`.
    pub const fn foreign_bind(mut self, ok: &[ForeignBind]) -> Needs {
        let mut m = 0u8;
        let mut i = 0;
        while i < ok.len() {
            m |= 1 << ok[i] as u8;
            i += 1;
        }
        self.foreign_bind = m;
        self
    }

    /// Whether a layout with these needs is correct on a device that behaves as `b`.
    pub const fn hold_for(&self, b: &DeviceBehaviour) -> bool {
        self.wait_prefetch & (1 << b.wait_prefetch as u8) != 0
            && self.recv_enable & (1 << b.recv_enable as u8) != 0
            && self.send_en_unit & (1 << b.send_en_unit as u8) != 0
            && self.self_enable & (1 << b.self_enable as u8) != 0
            && self.foreign_bind & (1 << b.foreign_bind as u8) != 0
    }

    /// The first question whose possible answers (under `answers`) these needs do not all
    /// tolerate; `None` when the layout is correct under every behaviour `answers` allow.
    pub fn unmet(&self, answers: &DeviceAnswers) -> Option<Question> {
        let b = answers.possible().find(|b| !self.hold_for(b))?;
        let n = *self;
        Question::ALL.into_iter().find(|q| {
            let one = Needs::ANY;
            let only = match q {
                Question::WaitPrefetch => Needs { wait_prefetch: n.wait_prefetch, ..one },
                Question::RecvEnable => Needs { recv_enable: n.recv_enable, ..one },
                Question::SendEnUnit => Needs { send_en_unit: n.send_en_unit, ..one },
                Question::SelfEnable => Needs { self_enable: n.self_enable, ..one },
                Question::ForeignBind => Needs { foreign_bind: n.foreign_bind, ..one },
            };
            !only.hold_for(&b)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_behaviours_are_distinct_and_paper_is_one_of_them() {
        for (i, a) in DeviceBehaviour::ALL.iter().enumerate() {
            for b in &DeviceBehaviour::ALL[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(DeviceBehaviour::ALL.contains(&DeviceBehaviour::PAPER));
    }

    #[test]
    fn unknown_answers_leave_every_behaviour_possible() {
        assert_eq!(DeviceAnswers::UNKNOWN.possible().count(), 48);
        assert_eq!(DeviceAnswers::exactly(DeviceBehaviour::PAPER).possible().count(), 1);
        let some = DeviceAnswers { foreign_bind: Some(ForeignBind::Refused), ..DeviceAnswers::UNKNOWN };
        assert_eq!(some.possible().count(), 16);
    }

    #[test]
    fn needs_name_the_question_they_fail() {
        let paper = Needs::ANY.wait_prefetch(WaitPrefetch::Stops).foreign_bind(&[ForeignBind::Honoured]);
        assert!(paper.hold_for(&DeviceBehaviour::PAPER));
        assert_eq!(paper.unmet(&DeviceAnswers::exactly(DeviceBehaviour::PAPER)), None);
        assert_eq!(paper.unmet(&DeviceAnswers::UNKNOWN), Some(Question::WaitPrefetch));
        let stops = DeviceAnswers { wait_prefetch: Some(WaitPrefetch::Stops), ..DeviceAnswers::UNKNOWN };
        assert_eq!(paper.unmet(&stops), Some(Question::ForeignBind));
        assert_eq!(Needs::ANY.unmet(&DeviceAnswers::UNKNOWN), None);
    }
}
