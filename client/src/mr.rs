//! [`LocalMr`]: a buffer of the caller's, registered with the client for zero-copy access.
//!
//! The handle owns or mutably borrows its memory, so it cannot outlive it, and nothing else
//! can touch the bytes while an access uses them: a zero-copy READ takes `&mut LocalMr` (the
//! blocking call) or the handle itself (the future, which keeps it until the device is done
//! even when the future is dropped). Only three buffer types qualify — `Vec<u8>`, `Box<[u8]>`
//! and `&mut [u8]` — because the device keeps the address it was given: each keeps its bytes
//! where they are for as long as the handle lives (the handle never lends out the `Vec`
//! itself, so it cannot reallocate).

use crate::transport::Registered;
use std::fmt;
use std::ops::Range;
use std::sync::Weak;

mod sealed {
    pub trait Sealed {}
    impl Sealed for Vec<u8> {}
    impl Sealed for Box<[u8]> {}
    impl Sealed for &mut [u8] {}
}

/// Memory a [`LocalMr`] can hold: its bytes stay at one address while the handle lives.
/// Sealed: `Vec<u8>`, `Box<[u8]>`, `&mut [u8]`.
///
/// ```
/// use omw_client::MrBuffer;
/// fn len_of<B: MrBuffer>(b: &B) -> usize { b.bytes().len() }
/// assert_eq!(len_of(&vec![0u8; 3]), 3);
/// ```
pub trait MrBuffer: sealed::Sealed + Send + Unpin {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl MrBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
impl MrBuffer for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
impl MrBuffer for &mut [u8] {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Who deregisters a dropped handle: the client, later, under its own lock (a handle may be
/// dropped while the client's engine is locked — inside a completion — so dropping never
/// locks it).
pub(crate) trait Registrar: Send + Sync {
    fn release(&self, reg: Registered);
}

/// Stands in once a handle's registration was released.
struct NoRegistrar;
impl Registrar for NoRegistrar {
    fn release(&self, _reg: Registered) {}
}

/// A caller buffer registered with one client ([`crate::Cn::register`]).
///
/// ```
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
/// let chunk = cn.alloc().unwrap();
/// let mut mr = cn.register(vec![0u8; 4096]).unwrap();
/// mr.as_mut_slice()[..5].copy_from_slice(b"hello");
/// cn.write_from(&chunk, 0, &mr, 0..5).unwrap(); // no staging copy
/// cn.read_into(&chunk, 0, &mut mr, 100..105).unwrap();
/// assert_eq!(&mr.as_slice()[100..105], b"hello");
/// let v: Vec<u8> = mr.into_inner(); // deregistered, the Vec handed back
/// assert_eq!(v.len(), 4096);
/// ```
pub struct LocalMr<B: MrBuffer> {
    buf: Option<B>,
    pub(crate) reg: Registered,
    owner: Weak<dyn Registrar>,
    pub(crate) client: u64,
    /// The client withdrew the registration ([`crate::Error::Deregistered`]).
    pub(crate) dead: bool,
}

impl<B: MrBuffer> fmt::Debug for LocalMr<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalMr").field("len", &self.len()).field("lkey", &self.reg.lkey).finish()
    }
}

impl<B: MrBuffer> LocalMr<B> {
    pub(crate) fn new(buf: B, reg: Registered, owner: Weak<dyn Registrar>, client: u64) -> Self {
        LocalMr { buf: Some(buf), reg, owner, client, dead: false }
    }

    /// The buffer's length.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.register(vec![0u8; 64]).unwrap().len(), 64);
    /// ```
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the buffer is empty (never: registering an empty buffer is refused).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert!(!cn.register(vec![0u8; 1]).unwrap().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let mr = cn.register(vec![7u8; 8]).unwrap();
    /// assert_eq!(mr.as_slice(), &[7u8; 8]);
    /// ```
    pub fn as_slice(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.bytes())
    }

    /// The bytes, to fill before a WRITE or read after a READ.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let mut mr = cn.register(vec![0u8; 8]).unwrap();
    /// mr.as_mut_slice().fill(1);
    /// assert_eq!(mr.as_slice(), &[1u8; 8]);
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self.buf.as_mut() {
            Some(b) => b.bytes_mut(),
            None => &mut [],
        }
    }

    /// Deregister and hand the buffer back.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let mut storage = [0u8; 16];
    /// let mr = cn.register(&mut storage[..]).unwrap(); // borrows: cannot outlive `storage`
    /// let back: &mut [u8] = mr.into_inner();
    /// back[0] = 1;
    /// assert_eq!(storage[0], 1);
    /// ```
    pub fn into_inner(mut self) -> B {
        self.release();
        self.buf.take().expect("the buffer is present until into_inner or drop")
    }

    pub(crate) fn check(&self, client: u64, range: &Range<usize>) -> Result<(), crate::Error> {
        if self.client != client {
            return Err(crate::Error::Foreign);
        }
        if self.dead {
            return Err(crate::Error::Deregistered);
        }
        if range.start > range.end || range.end > self.len() {
            return Err(crate::Error::OutOfBuffer { start: range.start, end: range.end, len: self.len() });
        }
        Ok(())
    }

    fn release(&mut self) {
        if self.dead {
            return;
        }
        if let Some(o) = self.owner.upgrade() {
            o.release(self.reg);
        }
        // a client already gone took its registrations down with its device
        self.owner = Weak::<NoRegistrar>::new();
    }
}

impl<B: MrBuffer> Drop for LocalMr<B> {
    fn drop(&mut self) {
        if self.buf.is_some() {
            self.release();
        }
    }
}
