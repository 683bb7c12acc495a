//! The canonical work-queue entry: one fixed 64-byte layout for every operation of DESIGN.md §5.
//!
//! Chains patch WQEs in place (a READ result lands in the rkey field of a later BIND), so the
//! layout is part of the protocol: field offsets are public constants, every multi-byte field is
//! **little-endian**, and the loopback NIC executes from these very bytes. mlx5 WQEs are
//! big-endian; a chain targeting mlx5 directly would need ODRP's byte-reversing READ, which is
//! why the canonical form is a translation layer and not the mlx5 format (see docs/WQE.md).
//!
//! ```text
//! off len field        used by
//!   0  1  opcode       all
//!   1  1  flags        SIGNALED | FENCE | SOLICITED | UNBIND
//!   2  2  reserved     must be zero
//!   4  4  imm          WRITE/SEND_WITH_IMM: immediate; SEND_WITH_INV, LOCAL_INV: rkey to
//!                      invalidate; BIND_MW: the window's new rkey (index selects the MW)
//!   8  8  wr_id        all (returned in the completion)
//!  16  8  local_addr   local SGE address; BIND_MW: window start
//!  24  4  length       local SGE length; BIND_MW: window length
//!  28  4  lkey         local SGE lkey; BIND_MW: lkey of the MR the window lies in
//!  32  8  remote_addr  READ/WRITE/atomics
//!  40  4  rkey         READ/WRITE/atomics
//!  44  4  qpn          BIND_MW: QP the window is bound to; WAIT/ENABLE: QP whose queue is meant
//!  48  8  operand0     FAA: add; CAS: compare; WAIT: absolute CQ count; ENABLE: how many more
//!                      entries the managed queue may execute (added to its limit)
//!  56  8  operand1     masked FAA: field-boundary mask; CAS: swap; BIND_MW: access flags;
//!                      WAIT/ENABLE: queue selector (0 = send, 1 = receive)
//! ```

use crate::access::AccessFlags;
use core::fmt;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const WQE_SIZE: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Opcode {
    Nop = 0x00,
    Send = 0x01,
    SendWithImm = 0x02,
    SendWithInv = 0x03,
    Write = 0x04,
    WriteWithImm = 0x05,
    Read = 0x06,
    FetchAdd = 0x07,
    MaskedFetchAdd = 0x08,
    CompareSwap = 0x09,
    BindMw = 0x0A,
    LocalInv = 0x0B,
    Wait = 0x0C,
    Enable = 0x0D,
}

impl Opcode {
    pub const ALL: [Opcode; 14] = [
        Opcode::Nop,
        Opcode::Send,
        Opcode::SendWithImm,
        Opcode::SendWithInv,
        Opcode::Write,
        Opcode::WriteWithImm,
        Opcode::Read,
        Opcode::FetchAdd,
        Opcode::MaskedFetchAdd,
        Opcode::CompareSwap,
        Opcode::BindMw,
        Opcode::LocalInv,
        Opcode::Wait,
        Opcode::Enable,
    ];
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.iter().copied().find(|o| *o as u8 == v)
    }
    pub const fn is_atomic(self) -> bool {
        matches!(self, Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap)
    }
    /// Operations that touch the remote side of the QP.
    pub const fn is_remote(self) -> bool {
        matches!(self, Opcode::Write | Opcode::WriteWithImm | Opcode::Read) || self.is_atomic()
    }
    /// Operations whose completion writes bytes into local memory (the patch producers).
    pub const fn writes_local(self) -> bool {
        matches!(self, Opcode::Read) || self.is_atomic()
    }
    pub const fn name(self) -> &'static str {
        match self {
            Opcode::Nop => "NOP",
            Opcode::Send => "SEND",
            Opcode::SendWithImm => "SEND_WITH_IMM",
            Opcode::SendWithInv => "SEND_WITH_INV",
            Opcode::Write => "WRITE",
            Opcode::WriteWithImm => "WRITE_WITH_IMM",
            Opcode::Read => "READ",
            Opcode::FetchAdd => "FETCH_ADD",
            Opcode::MaskedFetchAdd => "MASKED_FETCH_ADD",
            Opcode::CompareSwap => "COMPARE_SWAP",
            Opcode::BindMw => "BIND_MW",
            Opcode::LocalInv => "LOCAL_INV",
            Opcode::Wait => "WAIT",
            Opcode::Enable => "ENABLE",
        }
    }
}

bitflags::bitflags! {
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct WqeFlags: u8 {
        /// Generate a completion (and count towards WAIT).
        const SIGNALED = 1 << 0;
        /// Wait for earlier READs/atomics on this QP to complete before executing.
        const FENCE = 1 << 1;
        const SOLICITED = 1 << 2;
        /// BIND_MW only: the mlx5 UMR "free" form — invalidate the window named by `imm`
        /// without the bound-QP check (management path, MN-side only).
        const UNBIND = 1 << 3;
    }
}

/// Which queue of a QP a WAIT or ENABLE refers to.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum QueueSel {
    Send = 0,
    Recv = 1,
}

/// A patchable field: offset and width inside the 64-byte layout.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum WqeField {
    Imm,
    WrId,
    LocalAddr,
    Length,
    Lkey,
    RemoteAddr,
    Rkey,
    Qpn,
    Operand0,
    Operand1,
}

impl WqeField {
    /// Every field, in layout order.
    pub const ALL: [WqeField; 10] = [
        WqeField::Imm,
        WqeField::WrId,
        WqeField::LocalAddr,
        WqeField::Length,
        WqeField::Lkey,
        WqeField::RemoteAddr,
        WqeField::Rkey,
        WqeField::Qpn,
        WqeField::Operand0,
        WqeField::Operand1,
    ];

    pub const fn offset(self) -> usize {
        match self {
            WqeField::Imm => 4,
            WqeField::WrId => 8,
            WqeField::LocalAddr => 16,
            WqeField::Length => 24,
            WqeField::Lkey => 28,
            WqeField::RemoteAddr => 32,
            WqeField::Rkey => 40,
            WqeField::Qpn => 44,
            WqeField::Operand0 => 48,
            WqeField::Operand1 => 56,
        }
    }
    /// `len` bytes of a WQE image from this field on (a span may cover consecutive fields),
    /// if they lie inside the WQE — what a READ of ring memory at the field returns.
    pub fn read_span(self, image: &[u8; WQE_SIZE], len: usize) -> Option<&[u8]> {
        image.get(self.offset()..self.offset().checked_add(len)?)
    }
    /// Write `data` into a WQE image from this field on, as a patching READ or a RECV scatter
    /// lands it (what runs past the WQE's end is not written).
    pub fn patch(self, image: &mut [u8; WQE_SIZE], data: &[u8]) {
        let off = self.offset();
        let end = (off + data.len()).min(WQE_SIZE);
        image[off..end].copy_from_slice(&data[..end - off]);
    }
    pub const fn width(self) -> usize {
        match self {
            WqeField::Imm | WqeField::Length | WqeField::Lkey | WqeField::Rkey | WqeField::Qpn => 4,
            _ => 8,
        }
    }
    /// Fields of a given operation that a chain may patch. Everything else (opcode, flags,
    /// wr_id) is fixed at arm time: a patch there could turn a BIND into a WRITE.
    pub const fn patchable_for(self, op: Opcode) -> bool {
        use Opcode::*;
        use WqeField::*;
        match op {
            BindMw => matches!(self, Imm | Rkey | LocalAddr | Length | Lkey | Qpn),
            LocalInv | SendWithInv => matches!(self, Imm),
            // a READ's local key: the free chain's ownership proof (`chain::free`)
            Read => matches!(self, Imm | RemoteAddr | Rkey | LocalAddr | Lkey),
            Write | WriteWithImm => matches!(self, Imm | RemoteAddr | Rkey | LocalAddr),
            Send | SendWithImm => matches!(self, Imm | LocalAddr),
            FetchAdd | MaskedFetchAdd | CompareSwap => {
                matches!(self, RemoteAddr | Rkey | Operand0 | Operand1)
            }
            Wait | Enable => matches!(self, Operand0),
            Nop => false,
        }
    }
}

/// The byte image, exactly as it lies in a send queue ring.
#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct WqeBytes {
    pub opcode: u8,
    pub flags: u8,
    pub reserved: U16,
    pub imm: U32,
    pub wr_id: U64,
    pub local_addr: U64,
    pub length: U32,
    pub lkey: U32,
    pub remote_addr: U64,
    pub rkey: U32,
    pub qpn: U32,
    pub operand0: U64,
    pub operand1: U64,
}

const _: () = assert!(core::mem::size_of::<WqeBytes>() == WQE_SIZE);
const _: () = {
    use core::mem::offset_of;
    assert!(WqeField::Imm.offset() == offset_of!(WqeBytes, imm));
    assert!(WqeField::WrId.offset() == offset_of!(WqeBytes, wr_id));
    assert!(WqeField::LocalAddr.offset() == offset_of!(WqeBytes, local_addr));
    assert!(WqeField::Length.offset() == offset_of!(WqeBytes, length));
    assert!(WqeField::Lkey.offset() == offset_of!(WqeBytes, lkey));
    assert!(WqeField::RemoteAddr.offset() == offset_of!(WqeBytes, remote_addr));
    assert!(WqeField::Rkey.offset() == offset_of!(WqeBytes, rkey));
    assert!(WqeField::Qpn.offset() == offset_of!(WqeBytes, qpn));
    assert!(WqeField::Operand0.offset() == offset_of!(WqeBytes, operand0));
    assert!(WqeField::Operand1.offset() == offset_of!(WqeBytes, operand1));
};

/// A decoded, validated WQE.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Wqe {
    pub opcode: Opcode,
    pub flags: WqeFlags,
    pub imm: u32,
    pub wr_id: u64,
    pub local_addr: u64,
    pub length: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub qpn: u32,
    pub operand0: u64,
    pub operand1: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum WqeError {
    Truncated {
        len: usize,
    },
    UnknownOpcode(u8),
    UnknownFlags(u8),
    ReservedNotZero,
    /// An atomic whose length is not 8 or whose remote address is not 8-byte aligned.
    BadAtomic,
    /// UNBIND set on something other than BIND_MW.
    UnbindOnNonBind,
    QpnOverflow(u32),
    BadQueueSelector(u64),
    BadAccessFlags(u64),
    /// RECV with more scatter entries than [`MAX_RECV_SGES`].
    TooManySges(u8),
}

impl fmt::Display for WqeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { len } => write!(f, "WQE truncated: {len} bytes"),
            Self::UnknownOpcode(o) => write!(f, "unknown WQE opcode {o:#04x}"),
            Self::UnknownFlags(x) => write!(f, "unknown WQE flag bits {x:#04x}"),
            Self::ReservedNotZero => f.write_str("reserved WQE bytes are not zero"),
            Self::BadAtomic => f.write_str("atomic WQE needs length 8 and an 8-byte aligned remote address"),
            Self::UnbindOnNonBind => f.write_str("UNBIND flag on a WQE that is not BIND_MW"),
            Self::QpnOverflow(q) => write!(f, "QP number {q:#x} in WQE exceeds 24 bits"),
            Self::BadQueueSelector(q) => {
                write!(f, "queue selector {q} is neither send (0) nor receive (1)")
            }
            Self::BadAccessFlags(a) => write!(f, "access flags {a:#x} invalid for a memory window"),
            Self::TooManySges(n) => write!(f, "{n} scatter entries exceed the maximum of {MAX_RECV_SGES}"),
        }
    }
}

impl Wqe {
    pub const fn blank(opcode: Opcode) -> Self {
        Wqe {
            opcode,
            flags: WqeFlags::SIGNALED,
            imm: 0,
            wr_id: 0,
            local_addr: 0,
            length: 0,
            lkey: 0,
            remote_addr: 0,
            rkey: 0,
            qpn: 0,
            operand0: 0,
            operand1: 0,
        }
    }
    pub const fn nop() -> Self {
        Self::blank(Opcode::Nop)
    }
    pub const fn read(local: u64, lkey: u32, len: u32, remote: u64, rkey: u32) -> Self {
        let mut w = Self::blank(Opcode::Read);
        w.local_addr = local;
        w.lkey = lkey;
        w.length = len;
        w.remote_addr = remote;
        w.rkey = rkey;
        w
    }
    pub const fn write(local: u64, lkey: u32, len: u32, remote: u64, rkey: u32) -> Self {
        let mut w = Self::read(local, lkey, len, remote, rkey);
        w.opcode = Opcode::Write;
        w
    }
    pub const fn write_imm(local: u64, lkey: u32, len: u32, remote: u64, rkey: u32, imm: u32) -> Self {
        let mut w = Self::read(local, lkey, len, remote, rkey);
        w.opcode = Opcode::WriteWithImm;
        w.imm = imm;
        w
    }
    pub const fn send(local: u64, lkey: u32, len: u32) -> Self {
        let mut w = Self::blank(Opcode::Send);
        w.local_addr = local;
        w.lkey = lkey;
        w.length = len;
        w
    }
    pub const fn fetch_add(local: u64, lkey: u32, remote: u64, rkey: u32, add: u64) -> Self {
        let mut w = Self::read(local, lkey, 8, remote, rkey);
        w.opcode = Opcode::FetchAdd;
        w.operand0 = add;
        w
    }
    /// mlx5 extended atomic: `boundary` has a bit set at the most significant bit of each field;
    /// carries never cross a set bit, so a ring index or an rkey's key byte wraps in place.
    pub const fn masked_fetch_add(local: u64, lkey: u32, remote: u64, rkey: u32, add: u64, boundary: u64) -> Self {
        let mut w = Self::fetch_add(local, lkey, remote, rkey, add);
        w.opcode = Opcode::MaskedFetchAdd;
        w.operand1 = boundary;
        w
    }
    pub const fn compare_swap(local: u64, lkey: u32, remote: u64, rkey: u32, compare: u64, swap: u64) -> Self {
        let mut w = Self::read(local, lkey, 8, remote, rkey);
        w.opcode = Opcode::CompareSwap;
        w.operand0 = compare;
        w.operand1 = swap;
        w
    }
    /// Type-2 bind: the window `new_rkey.index()` becomes `new_rkey`, covering
    /// `[addr, addr+len)` of the MR `lkey`, usable only through QP `qpn`. The `rkey` field names
    /// the window's *current* key, as verbs name the window by `mw->rkey` (rdma-core's mlx5
    /// provider puts it in the control segment's `imm`): by default the predecessor of
    /// `new_rkey` — the window advanced by `ibv_inc_rkey`, as omw advances every window —
    /// otherwise [`Wqe::with_current_rkey`].
    pub const fn bind_mw(new_rkey: u32, addr: u64, len: u32, lkey: u32, qpn: u32, access: AccessFlags) -> Self {
        let mut w = Self::blank(Opcode::BindMw);
        w.imm = new_rkey;
        w.rkey = crate::ids::Rkey(new_rkey).prev_key().0;
        w.local_addr = addr;
        w.length = len;
        w.lkey = lkey;
        w.qpn = qpn;
        w.operand1 = access.bits() as u64;
        w
    }
    /// A bind naming `current` as the window's current key (see [`Wqe::bind_mw`]).
    pub const fn with_current_rkey(mut self, current: u32) -> Self {
        self.rkey = current;
        self
    }
    /// Management-path invalidation (mlx5 UMR with the free bit): no bound-QP check.
    pub const fn unbind_mw(rkey: u32) -> Self {
        let mut w = Self::blank(Opcode::BindMw);
        w.flags = WqeFlags::SIGNALED.union(WqeFlags::UNBIND);
        w.imm = rkey;
        w
    }
    pub const fn local_inv(rkey: u32) -> Self {
        let mut w = Self::blank(Opcode::LocalInv);
        w.imm = rkey;
        w
    }
    pub const fn send_with_inv(local: u64, lkey: u32, len: u32, rkey: u32) -> Self {
        let mut w = Self::send(local, lkey, len);
        w.opcode = Opcode::SendWithInv;
        w.imm = rkey;
        w
    }
    /// Block this send queue until the CQ of `qpn`'s `queue` has seen `count` completions.
    pub const fn wait(qpn: u32, queue: QueueSel, count: u64) -> Self {
        let mut w = Self::blank(Opcode::Wait);
        w.flags = WqeFlags::empty();
        w.qpn = qpn;
        w.operand0 = count;
        w.operand1 = queue as u64;
        w
    }
    /// Let the managed `queue` of `qpn` execute `count` more entries (its limit grows by
    /// `count`, like mlx5 SEND_EN/RECV_EN advancing the producer index a managed QP consumes).
    pub const fn enable(qpn: u32, queue: QueueSel, count: u64) -> Self {
        let mut w = Self::blank(Opcode::Enable);
        w.flags = WqeFlags::empty();
        w.qpn = qpn;
        w.operand0 = count;
        w.operand1 = queue as u64;
        w
    }
    pub const fn with_wr_id(mut self, wr_id: u64) -> Self {
        self.wr_id = wr_id;
        self
    }
    pub const fn with_flags(mut self, flags: WqeFlags) -> Self {
        self.flags = flags;
        self
    }

    pub fn queue_sel(&self) -> QueueSel {
        if self.operand1 == 1 {
            QueueSel::Recv
        } else {
            QueueSel::Send
        }
    }
    pub fn access(&self) -> AccessFlags {
        AccessFlags::from_bits_truncate(self.operand1 as u32)
    }

    pub fn to_bytes(&self) -> WqeBytes {
        WqeBytes {
            opcode: self.opcode as u8,
            flags: self.flags.bits(),
            reserved: U16::new(0),
            imm: U32::new(self.imm),
            wr_id: U64::new(self.wr_id),
            local_addr: U64::new(self.local_addr),
            length: U32::new(self.length),
            lkey: U32::new(self.lkey),
            remote_addr: U64::new(self.remote_addr),
            rkey: U32::new(self.rkey),
            qpn: U32::new(self.qpn),
            operand0: U64::new(self.operand0),
            operand1: U64::new(self.operand1),
        }
    }
    pub fn encode(&self) -> [u8; WQE_SIZE] {
        let mut out = [0u8; WQE_SIZE];
        out.copy_from_slice(self.to_bytes().as_bytes());
        out
    }

    /// Decode untrusted bytes (a ring slot the NIC fetched, possibly patched by a chain).
    pub fn decode(bytes: &[u8]) -> Result<Self, WqeError> {
        let (b, _) = WqeBytes::read_from_prefix(bytes).map_err(|_| WqeError::Truncated { len: bytes.len() })?;
        let opcode = Opcode::from_u8(b.opcode).ok_or(WqeError::UnknownOpcode(b.opcode))?;
        let flags = WqeFlags::from_bits(b.flags).ok_or(WqeError::UnknownFlags(b.flags))?;
        if b.reserved.get() != 0 {
            return Err(WqeError::ReservedNotZero);
        }
        let w = Wqe {
            opcode,
            flags,
            imm: b.imm.get(),
            wr_id: b.wr_id.get(),
            local_addr: b.local_addr.get(),
            length: b.length.get(),
            lkey: b.lkey.get(),
            remote_addr: b.remote_addr.get(),
            rkey: b.rkey.get(),
            qpn: b.qpn.get(),
            operand0: b.operand0.get(),
            operand1: b.operand1.get(),
        };
        if flags.contains(WqeFlags::UNBIND) && opcode != Opcode::BindMw {
            return Err(WqeError::UnbindOnNonBind);
        }
        if opcode.is_atomic() && (w.length != 8 || !w.remote_addr.is_multiple_of(8)) {
            return Err(WqeError::BadAtomic);
        }
        match opcode {
            Opcode::BindMw | Opcode::Wait | Opcode::Enable if w.qpn > crate::ids::Qpn::MAX => {
                return Err(WqeError::QpnOverflow(w.qpn))
            }
            Opcode::Wait | Opcode::Enable if w.operand1 > 1 => return Err(WqeError::BadQueueSelector(w.operand1)),
            Opcode::BindMw if !flags.contains(WqeFlags::UNBIND) => {
                let ok = AccessFlags::from_bits(w.operand1 as u32)
                    .filter(|a| w.operand1 <= u32::MAX as u64 && !a.intersects(AccessFlags::MR_ONLY));
                if ok.is_none() {
                    return Err(WqeError::BadAccessFlags(w.operand1));
                }
            }
            _ => {}
        }
        Ok(w)
    }
}

/// Maximum scatter entries of a receive WQE: enough for the largest request (header, reply
/// address, reply rkey, token, G−1 QP numbers) plus one spare.
pub const MAX_RECV_SGES: usize = 8;
pub const RECV_WQE_SIZE: usize = 16 + 16 * MAX_RECV_SGES;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A receive WQE: incoming SEND bytes are scattered across the entries in order. This is how a
/// request's bytes land directly in fields of pre-posted chain WQEs.
///
/// ```text
/// off len field
///   0  1  opcode (0x80)
///   1  1  sge count (≤ 8)
///   2  6  reserved (zero)
///   8  8  wr_id
///  16 16×8 entries: addr u64, length u32, lkey u32
/// ```
#[derive(Clone, PartialEq, Eq, Debug, Default, Hash)]
pub struct RecvWqe {
    pub wr_id: u64,
    pub sges: heapless::Vec<Sge, MAX_RECV_SGES>,
}

pub const RECV_OPCODE: u8 = 0x80;

/// The bytes of one scatter entry of a receive WQE.
#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
struct SgeBytes {
    addr: U64,
    length: U32,
    lkey: U32,
}

/// The byte image of a receive WQE (the table above).
#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, PartialEq, Eq, Debug)]
#[repr(C)]
struct RecvWqeBytes {
    opcode: u8,
    count: u8,
    reserved: [u8; 6],
    wr_id: U64,
    sges: [SgeBytes; MAX_RECV_SGES],
}

const _: () = assert!(core::mem::size_of::<SgeBytes>() == 16);
const _: () = assert!(core::mem::offset_of!(RecvWqeBytes, wr_id) == 8);
const _: () = assert!(core::mem::offset_of!(RecvWqeBytes, sges) == 16);
const _: () = assert!(core::mem::size_of::<RecvWqeBytes>() == RECV_WQE_SIZE);

impl RecvWqe {
    /// A receive of one scatter entry: every receive but a chain's, whose RECV scatters a
    /// request into several WQE fields.
    pub fn single(wr_id: u64, sge: Sge) -> Self {
        let mut sges = heapless::Vec::new();
        let pushed = sges.push(sge);
        debug_assert!(pushed.is_ok(), "one entry in an empty list of MAX_RECV_SGES >= 1");
        RecvWqe { wr_id, sges }
    }
    pub fn total_len(&self) -> u64 {
        self.sges.iter().map(|s| s.length as u64).sum()
    }
    pub fn encode(&self) -> [u8; RECV_WQE_SIZE] {
        let mut b = RecvWqeBytes::new_zeroed();
        b.opcode = RECV_OPCODE;
        b.count = self.sges.len() as u8;
        b.wr_id = U64::new(self.wr_id);
        for (out, s) in b.sges.iter_mut().zip(self.sges.iter()) {
            *out = SgeBytes { addr: U64::new(s.addr), length: U32::new(s.length), lkey: U32::new(s.lkey) };
        }
        zerocopy::transmute!(b)
    }
    pub fn decode(bytes: &[u8]) -> Result<Self, WqeError> {
        let (b, _) = RecvWqeBytes::read_from_prefix(bytes).map_err(|_| WqeError::Truncated { len: bytes.len() })?;
        if b.opcode != RECV_OPCODE {
            return Err(WqeError::UnknownOpcode(b.opcode));
        }
        let n = b.count;
        if n as usize > MAX_RECV_SGES {
            return Err(WqeError::TooManySges(n));
        }
        if b.reserved != [0; 6] {
            return Err(WqeError::ReservedNotZero);
        }
        let mut sges = heapless::Vec::new();
        for s in &b.sges[..n as usize] {
            let pushed = sges.push(Sge { addr: s.addr.get(), length: s.length.get(), lkey: s.lkey.get() });
            debug_assert!(pushed.is_ok(), "count <= MAX_RECV_SGES, checked above");
        }
        Ok(RecvWqe { wr_id: b.wr_id.get(), sges })
    }
}

/// Masked fetch-and-add as mlx5 defines it: the operand is cut into fields at the set bits of
/// `boundary` (each set bit is a field's most significant bit) and each field adds without
/// carrying into the next. Used by the NIC models and the host engine alike.
pub const fn masked_add(old: u64, add: u64, boundary: u64) -> u64 {
    let mut out = 0u64;
    let mut lo = 0u32;
    let mut bit = 0u32;
    while bit < 64 {
        if boundary & (1u64 << bit) != 0 || bit == 63 {
            let width = bit - lo + 1;
            let mask = if width == 64 { u64::MAX } else { ((1u64 << width) - 1) << lo };
            let sum = (old & mask).wrapping_add(add & mask) & mask;
            out |= sum;
            lo = bit + 1;
        }
        bit += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_layout() {
        let w = Wqe::read(0x1122_3344_5566_7788, 0xAABB_CCDD, 64, 0x0102_0304_0506_0708, 0x0A0B_0C0D).with_wr_id(0x99);
        let b = w.encode();
        assert_eq!(b[0], 0x06);
        assert_eq!(b[1], 0x01);
        assert_eq!(&b[8..16], &0x99u64.to_le_bytes());
        assert_eq!(&b[16..24], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[24..28], &64u32.to_le_bytes());
        assert_eq!(&b[28..32], &0xAABB_CCDDu32.to_le_bytes());
        assert_eq!(&b[32..40], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&b[40..44], &0x0A0B_0C0Du32.to_le_bytes());
        for f in WqeField::ALL {
            assert!(f.offset() + f.width() <= WQE_SIZE);
        }
        // fields tile the bytes after the header without gaps or overlaps
        for w in WqeField::ALL.windows(2) {
            assert_eq!(w[0].offset() + w[0].width(), w[1].offset());
        }
    }

    #[test]
    fn every_opcode_round_trips() {
        for op in Opcode::ALL {
            let mut w = Wqe::blank(op);
            if op.is_atomic() {
                w.length = 8;
            }
            assert_eq!(Wqe::decode(&w.encode()), Ok(w), "{}", op.name());
        }
    }

    #[test]
    fn malformed_wqes_rejected() {
        assert_eq!(Wqe::decode(&[0u8; 10]), Err(WqeError::Truncated { len: 10 }));
        let mut b = Wqe::nop().encode();
        b[0] = 0x7f;
        assert_eq!(Wqe::decode(&b), Err(WqeError::UnknownOpcode(0x7f)));
        let mut b = Wqe::nop().encode();
        b[1] = 0x80;
        assert_eq!(Wqe::decode(&b), Err(WqeError::UnknownFlags(0x80)));
        let mut b = Wqe::nop().encode();
        b[2] = 1;
        assert_eq!(Wqe::decode(&b), Err(WqeError::ReservedNotZero));
        let w = Wqe::fetch_add(0, 0, 4, 0, 1);
        assert_eq!(Wqe::decode(&w.encode()), Err(WqeError::BadAtomic));
        let w = Wqe::nop().with_flags(WqeFlags::UNBIND);
        assert_eq!(Wqe::decode(&w.encode()), Err(WqeError::UnbindOnNonBind));
        let w = Wqe::wait(0x100_0000, QueueSel::Send, 1);
        assert_eq!(Wqe::decode(&w.encode()), Err(WqeError::QpnOverflow(0x100_0000)));
        let mut w = Wqe::enable(1, QueueSel::Send, 1);
        w.operand1 = 2;
        assert_eq!(Wqe::decode(&w.encode()), Err(WqeError::BadQueueSelector(2)));
        let w = Wqe::bind_mw(0x100, 0, 1, 1, 1, AccessFlags::MW_BIND);
        assert_eq!(Wqe::decode(&w.encode()), Err(WqeError::BadAccessFlags(16)));
    }

    #[test]
    fn field_spans_read_and_patch_inside_the_wqe_only() {
        let mut img = Wqe::read(0x10, 1, 8, 0x2000, 0x0305).encode();
        assert_eq!(WqeField::Rkey.read_span(&img, 4), Some(&0x0305u32.to_le_bytes()[..]));
        // remote address and rkey in one span, as the alloc reply's scatter writes them
        assert_eq!(WqeField::RemoteAddr.read_span(&img, 12).map(<[u8]>::len), Some(12));
        assert_eq!(WqeField::Operand1.read_span(&img, 9), None);
        WqeField::Rkey.patch(&mut img, &0x0406u32.to_le_bytes());
        assert_eq!(Wqe::decode(&img).unwrap().rkey, 0x0406);
        // a patch past the end is cut at the WQE's end
        WqeField::Operand1.patch(&mut img, &[0xAB; 12]);
        assert_eq!(Wqe::decode(&img).unwrap().operand1, u64::from_le_bytes([0xAB; 8]));
    }

    #[test]
    fn recv_round_trip_and_errors() {
        let mut r = RecvWqe { wr_id: 5, sges: heapless::Vec::new() };
        r.sges.push(Sge { addr: 0x1000, length: 8, lkey: 3 }).unwrap();
        r.sges.push(Sge { addr: 0x2004, length: 4, lkey: 3 }).unwrap();
        assert_eq!(RecvWqe::decode(&r.encode()), Ok(r.clone()));
        assert_eq!(r.total_len(), 12);
        let mut b = r.encode();
        b[1] = 9;
        assert_eq!(RecvWqe::decode(&b), Err(WqeError::TooManySges(9)));
        assert_eq!(RecvWqe::decode(&b[..20]), Err(WqeError::Truncated { len: 20 }));
    }

    #[test]
    fn masked_add_wraps_fields() {
        // ring index in the low 6 bits (64-byte ring of 8-byte slots), base above untouched
        let base = 0x4000u64;
        assert_eq!(masked_add(base + 56, 8, 1 << 5), base);
        // key byte wraps inside the rkey, index bits unchanged; two rkeys in one word
        let word = 0x0000_12FF_0000_34FEu64;
        let b = (1 << 7) | (1 << 31) | (1 << 39) | (1 << 63);
        assert_eq!(masked_add(word, 1 | (1 << 32), b), 0x0000_1200_0000_34FF);
        // no boundary = plain add
        assert_eq!(masked_add(u64::MAX, 1, 0), 0);
    }

    proptest! {
        #[test]
        fn decode_arbitrary_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Wqe::decode(&bytes);
            let _ = RecvWqe::decode(&bytes);
        }

        #[test]
        fn decode_encode_round_trip(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::array::uniform32(any::<u8>())) {
            let mut b = [0u8; 64];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&tail);
            b[0] %= 14; // mostly valid opcodes
            if let Ok(w) = Wqe::decode(&b) {
                prop_assert_eq!(w.encode(), b);
            }
        }

        #[test]
        fn masked_add_zero_boundary_is_wrapping_add(a in any::<u64>(), b in any::<u64>()) {
            prop_assert_eq!(masked_add(a, b, 0), a.wrapping_add(b));
        }
    }
}
