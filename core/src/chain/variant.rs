//! Which chain layout a CORE-Direct device gets, from what its bring-up answered.
//!
//! Every layout states the device behaviours it is correct under ([`Needs`], over the open
//! questions of `device::behaviour`); the MN takes the first layout whose needs hold under
//! every behaviour the device's answers leave possible — an unknown answer counts as "any" —
//! and refuses to offload, naming the question, when none does.
//!
//! What the layouts the builders make today need, and why:
//! - **WAIT prefetch: any.** The validator counts only enable limits as fetch bounds
//!   (`ChainLayout::happens_before`): every WQE a scatter or a chain step patches lies beyond
//!   an enable limit raised only after the patch completed.
//! - **SEND_EN in the unit the device counts.** The mlx5 form's enable indices and lap
//!   counters count WQEBBs or WQEs, whichever the variant says (`Mlx5Scratch::send_en_unit`,
//!   `chain::mlx5`): an index in the wrong unit would release a multi-WQEBB bind or scatter
//!   READ early (or stall the ring), so each unit is its own variant and an unknown answer
//!   admits neither.
//! - **Self-enable: honoured, or any with relayed gates.** A phase gate is a FENCEd ENABLE of
//!   the Loop ring by itself. No public source shows a queue's SEND_EN of itself running
//!   (DPDK gives each QP one cd role), so the variants with `relays_gates` put no ENABLE of a
//!   queue on that queue: each gate becomes a FENCEd ENABLE of the management ring by the Loop
//!   ring, which releases exactly one management-ring ENABLE of the Loop ring (the relay) —
//!   relative counts, so nothing more to bump per lap in canonical form; in mlx5 form each
//!   relay is one more SEND_EN with its lap counter. What it costs: one more gated fetch per
//!   gate (the relay's hop through the management queue) and two WQEs per gate per lap in
//!   mlx5 form (`chain_cost_bounds`, docs/CHAINS.md).
//! - **Foreign binds: honoured, or any with binds to the poster.** The alloc chain posts every
//!   BIND on the management QP. The paper's layout names the CN's Free QP for MW\[0\] (the
//!   free chain's ownership proof is a checked LOCAL_INV there) and the access QPs the request
//!   names. rdma-core and libmlx5 only ever name the posting QP (`providers/mlx5/qp.c`), so a
//!   device may refuse another QP or bind to the poster silently. The variants with
//!   `binds_to_poster` name only the poster: MW\[0\] is bound to the alloc chain's own
//!   management QP, the CN names that QP for its access windows too (it reaches its windows
//!   through its Alloc QP, `ConnectInfo::access_qpns`), and the free chain proves ownership
//!   without a window — its proof READ's local key is the owner's proof key, copied out of the
//!   MWTable entry, and its local address the requester's own proof word, which only the
//!   requester's proof MR covers (`chain::free`). What it costs: the CN has no access QPs of
//!   its own (its accesses share the Alloc QP with its requests), one alloc chain per CN, one
//!   more gated phase and one loopback READ per free, one MR per CN slot.
//! - **Receives: by the doorbell, or by the chain.** The device posts every receive slot of a
//!   chain's management QP through the doorbell record when the chain is armed and hands each
//!   consumed one back when the MN drains the chain's CQs (`DevxBackend`); DEVX has no
//!   host-side RECV_EN. The chain's per-lap receive ENABLE (a RECV_EN, whose effect no public
//!   source settles) admits the *next* lap's request: where only RECV_EN makes a receive
//!   available, lap 0's request would never land. The variants with
//!   `lap_enables_its_receive` open each lap with a RECV_EN of its own receive and are correct
//!   either way; the others need the doorbell.

use crate::device::behaviour::{DeviceAnswers, ForeignBind, Needs, Question, RecvEnable, SelfEnable, SendEnUnit};
use core::fmt;

/// A chain layout the builders can make, by what it needs of the device: binds on the
/// management QP naming other QPs — and SEND_EN indices in `send_en_unit`; with
/// `lap_enables_its_receive`, receives enabled by the chain itself; without `relays_gates`,
/// phase gates that enable their own queue.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub struct ChainVariant {
    /// The unit the chain's SEND_EN indices and their lap counters count.
    pub send_en_unit: SendEnUnit,
    /// Each lap starts with a RECV_EN of its own request's receive (a canonical receive
    /// ENABLE of count 0: in mlx5 form the absolute index `lap + 1`), so a device that makes
    /// receives available only through RECV_EN lands lap 0's request too — the tail's RECV_EN
    /// only ever admits the next lap's. Where the doorbell enables receives it is ignored.
    /// Costs one WQE and one lap-counter bump per lap, off the request's path.
    pub lap_enables_its_receive: bool,
    /// No queue enables itself: every Loop-ring phase gate (and the lap-closing ENABLE) is a
    /// FENCEd ENABLE of the management ring, which runs the ENABLE of the Loop ring (the
    /// relay) — correct whether or not a device honours a queue's ENABLE of itself
    /// (`SelfEnable`). Costs one gated hop per gate.
    pub relays_gates: bool,
    /// Every BIND names the QP that posts it (the alloc chain's management QP); the free chain
    /// proves ownership with the owner's proof key (module doc) — correct whatever a device
    /// does with a bind naming another QP (`ForeignBind`).
    pub binds_to_poster: bool,
}

impl ChainVariant {
    /// SEND_EN indices in WQEBBs (Mellanox PCX's `cd_send_enable`), receives from the
    /// doorbell: the paper's device.
    pub const WQEBB_ENABLES: ChainVariant = ChainVariant {
        send_en_unit: SendEnUnit::Wqebb,
        lap_enables_its_receive: false,
        relays_gates: false,
        binds_to_poster: false,
    };
    /// SEND_EN indices in WQEs (MLNX_OFED libmlx5's `sq.head`).
    pub const WQE_ENABLES: ChainVariant = ChainVariant { send_en_unit: SendEnUnit::Wqe, ..Self::WQEBB_ENABLES };

    /// `self` with every lap enabling its own receive.
    pub const fn enabling_receives(self) -> ChainVariant {
        ChainVariant { lap_enables_its_receive: true, ..self }
    }

    /// `self` with every gate relayed through the management ring.
    pub const fn relaying_gates(self) -> ChainVariant {
        ChainVariant { relays_gates: true, ..self }
    }

    /// `self` with every bind naming the QP that posts it, and ownership proved by the owner's
    /// proof key instead of MW\[0\] (module doc).
    pub const fn binding_to_poster(self) -> ChainVariant {
        ChainVariant { binds_to_poster: true, ..self }
    }

    /// The layouts that bind as the paper does, in the order the MN prefers them.
    pub const PAPER_BINDS: [ChainVariant; 8] = [
        Self::WQEBB_ENABLES,
        Self::WQE_ENABLES,
        Self::WQEBB_ENABLES.enabling_receives(),
        Self::WQE_ENABLES.enabling_receives(),
        Self::WQEBB_ENABLES.relaying_gates(),
        Self::WQE_ENABLES.relaying_gates(),
        Self::WQEBB_ENABLES.enabling_receives().relaying_gates(),
        Self::WQE_ENABLES.enabling_receives().relaying_gates(),
    ];

    /// [`ChainVariant::PAPER_BINDS`] with binds to the poster.
    pub const BINDING_TO_POSTER: [ChainVariant; 8] = {
        let mut all = Self::PAPER_BINDS;
        let mut i = 0;
        while i < all.len() {
            all[i] = all[i].binding_to_poster();
            i += 1;
        }
        all
    };

    /// Every layout, in the order the MN prefers them (the cheaper first): the paper's binds
    /// before binds to the poster, which cost a gated phase per free and the CN's own access
    /// QPs for data.
    pub const ALL: [ChainVariant; 16] = {
        let mut all = [Self::WQEBB_ENABLES; 16];
        let mut i = 0;
        while i < 8 {
            all[i] = Self::PAPER_BINDS[i];
            all[i + 8] = Self::BINDING_TO_POSTER[i];
            i += 1;
        }
        all
    };

    /// The device behaviours this layout is correct under.
    pub const fn needs(self) -> Needs {
        let n = Needs::ANY.send_en_unit(self.send_en_unit);
        let n = if self.binds_to_poster { n } else { n.foreign_bind(&[ForeignBind::Honoured]) };
        let n = if self.relays_gates { n } else { n.self_enable(SelfEnable::Honoured) };
        if self.lap_enables_its_receive {
            n
        } else {
            n.recv_enable(RecvEnable::Doorbell)
        }
    }

    /// The first layout correct under every behaviour `answers` leave possible. Where none is,
    /// the refusal names the layout that got furthest through `Question::ALL` and the question
    /// it stopped at — so a question another layout tolerates unanswered is not asked first.
    pub fn choose(answers: &DeviceAnswers) -> Result<ChainVariant, NoVariant> {
        let rank = |q: Question| Question::ALL.iter().position(|x| *x == q).unwrap_or(0);
        let mut furthest: Option<(ChainVariant, Question)> = None;
        for v in Self::ALL {
            match v.needs().unmet(answers) {
                None => return Ok(v),
                Some(q) => {
                    if furthest.is_none_or(|(_, f)| rank(q) > rank(f)) {
                        furthest = Some((v, q));
                    }
                }
            }
        }
        let (variant, question) = furthest.ok_or(NoVariant { variant: None, question: None, answers: *answers })?;
        Err(NoVariant { variant: Some(variant), question: Some(question), answers: *answers })
    }
}

impl Default for ChainVariant {
    /// The paper's device: [`ChainVariant::WQEBB_ENABLES`].
    fn default() -> Self {
        Self::WQEBB_ENABLES
    }
}

/// No layout is correct under every behaviour the device's answers leave possible.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct NoVariant {
    /// The layout that got furthest (`ChainVariant::choose`) and the question it could not
    /// tolerate the answer to.
    pub variant: Option<ChainVariant>,
    pub question: Option<Question>,
    pub answers: DeviceAnswers,
}

impl fmt::Display for NoVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.variant, self.question) {
            (Some(v), Some(q)) => write!(
                f,
                "no chain layout is correct on this device: the closest one ({v:?}) needs a different answer to \"{q}\" \
                 (profile key {}) than the device gave or left unknown",
                q.key()
            ),
            _ => f.write_str("no chain layout is known"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::behaviour::{DeviceBehaviour, WaitPrefetch};

    #[test]
    fn the_layout_tolerates_prefetch_past_waits() {
        let mut b = DeviceBehaviour::PAPER;
        b.wait_prefetch = WaitPrefetch::FetchesPast;
        assert_eq!(ChainVariant::choose(&DeviceAnswers::exactly(b)), Ok(ChainVariant::WQEBB_ENABLES));
        // and an unknown prefetch answer is no reason to refuse
        let answers = DeviceAnswers { wait_prefetch: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) };
        assert_eq!(ChainVariant::choose(&answers), Ok(ChainVariant::WQEBB_ENABLES));
    }

    #[test]
    fn receives_gated_by_recv_en_or_unknown_get_laps_that_enable_their_own() {
        let mut b = DeviceBehaviour::PAPER;
        b.recv_enable = RecvEnable::RecvEnOnly;
        assert_eq!(
            ChainVariant::choose(&DeviceAnswers::exactly(b)),
            Ok(ChainVariant::WQEBB_ENABLES.enabling_receives())
        );
        b.send_en_unit = SendEnUnit::Wqe;
        assert_eq!(ChainVariant::choose(&DeviceAnswers::exactly(b)), Ok(ChainVariant::WQE_ENABLES.enabling_receives()));
        let answers = DeviceAnswers { recv_enable: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) };
        assert_eq!(ChainVariant::choose(&answers), Ok(ChainVariant::WQEBB_ENABLES.enabling_receives()));
        // the paper's device keeps the tail's RECV_EN
        assert_eq!(
            ChainVariant::choose(&DeviceAnswers::exactly(DeviceBehaviour::PAPER)),
            Ok(ChainVariant::WQEBB_ENABLES)
        );
    }

    /// Unknown answers: the refusal names a question no layout tolerates unanswered (the SEND_EN
    /// unit), not one some layout does (how receives are enabled).
    #[test]
    fn the_refusal_names_a_question_that_must_be_answered() {
        let e = ChainVariant::choose(&DeviceAnswers::UNKNOWN).unwrap_err();
        assert_eq!(e.question, Some(Question::SendEnUnit));
        // the SEND_EN unit alone is enough: the layout that tolerates every other answer
        let answers = DeviceAnswers { send_en_unit: Some(SendEnUnit::Wqebb), ..DeviceAnswers::UNKNOWN };
        assert_eq!(
            ChainVariant::choose(&answers),
            Ok(ChainVariant::WQEBB_ENABLES.enabling_receives().relaying_gates().binding_to_poster())
        );
    }

    /// A device that ignores (or has not said whether it honours) a queue's ENABLE of itself
    /// gets the layout whose gates go through the management ring; the paper's device keeps
    /// the self-enabling one, which costs fewer hops.
    #[test]
    fn self_enable_ignored_or_unknown_gets_relayed_gates() {
        let mut b = DeviceBehaviour::PAPER;
        b.self_enable = SelfEnable::Ignored;
        assert_eq!(ChainVariant::choose(&DeviceAnswers::exactly(b)), Ok(ChainVariant::WQEBB_ENABLES.relaying_gates()));
        b.recv_enable = RecvEnable::RecvEnOnly;
        b.send_en_unit = SendEnUnit::Wqe;
        assert_eq!(
            ChainVariant::choose(&DeviceAnswers::exactly(b)),
            Ok(ChainVariant::WQE_ENABLES.enabling_receives().relaying_gates())
        );
        let answers = DeviceAnswers { self_enable: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) };
        assert_eq!(ChainVariant::choose(&answers), Ok(ChainVariant::WQEBB_ENABLES.relaying_gates()));
        for v in ChainVariant::ALL {
            let ignored = DeviceBehaviour { self_enable: SelfEnable::Ignored, ..DeviceBehaviour::PAPER };
            assert_eq!(v.needs().hold_for(&ignored), v.relays_gates && v.send_en_unit == SendEnUnit::Wqebb, "{v:?}");
        }
    }

    #[test]
    fn each_send_en_unit_has_its_variant_and_an_unknown_unit_has_none() {
        let mut b = DeviceBehaviour::PAPER;
        b.send_en_unit = SendEnUnit::Wqe;
        assert_eq!(ChainVariant::choose(&DeviceAnswers::exactly(b)), Ok(ChainVariant::WQE_ENABLES));
        let answers = DeviceAnswers { send_en_unit: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) };
        let e = ChainVariant::choose(&answers).unwrap_err();
        assert_eq!(e.question, Some(Question::SendEnUnit));
    }

    #[test]
    fn a_foreign_bind_refused_redirected_or_unknown_gets_binds_to_the_poster() {
        for fb in [ForeignBind::Refused, ForeignBind::BoundToPoster] {
            let b = DeviceBehaviour { foreign_bind: fb, ..DeviceBehaviour::PAPER };
            assert_eq!(
                ChainVariant::choose(&DeviceAnswers::exactly(b)),
                Ok(ChainVariant::WQEBB_ENABLES.binding_to_poster())
            );
        }
        let answers = DeviceAnswers { foreign_bind: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) };
        assert_eq!(ChainVariant::choose(&answers), Ok(ChainVariant::WQEBB_ENABLES.binding_to_poster()));
        // the paper's device keeps its binds (cheaper frees, the CN's own access QPs)
        assert_eq!(
            ChainVariant::choose(&DeviceAnswers::exactly(DeviceBehaviour::PAPER)),
            Ok(ChainVariant::WQEBB_ENABLES)
        );
        // every one of the 48 behaviours has a layout, binding to the poster exactly where
        // foreign binds are not honoured
        for b in DeviceBehaviour::ALL {
            let v = ChainVariant::choose(&DeviceAnswers::exactly(b)).unwrap();
            assert!(v.needs().hold_for(&b), "{b:?} {v:?}");
            assert_eq!(v.binds_to_poster, b.foreign_bind != ForeignBind::Honoured, "{b:?}");
        }
    }

    /// Each layout binding to the poster is correct under every foreign-bind answer, and
    /// needs what its paper-binds twin needs of every other question.
    #[test]
    fn binds_to_the_poster_tolerate_every_foreign_bind_answer() {
        for (paper, poster) in ChainVariant::PAPER_BINDS.into_iter().zip(ChainVariant::BINDING_TO_POSTER) {
            for b in DeviceBehaviour::ALL {
                let twin = DeviceBehaviour { foreign_bind: ForeignBind::Honoured, ..b };
                assert_eq!(poster.needs().hold_for(&b), paper.needs().hold_for(&twin), "{poster:?} {b:?}");
            }
        }
        // and with them every one of the 48 behaviours has a layout
        for b in DeviceBehaviour::ALL {
            assert!(ChainVariant::BINDING_TO_POSTER.iter().any(|v| v.needs().hold_for(&b)), "{b:?}");
        }
    }

    #[test]
    fn unknown_answers_are_refused_with_the_question() {
        let e = ChainVariant::choose(&DeviceAnswers::UNKNOWN).unwrap_err();
        assert!(e.question.is_some());
        assert!(std::format!("{e}").contains(e.question.unwrap().key()));
    }
}
