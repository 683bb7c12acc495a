//! The caller's choices: how a blocking call waits ([`WaitPolicy`]), the allocation reserve
//! ([`ReservePolicy`]), and the client's options ([`Options`]).

use std::fmt;
use std::time::Duration;

/// How a blocking call waits for its completion: poll the CQs for `spin`, then sleep on the
/// transport's event fd (a completion channel on verbs), at most `max_sleep` at a time.
///
/// Spinning costs a core per waiting thread and gives the lowest latency; sleeping costs a
/// wake-up (an interrupt and a context switch) per completion and no CPU while waiting. One
/// sleeping thread watches the fd for all of a client's waiters; the others wait to be told.
///
/// ```
/// use omw_client::WaitPolicy;
/// use std::time::Duration;
/// let p = WaitPolicy::spin_then_sleep(Duration::from_micros(50));
/// assert_eq!(p.spin, Duration::from_micros(50));
/// assert_eq!(WaitPolicy::SLEEP.spin, Duration::ZERO);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct WaitPolicy {
    /// How long to poll before sleeping (`Duration::MAX`: never sleep).
    pub spin: Duration,
    /// The longest single sleep: the waiter wakes at least this often to run the client's
    /// timers (reply deadlines, the "empty" back-off) and check its own deadline.
    pub max_sleep: Duration,
}

impl WaitPolicy {
    /// Poll only: never sleep.
    pub const BUSY: WaitPolicy = WaitPolicy { spin: Duration::MAX, max_sleep: Duration::from_millis(10) };
    /// Sleep on the event fd at once.
    pub const SLEEP: WaitPolicy = WaitPolicy { spin: Duration::ZERO, max_sleep: Duration::from_millis(10) };

    /// Poll for `spin`, then sleep.
    ///
    /// ```
    /// let p = omw_client::WaitPolicy::spin_then_sleep(std::time::Duration::ZERO);
    /// assert_eq!(p, omw_client::WaitPolicy::SLEEP);
    /// ```
    pub const fn spin_then_sleep(spin: Duration) -> WaitPolicy {
        WaitPolicy { spin, max_sleep: Duration::from_millis(10) }
    }
}

impl Default for WaitPolicy {
    /// 20 µs of polling (a few round trips on a real NIC), then sleep.
    fn default() -> Self {
        WaitPolicy::spin_then_sleep(Duration::from_micros(20))
    }
}

/// A per-client reserve of allocated chunks, so an allocation usually needs no round trip to
/// the MN: refilled in the background while it holds fewer than `low` (up to the midpoint of
/// `low` and `high`); a freed chunk goes into it instead of back to the MN while it holds fewer
/// than `high`. Reserved chunks count against the CN's quota. The reserve goes back to the MN
/// on [`crate::Cn::shutdown`] and whenever the MN says its pool is empty (memory pressure: the
/// "empty" notice every CN receives); it refills again after "available".
///
/// ```
/// use omw_client::ReservePolicy;
/// let p = ReservePolicy::new(2, 6).unwrap();
/// assert_eq!(p.target(), 4);
/// assert!(ReservePolicy::new(5, 2).is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ReservePolicy {
    low: usize,
    high: usize,
}

/// A reserve policy that cannot work.
///
/// ```
/// assert_eq!(omw_client::ReservePolicy::new(0, 0), Err(omw_client::BadReserve { low: 0, high: 0 }));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BadReserve {
    pub low: usize,
    pub high: usize,
}

impl fmt::Display for BadReserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "reserve low-water {} / high-water {}: need 1 <= high and low <= high", self.low, self.high)
    }
}
impl std::error::Error for BadReserve {}

impl ReservePolicy {
    /// Low- and high-water marks (chunks): `low <= high`, `high >= 1`.
    ///
    /// ```
    /// assert!(omw_client::ReservePolicy::new(0, 1).is_ok());
    /// ```
    pub const fn new(low: usize, high: usize) -> Result<ReservePolicy, BadReserve> {
        if high == 0 || low > high {
            return Err(BadReserve { low, high });
        }
        Ok(ReservePolicy { low, high })
    }
    /// Refill while below this.
    ///
    /// ```
    /// assert_eq!(omw_client::ReservePolicy::new(1, 4).unwrap().low(), 1);
    /// ```
    pub const fn low(&self) -> usize {
        self.low
    }
    /// Free to the MN above this.
    ///
    /// ```
    /// assert_eq!(omw_client::ReservePolicy::new(1, 4).unwrap().high(), 4);
    /// ```
    pub const fn high(&self) -> usize {
        self.high
    }
    /// What a refill aims for: the midpoint, at least `low`, at least one.
    ///
    /// ```
    /// assert_eq!(omw_client::ReservePolicy::new(0, 1).unwrap().target(), 1);
    /// ```
    pub const fn target(&self) -> usize {
        let t = self.low + (self.high - self.low).div_ceil(2);
        if t == 0 { 1 } else { t }
    }
}

/// How a client behaves.
///
/// ```
/// use omw_client::{Options, ReservePolicy, WaitPolicy};
/// let o = Options { reserve: Some(ReservePolicy::new(2, 8).unwrap()), wait: WaitPolicy::SLEEP, ..Options::default() };
/// assert_eq!(o.timeout, std::time::Duration::from_secs(20));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Options {
    pub wait: WaitPolicy,
    /// How long one blocking call may wait (an allocation through "empty" until "available"
    /// included) and how long an allocation request may go unanswered.
    pub timeout: Duration,
    /// The allocation reserve, if any.
    pub reserve: Option<ReservePolicy>,
}

impl Default for Options {
    fn default() -> Self {
        Options { wait: WaitPolicy::default(), timeout: Duration::from_secs(20), reserve: None }
    }
}
