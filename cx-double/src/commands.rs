//! The PRM commands omw's `DevxBackend` sends, interpreted from the double's own offset table
//! ([`crate::prm`]): QUERY_HCA_CAP (general, atomic and RoCE capabilities), CREATE_CQ,
//! CREATE_QP (with the CORE-Direct roles), RST2INIT / INIT2RTR / RTR2RTS, 2RST and 2ERR,
//! QUERY_QP; CREATE_MKEY and QUERY_MKEY of memory windows (DESTROY_MKEY is the object's
//! destruction, `CxDouble::obj_destroy`). A window's mkey is a type-2 window of the model:
//! the binds the chains post name its index, and QUERY_MKEY reports the model's binding.
//!
//! A command is checked the way firmware must check it before anything is created: the lengths
//! (`BAD_INP_LEN` / `BAD_OUTP_LEN`), the opcode (`BAD_OP`), every value against what the device
//! can do (`BAD_PARAM`: a CQE size, timestamp format or role it lacks, sizes beyond its
//! maxima, a ring or doorbell record outside its umem, a QP number the object is not), every
//! object named (`BAD_RES`: a PD, UAR page, umem or CQ that does not exist), the QP's state
//! (`BAD_QP_STATE`). The statuses are Linux's `MLX5_CMD_STAT_*`; the syndromes are the double's
//! own (0xCD00_00nn, one per check — firmware's are not public).

use crate::double::{CqObj, CxDouble, Obj, QpObj};
use crate::prm::{self, create_cq as cc, create_qp as cq, get, header, mkc, modify_qp as mq, opcode, set, status};
use omw_loopback::{DeviceQp, HostId, QpAddr, RingAt, Transition};
use omw_verbs::devx::api::ObjHandle;

/// A refused command.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Refused {
    pub status: u8,
    pub syndrome: u32,
    pub why: &'static str,
}

const fn no(status: u8, code: u32, why: &'static str) -> Refused {
    Refused { status, syndrome: 0xCD00_0000 | code, why }
}

type R<T> = Result<T, Refused>;

fn field(input: &[u8], f: prm::Field) -> R<u64> {
    get(input, f).ok_or(no(status::BAD_INP_LEN, 0x01, "input shorter than the command"))
}

fn lengths(input: &[u8], inb: usize, out: &[u8], outb: usize) -> R<()> {
    if input.len() < inb {
        return Err(no(status::BAD_INP_LEN, 0x01, "input shorter than the command"));
    }
    if out.len() < outb {
        return Err(no(status::BAD_OUTP_LEN, 0x02, "output shorter than the answer"));
    }
    Ok(())
}

fn opcode_of(input: &[u8]) -> R<u16> {
    field(input, header::OPCODE).map(|o| o as u16)
}

/// `mlx5dv_devx_general_cmd`: QUERY_HCA_CAP.
pub(crate) fn general(d: &mut CxDouble, input: &[u8], out: &mut [u8]) -> R<()> {
    use prm::query_hca_cap as q;
    if opcode_of(input)? != opcode::QUERY_HCA_CAP {
        return Err(no(status::BAD_OP, 0x03, "not a general command the double knows"));
    }
    lengths(input, q::IN_BYTES, out, q::OUT_BYTES)?;
    let op_mod = field(input, header::OP_MOD)? as u16;
    out.fill(0);
    let c = d.caps;
    match op_mod >> 1 {
        q::GENERAL => {
            use prm::hca_cap as h;
            set(out, h::LOG_MAX_QP_SZ, c.log_max_qp_sz as u64);
            set(out, h::LOG_MAX_CQ_SZ, c.log_max_cq_sz as u64);
            set(out, h::LOG_MAX_MKEY, c.log_max_mkey as u64);
            set(out, h::PORT_TYPE, h::PORT_TYPE_ETH);
            set(out, h::LOG_MAX_MSG, c.log_max_msg as u64);
            set(out, h::UMR_FENCE, c.umr_fence as u64);
            set(out, h::ATOMIC, c.atomic as u64);
            set(out, h::CD, c.cd as u64);
            set(out, h::IMAICL, c.imaicl as u64);
            set(out, h::RC, c.rc as u64);
        }
        q::ATOMIC if c.atomic => {
            use prm::atomic_caps as a;
            set(out, a::REQ_8B_ENDIANNESS_MODE, c.atomic_8b_endianness_mode as u64);
            set(out, a::OPERATIONS, c.atomic_operations as u64);
            set(out, a::SIZE_QP, c.atomic_size_qp as u64);
        }
        q::ROCE => set(out, prm::roce_caps::QP_TS_FORMAT, c.qp_ts_format as u64),
        _ => return Err(no(status::BAD_PARAM, 0x04, "a capability type the double does not answer")),
    }
    Ok(())
}

/// `mlx5dv_devx_obj_create`: CREATE_CQ or CREATE_QP.
pub(crate) fn create(d: &mut CxDouble, input: &[u8], out: &mut [u8]) -> R<ObjHandle> {
    match opcode_of(input)? {
        opcode::CREATE_CQ => create_cq(d, input, out),
        opcode::CREATE_QP => create_qp(d, input, out),
        opcode::CREATE_MKEY => create_mkey(d, input, out),
        _ => Err(no(status::BAD_OP, 0x05, "not an object the double creates")),
    }
}

fn create_cq(d: &mut CxDouble, input: &[u8], out: &mut [u8]) -> R<ObjHandle> {
    lengths(input, cc::IN_BYTES, out, cc::OUT_BYTES)?;
    let v = |f| field(input, f);
    if v(cc::CQE_SZ)? != cc::CQE_SIZE_64B {
        return Err(no(status::BAD_PARAM, 0x10, "CQE size other than 64 bytes"));
    }
    if v(cc::CC)? != 0 || v(cc::CQE_COMP_EN)? != 0 {
        return Err(no(status::BAD_PARAM, 0x11, "collapsed or compressed CQEs (not modelled)"));
    }
    let log = v(cc::LOG_CQ_SIZE)? as u8;
    if log > d.caps.log_max_cq_sz {
        return Err(no(status::BAD_PARAM, 0x12, "log_cq_size beyond log_max_cq_sz"));
    }
    if !d.uars.contains(&(v(cc::UAR_PAGE)? as u32)) {
        return Err(no(status::BAD_RES, 0x13, "uar_page names no UAR of this context"));
    }
    if v(cc::C_EQN)? != d.caps.eqn as u64 {
        return Err(no(status::BAD_RES, 0x14, "c_eqn names no EQ"));
    }
    if v(cc::LOG_PAGE_SIZE)? != 0 {
        return Err(no(status::BAD_PARAM, 0x15, "log_page_size: umems are 4 KiB pages"));
    }
    if v(cc::CQ_UMEM_VALID)? != 1 || v(cc::DBR_UMEM_VALID)? != 1 {
        return Err(no(status::BAD_PARAM, 0x16, "ring or doorbell record not in a umem"));
    }
    let (umem, dbr_umem) = (v(cc::CQ_UMEM_ID)? as u32, v(cc::DBR_UMEM_ID)? as u32);
    if !d.umems.contains_key(&umem) || !d.umems.contains_key(&dbr_umem) {
        return Err(no(status::BAD_RES, 0x17, "umem id names no umem"));
    }
    let ring_len = 64u64 << log;
    let ring = d.in_umem(umem, v(cc::CQ_UMEM_OFFSET)?, ring_len).ok_or(no(
        status::BAD_PARAM,
        0x18,
        "CQE ring beyond its umem",
    ))?;
    let dbr_off = v(cc::DBR_ADDR)?;
    let dbr = d.in_umem(dbr_umem, dbr_off, 8).filter(|_| dbr_off.is_multiple_of(8)).ok_or(no(
        status::BAD_PARAM,
        0x19,
        "doorbell record beyond its umem or misaligned",
    ))?;
    let oi = v(cc::OI)? == 1;
    let (host, size) = (d.host, 1u64 << log);
    let mut f = d.fabric.borrow_mut();
    // it holds what the device produced until the double writes it into the ring
    let cqn = f.create_cq(host, 1 << 16).map_err(|_| no(status::LIM, 0x1a, "CQ numbers exhausted"))?;
    if !oi {
        let _ = f.set_cq_limit(host, cqn, Some(size));
    }
    drop(f);
    for u in [umem, dbr_umem] {
        if let Some(u) = d.umems.get_mut(&u) {
            u.users += 1;
        }
    }
    d.cqs.insert(cqn, CqObj { ring, log_size: log, dbr, oi, umems: [umem, dbr_umem] });
    out.fill(0);
    set(out, cc::OUT_CQN, cqn as u64);
    Ok(d.new_obj(Obj::Cq(cqn)))
}

fn create_qp(d: &mut CxDouble, input: &[u8], out: &mut [u8]) -> R<ObjHandle> {
    lengths(input, cq::IN_BYTES, out, cq::OUT_BYTES)?;
    let v = |f| field(input, f);
    if v(cq::QPC_EXT)? != 0 {
        return Err(no(status::BAD_PARAM, 0x20, "QPC extension (not modelled)"));
    }
    if v(cq::ST)? != cq::ST_RC || v(cq::PM_STATE)? != cq::PM_MIGRATED {
        return Err(no(status::BAD_PARAM, 0x21, "not an RC QP in the migrated state"));
    }
    let pd = d.pd_of_pdn(v(cq::PD)? as u32).ok_or(no(status::BAD_RES, 0x22, "pd names no protection domain"))?;
    let uar_page = v(cq::UAR_PAGE)? as u32;
    if !d.uars.contains(&uar_page) {
        return Err(no(status::BAD_RES, 0x23, "uar_page names no UAR of this context"));
    }
    let (cqn_snd, cqn_rcv) = (v(cq::CQN_SND)? as u32, v(cq::CQN_RCV)? as u32);
    if !d.cqs.contains_key(&cqn_snd) || !d.cqs.contains_key(&cqn_rcv) {
        return Err(no(status::BAD_RES, 0x24, "cqn_snd / cqn_rcv names no CQ"));
    }
    if v(cq::NO_SQ)? != 0 {
        return Err(no(status::BAD_PARAM, 0x25, "a QP without send queue (not modelled)"));
    }
    let log_sq = v(cq::LOG_SQ_SIZE)? as u8;
    let rq = match v(cq::RQ_TYPE)? {
        cq::RQ_REGULAR => Some((v(cq::LOG_RQ_SIZE)? as u8, 16u32 << v(cq::LOG_RQ_STRIDE)?)),
        cq::RQ_ZERO_LEN => None,
        _ => return Err(no(status::BAD_PARAM, 0x26, "rq_type: SRQ / RMP (not modelled)")),
    };
    if log_sq > d.caps.log_max_qp_sz || rq.is_some_and(|(l, _)| l > d.caps.log_max_qp_sz) {
        return Err(no(status::BAD_PARAM, 0x27, "queue size beyond log_max_qp_sz"));
    }
    // the free-running format only where the device has it, real time likewise (mlx5_ib
    // `get_qp_ts_format`: "Free running TS format is not supported")
    let ts_ok = match v(cq::TS_FORMAT)? {
        cq::TS_DEFAULT => true,
        cq::TS_FREE_RUNNING => d.caps.qp_ts_format != prm::roce_caps::TS_RT,
        cq::TS_REAL_TIME => d.caps.qp_ts_format != prm::roce_caps::TS_FR,
        _ => false,
    };
    if !ts_ok {
        return Err(no(status::BAD_PARAM, 0x28, "ts_format the device does not support"));
    }
    let (master, ss, sr) = (v(cq::CD_MASTER)? == 1, v(cq::CD_SLAVE_SEND)? == 1, v(cq::CD_SLAVE_RECEIVE)? == 1);
    if (master || ss || sr) && !d.caps.cd {
        return Err(no(status::BAD_PARAM, 0x29, "CORE-Direct role on a device without cd"));
    }
    if v(cq::LOG_PAGE_SIZE)? != 0 {
        return Err(no(status::BAD_PARAM, 0x2a, "log_page_size: umems are 4 KiB pages"));
    }
    if v(cq::WQ_UMEM_VALID)? != 1 || v(cq::DBR_UMEM_VALID)? != 1 {
        return Err(no(status::BAD_PARAM, 0x2b, "rings or doorbell record not in a umem"));
    }
    let (umem, dbr_umem) = (v(cq::WQ_UMEM_ID)? as u32, v(cq::DBR_UMEM_ID)? as u32);
    if !d.umems.contains_key(&umem) || !d.umems.contains_key(&dbr_umem) {
        return Err(no(status::BAD_RES, 0x2c, "umem id names no umem"));
    }
    // the receive queue first, the send queue after it (rdma-core providers/mlx5/verbs.c)
    let rq_bytes = rq.map_or(0, |(l, stride)| (stride as u64) << l);
    let sq_bytes = 64u64 << log_sq;
    let rings = d.in_umem(umem, v(cq::WQ_UMEM_OFFSET)?, rq_bytes + sq_bytes).ok_or(no(
        status::BAD_PARAM,
        0x2d,
        "rings beyond their umem",
    ))?;
    let dbr_off = v(cq::DBR_ADDR)?;
    let dbr = d.in_umem(dbr_umem, dbr_off, 8).filter(|_| dbr_off.is_multiple_of(8)).ok_or(no(
        status::BAD_PARAM,
        0x2e,
        "doorbell record beyond its umem or misaligned",
    ))?;
    let spec = DeviceQp {
        pd,
        sq: RingAt { base: rings + rq_bytes, entries: 1 << log_sq, stride: 64 },
        rq: rq.map(|(l, stride)| RingAt { base: rings, entries: 1 << l, stride }),
        cqn_snd,
        cqn_rcv,
        managed_send: ss,
        managed_recv: sr,
        cd_master: master,
        // `dbrec[MLX5_RCV_DBR]` (rdma-core providers/mlx5/mlx5.h: index 0 of the record): the
        // HCA reads it when it needs a receive WQE, whoever wrote it — the driver, or a
        // chain's loopback DMA
        recv_doorbell: rq.map(|_| dbr),
    };
    let host = d.host;
    let qpn = d.fabric.borrow_mut().create_qp_with(host, &spec).map_err(|_| no(status::LIM, 0x2f, "QPs exhausted"))?;
    for u in [umem, dbr_umem] {
        if let Some(u) = d.umems.get_mut(&u) {
            u.users += 1;
        }
    }
    d.qps.insert(qpn.get(), QpObj { uar_page, dbr, umems: [umem, dbr_umem] });
    out.fill(0);
    set(out, cq::OUT_QPN, qpn.get() as u64);
    Ok(d.new_obj(Obj::Qp(qpn.get())))
}

/// CREATE_MKEY: the double makes memory windows only — free, UMR-enabled, KLM-mode, bound to
/// no QP, remotely invalidatable (a type-2 window as Linux `mlx5_ib_alloc_mw` makes one) —
/// in a PD of this context. Anything else is refused before anything is made.
fn create_mkey(d: &mut CxDouble, input: &[u8], out: &mut [u8]) -> R<ObjHandle> {
    use prm::create_mkey as k;
    lengths(input, k::IN_BYTES, out, k::OUT_BYTES)?;
    let v = |f| field(input, f);
    if v(mkc::FREE)? != 1 {
        return Err(no(status::BAD_PARAM, 0x50, "an mkey created in use: the double makes free windows only"));
    }
    if (v(mkc::ACCESS_MODE_4_2)? << 2 | v(mkc::ACCESS_MODE_1_0)?) != mkc::ACCESS_MODE_KLMS {
        return Err(no(status::BAD_PARAM, 0x51, "access mode other than KLMs: not a window a bind can write"));
    }
    if v(mkc::UMR_EN)? != 1 {
        return Err(no(status::BAD_PARAM, 0x52, "umr_en clear: no UMR could ever bind it"));
    }
    if v(mkc::EN_RINVAL)? != 1 {
        return Err(no(status::BAD_PARAM, 0x53, "en_rinval clear: not a type-2 window"));
    }
    if v(mkc::QPN)? != mkc::QPN_NONE {
        return Err(no(status::BAD_PARAM, 0x54, "a free window bound to a QP"));
    }
    let octwords = v(mkc::TRANSLATIONS_OCTWORD_SIZE)? as u32;
    if octwords == 0 {
        return Err(no(status::BAD_PARAM, 0x55, "no room for the KLM a bind writes"));
    }
    let pd = d.pd_of_pdn(v(mkc::PD)? as u32).ok_or(no(status::BAD_RES, 0x56, "pd names no protection domain"))?;
    let key = v(mkc::MKEY_7_0)? as u8;
    let host = d.host;
    let rkey =
        d.fabric.borrow_mut().alloc_mw_keyed(host, pd, key).map_err(|_| no(status::LIM, 0x57, "mkeys exhausted"))?;
    if rkey.index() >= 1u32 << d.caps.log_max_mkey.min(24) {
        let _ = d.fabric.borrow_mut().dealloc_mw(host, rkey);
        return Err(no(status::LIM, 0x57, "mkeys exhausted"));
    }
    out.fill(0);
    set(out, k::OUT_MKEY_INDEX, rkey.index() as u64);
    Ok(d.new_obj(Obj::Mkey { index: rkey.index(), octwords }))
}

/// QUERY_MKEY: the window's context as the model holds it — free, or in use bound to its QP
/// under its current key over its span with its rights.
fn query_mkey(d: &mut CxDouble, obj: ObjHandle, input: &[u8], out: &mut [u8]) -> R<()> {
    use omw_loopback::MwState;
    use prm::query_mkey as q;
    lengths(input, q::IN_BYTES, out, q::OUT_BYTES)?;
    let Some(Some(Obj::Mkey { index, octwords })) = d.objs.get(obj.0).copied() else {
        return Err(no(status::BAD_RES, 0x58, "the object is not an mkey"));
    };
    if field(input, q::MKEY_INDEX)? != index as u64 {
        return Err(no(status::BAD_PARAM, 0x59, "mkey_index is not the object's"));
    }
    let info =
        d.fabric.borrow().mw_binding(d.host, index).ok_or(no(status::BAD_RES, 0x58, "the object is not an mkey"))?;
    out.fill(0);
    set(out, mkc::UMR_EN, 1);
    set(out, mkc::LR, 1);
    set(out, mkc::ACCESS_MODE_1_0, mkc::ACCESS_MODE_KLMS);
    set(out, mkc::EN_RINVAL, 1);
    set(out, mkc::MKEY_7_0, (info.rkey.0 & 0xFF) as u64);
    set(out, mkc::PD, (info.pd.0 + crate::double::PDN_BASE) as u64);
    set(out, mkc::TRANSLATIONS_OCTWORD_SIZE, octwords as u64);
    match info.state {
        MwState::Free => {
            set(out, mkc::FREE, 1);
            set(out, mkc::QPN, mkc::QPN_NONE);
        }
        MwState::Bound(b) => {
            use omw_core::access::AccessFlags as A;
            set(out, mkc::QPN, b.qpn.get() as u64);
            set(out, mkc::START_ADDR, b.addr);
            set(out, mkc::LEN, b.len);
            set(out, mkc::A, b.access.contains(A::REMOTE_ATOMIC) as u64);
            set(out, mkc::RW, b.access.contains(A::REMOTE_WRITE) as u64);
            set(out, mkc::RR, b.access.contains(A::REMOTE_READ) as u64);
            set(out, mkc::LW, b.access.contains(A::LOCAL_WRITE) as u64);
        }
    }
    Ok(())
}

/// `mlx5dv_devx_obj_query`: QUERY_QP, the state the QP is in; QUERY_MKEY, a window's context.
pub(crate) fn query(d: &mut CxDouble, obj: ObjHandle, input: &[u8], out: &mut [u8]) -> R<()> {
    use prm::query_qp as q;
    match opcode_of(input)? {
        opcode::QUERY_QP => {}
        opcode::QUERY_MKEY => return query_mkey(d, obj, input, out),
        _ => return Err(no(status::BAD_OP, 0x40, "not a query the double knows")),
    }
    lengths(input, q::IN_BYTES, out, q::OUT_BYTES)?;
    let Some(Some(Obj::Qp(qpn))) = d.objs.get(obj.0).copied() else {
        return Err(no(status::BAD_RES, 0x31, "the object is not a QP"));
    };
    if field(input, q::QPN)? != qpn as u64 {
        return Err(no(status::BAD_PARAM, 0x32, "qpn is not the object's"));
    }
    let qa = d.qp_addr(qpn).ok_or(no(status::BAD_RES, 0x31, "the object is not a QP"))?;
    let state = d.fabric.borrow().qp_state(qa).map_err(|_| no(status::BAD_RES, 0x31, "the object is not a QP"))?;
    out.fill(0);
    use omw_core::device::QpState as S;
    let v = match state {
        S::Reset => q::RST,
        S::Init => q::INIT,
        S::Rtr => q::RTR,
        S::Rts => q::RTS,
        S::Sqe => q::SQER,
        S::Sqd => q::SQD,
        S::Err => q::ERR,
    };
    set(out, q::STATE, v);
    Ok(())
}

/// `mlx5dv_devx_obj_modify`: the QP state transitions.
pub(crate) fn modify(d: &mut CxDouble, obj: ObjHandle, input: &[u8], out: &mut [u8]) -> R<()> {
    let op = opcode_of(input)?;
    let inb = match op {
        opcode::RST2INIT_QP | opcode::INIT2RTR_QP | opcode::RTR2RTS_QP => mq::IN_BYTES,
        opcode::QP_2RST | opcode::QP_2ERR => mq::TO_RST_IN_BYTES,
        _ => return Err(no(status::BAD_OP, 0x30, "not a modify the double knows")),
    };
    lengths(input, inb, out, mq::OUT_BYTES)?;
    let Some(Some(Obj::Qp(qpn))) = d.objs.get(obj.0).copied() else {
        return Err(no(status::BAD_RES, 0x31, "the object is not a QP"));
    };
    if field(input, mq::QPN)? != qpn as u64 {
        return Err(no(status::BAD_PARAM, 0x32, "qpn is not the object's"));
    }
    let v = |f| field(input, f);
    let to = match op {
        opcode::RST2INIT_QP => Transition::Init,
        opcode::INIT2RTR_QP => {
            if v(mq::VHCA_PORT_NUM)? != 1 {
                return Err(no(status::BAD_PARAM, 0x33, "vhca_port_num names no port"));
            }
            if v(mq::GRH)? != 1 {
                return Err(no(status::BAD_PARAM, 0x34, "RoCE needs the GRH"));
            }
            let gid = prm::bytes::<16>(input, mq::RGID).ok_or(no(status::BAD_INP_LEN, 0x01, "input too short"))?;
            let mac_hi = (v(mq::RMAC_47_32)? as u16).to_be_bytes();
            let mac_lo = (v(mq::RMAC_31_0)? as u32).to_be_bytes();
            let mac = [mac_hi[0], mac_hi[1], mac_lo[0], mac_lo[1], mac_lo[2], mac_lo[3]];
            let remote = v(mq::REMOTE_QPN)? as u32;
            // a path to no port of the fabric (a wrong GID or next-hop MAC) leads nowhere: the
            // QP's requests go unanswered (retries exhausted), as on a wire
            let host = d.route(&gid, mac).unwrap_or(HostId(omw_loopback::MAX_HOSTS));
            let peer = omw_core::ids::Qpn::new(remote)
                .map(|q| QpAddr::new(host, q))
                .map_err(|_| no(status::BAD_PARAM, 0x35, "remote_qpn wider than 24 bits"))?;
            Transition::Rtr { peer }
        }
        opcode::RTR2RTS_QP => Transition::Rts,
        opcode::QP_2RST => Transition::Reset,
        _ => Transition::Err,
    };
    let qa = d.qp_addr(qpn).ok_or(no(status::BAD_RES, 0x31, "the object is not a QP"))?;
    let r = d.fabric.borrow_mut().modify_qp(qa, to);
    r.map_err(|_| no(status::BAD_QP_STATE, 0x36, "the QP is not in the state this transition starts from"))?;
    out.fill(0);
    Ok(())
}
