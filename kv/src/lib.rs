//! omw-kv: a small remote key-value store — the example application of omw.
//!
//! Values live in MN memory, in objects that omw-core's [`ObjectAllocator`] carves out of
//! chunks the MN hands out (the paper's two-level allocation); the index (key → object) lives
//! on the CN. Updates are out of place (write the new record, swing the index, free the old
//! object), so a reader never sees half a record; a chunk goes back to the MN the moment its
//! last object dies, and [`KvStore::shrink`] moves the objects of sparse chunks together so
//! more chunks can go back.
//!
//! The store needs little from a CN, the [`CnMemory`] trait: allocate and free a chunk, read
//! and write bytes in it. Three implementations: [`loopback::LoopbackCn`] (the loopback cluster
//! of omw-loopback), [`verbs::VerbsCn`] (omw-verbs' `CnClient` against a real `omw mn`) and
//! [`pool::PoolCn`] (a pool of many MNs through omw-pool's client).
//!
//! [`async_store::AsyncKv`] is the same store on the CN library (omw-client): futures, many
//! requests in flight over one connection, zero-copy records, chunks from the client's
//! reserve; [`ycsb`] drives it with the YCSB core workloads A–D.
//!
//! ```
//! use omw_kv::{loopback::LoopbackCn, KvStore};
//! use omw_loopback::cluster::{Cluster, ClusterConfig};
//!
//! let mut cluster = Cluster::new(ClusterConfig { cns: 1, ..ClusterConfig::paper_like() }).unwrap();
//! let mut kv = KvStore::new(LoopbackCn::new(&mut cluster, 0, 0)).unwrap();
//! kv.insert(b"alpha", b"one").unwrap();
//! kv.update(b"alpha", b"uno").unwrap();
//! assert_eq!(kv.get(b"alpha").unwrap().as_deref(), Some(&b"uno"[..]));
//! assert!(kv.delete(b"alpha").unwrap());
//! assert_eq!(kv.held_chunks(), 0); // its chunk went back to the MN
//! ```

pub mod async_store;
pub mod exercise;
pub mod loopback;
pub mod pool;
pub mod record;
pub mod verbs;
pub mod ycsb;

use omw_core::cn::object_alloc::{
    AllocWithError, ChunkIndex, ClassConfigError, ObjectAllocError, ObjectAllocator, ObjectRef,
};
use record::{RecordError, RecordHeader, HEADER_LEN};
use std::collections::HashMap;
use std::fmt;

/// What the store needs from a compute node.
pub trait CnMemory {
    /// A chunk the MN handed out (what reads, writes and the free name).
    type Chunk;
    type Error: std::error::Error + 'static;
    /// Bytes per chunk (the MN's configuration).
    fn chunk_size(&self) -> u64;
    /// One chunk from the MN; an error when the MN has none left.
    fn alloc_chunk(&mut self) -> Result<Self::Chunk, Self::Error>;
    /// Give a chunk back to the MN.
    fn free_chunk(&mut self, chunk: Self::Chunk) -> Result<(), Self::Error>;
    /// One-sided WRITE of `data` at `offset` in `chunk`.
    fn write(&mut self, chunk: &Self::Chunk, offset: u64, data: &[u8]) -> Result<(), Self::Error>;
    /// One-sided READ of `buf.len()` bytes at `offset` in `chunk`.
    fn read(&mut self, chunk: &Self::Chunk, offset: u64, buf: &mut [u8]) -> Result<(), Self::Error>;
}

/// Chunks the store can hold at once.
pub const MAX_CHUNKS: usize = 1024;
/// Size classes: chunk/8, chunk/4, chunk/2, chunk.
pub const CLASSES: usize = 4;

type Alloc<C> = ObjectAllocator<C, MAX_CHUNKS, CLASSES, 1>;

#[derive(Debug)]
#[non_exhaustive]
pub enum KvError<E> {
    /// The CN's memory operations (including "the MN has no chunk left").
    Memory(E),
    /// The object allocator refused (table full).
    Alloc(ObjectAllocError),
    /// The chunk size gives no usable size classes.
    Config(ClassConfigError),
    /// Key and value do not fit one chunk.
    TooLarge { len: u64, max: u64 },
    /// `insert` of a key that exists.
    Exists,
    /// `update` of a key that does not exist.
    NotFound,
    /// What was read back is not the record the index points to.
    Corrupt(RecordError),
}

impl<E: fmt::Display> fmt::Display for KvError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::Memory(e) => write!(f, "remote memory: {e}"),
            KvError::Alloc(e) => write!(f, "object allocator: {e}"),
            KvError::Config(e) => write!(f, "size classes: {e}"),
            KvError::TooLarge { len, max } => write!(f, "record of {len} B exceeds the largest object ({max} B)"),
            KvError::Exists => f.write_str("key exists"),
            KvError::NotFound => f.write_str("key not found"),
            KvError::Corrupt(e) => write!(f, "record read back is corrupt: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for KvError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KvError::Memory(e) => Some(e),
            KvError::Alloc(e) => Some(e),
            KvError::Config(e) => Some(e),
            KvError::Corrupt(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<AllocWithError<E>> for KvError<E> {
    fn from(e: AllocWithError<E>) -> Self {
        match e {
            AllocWithError::Alloc(a) => KvError::Alloc(a),
            AllocWithError::Chunk(m) => KvError::Memory(m),
        }
    }
}

/// Counters of what the store did with MN memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    pub chunks_allocated: u64,
    pub chunks_freed: u64,
    /// Objects [`KvStore::shrink`] moved.
    pub objects_moved: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    object: ObjectRef,
    /// Record length (header + key + value).
    len: u32,
}

/// The store; see the crate documentation.
pub struct KvStore<M: CnMemory> {
    mem: M,
    alloc: Box<Alloc<M::Chunk>>,
    index: HashMap<Vec<u8>, Slot>,
    stats: KvStats,
}

impl<M: CnMemory> fmt::Debug for KvStore<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvStore").field("keys", &self.index.len()).field("alloc", &self.alloc).finish()
    }
}

impl<M: CnMemory> KvStore<M> {
    /// An empty store over `mem`, with size classes chunk/8 … chunk.
    pub fn new(mem: M) -> Result<Self, KvError<M::Error>> {
        let c = mem.chunk_size();
        let classes = [c / 8, c / 4, c / 2, c];
        Ok(KvStore {
            alloc: Box::new(Alloc::new(c, &classes).map_err(KvError::Config)?),
            mem,
            index: HashMap::new(),
            stats: KvStats::default(),
        })
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
    /// Chunks held from the MN right now.
    pub fn held_chunks(&self) -> usize {
        self.alloc.held_chunks()
    }
    pub fn stats(&self) -> KvStats {
        self.stats
    }
    pub fn memory(&mut self) -> &mut M {
        &mut self.mem
    }
    /// Largest key + value one record holds.
    pub fn max_payload(&self) -> u64 {
        self.mem.chunk_size() - HEADER_LEN as u64
    }

    fn record(key: &[u8], value: &[u8]) -> Result<Vec<u8>, RecordError> {
        let h = RecordHeader::new(key, value)?;
        let mut b = Vec::with_capacity(HEADER_LEN + key.len() + value.len());
        b.extend_from_slice(zerocopy::IntoBytes::as_bytes(&h));
        b.extend_from_slice(key);
        b.extend_from_slice(value);
        Ok(b)
    }

    /// Write a new record in a fresh object; the index is not touched.
    fn place(&mut self, key: &[u8], value: &[u8]) -> Result<Slot, KvError<M::Error>> {
        let rec = Self::record(key, value).map_err(KvError::Corrupt)?;
        let len = rec.len() as u64;
        let class = self.alloc.class_for(len).map_err(|_| KvError::TooLarge { len, max: self.mem.chunk_size() })?;
        let mem = &mut self.mem;
        let (object, new) = self.alloc.alloc_with(class, || mem.alloc_chunk())?;
        if new {
            self.stats.chunks_allocated += 1;
        }
        if let Err(e) = self.write_object(object, &rec) {
            self.release(object)?;
            return Err(e);
        }
        Ok(Slot { object, len: len as u32 })
    }

    fn write_object(&mut self, object: ObjectRef, bytes: &[u8]) -> Result<(), KvError<M::Error>> {
        let p = self.alloc.placement(object).map_err(KvError::Alloc)?;
        self.mem.write(p.chunk, p.offset, bytes).map_err(KvError::Memory)
    }

    fn read_object(&mut self, slot: Slot) -> Result<Vec<u8>, KvError<M::Error>> {
        let p = self.alloc.placement(slot.object).map_err(KvError::Alloc)?;
        let mut buf = vec![0u8; slot.len as usize];
        self.mem.read(p.chunk, p.offset, &mut buf).map_err(KvError::Memory)?;
        Ok(buf)
    }

    /// Free an object; its chunk goes back to the MN if that was the last object in it.
    fn release(&mut self, object: ObjectRef) -> Result<(), KvError<M::Error>> {
        if let Some(chunk) = self.alloc.free(object).map_err(KvError::Alloc)? {
            self.stats.chunks_freed += 1;
            self.mem.free_chunk(chunk).map_err(KvError::Memory)?;
        }
        Ok(())
    }

    /// Add a key that is not in the store.
    pub fn insert(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError<M::Error>> {
        if self.index.contains_key(key) {
            return Err(KvError::Exists);
        }
        let slot = self.place(key, value)?;
        self.index.insert(key.to_vec(), slot);
        Ok(())
    }

    /// Replace the value of a key in the store, out of place.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError<M::Error>> {
        let old = *self.index.get(key).ok_or(KvError::NotFound)?;
        let slot = self.place(key, value)?;
        self.index.insert(key.to_vec(), slot);
        self.release(old.object)
    }

    /// The value of a key, read from the MN and checked (magic, lengths, key, checksum).
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError<M::Error>> {
        let Some(slot) = self.index.get(key).copied() else { return Ok(None) };
        let bytes = self.read_object(slot)?;
        record::decode(&bytes, key).map(|v| Some(v.to_vec())).map_err(KvError::Corrupt)
    }

    /// Remove a key; false if it was not there.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, KvError<M::Error>> {
        let Some(slot) = self.index.remove(key) else { return Ok(false) };
        self.release(slot.object)?;
        Ok(true)
    }

    /// Compaction: for each size class, while the objects of its emptiest chunk fit into the
    /// free slots of its other chunks, move them there (read, write elsewhere, swing the
    /// index, free) — the emptied chunk goes back to the MN. Returns the chunks given back.
    pub fn shrink(&mut self) -> Result<usize, KvError<M::Error>> {
        let before = self.stats.chunks_freed;
        for class in 0..CLASSES {
            loop {
                let chunks: Vec<(ChunkIndex, u32, u32)> =
                    self.alloc.chunks().filter(|c| c.class == class).map(|c| (c.index, c.live, c.slots)).collect();
                let Some(&(victim, live, _)) = chunks.iter().min_by_key(|(i, live, _)| (*live, std::cmp::Reverse(*i)))
                else {
                    break;
                };
                let room: u32 = chunks.iter().filter(|c| c.0 != victim).map(|(_, l, s)| s - l).sum();
                if chunks.len() < 2 || live > room {
                    break;
                }
                let moving: Vec<(Vec<u8>, Slot)> =
                    self.index.iter().filter(|(_, s)| s.object.chunk == victim).map(|(k, s)| (k.clone(), *s)).collect();
                for (key, slot) in moving {
                    let bytes = self.read_object(slot)?;
                    record::decode(&bytes, &key).map_err(KvError::Corrupt)?;
                    let object = self.alloc.alloc_avoiding(class, victim).map_err(KvError::Alloc)?;
                    if let Err(e) = self.write_object(object, &bytes) {
                        self.release(object)?;
                        return Err(e);
                    }
                    self.index.insert(key, Slot { object, len: slot.len });
                    self.stats.objects_moved += 1;
                    self.release(slot.object)?;
                }
            }
        }
        Ok((self.stats.chunks_freed - before) as usize)
    }

    /// Delete every key and give every chunk back (the store stays usable).
    pub fn clear(&mut self) -> Result<(), KvError<M::Error>> {
        self.index.clear();
        let chunks: Vec<M::Chunk> = self.alloc.drain_chunks().collect();
        for c in chunks {
            self.stats.chunks_freed += 1;
            self.mem.free_chunk(c).map_err(KvError::Memory)?;
        }
        Ok(())
    }
}
