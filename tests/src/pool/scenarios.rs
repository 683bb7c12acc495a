//! The pool scenarios. Each builds its pool from a [`PoolShape`], drives pool clients as CNs,
//! and checks what the issue promises: spread, routing, a vanished MN's allocations failing
//! with `MnLost` while the rest go on, draining, size classes, bad records skipped, a lost
//! registry survived.

use super::{PoolBed, PoolScenario, PoolShape};
use crate::runner::{Failure, Outcome};
use omw_pool::client::{Departure, PoolNote, Skip};
use omw_pool::entry::{ClassSpec, MnEntry};
use omw_pool::registry::Name;
use omw_pool::session::Connector;
use omw_pool::{PoolAlloc, PoolClient, PoolError};
use std::collections::BTreeMap;
use std::time::Duration;

/// Every pool scenario.
pub fn list<B: PoolBed>() -> Vec<PoolScenario<B>> {
    vec![
        PoolScenario { name: "placement_spreads_over_the_mns", run: placement_spreads_over_the_mns::<B> },
        PoolScenario { name: "frees_and_accesses_go_to_the_allocations_own_mn", run: routing::<B> },
        PoolScenario { name: "a_vanished_mn_fails_with_mn_lost_and_the_rest_go_on", run: vanished_mn::<B> },
        PoolScenario { name: "a_draining_mn_gets_no_placements_and_keeps_serving", run: draining::<B> },
        PoolScenario { name: "size_classes_pick_the_smallest_that_fits", run: size_classes::<B> },
        PoolScenario { name: "bad_records_are_skipped_with_a_reason", run: bad_records::<B> },
    ]
}

const K4: ClassSpec = ClassSpec { chunk_size: 4096, chunks: 16 };

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(Failure(what()))
    }
}

/// A pattern unique to allocation `i`.
fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k * 7) as u8 ^ 0xA5).collect()
}

fn per_mn(allocs: &[PoolAlloc]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for a in allocs {
        *m.entry(a.mn().to_string()).or_insert(0) += 1;
    }
    m
}

/// Allocate `n` chunks of `size` bytes and write each one's pattern (`base` numbers them).
fn fill<C: Connector>(c: &mut PoolClient<C>, n: usize, size: u64, base: usize) -> Result<Vec<PoolAlloc>, Failure> {
    let mut out = Vec::new();
    for i in 0..n {
        let a = c.alloc(size).map_err(|e| Failure(format!("alloc {i}: {e}")))?;
        c.write(&a, 0, &pattern(base + i, 64)).map_err(|e| Failure(format!("write {i} on {}: {e}", a.mn())))?;
        out.push(a);
    }
    Ok(out)
}

fn verify<C: Connector>(c: &mut PoolClient<C>, a: &PoolAlloc, i: usize) -> Outcome {
    let mut b = vec![0u8; 64];
    c.read(a, 0, &mut b).map_err(|e| Failure(format!("read {i} on {}: {e}", a.mn())))?;
    ensure(b == pattern(i, 64), || format!("allocation {i} on {} reads back other bytes", a.mn()))
}

fn placement_spreads_over_the_mns<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let mut bed = make(&PoolShape::uniform(3, &[K4]));
    let mut c = bed.client(1);
    let allocs = fill(&mut c, 30, 4096, 0)?;
    let spread = per_mn(&allocs);
    let (min, max) = (spread.values().min().copied().unwrap_or(0), spread.values().max().copied().unwrap_or(0));
    ensure(spread.len() == 3 && min >= 5 && max <= 2 * min + 2, || format!("30 chunks over 3 MNs: {spread:?}"))?;
    for (i, a) in allocs.iter().enumerate() {
        verify(&mut c, a, i)?;
    }
    for a in allocs {
        c.free(a)?;
    }
    bed.pass(500);
    for mn in ["mn0", "mn1", "mn2"] {
        ensure(bed.held(mn) == Some(0), || format!("{mn} still holds {:?} chunk(s) after every free", bed.held(mn)))?;
    }
    bed.check().map_err(Failure)
}

fn routing<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let mut bed = make(&PoolShape::uniform(2, &[K4]));
    let mut a = bed.client(2);
    let mut b = bed.client(3);
    let xs = fill(&mut a, 10, 4096, 0)?;
    let ys = fill(&mut b, 6, 4096, 100)?;
    bed.pass(300);
    // the MNs hold exactly what the clients placed on each
    let (sa, sb) = (per_mn(&xs), per_mn(&ys));
    for mn in ["mn0", "mn1"] {
        let want = (sa.get(mn).copied().unwrap_or(0) + sb.get(mn).copied().unwrap_or(0)) as u64;
        ensure(bed.held(mn) == Some(want), || {
            format!("{mn} holds {:?}, the clients placed {want} there", bed.held(mn))
        })?;
    }
    // frees of A's chunks on mn0 reach mn0 alone
    let before1 = bed.held("mn1");
    let mut kept = Vec::new();
    for (i, x) in xs.into_iter().enumerate() {
        if x.mn() == "mn0" {
            a.free(x)?;
        } else {
            kept.push((i, x));
        }
    }
    let on0 = sb.get("mn0").copied().unwrap_or(0) as u64;
    ensure(bed.held("mn0") == Some(on0), || {
        format!("mn0 holds {:?} after A's frees, B has {on0} there", bed.held("mn0"))
    })?;
    ensure(bed.held("mn1") == before1, || "A's frees on mn0 changed mn1".into())?;
    // every remaining chunk still reads back its own bytes through its own MN
    for (i, x) in &kept {
        verify(&mut a, x, *i)?;
    }
    for (i, y) in ys.iter().enumerate() {
        verify(&mut b, y, 100 + i)?;
    }
    bed.check().map_err(Failure)
}

fn vanished_mn<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let mut bed = make(&PoolShape::uniform(3, &[K4]));
    let mut early = bed.client(4);
    let mut late = bed.client(5);
    // both hold chunks on every MN
    let mut xs = fill(&mut early, 9, 4096, 0)?;
    let mut ys = fill(&mut late, 9, 4096, 100)?;
    for (c, v, base) in [(&mut early, &mut xs, 0), (&mut late, &mut ys, 100)] {
        let mut k = 0;
        while !per_mn(v).contains_key("mn1") && k < 30 {
            let mut more = fill(c, 1, 4096, base + 50 + k)?;
            v.append(&mut more);
            k += 1;
        }
        ensure(per_mn(v).contains_key("mn1"), || "no chunk landed on mn1 in 39 placements".into())?;
    }
    bed.vanish("mn1");
    // right away (its record still there): an access to its chunk fails with MnLost, no hang
    let victim = xs.iter().position(|x| x.mn() == "mn1").unwrap_or(0);
    let mut b = vec![0u8; 64];
    match early.read(&xs[victim], 0, &mut b) {
        Err(PoolError::MnLost { mn }) if mn == "mn1" => {}
        other => return Err(Failure(format!("read on the vanished MN before its lease ran out: {other:?}"))),
    }
    // after the lease: the record went; the other client learns it from the registry
    bed.pass(bed.lease_ms() + 1500);
    let notes = late.take_notes();
    ensure(
        notes.iter().any(|n| matches!(n, PoolNote::Departed { mn, why: Departure::RecordGone, .. } if mn == "mn1")),
        || format!("the late client never saw mn1's record go: {notes:?}"),
    )?;
    for (c, v, base) in [(&mut early, &xs, 0), (&mut late, &ys, 100)] {
        for (i, x) in v.iter().enumerate() {
            let idx = if i < 9 { base + i } else { base + 50 + i - 9 };
            if x.mn() == "mn1" {
                ensure(matches!(c.read(x, 0, &mut b), Err(PoolError::MnLost { .. })), || {
                    "read of a lost chunk".into()
                })?;
                ensure(matches!(c.free(x.clone()), Err(PoolError::MnLost { .. })), || "free of a lost chunk".into())?;
            } else {
                verify(c, x, idx)?;
            }
        }
    }
    // nothing more is placed there
    let more = fill(&mut late, 12, 4096, 300)?;
    ensure(!per_mn(&more).contains_key("mn1"), || format!("placed on the departed MN: {:?}", per_mn(&more)))?;
    for (i, m) in more.iter().enumerate() {
        verify(&mut late, m, 300 + i)?;
    }
    // it comes back as a new MN: used again
    bed.restart("mn1");
    bed.pass(300);
    let mut back = false;
    for i in 0..60 {
        let a = late.alloc(4096)?;
        back |= a.mn() == "mn1";
        late.write(&a, 0, &pattern(400 + i, 64))?;
        verify(&mut late, &a, 400 + i)?;
        if back {
            break;
        }
    }
    ensure(back, || "the restarted mn1 got no placement in 60".into())?;
    let notes = late.take_notes();
    ensure(notes.iter().any(|n| matches!(n, PoolNote::Rejoined { mn, .. } if mn == "mn1")), || {
        format!("no rejoin noted: {notes:?}")
    })?;
    bed.check().map_err(Failure)
}

fn draining<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let mut bed = make(&PoolShape::uniform(2, &[K4]));
    let mut c = bed.client(6);
    let xs = fill(&mut c, 8, 4096, 0)?;
    ensure(per_mn(&xs).len() == 2, || format!("8 chunks on {:?}", per_mn(&xs)))?;
    bed.drain("mn0", true);
    // the MN reads the request at its keep-alive pace (a third of the lease) and publishes it
    bed.pass(bed.lease_ms() / 2 + 500);
    let more = fill(&mut c, 8, 4096, 100)?;
    ensure(!per_mn(&more).contains_key("mn0"), || format!("placed on the draining MN: {:?}", per_mn(&more)))?;
    let notes = c.take_notes();
    ensure(notes.iter().any(|n| matches!(n, PoolNote::Draining { mn } if mn == "mn0")), || format!("{notes:?}"))?;
    ensure(!bed.drained("mn0"), || "mn0 said it was drained while it held chunks".into())?;
    // its live allocations keep working, and once they are freed it says it is drained
    for (i, x) in xs.iter().enumerate() {
        verify(&mut c, x, i)?;
        if x.mn() == "mn0" {
            c.write(x, 64, b"still writable")?;
        }
    }
    for x in xs.into_iter().filter(|x| x.mn() == "mn0") {
        c.free(x)?;
    }
    bed.pass(bed.lease_ms() / 2 + 500);
    ensure(bed.drained("mn0"), || "mn0 never said it was drained".into())?;
    ensure(bed.held("mn0") == Some(0), || format!("mn0 holds {:?}", bed.held("mn0")))?;
    // undrained: placed on again
    bed.drain("mn0", false);
    bed.pass(bed.lease_ms() / 2 + 500);
    let again = fill(&mut c, 8, 4096, 200)?;
    ensure(per_mn(&again).contains_key("mn0"), || format!("never placed on mn0 again: {:?}", per_mn(&again)))?;
    bed.check().map_err(Failure)
}

fn size_classes<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let classes = [ClassSpec { chunk_size: 4096, chunks: 8 }, ClassSpec { chunk_size: 65536, chunks: 2 }];
    let mut bed = make(&PoolShape::uniform(2, &classes));
    let mut c = bed.client(7);
    for (size, class) in [(100u64, 4096u64), (4096, 4096), (4097, 65536), (65536, 65536)] {
        let a = c.alloc(size)?;
        ensure(a.chunk_size() == class, || format!("{size} B went to class {}", a.chunk_size()))?;
        let data = pattern(size as usize, class as usize);
        c.write(&a, 0, &data)?;
        let mut back = vec![0u8; class as usize];
        c.read(&a, 0, &mut back)?;
        ensure(back == data, || format!("{class}-B chunk read back other bytes"))?;
        ensure(matches!(c.write(&a, class - 4, &[0; 8]), Err(PoolError::OutOfBounds { .. })), || {
            "a write past the chunk was not refused".into()
        })?;
        c.free(a)?;
    }
    match c.alloc(65537) {
        Err(PoolError::NoClass { largest: Some(65536), .. }) => {}
        other => return Err(Failure(format!("65537 B: {other:?}"))),
    }
    // the large class runs out on every MN (2 × 2 chunks, two CNs taking them: no CN's quota
    // is what stops it) while the small one still serves
    let mut d = bed.client(70);
    let mut big: Vec<PoolAlloc> = (0..2).map(|_| c.alloc(65536)).collect::<Result<_, _>>()?;
    let theirs: Vec<PoolAlloc> = (0..2).map(|_| d.alloc(65536)).collect::<Result<_, _>>()?;
    big.extend(theirs.iter().cloned());
    ensure(per_mn(&big).len() == 2, || format!("large chunks on {:?}", per_mn(&big)))?;
    match c.alloc(65536) {
        Err(PoolError::Empty { chunk_size: 65536 }) => {}
        other => return Err(Failure(format!("a fifth large chunk: {other:?}"))),
    }
    let small = c.alloc(4096)?;
    ensure(small.chunk_size() == 4096, || "small class".into())?;
    for a in big {
        if theirs.contains(&a) {
            d.free(a)?;
        } else {
            c.free(a)?;
        }
    }
    c.free(small)?;
    bed.pass(300);
    let again = c.alloc(65536)?;
    c.free(again)?;
    bed.check().map_err(Failure)
}

fn bad_records<B: PoolBed>(make: &mut dyn FnMut(&PoolShape) -> B) -> Outcome {
    let mut bed = make(&PoolShape::uniform(1, &[K4]));
    let pool = bed.pool();
    let reg = bed.registry();
    let ttl = Duration::from_secs(30);
    let (_, good) =
        reg.members(&pool)?.into_iter().find(|(n, _)| n == "mn0").ok_or(Failure("mn0 not registered".into()))?;
    let good = MnEntry::parse("mn0", &good)?;
    reg.register(&pool, &Name::new("junk")?, b"{\"format\": 1, \"name\": ", ttl)?;
    let mut ghost = good.clone();
    ghost.name = "ghost".into();
    ghost.incarnation = 1;
    ghost.classes[0].addr = "192.0.2.250:9".into();
    ghost.classes[0].free = ghost.classes[0].chunks;
    reg.register(&pool, &Name::new("ghost")?, &ghost.encode(), ttl)?;
    // a record that points at mn0's class but claims another group size
    let mut liar = good.clone();
    liar.name = "liar".into();
    liar.incarnation = 2;
    liar.classes[0].group_size = if good.classes[0].group_size == 2 { 3 } else { 2 };
    liar.classes[0].free = liar.classes[0].chunks;
    reg.register(&pool, &Name::new("liar")?, &liar.encode(), ttl)?;
    let mut c = bed.client(8);
    let xs = fill(&mut c, 10, 4096, 0)?;
    ensure(per_mn(&xs).keys().all(|k| k == "mn0"), || format!("placed on {:?}", per_mn(&xs)))?;
    let notes = c.take_notes();
    let skipped = |who: &str, f: &dyn Fn(&Skip) -> bool| {
        notes.iter().any(|n| matches!(n, PoolNote::Skipped { mn, why } if mn == who && f(why)))
    };
    ensure(skipped("junk", &|w| matches!(w, Skip::Entry(_))), || format!("junk: {notes:?}"))?;
    ensure(skipped("ghost", &|w| matches!(w, Skip::Unreachable { .. })), || format!("ghost: {notes:?}"))?;
    ensure(skipped("liar", &|w| matches!(w, Skip::Geometry { .. })), || format!("liar: {notes:?}"))?;
    for (i, x) in xs.iter().enumerate() {
        verify(&mut c, x, i)?;
    }
    bed.check().map_err(Failure)
}
