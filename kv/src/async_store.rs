//! [`AsyncKv`]: the store on the CN library's async API — many requests in flight at once over
//! one connection, records moved with zero-copy accesses from registered buffers, chunks
//! usually taken from and given back to the client's reserve (no round trip to the MN).
//!
//! The index (key → object) and the object allocator are local and guarded by one lock, held
//! only between awaits; remote accesses run outside it, concurrently. Updates stay out of
//! place: the new record is written to a fresh object, then the index swings, then the old
//! object is freed. A reader that looked an object up just before its key moved may therefore
//! read a record that is no longer the key's: the record's checks (magic, key, checksum) or
//! the library's [`omw_client::Error::Freed`] for a chunk given back meanwhile say so, and the
//! read starts over from the index — it never returns another key's bytes. A chunk is given
//! back only once no access to it is in flight (the library waits), so no access ever hits a
//! window that is gone.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use omw_client::{model::Model, AsyncCn, Cn, Options, ReservePolicy};
//! use omw_kv::async_store::AsyncKv;
//! let model = Model::start(Default::default()).unwrap();
//! let opts = Options { reserve: Some(ReservePolicy::new(1, 4).unwrap()), ..Options::default() };
//! let cn = AsyncCn::new(Cn::connect(&model, opts).unwrap()).unwrap();
//! let kv = AsyncKv::new(cn).unwrap();
//! kv.insert(b"k", b"v1").await.unwrap();
//! kv.update(b"k", b"v2").await.unwrap();
//! assert_eq!(kv.get(b"k").await.unwrap().as_deref(), Some(&b"v2"[..]));
//! assert!(kv.delete(b"k").await.unwrap());
//! # }
//! ```

use crate::record::{self, RecordError, RecordHeader, HEADER_LEN};
use crate::{KvStats, CLASSES, MAX_CHUNKS};
use omw_client::transport::Transport;
use omw_client::{AsyncCn, Chunk, Error, LocalMr};
use omw_core::cn::object_alloc::{ClassConfigError, ObjectAllocError, ObjectAllocator, ObjectRef};
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

type Alloc = ObjectAllocator<Chunk, MAX_CHUNKS, CLASSES, 1>;

/// Reads that find their record moved start over at most this often before giving up.
const RETRIES: usize = 64;

#[derive(Debug)]
#[non_exhaustive]
pub enum AsyncKvError {
    /// The CN library (the MN has no chunk left, the connection is gone, …).
    Client(Error),
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
    /// A record failed its checks this many times in a row (no concurrent move explains it).
    Corrupt(RecordError),
}

impl fmt::Display for AsyncKvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsyncKvError::Client(e) => write!(f, "CN library: {e}"),
            AsyncKvError::Alloc(e) => write!(f, "object allocator: {e}"),
            AsyncKvError::Config(e) => write!(f, "size classes: {e}"),
            AsyncKvError::TooLarge { len, max } => write!(f, "record of {len} B exceeds the largest object ({max} B)"),
            AsyncKvError::Exists => f.write_str("key exists"),
            AsyncKvError::NotFound => f.write_str("key not found"),
            AsyncKvError::Corrupt(e) => write!(f, "record read back is corrupt: {e}"),
        }
    }
}

impl std::error::Error for AsyncKvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AsyncKvError::Client(e) => Some(e),
            AsyncKvError::Alloc(e) => Some(e),
            AsyncKvError::Config(e) => Some(e),
            AsyncKvError::Corrupt(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Error> for AsyncKvError {
    fn from(e: Error) -> Self {
        AsyncKvError::Client(e)
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    object: ObjectRef,
    len: u32,
}

struct State {
    alloc: Box<Alloc>,
    index: HashMap<Vec<u8>, Slot>,
    stats: KvStats,
}

/// The store over an [`AsyncCn`]; see the module documentation.
pub struct AsyncKv<T: Transport> {
    cn: AsyncCn<T>,
    state: Mutex<State>,
    /// Registered buffers of a chunk's size, lent one per access.
    buffers: Mutex<Vec<LocalMr<Vec<u8>>>>,
    chunk: u64,
}

impl<T: Transport> fmt::Debug for AsyncKv<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncKv").field("keys", &self.len()).finish()
    }
}

impl<T: Transport> AsyncKv<T> {
    /// An empty store on `cn`, with size classes chunk/8 … chunk.
    pub fn new(cn: AsyncCn<T>) -> Result<Self, AsyncKvError> {
        let c = cn.cn().chunk_size();
        let classes = [c / 8, c / 4, c / 2, c];
        let alloc = Box::new(Alloc::new(c, &classes).map_err(AsyncKvError::Config)?);
        Ok(AsyncKv {
            cn,
            state: Mutex::new(State { alloc, index: HashMap::new(), stats: KvStats::default() }),
            buffers: Mutex::new(Vec::new()),
            chunk: c,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keys in the store.
    pub fn len(&self) -> usize {
        self.state().index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Chunks held from the MN right now.
    pub fn held_chunks(&self) -> usize {
        self.state().alloc.held_chunks()
    }
    pub fn stats(&self) -> KvStats {
        self.state().stats
    }
    /// The client underneath.
    pub fn client(&self) -> &AsyncCn<T> {
        &self.cn
    }

    fn buffer(&self) -> Result<LocalMr<Vec<u8>>, AsyncKvError> {
        let spare = self.buffers.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match spare {
            Some(b) => Ok(b),
            None => Ok(self.cn.cn().register(vec![0u8; self.chunk as usize])?),
        }
    }

    fn give_back(&self, b: LocalMr<Vec<u8>>) {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner()).push(b);
    }

    /// Write a new record in a fresh object; the index is not touched.
    async fn place(&self, key: &[u8], value: &[u8]) -> Result<Slot, AsyncKvError> {
        let h = RecordHeader::new(key, value).map_err(AsyncKvError::Corrupt)?;
        let len = HEADER_LEN + key.len() + value.len();
        if len as u64 > self.chunk {
            return Err(AsyncKvError::TooLarge { len: len as u64, max: self.chunk });
        }
        let class = self.state().alloc.class_for(len as u64).map_err(AsyncKvError::Alloc)?;
        let object = loop {
            let r = self.state().alloc.alloc(class);
            match r {
                Ok(o) => break o,
                Err(ObjectAllocError::NeedChunk { .. }) => {
                    // from the reserve, usually: no round trip
                    let chunk = self.cn.alloc().await?;
                    let mut s = self.state();
                    s.stats.chunks_allocated += 1;
                    s.alloc.add_chunk(class, chunk).map_err(AsyncKvError::Alloc)?;
                }
                Err(e) => return Err(AsyncKvError::Alloc(e)),
            }
        };
        let (chunk, offset) = {
            let s = self.state();
            let p = s.alloc.placement(object).map_err(AsyncKvError::Alloc)?;
            (p.chunk.clone(), p.offset)
        };
        let mut buf = self.buffer()?;
        let b = buf.as_mut_slice();
        b[..HEADER_LEN].copy_from_slice(zerocopy::IntoBytes::as_bytes(&h));
        b[HEADER_LEN..HEADER_LEN + key.len()].copy_from_slice(key);
        b[HEADER_LEN + key.len()..len].copy_from_slice(value);
        let (r, buf) = self.cn.write_from(&chunk, offset, buf, 0..len).await;
        self.give_back(buf);
        if let Err(e) = r {
            self.release(object).await?;
            return Err(e.into());
        }
        Ok(Slot { object, len: len as u32 })
    }

    /// Free an object; its chunk goes back (to the reserve or the MN) with its last object.
    async fn release(&self, object: ObjectRef) -> Result<(), AsyncKvError> {
        let emptied = self.state().alloc.free(object).map_err(AsyncKvError::Alloc)?;
        if let Some(chunk) = emptied {
            self.state().stats.chunks_freed += 1;
            self.cn.free(chunk).await?;
        }
        Ok(())
    }

    /// Add a key that is not in the store.
    pub async fn insert(&self, key: &[u8], value: &[u8]) -> Result<(), AsyncKvError> {
        if self.state().index.contains_key(key) {
            return Err(AsyncKvError::Exists);
        }
        let slot = self.place(key, value).await?;
        let raced = {
            let mut s = self.state();
            if s.index.contains_key(key) {
                true
            } else {
                s.index.insert(key.to_vec(), slot);
                false
            }
        };
        if raced {
            self.release(slot.object).await?;
            return Err(AsyncKvError::Exists);
        }
        Ok(())
    }

    /// Replace the value of a key, out of place.
    pub async fn update(&self, key: &[u8], value: &[u8]) -> Result<(), AsyncKvError> {
        if !self.state().index.contains_key(key) {
            return Err(AsyncKvError::NotFound);
        }
        let slot = self.place(key, value).await?;
        let old = self.state().index.get_mut(key).map(|s| std::mem::replace(s, slot));
        match old {
            Some(old) => self.release(old.object).await,
            None => {
                // deleted meanwhile: the new record has no key
                self.release(slot.object).await?;
                Err(AsyncKvError::NotFound)
            }
        }
    }

    /// Upsert: insert, or update if the key exists.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), AsyncKvError> {
        match self.insert(key, value).await {
            Err(AsyncKvError::Exists) => self.update(key, value).await,
            r => r,
        }
    }

    /// The value of a key, read with a zero-copy READ and checked (magic, key, checksum).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, AsyncKvError> {
        let mut last = RecordError::BadLength;
        for _ in 0..RETRIES {
            let target = {
                let s = self.state();
                match s.index.get(key) {
                    None => return Ok(None),
                    Some(slot) => {
                        let p = s.alloc.placement(slot.object).map_err(AsyncKvError::Alloc)?;
                        (p.chunk.clone(), p.offset, slot.len as usize)
                    }
                }
            };
            let (chunk, offset, len) = target;
            let buf = self.buffer()?;
            let (r, buf) = self.cn.read_into(&chunk, offset, buf, 0..len).await;
            let out = match r {
                Ok(()) => record::decode(&buf.as_slice()[..len], key).map(|v| v.to_vec()),
                // the chunk went back between the lookup and the read: look again
                Err(Error::Freed) => Err(RecordError::WrongKey),
                Err(e) => {
                    self.give_back(buf);
                    return Err(e.into());
                }
            };
            self.give_back(buf);
            match out {
                Ok(v) => return Ok(Some(v)),
                // moved by a concurrent update: look again
                Err(e) => last = e,
            }
        }
        Err(AsyncKvError::Corrupt(last))
    }

    /// Remove a key; false if it was not there.
    pub async fn delete(&self, key: &[u8]) -> Result<bool, AsyncKvError> {
        let slot = self.state().index.remove(key);
        match slot {
            Some(s) => {
                self.release(s.object).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}
