//! Where an allocation goes: two random choices weighted by the MNs' published free counts
//! (Infiniswap's power of choices, DESIGN.md §11), then everything else as the fallback order.
//!
//! Drawing both candidates with probability proportional to their free chunks and keeping the
//! one with more of them sends most placements to the emptiest MNs while two CNs deciding from
//! the same stale counts still spread (a single "most free" choice would send every CN to the
//! same MN until its next refresh). When the chosen MN answers "empty" the client goes down
//! [`order`]'s list: the other candidates by free count, most first.

use omw_core::rng::SeededRng;

/// One MN that has the class asked for: an index into the caller's list, and how many chunks
/// of the class it is believed to have free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub idx: usize,
    pub free: u64,
}

/// One draw proportional to `free` (uniform when every count is zero) among `cands` not yet
/// `taken`.
fn weighted(cands: &[Candidate], taken: Option<usize>, rng: &mut SeededRng) -> Option<usize> {
    let open = |i: &usize| Some(*i) != taken;
    let total: u64 = (0..cands.len()).filter(open).map(|i| cands[i].free).sum();
    if total == 0 {
        let n = (0..cands.len()).filter(open).count() as u64;
        if n == 0 {
            return None;
        }
        let k = rng.next_u64() % n;
        return (0..cands.len()).filter(open).nth(k as usize);
    }
    let mut x = rng.next_u64() % total;
    for i in (0..cands.len()).filter(open) {
        if x < cands[i].free {
            return Some(i);
        }
        x -= cands[i].free;
    }
    None
}

/// The order to try the candidates in: the better of two weighted draws first, then the rest
/// by free count (most first; ties in the caller's order).
pub fn order(cands: &[Candidate], rng: &mut SeededRng) -> Vec<usize> {
    let Some(a) = weighted(cands, None, rng) else { return Vec::new() };
    let first = match weighted(cands, Some(a), rng) {
        Some(b) if cands[b].free > cands[a].free => b,
        _ => a,
    };
    let mut rest: Vec<usize> = (0..cands.len()).filter(|i| *i != first).collect();
    rest.sort_by(|x, y| cands[*y].free.cmp(&cands[*x].free));
    std::iter::once(first).chain(rest).map(|i| cands[i].idx).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(free: &[u64]) -> Vec<Candidate> {
        free.iter().enumerate().map(|(idx, f)| Candidate { idx: idx * 10, free: *f }).collect()
    }

    #[test]
    fn every_candidate_is_tried_once() {
        let mut rng = SeededRng::new(3);
        for free in [&[][..], &[0], &[5], &[0, 0, 0], &[3, 0, 9, 1]] {
            let mut o = order(&c(free), &mut rng);
            o.sort();
            assert_eq!(o, (0..free.len()).map(|i| i * 10).collect::<Vec<_>>());
        }
    }

    #[test]
    fn an_mn_with_nothing_free_is_never_first_while_another_has_some() {
        let mut rng = SeededRng::new(1);
        for _ in 0..500 {
            assert_ne!(order(&c(&[0, 4, 0, 1]), &mut rng)[0], 0);
        }
    }

    #[test]
    fn placements_follow_the_free_counts() {
        let mut rng = SeededRng::new(7);
        let mut first = [0u32; 3];
        for _ in 0..3000 {
            first[order(&c(&[10, 10, 80]), &mut rng)[0] / 10] += 1;
        }
        // the emptiest MN takes most, the others still some (two choices, not argmax)
        assert!(first[2] > first[0] + first[1], "{first:?}");
        assert!(first[0] > 0 && first[1] > 0, "{first:?}");
        // equal counts: an even spread
        let mut first = [0u32; 4];
        for _ in 0..4000 {
            first[order(&c(&[5, 5, 5, 5]), &mut rng)[0] / 10] += 1;
        }
        assert!(first.iter().all(|n| (700..1300).contains(n)), "{first:?}");
    }

    #[test]
    fn the_fallback_is_by_free_count() {
        let mut rng = SeededRng::new(2);
        let o = order(&c(&[1, 0, 7, 3]), &mut rng);
        let rest: Vec<usize> = o[1..].to_vec();
        let frees: Vec<u64> = rest.iter().map(|i| [1, 0, 7, 3][i / 10]).collect();
        assert!(frees.windows(2).all(|w| w[0] >= w[1]), "{o:?}");
    }
}
