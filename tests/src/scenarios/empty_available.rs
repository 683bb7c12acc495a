//! The queue runs empty: every CN hears "empty", backs off; a free makes a group available, the
//! MN's timer settles the ticket and announces it; nothing is lost.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, Heard, MnSpec};

pub const LIST: &[Scenario] =
    &[Scenario { name: "empty::empty_queue_then_available", needs: Caps::NONE, run: empty_then_available }];

/// From loopback_security.rs and FPGA chains.rs (`empty_queue_stops_the_chain_and_the_mn_recovers`).
fn empty_then_available(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 4).quota(16));
    let mut held = Vec::new();
    for i in 0..4 {
        held.push((i % 3, t.alloc(i % 3)?));
    }
    let r = t.alloc(0);
    assert!(matches!(&r, Err(e) if super::is_empty_refusal(e)), "{r:?}");
    invariants(&mut *t, "empty");
    assert!(t.is_empty_state());
    for i in 0..3 {
        assert!(t.heard(i).contains(&Heard::Empty), "cn{i} heard 'empty'");
    }
    // while backing off the client refuses to send
    assert!(t.alloc(1).is_err());
    let (i, a) = held.pop().unwrap();
    t.free(i, &a)?;
    t.tick(); // the MN's timer settles the ticket and announces availability
              // (alloc chains that pop ahead take the group again at once: one of them may run dry and
              // put the MN back into "empty" — with the group held ahead, not lost)
    assert!(!t.is_empty_state() || t.ahead() >= 1);
    for i in 0..3 {
        assert!(t.heard(i).contains(&Heard::Available), "cn{i} heard 'available'");
    }
    let again = t.alloc(0)?;
    assert_eq!(again.base, a.base, "the only free group");
    let (old, new) = (a.rkey(0).unwrap(), again.rkey(0).unwrap());
    assert_ne!(new, old, "rebound with a new key");
    assert_eq!(
        new,
        old.next_key(),
        "rebound with the next key ({old:?} → {new:?}, owner {:?} → {:?})",
        a.owner_rkey,
        again.owner_rkey
    );
    invariants(&mut *t, "again");
    // nothing lost: free everything, the queue holds all four
    t.free(0, &again)?;
    for (i, a) in held {
        t.free(i, &a)?;
    }
    t.tick();
    assert_eq!(t.unallocated(), 4);
    invariants(&mut *t, "after");
    Ok(())
}
