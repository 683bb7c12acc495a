//! `wait_prefetch`: does an unsatisfied WAIT stop the NIC fetching the WQEs behind it?
//!
//! QP A (`cd_master`) posts a WAIT for QP B's send CQ to reach the next completion, then
//! `gap` unsignaled NOPs, then a signaled 8-byte WRITE to address X, and rings its doorbell
//! past all of them. While the WAIT holds, the host rewrites the WRITE's remote address in
//! A's ring to Y (X and Y differ in one byte of the big-endian `raddr`, so the store cannot be
//! seen half done); then B completes a NOP and the WAIT is satisfied. The WRITE landing at X
//! means the NIC had fetched it before its gate opened — [`WaitPrefetch::FetchesPast`]; at Y
//! that it fetched it after. One trial per gap ([`GAPS`], so the WRITE sits at several
//! distances behind the WAIT); Y in every trial is [`WaitPrefetch::Stops`] — evidence, not
//! proof: a NIC that prefetches only sometimes could still land at Y in all of them. A host
//! store stands in for the chain's READ patch: what matters is that the bytes change while
//! the WQE is gated.

use super::{pattern, show, Finding, Rig, WaitOn};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::WaitPrefetch;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::wqebb::WQEBB;
use omw_core::wire::wqe::{QueueSel, Wqe, WqeFlags};

/// NOPs between the WAIT and the WRITE, one trial each.
pub const GAPS: [usize; 4] = [0, 1, 3, 7];

/// What one trial saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Trial {
    /// Something landed before the WAIT was satisfied.
    pub early: bool,
    pub at_x: bool,
    pub at_y: bool,
}

/// The answer the trials give.
pub fn verdict(trials: &[Trial]) -> Finding<WaitPrefetch> {
    if trials.is_empty() {
        return Finding::Unknown("no trial ran");
    }
    if trials.iter().any(|t| t.early) {
        return Finding::Unknown(
            "a WRITE behind an unsatisfied WAIT ran before the WAIT was satisfied: the WAIT did not gate",
        );
    }
    if trials.iter().any(|t| t.at_x && t.at_y) {
        return Finding::Unknown("one WRITE landed at both addresses");
    }
    if trials.iter().any(|t| t.at_x) {
        return Finding::Answer(WaitPrefetch::FetchesPast);
    }
    if trials.iter().all(|t| t.at_y) {
        return Finding::Answer(WaitPrefetch::Stops);
    }
    Finding::Unknown("a WRITE behind a WAIT landed nowhere once its WAIT was satisfied")
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<WaitPrefetch>, DevxError> {
    let (mut a, mut b) = rig.pair(CdRole::MASTER, CdRole::empty())?;
    rig.say(format_args!(
        "A {:#x} (cd_master) and B {:#x} connected; A's WAITs watch B's send CQ {:#x}",
        a.qpn(),
        b.qpn(),
        b.send_cq.devx.cqn
    ));
    let buf = rig.buffer(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    rig.fill(buf.addr, &pattern(8))?;
    let mut trials = Vec::new();
    for (t, gap) in GAPS.into_iter().enumerate() {
        // X and Y differ in bit 8 alone (the buffer is page-aligned, bits 8..11 of X are 0)
        let x = buf.addr + 0x1000 + 0x10 * t as u64;
        let y = x + 0x100;
        let wait = Wqe::wait(b.qpn(), QueueSel::Send, t as u64 + 1).with_flags(WqeFlags::empty());
        rig.write(&mut a, &wait, &mut WaitOn(b.send_cq.devx.cqn))?;
        for _ in 0..gap {
            rig.write(&mut a, &Wqe::nop().with_flags(WqeFlags::empty()), &mut omw_core::mlx5::encode::Unmanaged)?;
        }
        let at = rig.write(
            &mut a,
            &Wqe::write(buf.addr, buf.keys.lkey, 8, x, buf.keys.rkey),
            &mut omw_core::mlx5::encode::Unmanaged,
        )?;
        rig.ring(&a, a.pi)?;
        rig.settle();
        let early = rig.landed(x, 8)? || rig.landed(y, 8)?;
        // the WRITE's raddr (big-endian, after the 16-byte control segment): byte 6 holds bits 8..15
        let ring = a.devx.sq.len / WQEBB;
        let raddr = a.devx.sq.addr + at.slot(ring) * WQEBB + 16;
        rig.dev.write_mem(raddr + 6, &[(y >> 8) as u8])?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        rig.post_plain(&mut b, &Wqe::nop())?;
        let nop = rig.poll(&mut b.send_cq)?;
        let write = rig.poll(&mut a.send_cq)?;
        rig.settle();
        let trial = Trial { early, at_x: rig.landed(x, 8)?, at_y: rig.landed(y, 8)? };
        rig.say(format_args!(
            "trial {t}: WAIT(PI {}), {gap} NOP(s), WRITE to X; before the gate opened: landed {}; raddr rewritten to Y; B's NOP: {}; the WRITE: {}; landed at X (prefetched) {}, at Y (fetched after the gate) {}",
            t + 1,
            early,
            show(&nop),
            show(&write),
            trial.at_x,
            trial.at_y
        ));
        trials.push(trial);
    }
    Ok(verdict(&trials))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trials_decide() {
        let y = Trial { at_y: true, ..Trial::default() };
        let x = Trial { at_x: true, ..Trial::default() };
        assert_eq!(verdict(&[y; 4]), Finding::Answer(WaitPrefetch::Stops));
        assert_eq!(verdict(&[y, y, x, y]), Finding::Answer(WaitPrefetch::FetchesPast));
        assert!(matches!(verdict(&[y, Trial { early: true, ..y }]), Finding::Unknown(_)));
        assert!(matches!(verdict(&[y, Trial::default()]), Finding::Unknown(_)));
        assert!(matches!(verdict(&[Trial { at_x: true, at_y: true, early: false }]), Finding::Unknown(_)));
        assert!(matches!(verdict(&[]), Finding::Unknown(_)));
    }
}
