//! Formatting the MN's tables: a fresh MWTable (every group free) and a full free queue.

use super::*;

impl MemoryNode {
    /// Write a fresh MWTable (every group free, owner 0) and a full free queue. `rkey(g, i)`
    /// is the initial rkey of MW\[i\] of group g; `lkey(g)` the MR the group's windows bind in.
    pub fn format<P: MnPort>(
        &mut self,
        port: &mut P,
        rkey: impl Fn(GroupId, usize) -> Rkey,
        lkey: impl Fn(GroupId) -> u32,
    ) -> R<P::Error> {
        self.format_begin(port)?;
        let g = self.cfg.geometry;
        for i in 0..g.chunk_count() {
            let gid = GroupId(i);
            let rkeys: heapless::Vec<Rkey, MAX_GROUP_SIZE> = (0..g.group_size()).map(|k| rkey(gid, k)).collect();
            self.format_group(port, gid, lkey(gid), &rkeys)?;
        }
        self.format_end(port)
    }

    /// Formatting in steps, so a provisioner can register each chunk and allocate its windows
    /// as it goes (no table of keys held anywhere): zero the metadata first…
    pub fn format_begin<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let zero = [0u8; 256];
        let mut off = 0;
        while off < self.map.meta_len {
            let n = (self.map.meta_len - off).min(zero.len() as u64) as usize;
            port.write(self.map.meta_base + off, &zero[..n]).map_err(MnError::Port)?;
            off += n as u64;
        }
        Ok(())
    }

    /// …then write each group's entry (free, owner 0) and its queue slot…
    pub fn format_group<P: MnPort>(&mut self, port: &mut P, gid: GroupId, lkey: u32, rkeys: &[Rkey]) -> R<P::Error> {
        let g = self.cfg.geometry;
        let entry = self.map.entry_addr(gid).ok_or(MnError::BadConfig)?;
        let base = g.chunk_base(gid).ok_or(MnError::BadConfig)?;
        if rkeys.len() != g.group_size() {
            return Err(MnError::BadConfig);
        }
        let e = MwTableEntry::new(base, g.chunk_size() as u32, lkey, rkeys);
        write_entry(port, entry, &e)?;
        wr(port, self.map.queue.slot_addr(gid.0), entry)
    }

    /// …and last the queue's head and tail: every group free.
    pub fn format_end<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let g = self.cfg.geometry;
        wr(port, self.map.queue.head, self.map.queue.ring)?;
        wr(port, self.map.queue.tail, self.map.queue.slot_addr(g.chunk_count()))?;
        self.empty = false;
        self.tickets.clear();
        // every group free: nobody holds anything
        self.held = [0; MAX_CNS];
        Ok(())
    }
}
