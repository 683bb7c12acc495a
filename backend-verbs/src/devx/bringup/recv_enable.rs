//! `recv_enable`: does the doorbell record make a receive available on a `cd_slave_receive`
//! queue, or only a RECV_EN?
//!
//! QP R (`cd_slave_receive`) gets one receive WQE, published by its doorbell record as
//! `arm_chain` publishes a chain's receives; QP S, connected to R, SENDs 64 bytes to it (RNR
//! retry 7: the SEND waits for a receive for ever rather than failing). Landing now is
//! [`RecvEnable::Doorbell`]. Otherwise QP M (`cd_master`) posts RECV_EN of R up to receive
//! index 1; landing then is [`RecvEnable::RecvEnOnly`]. Neither is unknown (no receive is
//! ever consumed — the chains could not run), as is a SEND that fails.

use super::{pattern, show, EnableAt, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::RecvSge;
use omw_core::device::behaviour::RecvEnable;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::{QueueSel, Wqe};

/// What the step saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    /// The SEND's data reached the receive buffer with only the doorbell record published.
    pub landed_by_doorbell: bool,
    /// The SEND completed in error before any RECV_EN.
    pub send_failed: bool,
    /// The RECV_EN's completion: `Some(true)` success, `Some(false)` error, `None` none (or
    /// not posted).
    pub recv_en: Option<bool>,
    /// The data reached the buffer after the RECV_EN.
    pub landed_after_recv_en: bool,
}

pub fn verdict(o: &Observed) -> Finding<RecvEnable> {
    if o.landed_by_doorbell {
        return Finding::Answer(RecvEnable::Doorbell);
    }
    if o.send_failed {
        return Finding::Unknown("the SEND failed before any RECV_EN (its syndrome is printed above)");
    }
    if o.landed_after_recv_en {
        return Finding::Answer(RecvEnable::RecvEnOnly);
    }
    if o.recv_en == Some(false) {
        return Finding::Unknown("the receive was not available through the doorbell, and RECV_EN completed in error");
    }
    Finding::Unknown("the receive was consumed neither after the doorbell nor after a RECV_EN")
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<RecvEnable>, DevxError> {
    let mut r = rig.qp(CdRole::SLAVE_RECEIVE, true)?;
    let mut s = rig.qp(CdRole::empty(), false)?;
    rig.connect(&r, &s)?;
    let (mut m, mp) = (rig.qp(CdRole::MASTER, false)?, rig.qp(CdRole::empty(), false)?);
    rig.connect(&m, &mp)?;
    rig.say(format_args!(
        "R {:#x} (cd_slave_receive) and S {:#x} connected; M {:#x} (cd_master)",
        r.qpn(),
        s.qpn(),
        m.qpn()
    ));
    let buf = rig.buffer(4096, AccessFlags::LOCAL_WRITE)?;
    let (src, dst) = (buf.addr, buf.addr + 0x800);
    rig.fill(src, &pattern(64))?;
    rig.post_recv(&mut r, &[RecvSge { addr: dst, length: 64, lkey: buf.keys.lkey }])?;
    rig.post_plain(&mut s, &Wqe::send(src, buf.keys.lkey, 64))?;
    rig.settle();
    let sent = rig.poll(&mut s.send_cq)?;
    let mut o = Observed {
        landed_by_doorbell: rig.landed(dst, 64)?,
        send_failed: sent.is_some_and(|c| c.error.is_some()),
        ..Observed::default()
    };
    let received = match r.recv_cq.as_mut() {
        Some(c) => rig.poll(c)?,
        None => None,
    };
    rig.say(format_args!(
        "a receive published by R's doorbell record, a SEND from S: SEND {}; R's receive {}; landed {}",
        show(&sent),
        show(&received),
        o.landed_by_doorbell
    ));
    if !o.landed_by_doorbell && !o.send_failed {
        let en = Wqe::enable(r.qpn(), QueueSel::Recv, 1).with_flags(omw_core::wire::wqe::WqeFlags::SIGNALED);
        rig.post(&mut m, &en, &mut EnableAt(1))?;
        let en = rig.poll(&mut m.send_cq)?;
        o.recv_en = en.map(|c| c.error.is_none());
        rig.settle();
        o.landed_after_recv_en = rig.landed(dst, 64)?;
        let sent = if sent.is_none() { rig.poll(&mut s.send_cq)? } else { None };
        rig.say(format_args!(
            "RECV_EN of R to receive index 1 on M: {}; then the SEND {}; landed {}",
            show(&en),
            show(&sent),
            o.landed_after_recv_en
        ));
    }
    Ok(verdict(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observations_decide() {
        let o = Observed::default();
        assert_eq!(verdict(&Observed { landed_by_doorbell: true, ..o }), Finding::Answer(RecvEnable::Doorbell));
        assert_eq!(
            verdict(&Observed { recv_en: Some(true), landed_after_recv_en: true, ..o }),
            Finding::Answer(RecvEnable::RecvEnOnly)
        );
        for bad in [
            o,
            Observed { recv_en: Some(true), ..o },
            Observed { recv_en: Some(false), ..o },
            Observed { send_failed: true, landed_after_recv_en: true, ..o },
        ] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
