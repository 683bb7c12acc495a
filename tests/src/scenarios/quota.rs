//! Quotas (docs/ARCHITECTURE.md, "Quota"): offloaded, lazy — at the next audit a CN over its
//! quota is told `QuotaExceeded`, loses its management QPs and every chunk; host engine, exact —
//! the allocation that would exceed it is refused, nothing revoked. Others are unaffected.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, Heard, MnSpec, Refusal};
use omw_core::device::{ExecutionMode, WcStatus};
use omw_core::wire::message::ErrorCode;

pub const LIST: &[Scenario] = &[Scenario { name: "quota::quota_enforcement", needs: Caps::NONE, run: quota }];

/// From loopback_security.rs.
fn quota(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 16).quota(2));
    let keep = t.alloc(1)?;
    let a1 = t.alloc(0)?;
    let _a2 = t.alloc(0)?;
    let third = t.alloc(0);
    match t.mode() {
        ExecutionMode::Offloaded => {
            assert!(third.is_ok(), "the chain does not check quotas");
            t.audit();
            assert_eq!(t.stats().quota_disconnects, 1);
            assert!(t.heard(0).contains(&Heard::Failed(ErrorCode::QuotaExceeded)));
            invariants(&mut *t, "audit");
            // its chunks are revoked, its management QPs gone
            // (where its windows lived on its Alloc QP, the MN tore that QP down with the
            // others: the access finds no responder)
            let st = t.read_raw(0, 0, a1.base, a1.rkey(0).unwrap(), 8).0;
            let torn_down = t.windows_on_alloc_qp(0) && st == WcStatus::RetryExcErr;
            assert!(st == WcStatus::RemAccessErr || torn_down, "{st:?}");
            assert!(t.alloc(0).is_err());
        }
        _ => {
            assert_eq!(third, Err(Refusal::Mn(ErrorCode::QuotaExceeded)));
            assert_eq!(t.stats().quota_disconnects, 0);
            assert_eq!(t.write(0, &a1, 0, 0, b"kept"), WcStatus::Success);
            t.free(0, &a1)?;
            t.alloc(0)?;
        }
    }
    // the other CN is unaffected
    assert_eq!(t.write(1, &keep, 0, 0, b"still mine"), WcStatus::Success);
    t.alloc(1)?;
    invariants(&mut *t, "after");
    Ok(())
}
