//! The Coyote v2 / BALBOA command and context encodings, as data.
//!
//! Every word the host writes to the engine is built (and parsed back, for the test double)
//! here, so the bit layouts live in one place and the golden tests pin them. Facts from
//! Coyote's `cDefs.hpp` / `cThread.cpp` / `lynx_pkg` (DESIGN.md §6.3):
//!
//! ```text
//! control word (CTRL_REG, CTRL_REG_2)
//!   [4:0]   opcode        RDMA READ/WRITE/SEND, numbered per firmware version
//!   [9:8]   stream        0 card, 1 host, 2 RDMA, 3 TCP
//!   [15:10] pid           the Coyote thread id (ctid) = the QP of this vFPGA
//!   [19:16] dest          vFPGA AXI stream index
//!   20      LAST          the command completes a request: completion counters move
//!   21      START         (set on the remote-side word of an RDMA command)
//!   22      CLR_STAT      clear the pid's completion counters
//!   [63:32] length        bytes; the engine's LEN_BITS is 28
//!
//! QP context   CTX[0] = local qpn[23:0] | remote rkey << 32
//!              CTX[1] = local psn[23:0] | remote psn[23:0] << 24
//!              CTX[2] = remote vaddr[47:0]
//! connection   CONN[0] = local qpn[15:0] | remote qpn[23:0] << 16 | port[15:0] << 40
//!              CONN[1] = remote GID words 1,0 (IPv4 address repeated)
//!              CONN[2] = remote GID words 3,2
//! QPN          (vfid << 6) | ctid
//! ```

use core::fmt;

pub const OPCODE_BITS: u32 = 5;
pub const STREAM_OFFS: u32 = 8;
pub const PID_OFFS: u32 = 10;
pub const DEST_OFFS: u32 = 16;
pub const CTRL_LAST: u64 = 1 << 20;
pub const CTRL_START: u64 = 1 << 21;
pub const CTRL_CLR_STAT: u64 = 1 << 22;
pub const LEN_OFFS: u32 = 32;

pub const OPCODE_MASK: u64 = 0x1f;
pub const STREAM_MASK: u64 = 0x3;
pub const PID_MASK: u64 = 0x3f;
pub const DEST_MASK: u64 = 0xf;

/// Width of the engine's length field (`lynx_pkg::LEN_BITS`).
pub const LEN_BITS: u32 = 28;
pub const MAX_LEN_FIELD: u64 = (1 << LEN_BITS) - 1;
/// Coyote's software limit on one transfer (`MAX_TRANSFER_SIZE`, 128 MiB).
pub const MAX_TRANSFER_SIZE: u64 = 128 * 1024 * 1024;
/// Width of an engine virtual address (`VADDR_BITS`).
pub const VADDR_BITS: u32 = 48;
pub const MAX_VADDR: u64 = (1 << VADDR_BITS) - 1;
/// Depth of the per-vFPGA command FIFO (`CMD_FIFO_DEPTH`).
pub const CMD_FIFO_DEPTH: u64 = 32;
/// Coyote keeps this many FIFO entries free: `cThread::postCmd` waits while more than
/// `CMD_FIFO_DEPTH - CMD_FIFO_THR` commands are queued (`cDefs.hpp`, 4459deb). The FIFO is
/// written over AXI-Lite with no back-pressure to the host: a push into a full FIFO is lost.
pub const CMD_FIFO_THR: u64 = 10;
/// The most commands the shim lets wait in the FIFO before it refuses another.
pub const CMD_FIFO_LIMIT: u64 = CMD_FIFO_DEPTH - CMD_FIFO_THR;
/// Path MTU of the RoCE stack: `PMTU_BYTES`, a synthesis parameter whose default is 4096
/// (`cmake/FindCoyoteHW.cmake`, Coyote c81d68f); set [`crate::FpgaConfig::pmtu`] to the build's.
pub const DEFAULT_PMTU: u32 = 4096;
/// Outstanding RDMA WRITE/SEND requests per QP (`RDMA_N_WR_OUTSTANDING`).
pub const MAX_OUTSTANDING_WRITES: u32 = 16;
/// Outstanding RDMA READ requests per QP (`N_OUTSTANDING`).
pub const MAX_OUTSTANDING_READS: u32 = 8;
/// Coyote threads (QPs) per vFPGA (`N_CTID_MAX`).
pub const MAX_CTID: u8 = 63;
pub const MAX_VFID: u8 = 15;
pub const PID_BITS: u32 = 6;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum EncodeError {
    /// Length does not fit the engine's 28-bit length field.
    LengthOverflow {
        len: u64,
    },
    /// Address does not fit the engine's 48-bit virtual address.
    AddressOverflow {
        addr: u64,
    },
    CtidOverflow(u8),
    VfidOverflow(u8),
    DestOverflow(u8),
    QpnOverflow(u32),
    PsnOverflow(u32),
    PortOverflow(u32),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LengthOverflow { len } => {
                write!(f, "length {len} does not fit the engine's {LEN_BITS}-bit length field")
            }
            Self::AddressOverflow { addr } => {
                write!(f, "address {addr:#x} does not fit the engine's {VADDR_BITS}-bit virtual address")
            }
            Self::CtidOverflow(c) => write!(f, "Coyote thread id {c} exceeds {MAX_CTID}"),
            Self::VfidOverflow(v) => write!(f, "vFPGA id {v} exceeds {MAX_VFID}"),
            Self::DestOverflow(d) => write!(f, "stream destination {d} exceeds 15"),
            Self::QpnOverflow(q) => write!(f, "QP number {q:#x} does not fit the field"),
            Self::PsnOverflow(p) => write!(f, "PSN {p:#x} exceeds 24 bits"),
            Self::PortOverflow(p) => write!(f, "port {p} exceeds 16 bits"),
        }
    }
}

/// The RDMA operations the stock engine executes.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum RdmaOp {
    Read,
    Write,
    Send,
}

impl RdmaOp {
    pub const ALL: [RdmaOp; 3] = [RdmaOp::Read, RdmaOp::Write, RdmaOp::Send];
    /// WRITE and SEND share the engine's write-side counter and outstanding limit.
    pub const fn is_write_class(self) -> bool {
        matches!(self, RdmaOp::Write | RdmaOp::Send)
    }
}

/// How the RDMA opcodes are numbered in the control word. The encoding is selected per
/// engine, never guessed from the other.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum OpcodeEncoding {
    /// What Coyote v2's `cThread::invoke(oper, rdmaSg)` writes: `CoyoteOper - REMOTE_OFFS_OPS`,
    /// i.e. READ = 6 − 6 = 0, WRITE = 1, SEND = 2 (`cOps.hpp`, `cDefs.hpp`, `cThread.cpp`,
    /// Coyote 4459deb) — also `APP_READ` / `APP_WRITE` / `APP_SEND` of the `lynx_pkg` templates
    /// read here (bca3563, 05090aa). The default.
    CoyoteV2,
    /// READ = 0x12, WRITE = 0x13, SEND = 0x14: the `APP_*` values DESIGN.md §6.3 reads in a
    /// Coyote version not found in the index (unverified; kept for such a build). 0x12–0x14 are
    /// also the IB wire opcodes ATOMIC_ACK / COMPARE_SWAP / FETCH_ADD — see
    /// [`crate::ext::wire`].
    AppOpcodes,
}

impl OpcodeEncoding {
    pub const fn encode(self, op: RdmaOp) -> u8 {
        match (self, op) {
            (OpcodeEncoding::CoyoteV2, RdmaOp::Read) => 0,
            (OpcodeEncoding::CoyoteV2, RdmaOp::Write) => 1,
            (OpcodeEncoding::CoyoteV2, RdmaOp::Send) => 2,
            (OpcodeEncoding::AppOpcodes, RdmaOp::Read) => 0x12,
            (OpcodeEncoding::AppOpcodes, RdmaOp::Write) => 0x13,
            (OpcodeEncoding::AppOpcodes, RdmaOp::Send) => 0x14,
        }
    }
    pub fn decode(self, opcode: u8) -> Option<RdmaOp> {
        RdmaOp::ALL.into_iter().find(|op| self.encode(*op) == opcode)
    }
}

/// Data stream of a control word (`STRM_*`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u8)]
pub enum Stream {
    Card = 0,
    Host = 1,
    Rdma = 2,
    Tcp = 3,
}

impl Stream {
    pub const fn from_bits(v: u8) -> Stream {
        match v & 3 {
            0 => Stream::Card,
            1 => Stream::Host,
            2 => Stream::Rdma,
            _ => Stream::Tcp,
        }
    }
}

/// One control word (`CTRL_REG` / `CTRL_REG_2`), field by field.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct CtrlWord {
    /// Raw 5-bit opcode (see [`OpcodeEncoding`]).
    pub opcode: u8,
    pub stream: Stream,
    /// Coyote thread id: selects the QP.
    pub pid: u8,
    pub dest: u8,
    pub last: bool,
    pub start: bool,
    pub clr_stat: bool,
    pub len: u32,
}

impl CtrlWord {
    pub fn encode(&self) -> Result<u64, EncodeError> {
        if self.pid as u64 > PID_MASK {
            return Err(EncodeError::CtidOverflow(self.pid));
        }
        if self.dest as u64 > DEST_MASK {
            return Err(EncodeError::DestOverflow(self.dest));
        }
        if self.len as u64 > MAX_LEN_FIELD {
            return Err(EncodeError::LengthOverflow { len: self.len as u64 });
        }
        Ok((self.opcode as u64 & OPCODE_MASK)
            | ((self.stream as u64 & STREAM_MASK) << STREAM_OFFS)
            | ((self.pid as u64) << PID_OFFS)
            | ((self.dest as u64) << DEST_OFFS)
            | if self.last { CTRL_LAST } else { 0 }
            | if self.start { CTRL_START } else { 0 }
            | if self.clr_stat { CTRL_CLR_STAT } else { 0 }
            | ((self.len as u64) << LEN_OFFS))
    }
    /// Parse a word exactly as the engine latches it (the length keeps all 32 bits so a
    /// decoder can tell an overflowing length from a legal one).
    pub const fn decode(w: u64) -> CtrlWord {
        CtrlWord {
            opcode: (w & OPCODE_MASK) as u8,
            stream: Stream::from_bits(((w >> STREAM_OFFS) & STREAM_MASK) as u8),
            pid: ((w >> PID_OFFS) & PID_MASK) as u8,
            dest: ((w >> DEST_OFFS) & DEST_MASK) as u8,
            last: w & CTRL_LAST != 0,
            start: w & CTRL_START != 0,
            clr_stat: w & CTRL_CLR_STAT != 0,
            len: (w >> LEN_OFFS) as u32,
        }
    }
    /// The CLR_STAT word for a thread: clears its completion counters.
    pub const fn clear_stat(ctid: u8) -> u64 {
        CTRL_CLR_STAT | (((ctid as u64) & PID_MASK) << PID_OFFS)
    }
}

/// The four 64-bit words of one command, in the registers they go to. The host writes them
/// `VADDR_WR`, `CTRL_REG_2`, `VADDR_RD`, then `CTRL_REG` last: the `CTRL_REG` write is what
/// pushes the command into the FIFO (see [`crate::mmio::post_command`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Command {
    /// Destination address (`VADDR_WR_REG`).
    pub vaddr_wr: u64,
    /// Destination control word (`CTRL_REG_2`).
    pub ctrl_dst: u64,
    /// Source address (`VADDR_RD_REG`).
    pub vaddr_rd: u64,
    /// Source control word (`CTRL_REG`), written last.
    pub ctrl_src: u64,
}

/// One RDMA request as the shim hands it to the engine.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct RdmaRequest {
    pub op: RdmaOp,
    pub ctid: u8,
    pub local_addr: u64,
    pub remote_addr: u64,
    pub len: u32,
    pub last: bool,
    /// AXI stream indexes on the local and remote vFPGA.
    pub local_dest: u8,
    pub remote_dest: u8,
}

impl RdmaRequest {
    pub const fn new(op: RdmaOp, ctid: u8, local_addr: u64, remote_addr: u64, len: u32) -> Self {
        RdmaRequest { op, ctid, local_addr, remote_addr, len, last: true, local_dest: 0, remote_dest: 0 }
    }
}

impl Command {
    /// An RDMA command as `cThread::invoke(rdmaSg)` builds it: the remote-side word carries
    /// stream RDMA and START; for a READ the remote side is the source, for WRITE/SEND the
    /// destination.
    pub fn rdma(enc: OpcodeEncoding, r: &RdmaRequest) -> Result<Command, EncodeError> {
        if r.ctid > MAX_CTID {
            return Err(EncodeError::CtidOverflow(r.ctid));
        }
        for a in [r.local_addr, r.remote_addr] {
            if a > MAX_VADDR {
                return Err(EncodeError::AddressOverflow { addr: a });
            }
        }
        let opcode = enc.encode(r.op);
        let local = CtrlWord {
            opcode,
            stream: Stream::Host,
            pid: r.ctid,
            dest: r.local_dest,
            last: r.last,
            start: false,
            clr_stat: false,
            len: r.len,
        }
        .encode()?;
        let remote = CtrlWord {
            opcode,
            stream: Stream::Rdma,
            pid: r.ctid,
            dest: r.remote_dest,
            last: r.last,
            start: true,
            clr_stat: false,
            len: r.len,
        }
        .encode()?;
        Ok(match r.op {
            RdmaOp::Read => {
                Command { vaddr_wr: r.local_addr, ctrl_dst: local, vaddr_rd: r.remote_addr, ctrl_src: remote }
            }
            RdmaOp::Write | RdmaOp::Send => {
                Command { vaddr_wr: r.remote_addr, ctrl_dst: remote, vaddr_rd: r.local_addr, ctrl_src: local }
            }
        })
    }
    /// `cThread::clearCompleted`: CLR_STAT in both control words.
    pub const fn clear_stat(ctid: u8) -> Command {
        Command { vaddr_wr: 0, ctrl_dst: CtrlWord::clear_stat(ctid), vaddr_rd: 0, ctrl_src: CtrlWord::clear_stat(ctid) }
    }

    /// Decode a latched command the way the engine does; `None` for words that do not form an
    /// RDMA command of this encoding (the double counts those as decode errors).
    pub fn decode_rdma(&self, enc: OpcodeEncoding) -> Result<RdmaRequest, DecodeError> {
        let src = CtrlWord::decode(self.ctrl_src);
        let dst = CtrlWord::decode(self.ctrl_dst);
        let op = enc.decode(src.opcode).ok_or(DecodeError::UnknownOpcode(src.opcode))?;
        if dst.opcode != src.opcode || dst.pid != src.pid || dst.len != src.len {
            return Err(DecodeError::Mismatch);
        }
        if src.len as u64 > MAX_LEN_FIELD {
            return Err(DecodeError::LengthOverflow(src.len));
        }
        let (local_w, remote_w, local_addr, remote_addr) = match op {
            RdmaOp::Read => (dst, src, self.vaddr_wr, self.vaddr_rd),
            RdmaOp::Write | RdmaOp::Send => (src, dst, self.vaddr_rd, self.vaddr_wr),
        };
        if remote_w.stream != Stream::Rdma || local_w.stream == Stream::Rdma {
            return Err(DecodeError::Mismatch);
        }
        for a in [local_addr, remote_addr] {
            if a > MAX_VADDR {
                return Err(DecodeError::AddressOverflow(a));
            }
        }
        Ok(RdmaRequest {
            op,
            ctid: src.pid,
            local_addr,
            remote_addr,
            len: src.len,
            last: src.last && dst.last,
            local_dest: local_w.dest,
            remote_dest: remote_w.dest,
        })
    }
}

/// Why the engine would not accept a latched command.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum DecodeError {
    UnknownOpcode(u8),
    /// The two control words disagree or neither side is the RDMA stream.
    Mismatch,
    LengthOverflow(u32),
    AddressOverflow(u64),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownOpcode(o) => write!(f, "opcode {o:#x} is not an RDMA opcode of this firmware"),
            Self::Mismatch => f.write_str("source and destination control words do not form an RDMA command"),
            Self::LengthOverflow(l) => write!(f, "length {l} exceeds the {LEN_BITS}-bit length field"),
            Self::AddressOverflow(a) => write!(f, "address {a:#x} exceeds {VADDR_BITS} bits"),
        }
    }
}

/// `QPN = (vfid << 6) | ctid`.
pub fn qpn(vfid: u8, ctid: u8) -> Result<u32, EncodeError> {
    if vfid > MAX_VFID {
        return Err(EncodeError::VfidOverflow(vfid));
    }
    if ctid > MAX_CTID {
        return Err(EncodeError::CtidOverflow(ctid));
    }
    Ok(((vfid as u32) << PID_BITS) | ctid as u32)
}

/// Inverse of [`qpn`]: `(vfid, ctid)`, or `None` for numbers the engine cannot produce.
pub fn split_qpn(qpn: u32) -> Option<(u8, u8)> {
    if qpn >> (PID_BITS + 4) != 0 {
        return None;
    }
    Some(((qpn >> PID_BITS) as u8, (qpn & PID_MASK as u32) as u8))
}

/// The QP context (`RDMA_CTX_REG_0..2`, `writeQpContext`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct QpContext {
    pub local_qpn: u32,
    pub remote_rkey: u32,
    pub local_psn: u32,
    pub remote_psn: u32,
    pub remote_vaddr: u64,
}

impl QpContext {
    pub fn encode(&self) -> Result<[u64; 3], EncodeError> {
        if self.local_qpn > 0xFF_FFFF {
            return Err(EncodeError::QpnOverflow(self.local_qpn));
        }
        for p in [self.local_psn, self.remote_psn] {
            if p > 0xFF_FFFF {
                return Err(EncodeError::PsnOverflow(p));
            }
        }
        if self.remote_vaddr > MAX_VADDR {
            return Err(EncodeError::AddressOverflow { addr: self.remote_vaddr });
        }
        Ok([
            self.local_qpn as u64 | (self.remote_rkey as u64) << 32,
            self.local_psn as u64 | (self.remote_psn as u64) << 24,
            self.remote_vaddr,
        ])
    }
    pub const fn decode(w: [u64; 3]) -> QpContext {
        QpContext {
            local_qpn: (w[0] & 0xFF_FFFF) as u32,
            remote_rkey: (w[0] >> 32) as u32,
            local_psn: (w[1] & 0xFF_FFFF) as u32,
            remote_psn: ((w[1] >> 24) & 0xFF_FFFF) as u32,
            remote_vaddr: w[2] & MAX_VADDR,
        }
    }
}

/// The connection context (`RDMA_CONN_REG_0..2`).
///
/// `remote_ip` is the IPv4 address as a host-order number (10.0.0.1 = `0x0A00_0001`, what
/// `IOCTL_GET_IP_ADDRESS` returns and `ibvQ::ip_addr` holds). Coyote puts it in every GID word
/// with `uintToGid` (`%08x`) and writes CONN words 1–2 from `gidToUint(idx)`, which parses
/// those hex digits back and returns `ntohl(v)` — on a little-endian host the address
/// **byte-swapped** (`cDefs.hpp` / `cThread::writeQpContext`, Coyote 4459deb). For 10.0.0.1
/// the words are `0x0100_000A_0100_000A`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct ConnContext {
    /// Only the low 16 bits are carried (`CONN[0]` bits 15..0).
    pub local_qpn: u32,
    pub remote_qpn: u32,
    pub port: u32,
    pub remote_ip: u32,
}

impl ConnContext {
    pub fn encode(&self) -> Result<[u64; 3], EncodeError> {
        if self.local_qpn > 0xFFFF {
            return Err(EncodeError::QpnOverflow(self.local_qpn));
        }
        if self.remote_qpn > 0xFF_FFFF {
            return Err(EncodeError::QpnOverflow(self.remote_qpn));
        }
        if self.port > 0xFFFF {
            return Err(EncodeError::PortOverflow(self.port));
        }
        let g = gid_word(self.remote_ip) as u64;
        let gid = g << 32 | g;
        Ok([self.local_qpn as u64 | (self.remote_qpn as u64) << 16 | (self.port as u64) << 40, gid, gid])
    }
    pub const fn decode(w: [u64; 3]) -> ConnContext {
        ConnContext {
            local_qpn: (w[0] & 0xFFFF) as u32,
            remote_qpn: ((w[0] >> 16) & 0xFF_FFFF) as u32,
            port: ((w[0] >> 40) & 0xFFFF) as u32,
            remote_ip: (w[1] as u32).swap_bytes(),
        }
    }
}

/// One GID word as Coyote's `gidToUint` returns it for an address `uintToGid` stored:
/// `ntohl(ip)`, the byte-swapped address on the little-endian hosts Coyote runs on
/// (`htols` is the identity there).
pub const fn gid_word(ip: u32) -> u32 {
    ip.swap_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_word_round_trips() {
        let w = CtrlWord {
            opcode: 0x13,
            stream: Stream::Rdma,
            pid: 0x2a,
            dest: 5,
            last: true,
            start: true,
            clr_stat: false,
            len: 0x0FFF_FFFF,
        };
        assert_eq!(CtrlWord::decode(w.encode().unwrap()), w);
        let mut big = w;
        big.len = 1 << 28;
        assert_eq!(big.encode(), Err(EncodeError::LengthOverflow { len: 1 << 28 }));
    }

    #[test]
    fn qpn_split() {
        assert_eq!(qpn(3, 5), Ok(0xC5));
        assert_eq!(split_qpn(0xC5), Some((3, 5)));
        assert_eq!(split_qpn(0x400), None);
        assert_eq!(qpn(16, 0), Err(EncodeError::VfidOverflow(16)));
        assert_eq!(qpn(0, 64), Err(EncodeError::CtidOverflow(64)));
    }

    #[test]
    fn command_decodes_back() {
        for enc in [OpcodeEncoding::CoyoteV2, OpcodeEncoding::AppOpcodes] {
            for op in RdmaOp::ALL {
                let r = RdmaRequest::new(op, 7, 0x1000, 0x2000, 64);
                let c = Command::rdma(enc, &r).unwrap();
                assert_eq!(c.decode_rdma(enc), Ok(r));
            }
        }
    }
}
