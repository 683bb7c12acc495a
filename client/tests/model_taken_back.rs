//! Chunks the MN takes back while the CN stays connected, through the library end to end: an
//! RNIC reset's `Revoked` (last test), and one group (`wire::message::TakenBack`): the MN's audit finds the chunk's windows bound where no access QP
//! of its owner is — here because the device binds every window to the QP that posted the
//! bind (`ForeignBind::BoundToPoster`, docs/MLX5.md question 5) and the MN was made to
//! offload with the paper's layout anyway (not the one that binds to the poster, which `choose`
//! picks for such a device) — reclaims the group and tells the CN. And the layout that binds to
//! the poster, through the library: every access on the Alloc QP, nothing taken back. The library then answers `Freed` on
//! every handle of that chunk, counts it in `Stats::taken_back`, never frees it again, and
//! keeps serving: the next chunk it gets is counted in the pool once.

use omw_client::model::{Model, ModelConfig};
use omw_client::{Cn, Error, Options};
use omw_core::chain::variant::ChainVariant;
use omw_core::device::ExecutionMode;
use omw_core::device::behaviour::ForeignBind;
use omw_loopback::NicConfig;

const CHUNKS: u32 = 16;

fn model(foreign_bind: ForeignBind) -> Model {
    model_laid_out(foreign_bind, None)
}

fn model_laid_out(foreign_bind: ForeignBind, chain_variant: Option<ChainVariant>) -> Model {
    let mut b = NicConfig::DEFAULT_BEHAVIOUR;
    b.foreign_bind = foreign_bind;
    Model::start(ModelConfig {
        chunks: CHUNKS,
        mode: Some(ExecutionMode::Offloaded),
        nic: NicConfig::strict().with_behaviour(b),
        chain_variant,
        ..Default::default()
    })
    .unwrap()
}

/// Run the MN's audit over the whole table, with the CN's library making progress between
/// ticks (it receives the notice on its message QP).
fn audit_whole_table(m: &Model, cn: &Cn<omw_client::model::ModelDevice>) {
    let passes = m.with_cluster(|c| c.driver.mn.stats().audit_passes).unwrap();
    for _ in 0..64 {
        m.with_cluster(|c| c.tick().map(|_| c.driver.mn.stats().audit_passes)).unwrap().unwrap();
        cn.progress().unwrap();
        if m.with_cluster(|c| c.driver.mn.stats().audit_passes).unwrap() > passes {
            break;
        }
    }
    cn.progress().unwrap();
}

#[test]
fn a_chunk_the_mn_took_back_answers_freed_and_is_not_freed_again() {
    // the paper's layout forced onto a device that binds to the poster
    let m = model_laid_out(ForeignBind::BoundToPoster, Some(ChainVariant::WQEBB_ENABLES));
    let cn = Cn::connect(&m, Options::default()).unwrap();
    let c = cn.alloc().unwrap();
    let twin = c.clone();
    // bound to the alloc chain's management QP, not to an access QP: the CN cannot reach it
    // (an access now would fail with RemAccessErr and put the access QP pair in ERR, which the
    // library reports as a lost connection: `Error::Access`, docs/CN-LIBRARY.md)
    let notices = m.with_cluster(|c| c.driver.mn.stats().taken_back_notices).unwrap();
    audit_whole_table(&m, &cn);
    let s = m.with_cluster(|c| c.driver.mn.stats()).unwrap();
    assert!(s.taken_back_notices > notices, "the MN told the CN");
    assert_eq!(cn.stats().taken_back, 1, "the library heard it once");
    // every handle of the chunk now answers Freed, before anything is posted
    assert_eq!(cn.write(&c, 0, b"late"), Err(Error::Freed));
    let mut buf = [0u8; 4];
    assert_eq!(cn.read(&twin, 0, &mut buf), Err(Error::Freed));
    assert_eq!(cn.free(twin), Err(Error::Freed), "a chunk taken back is never freed again");
    assert_eq!(cn.held_chunks(), 0);
    // conservation at the MN: every group is free or held by a chain popping ahead
    m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
}

/// The control: on a device that honours foreign binds the same audit finds nothing, the
/// library hears nothing, and the chunk works.
#[test]
fn nothing_is_taken_back_where_the_windows_are_bound_to_the_access_qps() {
    let m = model(ForeignBind::Honoured);
    let cn = Cn::connect(&m, Options::default()).unwrap();
    let c = cn.alloc().unwrap();
    cn.write(&c, 0, b"kept").unwrap();
    audit_whole_table(&m, &cn);
    assert_eq!(m.with_cluster(|c| c.driver.mn.stats().taken_back_notices).unwrap(), 0);
    assert_eq!(cn.stats().taken_back, 0);
    let mut buf = [0u8; 4];
    cn.read(&c, 0, &mut buf).unwrap();
    assert_eq!(&buf, b"kept");
    cn.free(c).unwrap();
    cn.progress().unwrap();
}

/// The layout `choose` picks for a device that refuses or redirects a bind naming another QP
/// (`ChainVariant::binds_to_poster`): the library connects (its connect info names the Alloc
/// QP for every window), reaches its chunks through its Alloc QP, the audit finds nothing to
/// take back, and a free gives the chunk back to the pool.
#[test]
fn windows_on_the_alloc_qp_work_through_the_library() {
    for fb in [ForeignBind::BoundToPoster, ForeignBind::Refused] {
        let m = model(fb);
        assert!(m.with_cluster(|c| c.driver.mn.config().chain_variant.binds_to_poster).unwrap(), "{fb:?}");
        let cn = Cn::connect(&m, Options::default()).unwrap();
        let c = cn.alloc().unwrap();
        cn.write(&c, 0, b"on the Alloc QP").unwrap();
        audit_whole_table(&m, &cn);
        assert_eq!(m.with_cluster(|c| c.driver.mn.stats().taken_back_notices).unwrap(), 0, "{fb:?}");
        let mut buf = [0u8; 15];
        cn.read(&c, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"on the Alloc QP");
        let free = m.with_cluster(|c| c.free_groups()).unwrap();
        cn.free(c).unwrap();
        cn.progress().unwrap();
        m.with_cluster(|c| c.pump().map(|_| ())).unwrap().unwrap();
        assert_eq!(m.with_cluster(|c| c.free_groups()).unwrap(), free + 1, "{fb:?}: back in the pool");
        m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
    }
}

/// An RNIC reset at the MN revokes every chunk (`Revoked`): their handles answer `Freed`, the
/// library does not free them again, and the next allocation — whichever of its reply and the
/// notice arrives first — is kept and works; nothing leaks at the MN.
#[test]
fn an_rnic_reset_revokes_every_chunk_and_the_next_one_is_kept() {
    for mode in [ExecutionMode::Offloaded, ExecutionMode::HostEngine] {
        let m = Model::start(ModelConfig { chunks: CHUNKS, mode: Some(mode), ..Default::default() }).unwrap();
        let cn = Cn::connect(&m, Options::default()).unwrap();
        let old = cn.alloc().unwrap();
        cn.write(&old, 0, b"before").unwrap();
        m.with_cluster(|c| c.reset_mn_rnic()).unwrap().unwrap();
        cn.progress().unwrap();
        assert_eq!(cn.write(&old, 0, b"after"), Err(Error::Freed), "{mode:?}: revoked");
        assert_eq!(cn.free(old), Err(Error::Freed), "{mode:?}: never freed again");
        let new = cn.alloc().unwrap();
        cn.write(&new, 0, b"new generation").unwrap();
        let mut buf = [0u8; 14];
        cn.read(&new, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"new generation");
        assert_eq!(cn.held_chunks(), 1, "{mode:?}");
        cn.free(new).unwrap();
        cn.progress().unwrap();
        let ahead = m.with_cluster(|c| c.driver.groups_ahead()).unwrap();
        assert_eq!(m.free_groups().unwrap() + ahead, CHUNKS, "{mode:?}: every group back");
    }
}
