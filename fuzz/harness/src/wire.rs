//! Every wire decoder on arbitrary bytes: typed errors, never a panic; what decodes re-encodes
//! to the same message; and the CN client fed arbitrary MN messages and reply images.

use omw_core::cn::{Client, ClientError};
use omw_core::ids::{CnId, Qpn};
use omw_core::wire::message::{
    parse_header, AllocReply, AllocRequest, ConnectInfo, FreeRequest, Kind, MnMessage, WireError, ALLOC_REPLY_LEN,
    CONNECT_INFO_LEN, HEADER_LEN, MAX_ACCESS_QPS,
};
use omw_core::wire::mwtable::MwTableEntry;

pub fn run(data: &[u8]) -> bool {
    header(data);
    for g in 0..=MAX_ACCESS_QPS + 1 {
        alloc_request(data, g);
    }
    free_request(data);
    alloc_reply(data);
    connect_info(data);
    mn_message(data);
    let _ = MwTableEntry::read(data);
    client(data);
    true
}

fn header(data: &[u8]) {
    match parse_header(data) {
        Ok((kind, token)) => {
            assert!(data.len() >= HEADER_LEN);
            assert_eq!(u16::from_le_bytes([data[0], data[1]]), omw_core::wire::message::MAGIC);
            assert_eq!(data[2], omw_core::wire::message::VERSION);
            assert_eq!(kind as u8, data[3]);
            assert_eq!(token, u32::from_le_bytes([data[4], data[5], data[6], data[7]]));
        }
        Err(WireError::Truncated { need, got }) => assert!(got < need && got == data.len()),
        Err(_) => assert!(data.len() >= HEADER_LEN),
    }
}

fn alloc_request(data: &[u8], g: usize) {
    let Ok(r) = AllocRequest::decode(data, g) else { return };
    assert_eq!(r.access_qpns.len(), g);
    let mut out = [0u8; 64];
    let n = r.encode(&mut out).expect("a decoded request encodes");
    assert_eq!(&out[..n], data, "AllocRequest does not round-trip");
}

fn free_request(data: &[u8]) {
    let Ok(r) = FreeRequest::decode(data) else { return };
    assert_eq!(&r.encode()[..], data, "FreeRequest does not round-trip");
}

fn alloc_reply(data: &[u8]) {
    let Ok(r) = AllocReply::decode(data) else { return };
    assert_eq!(data.len(), ALLOC_REPLY_LEN);
    let e = r.encode();
    // the header's token is not part of the reply (it travels as the immediate)
    assert_eq!(&e[..4], &data[..4]);
    assert_eq!(&e[HEADER_LEN..], &data[HEADER_LEN..], "AllocReply does not round-trip");
    assert_eq!(AllocReply::decode(&e), Ok(r));
}

fn connect_info(data: &[u8]) {
    let Ok(c) = ConnectInfo::decode(data) else { return };
    assert_eq!(data.len(), CONNECT_INFO_LEN);
    assert_eq!(c.access_qpns.len() + 1, c.group_size as usize);
    assert_eq!(ConnectInfo::decode(&c.encode()), Ok(c));
}

fn mn_message(data: &[u8]) {
    let Ok(m) = MnMessage::decode(data) else { return };
    let again = match &m {
        MnMessage::Notice(n) => MnMessage::decode(&n.encode()),
        MnMessage::Error(e) => MnMessage::decode(&e.encode()),
        MnMessage::ConnectInfo(c) => MnMessage::decode(&c.encode()),
        MnMessage::Rebound(r) => MnMessage::decode(&r.encode()),
        MnMessage::TakenBack(t) => MnMessage::decode(&t.encode()),
    };
    assert_eq!(again, Ok(m), "MnMessage does not round-trip");
}

/// A connected client with an allocation in flight, fed the bytes as a message and as the
/// reply image: it may refuse them, but what it adopts is consistent with what it was told.
fn client(data: &[u8]) {
    let info = ConnectInfo {
        cn: CnId::new(3).expect("nonzero"),
        group_size: 3,
        chunk_size: 4096,
        alloc_qpn: Qpn::new(0x10).expect("24 bit"),
        free_qpn: Qpn::new(0x11).expect("24 bit"),
        access_qpns: [Qpn::new(0x12).expect("24 bit"), Qpn::new(0x13).expect("24 bit")].into_iter().collect(),
        quota: 4,
        flags: Default::default(),
    };
    let mut c: Client<4> = Client::new();
    c.on_message(0, &info.encode()).expect("a valid connect info");
    let mut req = [0u8; 64];
    let (token, _) = c.alloc_request(1, 0x1000, 7, &mut req).expect("connected client builds a request");
    let before = c.info().cloned();
    match c.on_message(2, data) {
        Ok(omw_core::cn::ClientEvent::Connected(id)) => assert_eq!(c.id(), Some(id)),
        Ok(_) => assert_eq!(c.info().cloned(), before),
        // refused: bytes that do not parse, or a notice (a rebind) naming an entry it does not hold
        Err(ClientError::Wire(_) | ClientError::NotMine { .. }) => assert_eq!(c.info().cloned(), before),
        Err(e) => panic!("on_message: unexpected error {e:?}"),
    }
    // whatever the message did, a reply for the token either is adopted consistently or refused
    let info = c.info().cloned().expect("still connected");
    let pending = c.pending_token();
    let live = c.live().len();
    match c.on_alloc_reply(token, data) {
        Ok(a) => {
            assert_eq!(pending, Some(token));
            assert_eq!(a.length, info.chunk_size);
            assert_eq!(a.rkeys.len() + 1, info.group_size as usize);
            assert_ne!(a.entry_addr, 0);
            assert_eq!(c.live().len(), live + 1);
            assert_eq!(data.len(), ALLOC_REPLY_LEN);
            assert_eq!(data[3], Kind::AllocReply as u8);
            // and it can be freed exactly once
            assert!(c.free_request(a.entry_addr).is_ok());
        }
        Err(_) => assert_eq!(c.live().len(), live),
    }
    assert!(c.pending_token().is_none() || c.pending_token() == pending);
}
