//! A recording [`DevxApi`]: every call with its exact input bytes, in order, and scripted
//! firmware answers. The command-sequence tests (`sequence_tests.rs`) compare recordings.

use super::api::{DevxApi, MemRange, ObjHandle, UarHandle, UmemHandle};
use super::cm::{CmQpAttr, LocalPath};
use super::device::DevxDevice;
use super::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::{Domain, MrKeys};
use std::collections::{BTreeMap, HashMap};

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Call {
    GeneralCmd { command: &'static str, input: Vec<u8> },
    ObjCreate { command: &'static str, input: Vec<u8>, obj: ObjHandle },
    ObjModify { command: &'static str, obj: ObjHandle, input: Vec<u8> },
    ObjQuery { command: &'static str, obj: ObjHandle, input: Vec<u8> },
    ObjDestroy(ObjHandle),
    UmemReg { mem: MemRange, access: u32, umem: UmemHandle },
    UmemDereg(UmemHandle),
    AllocUar(UarHandle),
    QueryEqn(u32),
    WriteMem { addr: usize, bytes: Vec<u8> },
    WriteDbr { addr: usize, value: [u8; 4] },
    WriteUar { uar: UarHandle, value: [u8; 8] },
    RegMr { domain: Domain, mem: MemRange, access: AccessFlags, keys: MrKeys },
    AllocMw(u32),
}

#[derive(Default, Debug)]
pub struct RecordingDevx {
    pub calls: Vec<Call>,
    pub pdn: u32,
    /// Output bytes a command returns (copied into `out`); absent: zeros (status OK).
    pub outputs: HashMap<&'static str, Vec<u8>>,
    /// Commands the "firmware" refuses: (status, syndrome), as DEVX reports it (call fails,
    /// `out` holds the status).
    pub refuse: HashMap<&'static str, (u8, u32)>,
    /// CREATE_CQ / CREATE_QP without a scripted output answer fresh numbers (CQs from
    /// 0x400, QPs from 0x1100) instead of zeros.
    pub number_objects: bool,
    /// Memory from `alloc_mem`, by start address: stores land here (the backend tests read
    /// the rings back and plant CQEs in the CQ rings).
    pub memory: BTreeMap<usize, Vec<u8>>,
    /// Every mkey CREATE_MKEY made, by index (numbered from 0x2000, as firmware numbers them
    /// apart): its 64-byte mkey context, as created. QUERY_MKEY answers with it, so a test
    /// plants a binding (the mock executes no UMR) by rewriting it.
    pub mkeys: BTreeMap<u32, [u8; MKC_BYTES]>,
    next: usize,
    next_addr: usize,
    numbered: u32,
}

/// Bytes of an mkey context (`mlx5_ifc_mkc_bits`), at byte 16 of CREATE_MKEY's input and of
/// QUERY_MKEY's output.
pub const MKC_BYTES: usize = 64;
const MKC_AT: usize = 16;
/// The first mkey index the mock hands out.
pub const FIRST_MKEY_INDEX: u32 = 0x2000;

/// The MN-private PD's number in the mock: the CN-facing one (`pdn`) + 1.
pub const PRIVATE_PDN_OFFSET: u32 = 1;

/// The mock port's path to itself.
pub const MOCK_PATH: LocalPath = LocalPath {
    port: 1,
    gid_index: 3,
    gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
    mac: [0x02, 0, 0, 0, 0, 0x01],
    mtu: 3,
};

impl RecordingDevx {
    pub fn new(pdn: u32) -> Self {
        RecordingDevx { pdn, ..Default::default() }
    }
    /// A mock whose objects get distinct numbers (the backend's tests), and whose QPs QUERY_QP
    /// reports in RTS unless a test scripts another answer.
    pub fn numbered(pdn: u32) -> Self {
        let mut rts = vec![0u8; omw_core::mlx5::prm::qp::MODIFY_QP_OUT_LEN.max(272)];
        rts[24] = 3 << 4; // qpc.state (bits 0xc0..0xc4) = MLX5_QP_STATE_RTS
        let outputs = [("QUERY_QP", rts)].into_iter().collect();
        RecordingDevx { pdn, number_objects: true, next_addr: 0x7000_0000_0000, outputs, ..Default::default() }
    }
    fn region(&self, addr: usize, len: usize) -> Option<(usize, usize)> {
        let (start, v) = self.memory.range(..=addr).next_back()?;
        let off = addr - start;
        (off.checked_add(len)? <= v.len()).then_some((*start, off))
    }
    /// Bytes of mock memory (panics outside it: a test bug).
    pub fn bytes(&self, addr: usize, len: usize) -> Vec<u8> {
        let (s, off) = self.region(addr, len).expect("inside mock memory");
        self.memory[&s][off..off + len].to_vec()
    }
    /// Store into mock memory as the device would (a CQE, a doorbell record).
    pub fn device_write(&mut self, addr: usize, bytes: &[u8]) {
        let (s, off) = self.region(addr, bytes.len()).expect("inside mock memory");
        self.memory.get_mut(&s).unwrap()[off..off + bytes.len()].copy_from_slice(bytes);
    }
    fn store_if_inside(&mut self, addr: usize, bytes: &[u8]) -> bool {
        match self.region(addr, bytes.len()) {
            Some((s, off)) => {
                self.memory.get_mut(&s).unwrap()[off..off + bytes.len()].copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
    fn id(&mut self) -> usize {
        self.next += 1;
        self.next
    }
    fn answer(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<(), DevxError> {
        let opcode = opcode(input);
        out.fill(0);
        if let Some((status, syndrome)) = self.refuse.get(command) {
            return Err(DevxError::Command { command, opcode, status: *status, syndrome: *syndrome, errno: libc::EIO });
        }
        if let Some(o) = self.outputs.get(command) {
            let n = o.len().min(out.len());
            out[..n].copy_from_slice(&o[..n]);
        } else if self.number_objects && matches!(command, "CREATE_CQ" | "CREATE_QP") && out.len() >= 12 {
            self.numbered += 1;
            let n = if command == "CREATE_CQ" { 0x400 } else { 0x1100 } + self.numbered;
            out[9..12].copy_from_slice(&n.to_be_bytes()[1..]);
        } else if command == "CREATE_MKEY" && input.len() >= MKC_AT + MKC_BYTES && out.len() >= 12 {
            let index = FIRST_MKEY_INDEX + self.mkeys.len() as u32;
            let mut mkc = [0u8; MKC_BYTES];
            mkc.copy_from_slice(&input[MKC_AT..MKC_AT + MKC_BYTES]);
            self.mkeys.insert(index, mkc);
            out[9..12].copy_from_slice(&index.to_be_bytes()[1..]);
        } else if command == "QUERY_MKEY" && input.len() >= 12 && out.len() >= MKC_AT + MKC_BYTES {
            let index = u32::from_be_bytes([0, input[9], input[10], input[11]]);
            if let Some(mkc) = self.mkeys.get(&index) {
                out[MKC_AT..MKC_AT + MKC_BYTES].copy_from_slice(mkc);
            }
        }
        Ok(())
    }
    /// The calls with the given command name, in order.
    pub fn inputs(&self, command: &str) -> Vec<&[u8]> {
        self.calls
            .iter()
            .filter_map(|c| match c {
                Call::GeneralCmd { command: n, input }
                | Call::ObjCreate { command: n, input, .. }
                | Call::ObjModify { command: n, input, .. }
                | Call::ObjQuery { command: n, input, .. }
                    if *n == command =>
                {
                    Some(&input[..])
                }
                _ => None,
            })
            .collect()
    }
}

fn opcode(input: &[u8]) -> u16 {
    u16::from_be_bytes([input[0], input[1]])
}

impl DevxApi for RecordingDevx {
    fn pdn(&self) -> u32 {
        self.pdn
    }
    fn general_cmd(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<(), DevxError> {
        self.calls.push(Call::GeneralCmd { command, input: input.to_vec() });
        self.answer(command, input, out)
    }
    fn obj_create(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<ObjHandle, DevxError> {
        let obj = ObjHandle(self.id());
        self.answer(command, input, out)?;
        self.calls.push(Call::ObjCreate { command, input: input.to_vec(), obj });
        Ok(obj)
    }
    fn obj_modify(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        self.calls.push(Call::ObjModify { command, obj, input: input.to_vec() });
        self.answer(command, input, out)
    }
    fn obj_query(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        self.calls.push(Call::ObjQuery { command, obj, input: input.to_vec() });
        self.answer(command, input, out)
    }
    fn obj_destroy(&mut self, obj: ObjHandle) -> Result<(), DevxError> {
        self.calls.push(Call::ObjDestroy(obj));
        Ok(())
    }
    fn umem_reg(&mut self, mem: MemRange, access: u32) -> Result<UmemHandle, DevxError> {
        let slot = self.id();
        let umem = UmemHandle { slot, umem_id: 0x100 + slot as u32 };
        self.calls.push(Call::UmemReg { mem, access, umem });
        Ok(umem)
    }
    fn umem_dereg(&mut self, umem: UmemHandle) -> Result<(), DevxError> {
        self.calls.push(Call::UmemDereg(umem));
        Ok(())
    }
    fn alloc_uar(&mut self) -> Result<UarHandle, DevxError> {
        let slot = self.id();
        let uar = UarHandle { slot, page_id: 0x40 + slot as u32 };
        self.calls.push(Call::AllocUar(uar));
        Ok(uar)
    }
    fn query_eqn(&mut self, vector: u32) -> Result<u32, DevxError> {
        self.calls.push(Call::QueryEqn(vector));
        Ok(7)
    }
    fn write_mem(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        self.calls.push(Call::WriteMem { addr, bytes: bytes.to_vec() });
        self.store_if_inside(addr, bytes);
        Ok(())
    }
    fn write_dbr(&mut self, addr: usize, value_be: [u8; 4]) {
        self.calls.push(Call::WriteDbr { addr, value: value_be });
        self.store_if_inside(addr, &value_be);
    }
    fn write_uar(&mut self, uar: UarHandle, value: [u8; 8]) {
        self.calls.push(Call::WriteUar { uar, value });
    }
}

impl DevxDevice for RecordingDevx {
    fn domain_pdn(&self, domain: Domain) -> u32 {
        match domain {
            Domain::CnFacing => self.pdn,
            Domain::MnPrivate => self.pdn + PRIVATE_PDN_OFFSET,
        }
    }
    fn reg_mr(&mut self, domain: Domain, mem: MemRange, access: AccessFlags) -> Result<MrKeys, DevxError> {
        let n = self.id() as u32;
        let keys = MrKeys { lkey: 0x10_0000 + n, rkey: 0x20_0000 + n };
        self.calls.push(Call::RegMr { domain, mem, access, keys });
        Ok(keys)
    }
    fn alloc_mw(&mut self) -> Result<u32, DevxError> {
        let rkey = (0x1000 + self.id() as u32) << 8;
        self.calls.push(Call::AllocMw(rkey));
        Ok(rkey)
    }
    fn alloc_mem(&mut self, len: usize, align: usize) -> Result<MemRange, DevxError> {
        let align = align.max(4096);
        let addr = self.next_addr.max(0x7000_0000_0000).div_ceil(align) * align;
        self.next_addr = addr + len.max(1) + 4096;
        self.memory.insert(addr, vec![0u8; len]);
        Ok(MemRange { addr, len })
    }
    fn read_mem(&self, addr: usize, out: &mut [u8]) -> Result<(), DevxError> {
        let (s, off) = self.region(addr, out.len()).ok_or(DevxError::OutsideMemory { addr, len: out.len() })?;
        out.copy_from_slice(&self.memory[&s][off..off + out.len()]);
        Ok(())
    }
    fn store(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        if self.store_if_inside(addr, bytes) {
            Ok(())
        } else {
            Err(DevxError::OutsideMemory { addr, len: bytes.len() })
        }
    }
    fn local_path(&mut self) -> Result<LocalPath, DevxError> {
        Ok(MOCK_PATH)
    }
    /// Every peer is one hop away on the mock's link: the MAC is the peer's GID's last bytes.
    fn next_hop_mac(&mut self, attr: &CmQpAttr) -> Result<[u8; 6], DevxError> {
        let g = attr.dgid;
        Ok([0x02, 0, g[12], g[13], g[14], g[15]])
    }
    /// Executes nothing: nothing to wait for.
    fn settle(&mut self, _: std::time::Duration) {}
}
