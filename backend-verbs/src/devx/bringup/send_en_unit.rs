//! `send_en_unit`: does a SEND_EN's index count WQEBBs or WQEs?
//!
//! QP B (`cd_slave_send`) holds W0, a READ scattered over 14 one-byte segments (4 WQEBBs:
//! indices 0..4), then two 8-byte WRITEs W1 (index 4) and W2 (index 5), no doorbell rung (a
//! doorbell may release a slave queue too — the arm starts a loop ring's first lap so — and
//! would hide the unit). QP M (`cd_master`) then SEND_ENs B to index 4, and later to 5 — both
//! at WQE boundaries in WQEBBs, so no WQE is ever half released (whether a device runs a WQE
//! whose first WQEBB alone is released is not this question):
//!
//! | unit | after SEND_EN 4 | after SEND_EN 5 |
//! |---|---|---|
//! | WQEBBs | W0 (its four WQEBBs; W1 at index 4 is not below 4) | W0, W1 (W2 at 5 is not below 5) |
//! | WQEs   | W0, W1, W2 (four WQEs: all there are) | W0, W1, W2 |
//!
//! All three landing after the first SEND_EN is [`SendEnUnit::Wqe`]; W0 alone after it and W1 after
//! the second, [`SendEnUnit::Wqebb`] (W2 too after the second: WQEBBs with an inclusive
//! index, which the chains do not assume — printed). Anything landing before any SEND_EN means the slave queue ran
//! unreleased, and the unit cannot be seen. A scatter READ is the multi-WQEBB WQE here
//! rather than a 3-WQEBB bind: its landing is seen directly (a bind only through a later READ)
//! and it is what the chains' byte-reversing copies are.

use super::{pattern, show, EnableAt, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::SendEnUnit;
use omw_core::mlx5::data::DataSeg;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::{QueueSel, Wqe, WqeFlags};

/// Scatter segments of W0: `ds` = 2 + 14 = 16, four WQEBBs.
pub const W0_SGES: usize = 14;
/// The SEND_EN indices, in order.
pub const ENABLES: [u16; 2] = [4, 5];

/// Which of W0, W1, W2 had landed: before any SEND_EN, after the first, after the second.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    pub before: [bool; 3],
    pub after: [[bool; 3]; 2],
}

pub fn verdict(o: &Observed) -> Finding<SendEnUnit> {
    if o.before.iter().any(|x| *x) {
        return Finding::Unknown("the slave queue ran before any SEND_EN: the unit cannot be seen");
    }
    let [first, second] = o.after;
    match (first, second) {
        ([true, true, true], _) => Finding::Answer(SendEnUnit::Wqe),
        ([true, false, false], [true, true, _]) => Finding::Answer(SendEnUnit::Wqebb),
        ([false, false, false], [false, false, false]) => Finding::Unknown("no SEND_EN released anything"),
        ([false, false, false], _) => Finding::Unknown("SEND_EN to 4 released nothing, SEND_EN to 5 something"),
        _ => Finding::Unknown("SEND_EN released the slave's WQEs out of order"),
    }
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<SendEnUnit>, DevxError> {
    let (mut m, mut b) = rig.pair(CdRole::MASTER, CdRole::SLAVE_SEND)?;
    rig.say(format_args!("M {:#x} (cd_master) and B {:#x} (cd_slave_send) connected", m.qpn(), b.qpn()));
    let buf = rig.buffer(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE)?;
    let src = buf.addr;
    rig.fill(src, &pattern(64))?;
    let dst = [buf.addr + 0x1000, buf.addr + 0x1100, buf.addr + 0x1200];
    let sges: Vec<DataSeg> = (0..W0_SGES as u64).map(|i| DataSeg::new(1, buf.keys.lkey, dst[0] + i)).collect();
    let w0 = rig.write_scatter_read(&mut b, src, buf.keys.rkey, &sges, WqeFlags::SIGNALED)?;
    let mut un = omw_core::mlx5::encode::Unmanaged;
    let w1 = rig.write(&mut b, &Wqe::write(src, buf.keys.lkey, 8, dst[1], buf.keys.rkey), &mut un)?;
    let w2 = rig.write(&mut b, &Wqe::write(src, buf.keys.lkey, 8, dst[2], buf.keys.rkey), &mut un)?;
    // no doorbell: a slave queue runs what SEND_EN releases, as the chains' management rings
    // do (the arm rings no doorbell for a ring whose first enable index is 0) — a doorbell
    // may release it as well (the arm starts the loop ring's first lap that way), which would
    // hide the unit
    rig.say(format_args!(
        "on B: W0 READ over {W0_SGES} one-byte segments at index {} ({} WQEBBs), W1 WRITE at {}, W2 WRITE at {}; no doorbell",
        w0.get(),
        w1.get() - w0.get(),
        w1.get(),
        w2.get(),
    ));
    let lens = [W0_SGES, 8, 8];
    let landed = |rig: &mut Rig<'_, D>| -> Result<[bool; 3], DevxError> {
        Ok([rig.landed(dst[0], lens[0])?, rig.landed(dst[1], lens[1])?, rig.landed(dst[2], lens[2])?])
    };
    rig.settle();
    let mut o = Observed { before: landed(rig)?, ..Observed::default() };
    rig.say(format_args!("before any SEND_EN: landed [W0, W1, W2] = {:?}", o.before));
    for (k, index) in ENABLES.into_iter().enumerate() {
        rig.post(&mut m, &Wqe::enable(b.qpn(), QueueSel::Send, 0), &mut EnableAt(index))?;
        let en = rig.poll(&mut m.send_cq)?;
        rig.settle();
        o.after[k] = landed(rig)?;
        rig.say(format_args!("SEND_EN of B to index {index}: {}; landed [W0, W1, W2] = {:?}", show(&en), o.after[k]));
    }
    while let Some(c) = rig.poll(&mut b.send_cq)? {
        rig.say(format_args!("B: {}", show(&Some(c))));
    }
    let v = verdict(&o);
    if v == Finding::Answer(SendEnUnit::Wqebb) && o.after[1][2] {
        rig.say(format_args!(
            "NOTE: W2 at index 5 ran after SEND_EN to 5: max_index is inclusive here; the chains assume it is the first WQEBB not released"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_decides() {
        let none = [false; 3];
        let o = |before, a, b| Observed { before, after: [a, b] };
        let w0 = [true, false, false];
        assert_eq!(verdict(&o(none, [true, true, true], [true, true, true])), Finding::Answer(SendEnUnit::Wqe));
        assert_eq!(verdict(&o(none, w0, [true, true, false])), Finding::Answer(SendEnUnit::Wqebb));
        assert_eq!(verdict(&o(none, w0, [true, true, true])), Finding::Answer(SendEnUnit::Wqebb));
        for bad in [
            o(w0, w0, [true, true, false]),
            o(none, none, [true, true, false]),
            o(none, none, none),
            o(none, w0, w0),
            o(none, [false, true, false], [true, true, false]),
        ] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
