//! `foreign_bind`: is a type-2 bind posted on one QP that names another honoured?
//!
//! Two connected pairs, A–A′ and B–B′, in the window's protection domain. A posts a signaled
//! bind (the encoder's UMR) of a fresh type-2 window over 4 KiB of pattern, naming **B** as
//! the QP the window is bound to. Then B′ READs 256 bytes through the window (the request
//! arrives on B), and A′ does the same (it arrives on A):
//!
//! | bind | READ from B′ | READ from A′ | answer |
//! |---|---|---|---|
//! | error completion | – | – | [`ForeignBind::Refused`] |
//! | success | data | access error | [`ForeignBind::Honoured`] |
//! | success | access error | data | [`ForeignBind::BoundToPoster`] |
//!
//! Both READs succeeding (the window is not bound to one QP) or neither is unknown.

use super::{pattern, show, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::ForeignBind;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::Wqe;

/// Bytes each READ through the window fetches.
pub const READ_LEN: usize = 256;

/// A work request's outcome: `None` no completion, `Some(true)` success (for a READ: and the
/// data arrived), `Some(false)` an error completion (or a READ whose data did not arrive).
pub type Outcome = Option<bool>;

/// What the step saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    pub bind: Outcome,
    pub read_from_b: Outcome,
    pub read_from_a: Outcome,
}

pub fn verdict(o: &Observed) -> Finding<ForeignBind> {
    match (o.bind, o.read_from_b, o.read_from_a) {
        (None, _, _) => Finding::Unknown("the bind never completed"),
        (Some(false), _, _) => Finding::Answer(ForeignBind::Refused),
        (Some(true), Some(true), Some(false)) => Finding::Answer(ForeignBind::Honoured),
        (Some(true), Some(false), Some(true)) => Finding::Answer(ForeignBind::BoundToPoster),
        (Some(true), Some(true), Some(true)) => {
            Finding::Unknown("the window answered READs arriving on both QPs: it is not bound to one QP")
        }
        (Some(true), Some(false), Some(false)) => {
            Finding::Unknown("the bind completed, yet no READ through the window succeeded")
        }
        _ => Finding::Unknown("a READ through the window never completed"),
    }
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<ForeignBind>, DevxError> {
    let (mut a, mut ap) = rig.pair(CdRole::empty(), CdRole::empty())?;
    let (b, mut bp) = rig.pair(CdRole::empty(), CdRole::empty())?;
    rig.say(format_args!("pairs A {:#x}–A' {:#x} and B {:#x}–B' {:#x}", a.qpn(), ap.qpn(), b.qpn(), bp.qpn()));
    let buf = rig.buffer(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::MW_BIND)?;
    let data = pattern(READ_LEN);
    rig.fill(buf.addr, &data)?;
    let mw = rig.dev.alloc_mw()?;
    let key = (mw & 0xFFFF_FF00) | (mw.wrapping_add(1) & 0xFF);
    let bind = Wqe::bind_mw(key, buf.addr, 4096, buf.keys.lkey, b.qpn(), AccessFlags::REMOTE_READ);
    rig.post_plain(&mut a, &bind)?;
    let bound = rig.poll(&mut a.send_cq)?;
    let mut o = Observed { bind: bound.map(|c| c.error.is_none()), ..Observed::default() };
    rig.say(format_args!("window {mw:#010x}: bind posted on A naming B, key {key:#010x}: {}", show(&bound)));
    if o.bind == Some(true) {
        o.read_from_b = rig.read_through_window(&mut bp, &buf, 0x1000, key, &data, "B'")?;
        o.read_from_a = rig.read_through_window(&mut ap, &buf, 0x1800, key, &data, "A'")?;
    }
    Ok(verdict(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_decides() {
        let o = |bind, read_from_b, read_from_a| Observed { bind, read_from_b, read_from_a };
        let (ok, err) = (Some(true), Some(false));
        assert_eq!(verdict(&o(err, None, None)), Finding::Answer(ForeignBind::Refused));
        assert_eq!(verdict(&o(ok, ok, err)), Finding::Answer(ForeignBind::Honoured));
        assert_eq!(verdict(&o(ok, err, ok)), Finding::Answer(ForeignBind::BoundToPoster));
        for bad in [o(None, None, None), o(ok, ok, ok), o(ok, err, err), o(ok, None, err), o(ok, ok, None)] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
