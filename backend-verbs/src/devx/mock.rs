//! A recording [`DevxApi`]: every call with its exact input bytes, in order, and scripted
//! firmware answers. The command-sequence tests (`sequence_tests.rs`) compare recordings.

use super::api::{DevxApi, MemRange, ObjHandle, UarHandle, UmemHandle};
use super::DevxError;
use std::collections::HashMap;

#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Call {
    GeneralCmd { command: &'static str, input: Vec<u8> },
    ObjCreate { command: &'static str, input: Vec<u8>, obj: ObjHandle },
    ObjModify { command: &'static str, obj: ObjHandle, input: Vec<u8> },
    ObjDestroy(ObjHandle),
    UmemReg { mem: MemRange, access: u32, umem: UmemHandle },
    UmemDereg(UmemHandle),
    AllocUar(UarHandle),
    QueryEqn(u32),
    WriteMem { addr: usize, bytes: Vec<u8> },
    WriteDbr { addr: usize, value: [u8; 4] },
    WriteUar { uar: UarHandle, value: [u8; 8] },
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
    next: usize,
}

impl RecordingDevx {
    pub fn new(pdn: u32) -> Self {
        RecordingDevx { pdn, ..Default::default() }
    }
    fn id(&mut self) -> usize {
        self.next += 1;
        self.next
    }
    fn answer(&mut self, command: &'static str, opcode: u16, out: &mut [u8]) -> Result<(), DevxError> {
        out.fill(0);
        if let Some((status, syndrome)) = self.refuse.get(command) {
            return Err(DevxError::Command { command, opcode, status: *status, syndrome: *syndrome, errno: libc::EIO });
        }
        if let Some(o) = self.outputs.get(command) {
            let n = o.len().min(out.len());
            out[..n].copy_from_slice(&o[..n]);
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
        self.answer(command, opcode(input), out)
    }
    fn obj_create(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<ObjHandle, DevxError> {
        let obj = ObjHandle(self.id());
        self.answer(command, opcode(input), out)?;
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
        self.answer(command, opcode(input), out)
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
        Ok(())
    }
    fn write_dbr(&mut self, addr: usize, value_be: [u8; 4]) {
        self.calls.push(Call::WriteDbr { addr, value: value_be });
    }
    fn write_uar(&mut self, uar: UarHandle, value: [u8; 8]) {
        self.calls.push(Call::WriteUar { uar, value });
    }
}
