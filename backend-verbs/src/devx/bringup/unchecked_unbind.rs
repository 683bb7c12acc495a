//! `unchecked_unbind`: does an invalidate **without** the QPN check revoke a type-2 window
//! bound to another QP? (docs/MLX5.md question 21, `omw_core::device::behaviour::UncheckedUnbind`)
//!
//! The free chain unbinds a group's access windows from the CN's Free QP, and the MN its own
//! windows from its admin QP, with rdma-core's LOCAL_INV UMR (`set_bind_wr(qp,
//! IBV_MW_TYPE_2, 0, …)` in `providers/mlx5/qp.c`) less its `CHECK_QPN` flag and the QPN in its
//! mask — a form rdma-core never emits. Two connected pairs, A–A′ and B–B′, in the window's
//! protection domain. B binds a fresh type-2 window over 4 KiB of pattern to **itself** (the
//! poster: correct whatever `foreign_bind` answers) and B′ READs through it (the control). Then
//! A posts the unchecked invalidate of the window's key, and B′ READs again:
//!
//! | invalidate on A | READ from B′ after | answer |
//! |---|---|---|
//! | error completion | – | [`UncheckedUnbind::Refused`] |
//! | success | access error | [`UncheckedUnbind::Honoured`] |
//! | success | data | unknown: it completed, yet the window still answers |
//!
//! A control that fails (the bind on B, the first READ) leaves it unknown.

use super::{pattern, show, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::UncheckedUnbind;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::Wqe;

/// What a READ, the bind or the invalidate did (as in `foreign_bind`).
pub use super::foreign_bind::{Outcome, READ_LEN};

/// What the step saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    pub bind: Outcome,
    pub read_before: Outcome,
    pub unbind: Outcome,
    pub read_after: Outcome,
}

pub fn verdict(o: &Observed) -> Finding<UncheckedUnbind> {
    match (o.bind, o.read_before, o.unbind, o.read_after) {
        (Some(true), Some(true), Some(false), _) => Finding::Answer(UncheckedUnbind::Refused),
        (Some(true), Some(true), Some(true), Some(false)) => Finding::Answer(UncheckedUnbind::Honoured),
        (Some(true), Some(true), Some(true), Some(true)) => {
            Finding::Unknown("the invalidate completed, yet the window still answered a READ")
        }
        (Some(true), Some(true), None, _) => Finding::Unknown("the invalidate never completed"),
        (Some(true), Some(true), Some(true), None) => Finding::Unknown("the READ after the invalidate never completed"),
        (Some(true), _, _, _) => Finding::Unknown("the control READ through the window failed"),
        _ => Finding::Unknown("the control bind of the window to its own QP failed"),
    }
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<UncheckedUnbind>, DevxError> {
    let (mut a, _ap) = rig.pair(CdRole::empty(), CdRole::empty())?;
    let (mut b, mut bp) = rig.pair(CdRole::empty(), CdRole::empty())?;
    rig.say(format_args!("pairs A {:#x} and B {:#x}–B' {:#x}", a.qpn(), b.qpn(), bp.qpn()));
    let buf = rig.buffer(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::MW_BIND)?;
    let data = pattern(READ_LEN);
    rig.fill(buf.addr, &data)?;
    let mw = rig.dev.alloc_mw()?;
    let key = (mw & 0xFFFF_FF00) | (mw.wrapping_add(1) & 0xFF);
    let mut o = Observed::default();
    let bind = Wqe::bind_mw(key, buf.addr, 4096, buf.keys.lkey, b.qpn(), AccessFlags::REMOTE_READ);
    rig.post_plain(&mut b, &bind)?;
    let bound = rig.poll(&mut b.send_cq)?;
    o.bind = bound.map(|c| c.error.is_none());
    rig.say(format_args!("window {mw:#010x}: bound on B to B, key {key:#010x}: {}", show(&bound)));
    if o.bind != Some(true) {
        return Ok(verdict(&o));
    }
    o.read_before = rig.read_through_window(&mut bp, &buf, 0x1000, key, &data, "B' (control)")?;
    if o.read_before != Some(true) {
        return Ok(verdict(&o));
    }
    rig.post_plain(&mut a, &Wqe::unbind_mw(key))?;
    let inv = rig.poll(&mut a.send_cq)?;
    o.unbind = inv.map(|c| c.error.is_none());
    rig.say(format_args!("invalidate without the QPN check, posted on A: {}", show(&inv)));
    if o.unbind == Some(true) {
        o.read_after = rig.read_through_window(&mut bp, &buf, 0x1800, key, &data, "B' after it")?;
    }
    Ok(verdict(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_decides() {
        let o = |bind, read_before, unbind, read_after| Observed { bind, read_before, unbind, read_after };
        let (ok, err) = (Some(true), Some(false));
        assert_eq!(verdict(&o(ok, ok, err, None)), Finding::Answer(UncheckedUnbind::Refused));
        assert_eq!(verdict(&o(ok, ok, ok, err)), Finding::Answer(UncheckedUnbind::Honoured));
        for bad in [
            o(ok, ok, ok, ok),
            o(ok, ok, None, None),
            o(ok, ok, ok, None),
            o(ok, err, None, None),
            o(err, None, None, None),
            o(None, None, None, None),
        ] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
