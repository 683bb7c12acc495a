//! Event-driven completions: a CN's CQs on one completion channel (`ibv_create_comp_channel`),
//! armed with `ibv_req_notify_cq`, its events taken with `ibv_get_cq_event` and acknowledged at
//! once with `ibv_ack_cq_events` (a CQ with unacknowledged events cannot be destroyed); and one
//! fd — an epoll set of the completion channel and the rdma_cm event channel — that turns
//! readable when either has something: what a thread sleeps on ([`EventFd::wait`]) and what an
//! async reactor watches ([`AsyncEventFd`], feature `tokio`).

use crate::error::{Result, VerbsError};
use rdma_sys::*;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::time::Duration;

/// A completion channel: the CQs created while it exists report their events on it.
#[derive(Debug)]
pub(crate) struct CompChannel {
    ch: *mut ibv_comp_channel,
}

impl CompChannel {
    /// A channel on `ctx`, its fd non-blocking (events are taken without waiting; sleeping is
    /// the epoll set's job).
    pub(crate) fn create(ctx: *mut ibv_context) -> Result<Self> {
        // SAFETY: ctx is an open device context; the channel is ours until Drop.
        let ch = unsafe { ibv_create_comp_channel(ctx) };
        if ch.is_null() {
            return Err(VerbsError::last("ibv_create_comp_channel"));
        }
        let c = CompChannel { ch };
        // SAFETY: ch->fd is the channel's open file descriptor.
        let rc = unsafe {
            let fd = (*ch).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        };
        if rc != 0 {
            return Err(VerbsError::last("fcntl(O_NONBLOCK) on the completion channel"));
        }
        Ok(c)
    }

    pub(crate) fn ptr(&self) -> *mut ibv_comp_channel {
        self.ch
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while self is.
        unsafe { (*self.ch).fd }
    }

    /// Take every event waiting, acknowledging each at once; how many there were.
    pub(crate) fn drain(&self) -> usize {
        let mut n = 0;
        loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut cq_ctx: *mut libc::c_void = ptr::null_mut();
            // SAFETY: the channel is live; the fd is non-blocking, so with nothing waiting the
            // call returns -1 (EAGAIN) instead of sleeping; cq and cq_ctx are out-parameters.
            let rc = unsafe { ibv_get_cq_event(self.ch, &mut cq, &mut cq_ctx) };
            if rc != 0 || cq.is_null() {
                return n;
            }
            // SAFETY: cq is the live CQ the event came from; exactly one event is acknowledged.
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }

    /// Ask for an event at the CQ's next completion.
    pub(crate) fn arm(cq: *mut ibv_cq) -> Result<()> {
        // SAFETY: cq is a live CQ of this backend, created on this channel.
        let rc = unsafe { ibv_req_notify_cq(cq, 0) };
        if rc != 0 {
            return Err(VerbsError::rc("ibv_req_notify_cq", rc));
        }
        Ok(())
    }
}

impl Drop for CompChannel {
    /// The backend destroys every CQ first (a channel with CQs on it cannot be destroyed).
    fn drop(&mut self) {
        // SAFETY: the channel is live and no CQ uses it any more.
        unsafe { ibv_destroy_comp_channel(self.ch) };
    }
}

/// One fd for everything a CN waits on: readable while the completion channel or the rdma_cm
/// channel has an event (an epoll set, level-triggered). Clones share the set.
#[derive(Debug)]
pub struct EventFd {
    epoll: OwnedFd,
}

impl EventFd {
    /// An epoll set watching `fds` for input.
    pub(crate) fn watching(fds: &[RawFd]) -> io::Result<EventFd> {
        // SAFETY: plain system call; on success it returns a new fd this value then owns.
        let e = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if e < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `e` is a fresh fd nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(e) };
        for fd in fds {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: *fd as u64 };
            // SAFETY: the epoll fd is live; ev is a valid event for the duration of the call.
            let rc = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, *fd, &mut ev) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(EventFd { epoll })
    }

    /// Another handle on the same set.
    pub fn try_clone(&self) -> io::Result<EventFd> {
        Ok(EventFd { epoll: self.epoll.try_clone()? })
    }

    /// Sleep until an event is waiting or `timeout` passed; whether one is. Consumes nothing.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        let mut p = libc::pollfd { fd: self.epoll.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
        }
        Ok(rc > 0)
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

/// The event fd registered with tokio's reactor.
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub struct AsyncEventFd(tokio::io::unix::AsyncFd<EventFd>);

#[cfg(feature = "tokio")]
impl AsyncEventFd {
    /// Register `fd` with the current tokio runtime (call inside one).
    pub fn new(fd: EventFd) -> io::Result<AsyncEventFd> {
        // SAFETY: the EventFd owns its fd (an OwnedFd) and hands it to the AsyncFd, which owns
        // it until it is dropped; the fd stays open and `as_raw_fd` returns that same fd for
        // the AsyncFd's whole life — what `AsyncFd::register` requires.
        let a = unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(AsyncEventFd(a))
    }

    /// Wait until an event is waiting, then clear tokio's readiness (the caller takes the
    /// events next; anything newer makes the fd readable again).
    pub async fn readable(&self) -> io::Result<()> {
        let mut g = self.0.readable().await?;
        g.clear_ready();
        Ok(())
    }
}
