//! The canonical WQE decoders on arbitrary bytes: typed errors, never a panic; a WQE that
//! decodes re-encodes to exactly its 64 bytes, and what it decodes to satisfies every rule the
//! decoder promises (the NIC models rely on them); a RECV re-encodes to its used prefix.

use omw_core::access::AccessFlags;
use omw_core::wire::wqe::{masked_add, Opcode, RecvWqe, Wqe, WqeError, WqeField, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};

const FIELDS: [WqeField; 10] = WqeField::ALL;

pub fn run(data: &[u8]) -> bool {
    send_wqe(data);
    recv_wqe(data);
    // every 64-byte window of the input, as a ring would hold consecutive entries
    for chunk in data.chunks_exact(WQE_SIZE).skip(1) {
        send_wqe(chunk);
    }
    if data.len() >= 24 {
        let word = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().expect("8 bytes"));
        let (a, b, m) = (word(0), word(8), word(16));
        let r = masked_add(a, b, m);
        // a field never carries into the next: bits above each boundary see only their own sum
        assert_eq!(masked_add(a, b, 0), a.wrapping_add(b));
        assert_eq!(masked_add(r, 0, m), r);
        // the top field (above the highest boundary bit below 63) is a plain wrapping add
        let below = m & !(1 << 63);
        let mask = if below == 0 { u64::MAX } else { u64::MAX << (64 - below.leading_zeros()) };
        assert_eq!(r & mask, (a & mask).wrapping_add(b & mask) & mask);
        // and the lowest field (up to the lowest boundary bit) is an add modulo its width
        let low_bits = if m == 0 { 64 } else { m.trailing_zeros() + 1 };
        let lmask = if low_bits >= 64 { u64::MAX } else { (1u64 << low_bits) - 1 };
        assert_eq!(r & lmask, a.wrapping_add(b) & lmask);
    }
    true
}

fn send_wqe(data: &[u8]) {
    match Wqe::decode(data) {
        Ok(w) => {
            assert!(data.len() >= WQE_SIZE);
            assert_eq!(&w.encode()[..], &data[..WQE_SIZE], "WQE does not round-trip");
            assert_eq!(w.opcode as u8, data[0]);
            assert_eq!(w.flags.bits(), data[1]);
            if w.flags.contains(WqeFlags::UNBIND) {
                assert_eq!(w.opcode, Opcode::BindMw);
            }
            if w.opcode.is_atomic() {
                assert_eq!(w.length, 8);
                assert_eq!(w.remote_addr % 8, 0);
            }
            match w.opcode {
                Opcode::BindMw | Opcode::Wait | Opcode::Enable => assert!(w.qpn <= omw_core::ids::Qpn::MAX),
                _ => {}
            }
            if matches!(w.opcode, Opcode::Wait | Opcode::Enable) {
                assert!(w.operand1 <= 1);
                assert_eq!(w.queue_sel() as u64, w.operand1);
            }
            if w.opcode == Opcode::BindMw && !w.flags.contains(WqeFlags::UNBIND) {
                let a = w.access();
                assert_eq!(a.bits() as u64, w.operand1);
                assert!(!a.intersects(AccessFlags::MR_ONLY));
            }
            // patchability is a pure function of (field, opcode) and never allows the fixed part
            for f in FIELDS {
                assert!(f.offset() + f.width() <= WQE_SIZE);
                if f == WqeField::WrId {
                    assert!(!f.patchable_for(w.opcode));
                }
            }
        }
        Err(WqeError::Truncated { len }) => assert!(len < WQE_SIZE && len == data.len()),
        Err(WqeError::ReservedNotZero) => assert!(data[2] != 0 || data[3] != 0),
        Err(WqeError::UnknownOpcode(o)) => assert!(Opcode::from_u8(o).is_none()),
        Err(_) => {}
    }
}

fn recv_wqe(data: &[u8]) {
    match RecvWqe::decode(data) {
        Ok(r) => {
            let n = r.sges.len();
            assert_eq!(n, data[1] as usize);
            let used = 16 + 16 * n;
            assert_eq!(&r.encode()[..used], &data[..used], "RECV does not round-trip");
            assert!(r.encode()[used..].iter().all(|b| *b == 0));
            assert_eq!(RecvWqe::decode(&r.encode()), Ok(r.clone()));
            let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
            assert_eq!(r.total_len(), total);
        }
        Err(WqeError::Truncated { len }) => assert!(len < RECV_WQE_SIZE),
        Err(_) => {}
    }
}
