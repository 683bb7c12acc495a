//! `recv_publish`: does a receive doorbell record written by the HCA's own DMA publish the
//! receive, as the driver's store does? The chains publish each next receive so
//! (`Capabilities::RECV_DOORBELL_RECORD`, docs/MLX5.md question 20): a READ on the loop QP
//! lands the count in `dbrec[MLX5_RCV_DBR]`. mlx5 has no MMIO doorbell for receives
//! (rdma-core `mlx5_post_recv` only stores `htobe32(head & 0xffff)` into the record), so the
//! HCA must read the record from memory when it needs a receive WQE — this step checks that it
//! takes a record its own DMA wrote.
//!
//! QP R (a plain receive queue, so the receive answer does not enter) gets one receive WQE
//! written and its record left at 0; QP S, connected to R, SENDs 64 bytes (RNR retry 7: it
//! waits). Landing now — nothing published — is unknown. Then QP L, a loopback pair in R's
//! domain, WRITEs `htobe32(1)` into R's record through an MR over R's queue memory: landing
//! then is [`RecvPublish::Honoured`]. Otherwise the CPU stores the same record (the control):
//! landing then is [`RecvPublish::Ignored`]; nothing landing at all is unknown.

use super::{pattern, show, Finding, Rig};
use crate::devx::device::DevxDevice;
use crate::devx::DevxError;
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::RecvSge;
use omw_core::device::behaviour::RecvPublish;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::wire::wqe::{Wqe, WqeFlags};

/// What the step saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Observed {
    /// The SEND landed with no receive published.
    pub landed_unpublished: bool,
    /// The loop WRITE into the record: `Some(true)` success, `Some(false)` error, `None` none.
    pub dma_write: Option<bool>,
    /// The SEND landed after the HCA's WRITE of the record.
    pub landed_after_dma: bool,
    /// The SEND landed after the CPU's store of the record.
    pub landed_after_cpu: bool,
}

pub fn verdict(o: &Observed) -> Finding<RecvPublish> {
    if o.landed_unpublished {
        return Finding::Unknown("the SEND landed with no receive published: the record is not what gates receives");
    }
    if o.landed_after_dma {
        return Finding::Answer(RecvPublish::Honoured);
    }
    if o.dma_write == Some(false) {
        return Finding::Unknown("the loop WRITE into the record completed in error (syndrome printed above)");
    }
    if o.landed_after_cpu {
        return Finding::Answer(RecvPublish::Ignored);
    }
    Finding::Unknown("the receive was consumed neither after the HCA's nor after the CPU's record")
}

pub fn run<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Result<Finding<RecvPublish>, DevxError> {
    let mut r = rig.qp(CdRole::empty(), true)?;
    let mut s = rig.qp(CdRole::empty(), false)?;
    rig.connect(&r, &s)?;
    let (mut l, _l2) = rig.pair(CdRole::empty(), CdRole::empty())?;
    rig.say(format_args!(
        "R {:#x} (a receive queue) and S {:#x} connected; L {:#x} a loopback pair",
        r.qpn(),
        s.qpn(),
        l.qpn()
    ));
    let buf = rig.buffer(4096, AccessFlags::LOCAL_WRITE)?;
    let (src, dst, one) = (buf.addr, buf.addr + 0x800, buf.addr + 0xF00);
    rig.fill(src, &pattern(64))?;
    rig.fill(one, &1u32.to_be_bytes())?;
    let record = rig.record_mr(&r)?;
    rig.stage_recv(&mut r, &[RecvSge { addr: dst, length: 64, lkey: buf.keys.lkey }])?;
    rig.post_plain(&mut s, &Wqe::send(src, buf.keys.lkey, 64))?;
    rig.settle();
    let mut o = Observed { landed_unpublished: rig.landed(dst, 64)?, ..Observed::default() };
    rig.say(format_args!("a receive written, R's record left at 0, a SEND from S: landed {}", o.landed_unpublished));
    if !o.landed_unpublished {
        let w = Wqe::write(one, buf.keys.lkey, 4, record.addr, record.rkey).with_flags(WqeFlags::SIGNALED);
        rig.post_plain(&mut l, &w)?;
        let done = rig.poll(&mut l.send_cq)?;
        o.dma_write = done.map(|c| c.error.is_none());
        rig.settle();
        o.landed_after_dma = rig.landed(dst, 64)?;
        rig.say(format_args!("L WRITEs htobe32(1) into R's record: {}; landed {}", show(&done), o.landed_after_dma));
        if !o.landed_after_dma {
            rig.publish_recvs(&mut r, 1)?;
            rig.settle();
            o.landed_after_cpu = rig.landed(dst, 64)?;
            rig.say(format_args!("the CPU stores the same record: landed {}", o.landed_after_cpu));
        }
    }
    let sent = rig.poll(&mut s.send_cq)?;
    rig.say(format_args!("S's SEND: {}", show(&sent)));
    Ok(verdict(&o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observations_decide() {
        let o = Observed::default();
        assert_eq!(
            verdict(&Observed { dma_write: Some(true), landed_after_dma: true, ..o }),
            Finding::Answer(RecvPublish::Honoured)
        );
        assert_eq!(
            verdict(&Observed { dma_write: Some(true), landed_after_cpu: true, ..o }),
            Finding::Answer(RecvPublish::Ignored)
        );
        for bad in [
            Observed { landed_unpublished: true, landed_after_dma: true, ..o },
            Observed { dma_write: Some(false), landed_after_cpu: true, ..o },
            o,
        ] {
            assert!(matches!(verdict(&bad), Finding::Unknown(_)), "{bad:?}");
        }
    }
}
