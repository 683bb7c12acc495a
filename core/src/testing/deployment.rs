//! One deployment and the one pump that drives it: an MN on its [`MnDriver`], its CNs, and the
//! schedule every testbed runs them by — quinn's test `Pair`, for one MN and N CNs.
//!
//! Every testbed used to hand-write this loop (the loopback cluster, the FPGA double's support,
//! the core's own MN tests, the freestanding no_std check), and each got a different piece of
//! it wrong in its own way: one never ran the MN's timers, one ran them only where the model
//! was idle, one never told the MN about a crashed CN. Here it is written once. What differs
//! between testbeds is only
//! - the world the devices live in — the model's fabric, the FPGA register double, the core's
//!   test NIC: a [`Fabric`] (run posted work, one step at a time when interleaving, a clock,
//!   the MN CPU's modelled cost), and
//! - what a CN makes of what reached it — a [`CnSide`] (its driver polled, its events
//!   recorded the way that testbed's scenarios read them).
//!
//! The schedule: devices run (to idle, or step by step with the MN CPU let in between any two
//! steps when the fabric interleaves); the MN CPU reacts (a crashed CN reported the way a
//! connection manager would, the driver polled, its timers run when due); every running CN
//! takes what reached it; repeat until nothing moves. Time moves only through
//! [`Deployment::run_until`], from one timer to the next — never past a due timer.
//!
//! No heap: CNs live in the caller's storage and are lent as a slice.

use crate::chain::arm::MnDevice;
use crate::cn::driver::{CnDriver, CnError};
use crate::device::{DataPath, RdmaBackend};
use crate::ids::CnId;
use crate::mn::driver::{DriverError, MnDriver};
use crate::mn::tenant::TenantId;
use crate::mn::{AllocChainQps, CnQps, Event};
use core::fmt;

/// Pump rounds before a deployment that never goes idle is reported ([`PumpError::NeverIdle`]):
/// a host-engine lap advances one device step per round, so a few hundred laps' worth.
pub const MAX_ROUNDS: u32 = 1024;

/// The world the devices live in. The defaults are a fabric that never interleaves and has
/// no CPU timing model.
pub trait Fabric {
    type Error: fmt::Debug + fmt::Display;
    /// The fabric's clock (ns). A fabric without time keeps the last [`Fabric::advance_to`].
    fn now(&self) -> u64;
    /// Run what the devices have posted until they are idle (bounded by the fabric); the steps run.
    fn run(&mut self) -> Result<u64, Self::Error>;
    /// Let time pass up to `t` (≥ [`Fabric::now`]), running what falls due.
    fn advance_to(&mut self, t: u64) -> Result<(), Self::Error>;
    /// Whether the fabric explores interleavings: devices stepped one at a time, the MN CPU let
    /// in between any two steps when [`Fabric::mn_acts_now`] says so. Otherwise the MN acts
    /// only when the devices are idle.
    fn interleaves(&self) -> bool {
        false
    }
    /// One device step; false when idle (interleaved schedules).
    fn step(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }
    /// Interleaved schedules: whether the MN CPU acts before the next device step.
    fn mn_acts_now(&mut self) -> bool {
        false
    }
    /// Charge the MN CPU for `events` events it handled and `steps` host-engine steps it ran
    /// (a timing model advances the MN host's CPU).
    fn charge_mn_cpu(&mut self, _events: u64, _steps: u64) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Count `n` MN CPU events whose cost the model leaves out (a departure, a timer).
    fn count_mn_events(&mut self, _n: u64) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Where a CN is in its life, as the deployment drives it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Life {
    /// Polled every round.
    Running,
    /// Alive but no longer polling or posting receives (a hung or hostile CN): not polled.
    Stalled,
    /// Its host crashed; the MN is told ([`Event::CnGone`]) the way a connection manager tells it.
    Crashed,
    /// Its host vanished without a disconnect: nobody tells the MN; only its lease notices.
    Vanished,
}

/// One CN as the deployment sees it.
pub trait CnSide {
    type Error: fmt::Debug + fmt::Display;
    fn life(&self) -> Life;
    /// The id the MN gave it ([`CnId::UNASSIGNED`] before its connect).
    fn mn_id(&self) -> CnId;
    /// The MN admitted it as `id` ([`Deployment::connect`]).
    fn set_mn_id(&mut self, id: CnId);
    /// The id its connect info told it, once that arrived.
    fn learnt_id(&self) -> Option<CnId>;
    /// Take what reached it (poll its driver, record its events); whether anything did. `mn` is
    /// the MN's device, for the MN's half of a reconnect where the fabric does not bring both
    /// ends of a broken pair back itself (a CN reconnecting through the MN's connection manager).
    fn service<M: DataPath>(&mut self, now: u64, mn: &mut M) -> Result<bool, Self::Error>;
    /// When its own timers (reply deadline, "empty" back-off) next need [`CnSide::handle_timeout`].
    fn poll_timeout(&self) -> Option<u64>;
    fn handle_timeout(&mut self, now: u64);
}

/// A bare driver is a CN that keeps what it heard in its own event queue for the caller
/// ([`CnDriver::next_event`]): it moved when that queue grew. It never stalls or crashes, and
/// its MN id is the one its connect info told it.
impl<B: RdmaBackend, const N: usize, const S: usize> CnSide for CnDriver<B, N, S> {
    type Error = CnError<B::Error>;
    fn life(&self) -> Life {
        Life::Running
    }
    fn mn_id(&self) -> CnId {
        self.id().unwrap_or(CnId::UNASSIGNED)
    }
    fn set_mn_id(&mut self, _id: CnId) {}
    fn learnt_id(&self) -> Option<CnId> {
        self.id()
    }
    fn service<M: DataPath>(&mut self, now: u64, _mn: &mut M) -> Result<bool, Self::Error> {
        let before = self.pending_events();
        self.poll(now)?;
        Ok(self.pending_events() > before)
    }
    fn poll_timeout(&self) -> Option<u64> {
        CnDriver::poll_timeout(self)
    }
    fn handle_timeout(&mut self, now: u64) {
        CnDriver::handle_timeout(self, now)
    }
}

/// CNs lent by reference (`&mut [&mut cn0, &mut cn1]`).
impl<C: CnSide> CnSide for &mut C {
    type Error = C::Error;
    fn life(&self) -> Life {
        (**self).life()
    }
    fn mn_id(&self) -> CnId {
        (**self).mn_id()
    }
    fn set_mn_id(&mut self, id: CnId) {
        (**self).set_mn_id(id)
    }
    fn learnt_id(&self) -> Option<CnId> {
        (**self).learnt_id()
    }
    fn service<M: DataPath>(&mut self, now: u64, mn: &mut M) -> Result<bool, Self::Error> {
        (**self).service(now, mn)
    }
    fn poll_timeout(&self) -> Option<u64> {
        (**self).poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        (**self).handle_timeout(now)
    }
}

/// What went wrong while pumping.
#[derive(Debug)]
#[non_exhaustive]
pub enum PumpError<F, D, C> {
    Fabric(F),
    Mn(DriverError<D>),
    /// CN `cn` (its index in the slice) failed in its own device calls.
    Cn {
        cn: usize,
        error: C,
    },
    /// [`MAX_ROUNDS`] rounds and something still moved.
    NeverIdle,
    /// A new CN never received its connect info.
    NoConnectInfo {
        cn: usize,
    },
}

impl<F: fmt::Display, D: fmt::Display, C: fmt::Display> fmt::Display for PumpError<F, D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PumpError::Fabric(e) => write!(f, "fabric: {e}"),
            PumpError::Mn(e) => write!(f, "MN driver: {e}"),
            PumpError::Cn { cn, error } => write!(f, "cn{cn}: {error}"),
            PumpError::NeverIdle => write!(f, "the deployment never went idle in {MAX_ROUNDS} rounds"),
            PumpError::NoConnectInfo { cn } => write!(f, "cn{cn} never received its connect info"),
        }
    }
}

/// What the MN CPU did during one [`Deployment::pump`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MnActivity {
    /// Events the MN CPU handled (the figure OneSidedMW drives to zero).
    pub cpu_events: u64,
}

/// An MN, its fabric and its CNs, lent for one call: `Deployment::new(&mut fabric, &mut mn,
/// &mut cns).pump()`.
pub struct Deployment<'a, F: Fabric, D: MnDevice, C: CnSide> {
    pub fabric: &'a mut F,
    pub mn: &'a mut MnDriver<D>,
    pub cns: &'a mut [C],
}

impl<F: Fabric, D: MnDevice, C: CnSide> fmt::Debug for Deployment<'_, F, D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deployment").field("cns", &self.cns.len()).finish_non_exhaustive()
    }
}

type Res<T, F, D, C> =
    Result<T, PumpError<<F as Fabric>::Error, <D as crate::device::DataPath>::Error, <C as CnSide>::Error>>;

impl<'a, F: Fabric, D: MnDevice, C: CnSide> Deployment<'a, F, D, C> {
    pub fn new(fabric: &'a mut F, mn: &'a mut MnDriver<D>, cns: &'a mut [C]) -> Self {
        Deployment { fabric, mn, cns }
    }

    /// Run the devices, the MN CPU and every running CN until nothing moves.
    pub fn pump(&mut self) -> Res<MnActivity, F, D, C> {
        let mut act = MnActivity::default();
        for _ in 0..MAX_ROUNDS {
            let steps = match self.fabric.interleaves() {
                false => self.fabric.run().map_err(PumpError::Fabric)?,
                true => {
                    // The MN CPU runs *while* the NIC executes chains: step the devices one at a
                    // time and let the MN act between any two steps when the schedule says so.
                    let mut n = 0u64;
                    while n < 10_000_000 && self.fabric.step().map_err(PumpError::Fabric)? {
                        n += 1;
                        if self.fabric.mn_acts_now() {
                            self.mn_round(&mut act)?;
                        }
                    }
                    n
                }
            };
            let events = self.mn_round(&mut act)?;
            let cn_moved = self.service_cns()?;
            if steps == 0 && events == 0 && !cn_moved {
                return Ok(act);
            }
        }
        Err(PumpError::NeverIdle)
    }

    /// One round of the MN CPU: departures a connection manager reports, chain failures (and
    /// host-engine requests), the timers that are due. Returns the events that count as
    /// movement.
    fn mn_round(&mut self, act: &mut MnActivity) -> Res<u32, F, D, C> {
        // CNs harvest what reached them first: a repair resets the MN's end of a pair, and a
        // fabric may reset the CN's end with it (a CN reconnecting), which would take
        // completions the CN already had out of its CQ
        self.service_cns()?;
        let now = self.fabric.now();
        let mut events = 0u32;
        for i in 0..self.cns.len() {
            let c = &self.cns[i];
            if c.life() == Life::Crashed && self.mn.mn.cn(c.mn_id()).is_some() {
                let cn = c.mn_id();
                self.mn.handle(now, Event::CnGone { cn }).map_err(PumpError::Mn)?;
                self.fabric.count_mn_events(1).map_err(PumpError::Fabric)?;
                act.cpu_events += 1;
                events += 1;
            }
        }
        let steps_before = self.mn.stats.cpu_steps;
        let report = self.mn.poll(now).map_err(PumpError::Mn)?;
        let steps = self.mn.stats.cpu_steps - steps_before;
        if report.events > 0 || steps > 0 {
            // a lap resumed without a new event is CPU work too
            self.fabric.charge_mn_cpu(report.events as u64, steps).map_err(PumpError::Fabric)?;
        }
        act.cpu_events += report.events as u64;
        events += report.events;
        // resumed laps count as movement (they posted their next device step)
        events += report.laps_advanced.min(1);
        // the MN's timers (the tail watch while tickets are outstanding, lease, audit); a timer
        // firing is not movement by itself (the tail watch fires while a ticket waits)
        if self.mn.poll_timeout().is_some_and(|t| t <= now) {
            let n = self.mn.handle_timeout(now).map_err(PumpError::Mn)?;
            self.fabric.count_mn_events(n as u64).map_err(PumpError::Fabric)?;
            act.cpu_events += n as u64;
        }
        Ok(events)
    }

    /// Let every running CN take what reached it (and run its due timers); whether anything did.
    fn service_cns(&mut self) -> Res<bool, F, D, C> {
        let now = self.fabric.now();
        let mut moved = false;
        for (i, c) in self.cns.iter_mut().enumerate() {
            if c.life() != Life::Running {
                continue;
            }
            if c.poll_timeout().is_some_and(|t| t <= now) {
                c.handle_timeout(now);
            }
            moved |= c.service(now, &mut self.mn.backend).map_err(|error| PumpError::Cn { cn: i, error })?;
        }
        Ok(moved)
    }

    /// The earliest timer of the MN or of a running CN that lies after `now`. A timer already
    /// due is the pump's (every round runs what is due); one that stays due after it ran (the
    /// tail watch while a ticket waits) must not hold time still.
    pub fn next_timer_after(&self, now: u64) -> Option<u64> {
        let later = |t: Option<u64>| t.filter(|t| *t > now);
        let cns = self.cns.iter().filter(|c| c.life() == Life::Running).filter_map(|c| later(c.poll_timeout())).min();
        match (later(self.mn.mn.poll_timeout()), cns) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Let time pass up to `t`: from one timer to the next (each run at its own time, then
    /// everything pumped), never past a due one; then to `t`.
    pub fn run_until(&mut self, t: u64) -> Res<MnActivity, F, D, C> {
        let mut act = self.pump()?;
        while let Some(next) = self.next_timer_after(self.fabric.now()).filter(|n| *n <= t) {
            self.fabric.advance_to(next).map_err(PumpError::Fabric)?;
            let a = self.pump()?;
            act.cpu_events += a.cpu_events;
        }
        if self.fabric.now() < t {
            self.fabric.advance_to(t).map_err(PumpError::Fabric)?;
        }
        let a = self.pump()?;
        act.cpu_events += a.cpu_events;
        Ok(act)
    }

    /// Connect the CN at `index` (already in the slice, its device set up; `qps` the MN's
    /// ends of its QPs), alone or as one of `tenant`'s CNs: the MN admits it and sends its
    /// connect info; pump until it arrived. The id, and what the MN CPU did meanwhile.
    pub fn connect(&mut self, index: usize, qps: CnQps, tenant: Option<TenantId>) -> Res<(CnId, MnActivity), F, D, C> {
        self.connect_with_chains(index, qps, &[], tenant)
    }

    /// [`Deployment::connect`] for a CN with extra alloc chains (`extra`: their MN ends).
    pub fn connect_with_chains(
        &mut self,
        index: usize,
        qps: CnQps,
        extra: &[AllocChainQps],
        tenant: Option<TenantId>,
    ) -> Res<(CnId, MnActivity), F, D, C> {
        let id = self.mn.connect_with_chains(qps, extra, tenant).map_err(PumpError::Mn)?;
        if let Some(c) = self.cns.get_mut(index) {
            c.set_mn_id(id);
        }
        let act = self.pump()?;
        match self.cns.get(index).and_then(|c| c.learnt_id()) {
            Some(learnt) if learnt == id => Ok((id, act)),
            _ => Err(PumpError::NoConnectInfo { cn: index }),
        }
    }
}

/// A fabric that runs work as it is posted and keeps a clock it is told (the core's test NIC).
#[derive(Clone, Copy, Debug, Default)]
pub struct Immediate {
    pub now: u64,
}

impl Fabric for Immediate {
    type Error = core::convert::Infallible;
    fn now(&self) -> u64 {
        self.now
    }
    fn run(&mut self) -> Result<u64, Self::Error> {
        Ok(0)
    }
    fn advance_to(&mut self, t: u64) -> Result<(), Self::Error> {
        self.now = self.now.max(t);
        Ok(())
    }
}
