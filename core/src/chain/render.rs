//! The chains rendered as Markdown: docs/CHAINS.md is generated from [`ChainLayout::write_table`]
//! and [`ChainLayout::write_summary`] (a test fails when the file is stale).

use super::*;
impl ChainLayout {
    /// Render the chain as a Markdown table (docs/CHAINS.md is generated from this).
    pub fn write_table(&self, out: &mut impl fmt::Write) -> fmt::Result {
        writeln!(out, "| # | ring | pos | op | flags | what | patched by |")?;
        writeln!(out, "|---|---|---|---|---|---|---|")?;
        for (i, s) in self.steps.iter().enumerate() {
            let w = &s.wqe;
            if w.opcode == Opcode::Nop {
                continue;
            }
            let ring = match s.ring {
                Ring::Loop => "Loop",
                Ring::Mgmt => "Mgmt",
            };
            write!(out, "| {i} | {ring} | {} | {} | ", self.position(i), w.opcode.name())?;
            let mut first = true;
            for (flag, name) in [
                (crate::wire::wqe::WqeFlags::SIGNALED, "sig"),
                (crate::wire::wqe::WqeFlags::FENCE, "fence"),
                (crate::wire::wqe::WqeFlags::UNBIND, "unbind"),
            ] {
                if w.flags.contains(flag) {
                    write!(out, "{}{name}", if first { "" } else { "," })?;
                    first = false;
                }
            }
            write!(out, " | ")?;
            self.describe(i, out)?;
            write!(out, " | ")?;
            let mut any = false;
            for (p, ps) in self.steps.iter().enumerate() {
                for loc in [ps.local, ps.remote].into_iter().flatten() {
                    if let Loc::Field { step, field } = loc {
                        if step as usize == i {
                            let kind = match (ps.remote == Some(loc), ps.wqe.opcode) {
                                (true, Opcode::Read) => "→",
                                (true, Opcode::FetchAdd) => "bump ",
                                (true, _) => "cleared ",
                                _ => "",
                            };
                            let sep = if any { ", " } else { "" };
                            if kind == "→" {
                                write!(out, "{sep}{field:?}→#{p}")?;
                            } else {
                                write!(out, "{sep}{kind}{field:?}←#{p}")?;
                            }
                            any = true;
                        }
                    }
                }
            }
            for r in self.recv.iter() {
                if let Loc::Field { step, field } = r.loc {
                    if step as usize == i {
                        write!(out, "{}{field:?}←RECV", if any { ", " } else { "" })?;
                        any = true;
                    }
                }
            }
            writeln!(out, " |")?;
        }
        let nops = self.steps.iter().filter(|s| s.wqe.opcode == Opcode::Nop).count();
        writeln!(out)?;
        writeln!(
            out,
            "Ring depths: Loop {}, Mgmt {} ({nops} NOP padding entries not shown). First lap enables Loop 0..{}, Mgmt 0..{}.",
            self.ring_depth[0], self.ring_depth[1], self.initial_enable[0], self.initial_enable[1]
        )?;
        write!(out, "RECV scatter: ")?;
        for (k, r) in self.recv.iter().enumerate() {
            let sep = if k == 0 { "" } else { ", " };
            match r.loc {
                Loc::Mem(a) => write!(out, "{sep}{} B → MN {a:#x}", r.len)?,
                Loc::Field { step, field } => write!(out, "{sep}{} B → #{step}.{field:?}", r.len)?,
                Loc::RecvDoorbell => write!(out, "{sep}{} B → the receive doorbell", r.len)?,
            }
        }
        writeln!(out)
    }

    /// The chain's cost in one paragraph (docs/CHAINS.md): gated phases before its
    /// [`Self::critical_end`], WQEs per lap, re-arm bumps.
    pub fn write_summary(&self, out: &mut impl fmt::Write) -> fmt::Result {
        let nops = self.steps.iter().filter(|s| s.wqe.opcode == Opcode::Nop).count();
        let what = match self.kind {
            ChainKind::Alloc => "the reply",
            ChainKind::Free => "the push",
        };
        match (self.critical_end, self.critical_path()) {
            (Some(end), Some(g)) => writeln!(
                out,
                "**Critical path:** {} gated phases from the request to {what} (#{end}): {} WAIT, {} ENABLE releases.",
                g.gates,
                g.waits,
                g.gates - g.waits
            )?,
            _ => writeln!(out, "**Critical path:** not computed (no end step, or the layout does not validate).")?,
        }
        writeln!(
            out,
            "**Per lap:** {} WQEs (Loop {}, Mgmt {}; {} of them NOP padding), of which {} lap re-arm fetch-and-add{}.",
            self.wqes_per_lap(),
            self.ring_depth[0],
            self.ring_depth[1],
            nops,
            self.rearm_bumps(),
            if self.rearm_bumps() == 1 { "" } else { "s" }
        )
    }

    fn describe(&self, i: usize, out: &mut impl fmt::Write) -> fmt::Result {
        let s = &self.steps[i];
        let w = &s.wqe;
        let loc = |l: Option<Loc>, addr: u64| match l {
            Some(Loc::Field { step, field }) => FieldOrAddr::Field(step, field),
            Some(Loc::RecvDoorbell) => FieldOrAddr::RecvDoorbell,
            _ => FieldOrAddr::Addr(addr),
        };
        match w.opcode {
            Opcode::Wait => {
                let q = if w.queue_sel() == QueueSel::Recv { "recv" } else { "send" };
                let r = if w.qpn == self.qpns[0] { "Loop" } else { "Mgmt" };
                write!(out, "until {r} {q} CQ ≥ {} (lap 0)", w.operand0)
            }
            Opcode::Enable => {
                let q = if w.queue_sel() == QueueSel::Recv { "recv" } else { "send" };
                let r = if w.qpn == self.qpns[0] { "Loop" } else { "Mgmt" };
                write!(out, "{r} {q} queue += {}", w.operand0)
            }
            Opcode::Read => {
                write!(out, "{} B {} → {}", w.length, loc(s.remote, w.remote_addr), loc(s.local, w.local_addr))
            }
            Opcode::Write | Opcode::WriteWithImm => {
                write!(out, "{} B {} → {}", w.length, loc(s.local, w.local_addr), loc(s.remote, w.remote_addr))
            }
            Opcode::FetchAdd | Opcode::MaskedFetchAdd => write!(
                out,
                "{} += {:#x} (mask {:#x}), old → {}",
                loc(s.remote, w.remote_addr),
                w.operand0,
                w.operand1,
                loc(s.local, w.local_addr)
            ),
            Opcode::BindMw if w.flags.contains(crate::wire::wqe::WqeFlags::UNBIND) => {
                f_write(out, "invalidate window (no QP check)")
            }
            Opcode::BindMw => write!(out, "bind window to QP {:#x}, access {:?}", w.qpn, w.access()),
            Opcode::LocalInv => f_write(out, "invalidate window (bound-QP check)"),
            _ => Ok(()),
        }
    }
}

fn f_write(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    out.write_str(s)
}

enum FieldOrAddr {
    Field(u8, WqeField),
    Addr(u64),
    RecvDoorbell,
}

impl fmt::Display for FieldOrAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldOrAddr::Field(s, fl) => write!(f, "#{s}.{fl:?}"),
            FieldOrAddr::Addr(a) => write!(f, "[{a:#x}]"),
            FieldOrAddr::RecvDoorbell => f.write_str("[Mgmt receive doorbell record]"),
        }
    }
}

#[cfg(test)]
mod doc_tests {
    use crate::chain::alloc::build_alloc_chain;
    use crate::chain::builder::test_env;
    use crate::chain::free::build_free_chain;
    use std::string::String;

    const HEAD: &str = r#"
How the chains keep short (the mechanisms are checked by `ChainLayout::validate`):

- **Gates.** A *gated phase* begins where a send queue stops fetching until something else
  happened: a WAIT (until a CQ count), or the end of a managed queue's enabled range (until an
  ENABLE raises it). On the NIC each costs a WQE fetch after the gate opens. A patched WQE
  field must be complete before its WQE can be fetched, so each value the chain learns and then
  uses as a WQE field — the slot address, the entry address, the entry — costs one gate.
- **FENCE instead of WAIT.** A FENCEd WQE executes only after every earlier READ and atomic of
  its QP completed (IBTA's fence indicator; rdma-core maps `IBV_SEND_FENCE` to mlx5's fence
  mode). A copy that *reads* a value an earlier READ or atomic produced therefore sits in the
  same phase as its producer, FENCEd; and a FENCEd ENABLE of the chain's own Loop ring is a gate
  that needs no WAIT. WAIT counts are absolute (mlx5 WAIT compares a CQ producer index), so each
  WAIT needs a fetch-and-add per lap; ENABLE counts are relative and need none. Only the WAIT
  for the RECV (and, in the alloc chain, the management ring's WAIT for the reply, off the
  critical path) remain.
- **Order on the management QP.** The binds and the reply (alloc), the invalidations and the
  release of the second half (free) share one send queue: mlx5 fences the WQE after a bind or
  invalidation until it completed, and a failure errors the QP and flushes the rest — no WAIT.
- **Scatter, not copy.** The RECV puts request bytes straight into the WQEs that use them (the
  reply target, the access QP numbers, the free's entry address); loop READs copy a field out of
  a WQE (`#n.Field → [addr]`) where scratch needs it too.
- **Checks first.** Nothing after the empty probe (alloc) or the ownership check (free) can
  execute before that check completed; the reply (push) only after every bind (invalidation).
- **No replay.** Addresses and keys the RECV puts into WQEs are cleared every lap, and nothing
  the next request overwrites is still in use when its RECV is enabled.
- **What only hardware can settle.** That an mlx5 SEND_EN WQE with the fence bit waits like
  any fenced WQE (the lap-closing ENABLE relied on it before); that the small fence after a UMR
  holds the next WQE until the UMR completed.
- **The same chains in mlx5 form** (`omw_core::chain::mlx5`, docs/MLX5.md): every step keeps
  its place, FENCE and completion; a copy between little-endian MN memory and a big-endian
  WQE field becomes a byte-reversing scatter READ, the RECV reverses the request's fields, and
  every WAIT and ENABLE (absolute on mlx5) advances per lap through a little-endian shadow
  counter. docs/MLX5.md gives the WQEs and WQEBBs per lap of that form.

"#;

    /// docs/CHAINS.md is generated from the builders; this fails when it is stale.
    /// Regenerate with `OMW_BLESS=1 cargo test -p omw-core chains_doc`.
    #[test]
    fn chains_doc_is_current() {
        let mut env = test_env(4096, 16, 3);
        // the free chain scrubs on the NIC (from a private chunk of zeros)
        env.keys.zero_lkey = 0x18;
        env.keys.pool_scrub_rkey = 0x19;
        env.keys.zero_addr = 1 << 40;
        // as deployed on a device that keeps its receive doorbell records where a chain can
        // write them (the model, DEVX): each lap publishes the next receive itself
        env.posts_receives = true;
        let mut doc = String::new();
        doc.push_str("# The alloc and free chains, step by step\n\n");
        doc.push_str("Generated from `omw_core::chain::alloc` / `free_chain` for G = 3, 4 KiB chunks, 16 chunks,\n");
        doc.push_str(
            "NIC scrubbing (`OMW_BLESS=1 cargo test -p omw-core chains_doc` regenerates it; a test fails when it is stale).\n",
        );
        doc.push_str("`#n.Field` is a field of step n's WQE, `[addr]` an MN address (scratch, queue, table),\n");
        doc.push_str("`Loop` the MN loopback QP's send queue, `Mgmt` the MN end of the CN's Alloc/Free QP.\n");
        doc.push_str("WAITs are bumped by a FETCH_ADD at the end of each lap (`bump Operand0←#n`), request-supplied\n");
        doc.push_str("fields are `cleared` for the next lap, `Field→#n` marks a loop READ copying that field out.\n");
        doc.push_str("Each lap publishes the next receive itself (`ChainEnv::posts_receives`): a FETCH_ADD of the\n");
        doc.push_str("management QP's receive doorbell record right behind the receive ENABLE, so a second request\n");
        doc.push_str("on the chain waits (RNR) until this lap is done with the receive's targets.\n");
        doc.push_str(HEAD);
        doc.push_str("## Alloc chain\n\n");
        let a = build_alloc_chain(&env).unwrap();
        a.write_summary(&mut doc).unwrap();
        doc.push('\n');
        a.write_table(&mut doc).unwrap();
        doc.push_str("\n## Free chain\n\n");
        let f = build_free_chain(&env).unwrap();
        f.write_summary(&mut doc).unwrap();
        doc.push('\n');
        f.write_table(&mut doc).unwrap();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CHAINS.md");
        if std::env::var("OMW_BLESS").is_ok() {
            std::fs::write(path, &doc).unwrap();
        }
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == doc, "docs/CHAINS.md is stale: run OMW_BLESS=1 cargo test -p omw-core chains_doc");
    }
}
