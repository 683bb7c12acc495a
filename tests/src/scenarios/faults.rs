//! Message faults on the way to the MN: a lost request, a delayed one.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, MnSpec};
use omw_core::device::WcStatus;

pub const LIST: &[Scenario] = &[Scenario {
    name: "faults::lost_and_delayed_messages",
    needs: Caps::FAULTS.union(Caps::TIME_CONTROL),
    run: lost_and_delayed,
}];

/// From loopback_security.rs. A lost request: the CN's send fails, both ends of the Alloc QP
/// pair error; the MN sees its chain QP flushed, repairs and re-arms; the CN allocates again. A
/// delayed request only costs time.
fn lost_and_delayed(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    t.drop_next(1, 1);
    assert!(t.alloc(1).is_err(), "a dropped request yields no allocation");
    t.tick();
    invariants(&mut *t, "lost");
    let a = t.alloc(1).unwrap_or_else(|e| panic!("after a lost message: {e}"));
    assert_eq!(t.write(1, &a, 0, 0, b"after loss"), WcStatus::Success);
    let t0 = t.now();
    t.delay_next(1, 50_000);
    let b = t.alloc(1)?;
    assert!(t.now() - t0 >= 50_000, "the delay shows in modelled time");
    t.free(1, &b)?;
    t.free(1, &a)?;
    t.tick();
    assert_eq!(t.unallocated(), 8);
    invariants(&mut *t, "after");
    Ok(())
}
