//! What the malicious_cn inputs of a folder reach in the MN: `cargo run --example reach -- DIR`
//! replays every file (the current format) and sums the MN's counters — quota enforcement
//! (`quota_disconnects`), reclaim (`groups_reclaimed`), the audit (offloaded ticks, and the
//! windows it found misbound: `spans_refused`), evictions.
use arbitrary::{Arbitrary, Unstructured};
use omw_fuzz_harness::malicious_cn::{check, Input, Lap, Step};
fn main() {
    let dir = std::env::args().nth(1).expect("a folder of malicious_cn inputs");
    let mut files: Vec<_> = std::fs::read_dir(&dir).expect("folder").flatten().map(|e| e.path()).collect();
    files.sort();
    let (mut n, mut laps, mut with_lap) = (0u64, [0u64; 5], 0u64);
    let (mut audits, mut with_audit, mut quota, mut with_quota, mut reclaimed, mut with_reclaim) = (0, 0, 0, 0, 0, 0);
    let (mut spans, mut evicted, mut stale) = (0, 0, 0);
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(&data)) else { continue };
        n += 1;
        let mut any = false;
        for s in input.ops.iter().take(40) {
            if let Step::Lap(l) = s {
                any = true;
                laps[match l {
                    Lap::Misbind { .. } => 0,
                    Lap::OverQuota(_) => 1,
                    Lap::AuditMidLap { .. } => 2,
                    Lap::FreeDuringAudit { .. } => 3,
                    Lap::VanishMidLap { .. } => 4,
                }] += 1;
            }
        }
        with_lap += u64::from(any);
        let r = check(&input);
        audits += r.audits;
        with_audit += u64::from(r.audits > 0);
        quota += r.mn.quota_disconnects;
        with_quota += u64::from(r.mn.quota_disconnects > 0);
        reclaimed += r.mn.groups_reclaimed;
        with_reclaim += u64::from(r.mn.groups_reclaimed > 0);
        spans += r.mn.spans_refused;
        evicted += r.mn.cns_evicted;
        stale += r.mn.stale_repairs;
    }
    println!("inputs {n}; with a Lap step {with_lap}; Lap steps misbind/over-quota/audit-mid-lap/free-during-audit/vanish-mid-lap {laps:?}");
    println!("audit (offloaded ticks): {audits} in {with_audit} inputs; spans_refused {spans}");
    println!("enforce_quota disconnects: {quota} in {with_quota} inputs");
    println!("groups_reclaimed: {reclaimed} in {with_reclaim} inputs; cns_evicted {evicted}; stale_repairs {stale}");
}
