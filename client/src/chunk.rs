//! [`Chunk`]: the handle of one chunk the MN handed this client.

/// One chunk of MN memory this client holds: what reads, writes, atomics and the free name.
///
/// The handle is a name, not the chunk's keys: every access looks the chunk up in the
/// client's table, so a window the MN re-keyed is used with its new key, and a handle that
/// outlived its chunk (a clone kept after [`crate::Cn::free`], or any handle after the MN
/// revoked every allocation) gets [`crate::Error::Freed`] — never an access with a stale key,
/// which would break the QP. An access in flight keeps its chunk: the free waits for it.
///
/// ```
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
/// let chunk = cn.alloc().unwrap();
/// assert_eq!(chunk.size(), model.config().chunk_size);
/// let copy = chunk.clone();
/// cn.free(chunk).unwrap();
/// assert_eq!(cn.write(&copy, 0, b"late"), Err(omw_client::Error::Freed));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chunk {
    pub(crate) id: u64,
    pub(crate) size: u64,
    pub(crate) client: u64,
}

impl Chunk {
    /// The chunk's size in bytes (the MN's chunk size).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// assert!(c.size().is_power_of_two());
    /// ```
    pub fn size(&self) -> u64 {
        self.size
    }
}
