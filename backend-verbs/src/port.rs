//! The set-up decisions a port's attributes settle, as pure functions over plain data (so they
//! are tested on constructed attributes and GID tables, not only on the one device at hand):
//! which device and port to use, which GID, how a raw QP addresses its peer, which path MTU.
//!
//! Sources: `struct ibv_port_attr`, `enum ibv_port_state`, `IBV_LINK_LAYER_*`, `enum ibv_mtu`
//! and `enum ibv_gid_type` of rdma-core's `libibverbs/verbs.h` (v44, the version this crate's
//! bindings are generated from); the sysfs GID type strings ("IB/RoCE v1", "RoCE v2") of the
//! kernel's `drivers/infiniband/core/cache.c` (`gid_type_str`).

use std::fmt;

/// `ibv_port_attr.link_layer`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LinkLayer {
    /// `IBV_LINK_LAYER_UNSPECIFIED` (0): old providers report it for InfiniBand.
    Unspecified,
    /// `IBV_LINK_LAYER_INFINIBAND` (1).
    InfiniBand,
    /// `IBV_LINK_LAYER_ETHERNET` (2): RoCE (and soft-RoCE).
    Ethernet,
    Other(u8),
}

impl LinkLayer {
    pub fn from_raw(v: u8) -> Self {
        match v {
            0 => LinkLayer::Unspecified,
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            o => LinkLayer::Other(o),
        }
    }
    /// Addressed by LID (an InfiniBand subnet); Ethernet is addressed by GID only.
    pub fn uses_lids(self) -> bool {
        matches!(self, LinkLayer::InfiniBand | LinkLayer::Unspecified)
    }
}

/// `enum ibv_port_state`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Other(u32),
}

impl PortState {
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            o => PortState::Other(o),
        }
    }
    pub fn is_active(self) -> bool {
        matches!(self, PortState::Active | PortState::ActiveDefer)
    }
    /// What an operator does about a port in this state.
    pub fn hint(self) -> &'static str {
        match self {
            PortState::Down => "the link is down: check the cable/switch port and `ibstat`/`ip link`",
            PortState::Init | PortState::Armed => {
                "the InfiniBand port waits for a subnet manager: start opensm (or the switch's SM)"
            }
            _ => "check `ibv_devinfo`",
        }
    }
}

/// `enum ibv_mtu` as bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Mtu {
    B256 = 1,
    B512 = 2,
    B1024 = 3,
    B2048 = 4,
    B4096 = 5,
}

impl Mtu {
    /// None for a value outside `enum ibv_mtu`.
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            1 => Mtu::B256,
            2 => Mtu::B512,
            3 => Mtu::B1024,
            4 => Mtu::B2048,
            5 => Mtu::B4096,
            _ => return None,
        })
    }
    pub fn raw(self) -> u32 {
        self as u32
    }
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// What `ibv_query_port` says, as far as set-up needs it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PortAttr {
    pub port: u8,
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// Base LID (InfiniBand; 0 when no subnet manager assigned one, and on Ethernet).
    pub lid: u16,
    /// None when the provider reported a value outside `enum ibv_mtu`.
    pub active_mtu: Option<Mtu>,
    pub gid_table_len: u32,
    /// The largest message the port carries (`max_msg_sz`): one work request's limit.
    pub max_msg_sz: u32,
}

/// `enum ibv_gid_type`, or the sysfs string of the GID table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GidType {
    /// InfiniBand GID (on an InfiniBand port).
    Ib,
    RoceV1,
    RoceV2,
    Unknown,
}

impl GidType {
    /// `ibv_gid_entry.gid_type`: `IBV_GID_TYPE_IB` 0, `_ROCE_V1` 1, `_ROCE_V2` 2.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => GidType::Ib,
            1 => GidType::RoceV1,
            2 => GidType::RoceV2,
            _ => GidType::Unknown,
        }
    }
    /// `/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/<i>`: "IB/RoCE v1" is one type
    /// for both (the link layer tells which), "RoCE v2" the other.
    pub fn from_sysfs(s: &str, link: LinkLayer) -> Self {
        match s.trim() {
            "RoCE v2" => GidType::RoceV2,
            "IB/RoCE v1" if link == LinkLayer::Ethernet => GidType::RoceV1,
            "IB/RoCE v1" => GidType::Ib,
            _ => GidType::Unknown,
        }
    }
}

/// One GID table entry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct GidEntry {
    pub index: u8,
    pub gid: [u8; 16],
    pub gid_type: GidType,
}

impl GidEntry {
    pub fn is_zero(&self) -> bool {
        self.gid.iter().all(|b| *b == 0)
    }
    /// `::ffff:a.b.c.d`: the GID of an IPv4 address (RoCE).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|b| *b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }
    /// fe80::/10 (the default GID of every RoCE port; reaches the local link only).
    pub fn is_link_local(&self) -> bool {
        self.gid[0] == 0xfe && self.gid[1] & 0xc0 == 0x80
    }
    /// The InfiniBand subnet prefix (the upper 64 bits).
    pub fn subnet_prefix(&self) -> [u8; 8] {
        let mut p = [0u8; 8];
        p.copy_from_slice(&self.gid[..8]);
        p
    }
}

/// Set-up cannot go on; each says what to do.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum PortError {
    /// `--gid-index` names an entry that is empty or beyond the table.
    GidIndexInvalid { index: u8, valid: Vec<u8> },
    /// The port's GID table has no usable entry.
    NoGid { port: u8 },
    /// An InfiniBand port without a LID (no subnet manager).
    NoLid { port: u8 },
    /// The port is not ACTIVE.
    NotActive { port: u8, state: PortState },
    /// The provider reported an active MTU outside `enum ibv_mtu`.
    BadMtu { port: u8 },
    /// No device has an active port.
    NoActivePort { devices: Vec<(String, Vec<(u8, PortState)>)> },
}

impl fmt::Display for PortError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortError::GidIndexInvalid { index, valid } => write!(
                f,
                "--gid-index {index} is not a valid GID of the port (valid: {}); `show_gids` or `ibv_devinfo -v` lists them",
                if valid.is_empty() {
                    "none".to_string()
                } else {
                    valid.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
                }
            ),
            PortError::NoGid { port } => write!(
                f,
                "port {port} has no GID (RoCE: is an IP address assigned to the device's network interface?)"
            ),
            PortError::NoLid { port } => {
                write!(f, "InfiniBand port {port} has no LID: start a subnet manager (opensm)")
            }
            PortError::NotActive { port, state } => {
                write!(f, "port {port} is {state:?}, not ACTIVE: {}", state.hint())
            }
            PortError::BadMtu { port } => write!(f, "port {port} reports an active MTU outside ibv_mtu"),
            PortError::NoActivePort { devices } => {
                f.write_str("no RDMA device has an ACTIVE port (")?;
                for (i, (name, ports)) in devices.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{name}:")?;
                    for (p, s) in ports {
                        write!(f, " port {p} {s:?}")?;
                    }
                }
                f.write_str("); check `ibv_devinfo` and the links")
            }
        }
    }
}

impl std::error::Error for PortError {}

/// The GID raw QPs use as their source. `forced` (`--gid-index`, perftest's `-x`) must name a
/// non-empty entry. Otherwise, on Ethernet (RoCE) the best of: RoCE v2 with an IPv4-mapped
/// address, RoCE v2 routable IPv6, RoCE v2 link-local, then the same for RoCE v1 — mlx5 lists
/// each address once per type, often v1 first, and v2 is what routed RoCE networks carry; on
/// InfiniBand the port GID (index 0 when present).
pub fn choose_gid(port: &PortAttr, table: &[GidEntry], forced: Option<u8>) -> Result<GidEntry, PortError> {
    let usable: Vec<&GidEntry> = table.iter().filter(|e| !e.is_zero()).collect();
    if let Some(i) = forced {
        return usable
            .iter()
            .find(|e| e.index == i)
            .map(|e| **e)
            .ok_or_else(|| PortError::GidIndexInvalid { index: i, valid: usable.iter().map(|e| e.index).collect() });
    }
    let rank = |e: &GidEntry| -> u8 {
        if port.link_layer == LinkLayer::Ethernet {
            let t = match e.gid_type {
                GidType::RoceV2 => 0,
                GidType::RoceV1 => 3,
                _ => 6,
            };
            let a = if e.is_ipv4_mapped() {
                0
            } else if !e.is_link_local() {
                1
            } else {
                2
            };
            t + a
        } else {
            // InfiniBand: the port GID first
            u8::from(e.index != 0)
        }
    };
    usable.into_iter().min_by_key(|e| (rank(e), e.index)).copied().ok_or(PortError::NoGid { port: port.port })
}

/// How a raw RC QP reaches its peer (`ibv_qp_attr.ah_attr`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Addressing {
    /// InfiniBand within the subnet: `dlid`, `is_global = 0`.
    Lid { dlid: u16 },
    /// A global route header: RoCE always, InfiniBand across subnets (`dlid` then names the
    /// router port).
    Global { dlid: u16, dgid: [u8; 16], sgid_index: u8, hop_limit: u8 },
}

/// What is known of the peer of a raw QP.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Peer {
    pub lid: u16,
    pub gid: [u8; 16],
}

/// The address vector of a raw RC QP from `local` (port and chosen GID) to `peer`.
pub fn address(port: &PortAttr, local: &GidEntry, peer: &Peer) -> Result<Addressing, PortError> {
    if port.link_layer.uses_lids() {
        if port.lid == 0 {
            return Err(PortError::NoLid { port: port.port });
        }
        let same_subnet = peer.gid[..8] == local.subnet_prefix() || peer.gid.iter().all(|b| *b == 0);
        if same_subnet {
            return Ok(Addressing::Lid { dlid: peer.lid });
        }
        return Ok(Addressing::Global { dlid: peer.lid, dgid: peer.gid, sgid_index: local.index, hop_limit: 64 });
    }
    Ok(Addressing::Global { dlid: 0, dgid: peer.gid, sgid_index: local.index, hop_limit: 64 })
}

/// The path MTU of a connection: the smaller active MTU of the two ends.
pub fn path_mtu(local: &PortAttr, peer_mtu: Option<Mtu>) -> Result<Mtu, PortError> {
    let m = local.active_mtu.ok_or(PortError::BadMtu { port: local.port })?;
    Ok(peer_mtu.map_or(m, |p| p.min(m)))
}

/// A device as the auto-pick sees it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub name: String,
    /// The attributes advertise type-2 windows (a hint only: the probe decides).
    pub mw_type2_flag: bool,
    pub ports: Vec<(u8, PortState)>,
}

/// The device and port to open when none is named: the first device with an ACTIVE port,
/// preferring one whose attributes advertise type-2 windows (but not requiring it: the probe
/// decides what the device really does). With `name`, that device's first ACTIVE port.
pub fn pick_device(cands: &[Candidate], name: Option<&str>) -> Result<(usize, u8), PortError> {
    let active = |c: &Candidate| c.ports.iter().find(|(_, s)| s.is_active()).map(|(p, _)| *p);
    let pool: Vec<(usize, &Candidate)> =
        cands.iter().enumerate().filter(|(_, c)| name.is_none_or(|n| c.name == n)).collect();
    if let [(i, c)] = pool.as_slice() {
        if name.is_some() {
            return match active(c) {
                Some(p) => Ok((*i, p)),
                None => {
                    let (port, state) = c.ports.first().copied().unwrap_or((1, PortState::Down));
                    Err(PortError::NotActive { port, state })
                }
            };
        }
    }
    let best =
        pool.iter().filter_map(|(i, c)| active(c).map(|p| (*i, p, c.mw_type2_flag))).min_by_key(|(i, _, mw)| (!mw, *i));
    best.map(|(i, p, _)| (i, p)).ok_or_else(|| PortError::NoActivePort {
        devices: pool.iter().map(|(_, c)| (c.name.clone(), c.ports.clone())).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eth() -> PortAttr {
        PortAttr {
            port: 1,
            state: PortState::Active,
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            active_mtu: Some(Mtu::B1024),
            gid_table_len: 16,
            max_msg_sz: 1 << 31,
        }
    }
    fn ib(lid: u16) -> PortAttr {
        PortAttr { link_layer: LinkLayer::InfiniBand, lid, active_mtu: Some(Mtu::B4096), ..eth() }
    }
    fn gid(index: u8, t: GidType, head: &[u8]) -> GidEntry {
        let mut g = [0u8; 16];
        g[..head.len()].copy_from_slice(head);
        GidEntry { index, gid: g, gid_type: t }
    }
    fn v4(index: u8, t: GidType) -> GidEntry {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[192, 0, 2, 1]);
        GidEntry { index, gid: g, gid_type: t }
    }
    const LL: [u8; 2] = [0xfe, 0x80];

    /// mlx5 on RoCE: each address twice, v1 then v2 — the v2 IPv4 entry wins.
    #[test]
    fn roce_prefers_v2_ipv4() {
        let t = [
            gid(0, GidType::RoceV1, &LL),
            gid(1, GidType::RoceV2, &LL),
            v4(2, GidType::RoceV1),
            v4(3, GidType::RoceV2),
            gid(4, GidType::RoceV1, &[0x20, 0x01, 0x0d, 0xb8]),
            gid(5, GidType::RoceV2, &[0x20, 0x01, 0x0d, 0xb8]),
        ];
        assert_eq!(choose_gid(&eth(), &t, None).unwrap().index, 3);
        // without the v4 address: routable v6 v2, then link-local v2, then v1
        assert_eq!(choose_gid(&eth(), &t[..2], None).unwrap().index, 1);
        assert_eq!(choose_gid(&eth(), &[t[0], t[1], t[4], t[5]], None).unwrap().index, 5);
        assert_eq!(choose_gid(&eth(), &[t[0], t[2]], None).unwrap().index, 2);
    }

    /// soft-RoCE reports every GID as v2 on recent kernels: index 1 (IPv4), not 0 (fe80::).
    #[test]
    fn rxe_table_picks_the_ipv4_gid() {
        let t = [gid(0, GidType::RoceV2, &LL), v4(1, GidType::RoceV2), gid(2, GidType::Unknown, &[])];
        assert_eq!(choose_gid(&eth(), &t, None).unwrap().index, 1);
    }

    #[test]
    fn forced_index_must_exist() {
        let t = [gid(0, GidType::RoceV1, &LL), v4(1, GidType::RoceV1), gid(2, GidType::Unknown, &[])];
        assert_eq!(choose_gid(&eth(), &t, Some(0)).unwrap().index, 0);
        assert_eq!(choose_gid(&eth(), &t, Some(2)), Err(PortError::GidIndexInvalid { index: 2, valid: vec![0, 1] }));
        assert!(choose_gid(&eth(), &t, Some(9)).unwrap_err().to_string().contains("valid: 0, 1"));
        assert_eq!(choose_gid(&eth(), &[], None), Err(PortError::NoGid { port: 1 }));
    }

    #[test]
    fn infiniband_uses_the_port_gid_and_lids() {
        let pfx = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x00, 0x02, 0xc9];
        let t = [gid(0, GidType::Ib, &pfx), gid(1, GidType::Ib, &[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 7])];
        let g = choose_gid(&ib(5), &t, None).unwrap();
        assert_eq!(g.index, 0);
        // same subnet: LID routed, no GRH
        let peer = Peer { lid: 9, gid: t[0].gid };
        assert_eq!(address(&ib(5), &g, &peer), Ok(Addressing::Lid { dlid: 9 }));
        assert_eq!(address(&ib(5), &g, &Peer { lid: 9, gid: [0; 16] }), Ok(Addressing::Lid { dlid: 9 }));
        // another subnet prefix: a GRH is needed
        let far = Peer { lid: 3, gid: gid(0, GidType::Ib, &[0xfe, 0x80, 0, 0, 0, 0, 0, 1]).gid };
        assert!(matches!(address(&ib(5), &g, &far), Ok(Addressing::Global { dlid: 3, sgid_index: 0, .. })));
        // no SM: no LID
        assert_eq!(address(&ib(0), &g, &peer), Err(PortError::NoLid { port: 1 }));
        // an old provider's "unspecified" link layer is InfiniBand
        let old = PortAttr { link_layer: LinkLayer::Unspecified, ..ib(5) };
        assert_eq!(address(&old, &g, &peer), Ok(Addressing::Lid { dlid: 9 }));
    }

    #[test]
    fn roce_always_routes_globally() {
        let g = v4(3, GidType::RoceV2);
        let a = address(&eth(), &g, &Peer { lid: 0, gid: g.gid }).unwrap();
        assert_eq!(a, Addressing::Global { dlid: 0, dgid: g.gid, sgid_index: 3, hop_limit: 64 });
    }

    #[test]
    fn mtu_is_the_smaller_end() {
        assert_eq!(path_mtu(&ib(1), None), Ok(Mtu::B4096));
        assert_eq!(path_mtu(&ib(1), Some(Mtu::B2048)), Ok(Mtu::B2048));
        assert_eq!(path_mtu(&eth(), Some(Mtu::B4096)), Ok(Mtu::B1024));
        assert_eq!(path_mtu(&PortAttr { active_mtu: None, ..eth() }, None), Err(PortError::BadMtu { port: 1 }));
        assert_eq!(Mtu::from_raw(3), Some(Mtu::B1024));
        assert_eq!(Mtu::B1024.bytes(), 1024);
        assert_eq!(Mtu::from_raw(9), None);
    }

    #[test]
    fn sysfs_gid_types() {
        assert_eq!(GidType::from_sysfs("RoCE v2\n", LinkLayer::Ethernet), GidType::RoceV2);
        assert_eq!(GidType::from_sysfs("IB/RoCE v1\n", LinkLayer::Ethernet), GidType::RoceV1);
        assert_eq!(GidType::from_sysfs("IB/RoCE v1", LinkLayer::InfiniBand), GidType::Ib);
        assert_eq!(GidType::from_sysfs("", LinkLayer::Ethernet), GidType::Unknown);
        assert_eq!(GidType::from_raw(2), GidType::RoceV2);
    }

    #[test]
    fn device_pick_considers_port_state() {
        let c = |name: &str, mw: bool, ports: &[(u8, PortState)]| Candidate {
            name: name.into(),
            mw_type2_flag: mw,
            ports: ports.to_vec(),
        };
        let cands = [
            c("mlx5_0", true, &[(1, PortState::Down)]),
            c("mlx5_1", false, &[(1, PortState::Active)]),
            c("mlx5_2", true, &[(1, PortState::Init), (2, PortState::Active)]),
        ];
        // the first with an active port and the type-2 flag; the flag is a preference only
        assert_eq!(pick_device(&cands, None), Ok((2, 2)));
        assert_eq!(pick_device(&cands[..2], None), Ok((1, 1)));
        assert_eq!(pick_device(&cands, Some("mlx5_1")), Ok((1, 1)));
        assert_eq!(pick_device(&cands, Some("mlx5_0")), Err(PortError::NotActive { port: 1, state: PortState::Down }));
        let e = pick_device(&cands[..1], None).unwrap_err();
        assert!(matches!(e, PortError::NoActivePort { .. }));
        assert!(e.to_string().contains("mlx5_0: port 1 Down"), "{e}");
    }
}
