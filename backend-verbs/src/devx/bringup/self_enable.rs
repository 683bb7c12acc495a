//! `self_enable`: does a queue's SEND_EN of itself release its own WQEs?
//!
//! QP Q (`cd_master | cd_slave_send`, the loop QP's roles) holds a signaled SEND_EN of Q to
//! index 3 at index 0, then WRITEs W1, W2, W3 at indices 1, 2, 3; its doorbell is rung to
//! index 1 only — the SEND_EN — as `arm_chain` rings a loop ring to its first enable index.
//! W1 and W2 landing (not W3: index 3 is not below 3) is [`SelfEnable::Honoured`]; the
//! SEND_EN completing with nothing landing, [`SelfEnable::Ignored`]. Nothing running at all
//! means the doorbell did not start the slave queue (docs/MLX5.md question 16), and W3
//! landing that the queue is not gated at all: both unknown.

use super::{pattern, show, EnableAt, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::SelfEnable;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::{QueueSel, Wqe};

/// What the step saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    /// The SEND_EN's completion: `Some(true)` success, `Some(false)` error, `None` none.
    pub enable: Option<bool>,
    /// W1, W2, W3 landed.
    pub landed: [bool; 3],
}

pub fn verdict(o: &Observed) -> Finding<SelfEnable> {
    match (o.landed, o.enable) {
        ([_, _, true], _) => {
            Finding::Unknown("a WRITE beyond the doorbell and the SEND_EN ran: the slave queue is not gated")
        }
        ([true, true, false], _) => Finding::Answer(SelfEnable::Honoured),
        ([false, false, false], Some(true)) => Finding::Answer(SelfEnable::Ignored),
        ([false, false, false], Some(false)) => {
            Finding::Unknown("the self SEND_EN completed in error (syndrome printed above)")
        }
        ([false, false, false], None) => Finding::Unknown(
            "nothing ran: the doorbell did not start the cd_slave_send queue (docs/MLX5.md question 16)",
        ),
        _ => Finding::Unknown("only part of what the self SEND_EN released ran"),
    }
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<SelfEnable>, DevxError> {
    let (mut q, _p) = rig.pair(CdRole::MASTER | CdRole::SLAVE_SEND, CdRole::empty())?;
    rig.say(format_args!("Q {:#x} (cd_master | cd_slave_send) connected to its peer", q.qpn()));
    let buf = rig.buffer(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    rig.fill(buf.addr, &pattern(8))?;
    let dst = [buf.addr + 0x1000, buf.addr + 0x1100, buf.addr + 0x1200];
    // signaled: its completion tells "ignored" (completes, releases nothing) from "nothing ran"
    let me = Wqe::enable(q.qpn(), QueueSel::Send, 0).with_flags(omw_core::wire::wqe::WqeFlags::SIGNALED);
    let en = rig.write(&mut q, &me, &mut EnableAt(3))?;
    for d in dst {
        rig.write(
            &mut q,
            &Wqe::write(buf.addr, buf.keys.lkey, 8, d, buf.keys.rkey),
            &mut omw_core::mlx5::encode::Unmanaged,
        )?;
    }
    let first = en.add(1);
    rig.ring(&q, first)?;
    rig.say(format_args!(
        "on Q: SEND_EN of Q to 3 at index {}, WRITEs W1..W3 at 1..3; doorbell to {} (the SEND_EN alone)",
        en.get(),
        first.get()
    ));
    rig.settle();
    let mut o = Observed::default();
    while let Some(c) = rig.poll(&mut q.send_cq)? {
        if c.wqe_counter.get() == en.get() {
            o.enable = Some(c.error.is_none());
        }
        rig.say(format_args!("Q: {}", show(&Some(c))));
    }
    o.landed = [rig.landed(dst[0], 8)?, rig.landed(dst[1], 8)?, rig.landed(dst[2], 8)?];
    rig.say(format_args!("SEND_EN completed {:?}; landed [W1, W2, W3] = {:?}", o.enable, o.landed));
    Ok(verdict(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observations_decide() {
        let o = |enable, landed| Observed { enable, landed };
        assert_eq!(verdict(&o(Some(true), [true, true, false])), Finding::Answer(SelfEnable::Honoured));
        assert_eq!(verdict(&o(None, [true, true, false])), Finding::Answer(SelfEnable::Honoured));
        assert_eq!(verdict(&o(Some(true), [false; 3])), Finding::Answer(SelfEnable::Ignored));
        for bad in [
            o(None, [false; 3]),
            o(Some(false), [false; 3]),
            o(Some(true), [true; 3]),
            o(Some(true), [true, false, false]),
        ] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
