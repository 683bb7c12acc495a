/*
 * mw-semantics.c — self-test of the soft-RoCE VM harness (scripts/rxe-vm-selftest): type-2 memory window
 * semantics on a verbs device, as observed on Linux rdma_rxe (see docs/RXE-VM.md and DESIGN.md §3, §6.2).
 *
 * All QPs live on one device/port and are connected back-to-back (RoCEv2, GID index gidx). "A" QPs own the
 * memory (MWs are bound on them), "B" QPs issue RDMA READ/WRITE. Checked (EXPECT, counted as failures):
 *   [0]  ibv_alloc_mw(IBV_MW_TYPE_2); the type-1 verb ibv_bind_mw() on it is refused
 *   [1]  IBV_WR_BIND_MW with rkey ibv_inc_rkey(mw->rkey); READ/WRITE through the window; the owner MR itself
 *        (no REMOTE rights) is not reachable with its own rkey
 *   [a]  cross-QP denial: the window's rkey used via another QP of the same PD -> REM_ACCESS_ERR, no data lands
 *   [b]  IBV_WR_LOCAL_INV on the bound QP; access afterwards -> REM_ACCESS_ERR
 *   [c]  rebind with ibv_inc_rkey on a fresh QP; new key works; the stale key -> REM_ACCESS_ERR
 *   [x1] bind while still bound -> MW_BIND_ERR
 *   [x2] LOCAL_INV from a non-bound QP of the same PD (rxe allows it; reported)
 *   [x3] read-only window: WRITE denied; READ past the window but inside the MR: an rxe deviation from the
 *        IBTA (reported as DEV, not a failure); outside the MR -> REM_ACCESS_ERR
 * Cleanup invalidates and deallocates the MW before destroying QPs (a process exiting with a bound type-2 MW
 * stalls ~51 s in rxe_destroy_qp).
 *
 *   gcc -O2 -Wall -o mw-semantics mw-semantics.c -libverbs
 *   ./mw-semantics [-d rxe0] [-g 1] [-p] [-n iters] [-k]
 *     -p  also measure (software) READ latency and bind/invalidate rates, -n iterations (default 200)
 *     -k  leave the bound MW to process exit (demonstrates the stall)
 * Exit status: 0 iff every expectation matched; 1 if one did not; 2 if the device could not be used.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <errno.h>
#include <unistd.h>

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static int gidx = 1, port = 1;
static union ibv_gid gid;
static int failures, deviations;
static double T0;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

struct qpx {
	struct ibv_qp *qp;
	struct ibv_cq *cq;
	const char *name;
};
static struct qpx allqp[64];
static int nallqp;

static const char *qp_state_str(struct qpx *q)
{
	static const char *n[] = { "RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR", "UNKNOWN" };
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	if (ibv_query_qp(q->qp, &a, IBV_QP_STATE, &ia))
		return "query-failed";
	return a.qp_state <= 7 ? n[a.qp_state] : "?";
}

static struct qpx mkqp(const char *name)
{
	struct qpx q = { .name = name };
	q.cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	if (!q.cq) { perror("ibv_create_cq"); exit(2); }
	struct ibv_qp_init_attr ia = {
		.send_cq = q.cq, .recv_cq = q.cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
		.cap = { .max_send_wr = 128, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	q.qp = ibv_create_qp(pd, &ia);
	if (!q.qp) { perror("ibv_create_qp"); exit(2); }
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = port,
		.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
				   IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC };
	if (ibv_modify_qp(q.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
		perror("modify INIT"); exit(2);
	}
	if (nallqp < 64) allqp[nallqp++] = q;
	return q;
}

static void to_rts(struct qpx *q, uint32_t dqpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = dqpn,
		.rq_psn = 0, .max_dest_rd_atomic = 16, .min_rnr_timer = 12 };
	a.ah_attr.is_global = 1;
	a.ah_attr.port_num = port;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = gidx;
	a.ah_attr.grh.hop_limit = 1;
	if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
		perror("modify RTR"); exit(2);
	}
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS; a.timeout = 12; a.retry_cnt = 3; a.rnr_retry = 3; a.sq_psn = 0; a.max_rd_atomic = 16;
	if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
		perror("modify RTS"); exit(2);
	}
}

struct pair { struct qpx a, b; };
static struct pair mkpair(const char *an, const char *bn)
{
	struct pair p = { mkqp(an), mkqp(bn) };
	to_rts(&p.a, p.b.qp->qp_num);
	to_rts(&p.b, p.a.qp->qp_num);
	return p;
}

/* post one signaled WR and wait for its completion; returns status or -1 on timeout / -2 post error */
static int post_wait(struct qpx *q, struct ibv_send_wr *wr, double tmo)
{
	struct ibv_send_wr *bad;
	struct ibv_wc wc;
	wr->send_flags |= IBV_SEND_SIGNALED;
	int rc = ibv_post_send(q->qp, wr, &bad);
	if (rc) { fprintf(stderr, "  ibv_post_send(%s) failed: %s\n", q->name, strerror(rc)); return -2; }
	double t0 = now();
	for (;;) {
		int n = ibv_poll_cq(q->cq, 1, &wc);
		if (n < 0) return -3;
		if (n == 1) return wc.status;
		if (now() - t0 > tmo) return -1;
	}
}

static const char *st(int s)
{
	if (s == -1) return "TIMEOUT(no completion)";
	if (s == -2) return "POST_SEND_FAILED";
	if (s == -3) return "POLL_FAILED";
	return ibv_wc_status_str(s);
}

static void expect(const char *what, int got, int want)
{
	int ok = got == want;
	printf("  %-4s %-70s -> %s (%d)%s%s\n", ok ? "OK" : "FAIL", what, st(got), got,
	       ok ? "" : "   expected ", ok ? "" : st(want));
	if (!ok) failures++;
}

/* IBTA-mandated behaviour that rxe does not implement: reported, not counted as failure */
static void deviation(const char *what, int got, int ibta)
{
	int ok = got == ibta;
	printf("  %-4s %-70s -> %s (%d)%s%s\n", ok ? "OK" : "DEV", what, st(got), got,
	       ok ? "" : "   IBTA semantics would give ", ok ? "" : st(ibta));
	if (!ok) deviations++;
}

static char *ownbuf, *reqbuf;
static struct ibv_mr *mr_own, *mr_req, *mr_plain;
#define BUFSZ 65536

static int rdma(struct qpx *q, enum ibv_wr_opcode op, uint64_t raddr, uint32_t rkey, size_t off, size_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)reqbuf + off, .length = len, .lkey = mr_req->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .opcode = op, .sg_list = &sge, .num_sge = 1 };
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return post_wait(q, &wr, 5.0);
}

static int bind_mw(struct qpx *q, struct ibv_mw *mw, uint32_t newkey, uint64_t addr, size_t len, int acc)
{
	struct ibv_send_wr wr = { .wr_id = 2, .opcode = IBV_WR_BIND_MW };
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = newkey;
	wr.bind_mw.bind_info.mr = mr_own;
	wr.bind_mw.bind_info.addr = addr;
	wr.bind_mw.bind_info.length = len;
	wr.bind_mw.bind_info.mw_access_flags = acc;
	return post_wait(q, &wr, 5.0);
}

static int local_inv(struct qpx *q, uint32_t rkey)
{
	struct ibv_send_wr wr = { .wr_id = 3, .opcode = IBV_WR_LOCAL_INV };
	wr.invalidate_rkey = rkey;
	return post_wait(q, &wr, 5.0);
}

#define RW (IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)

int main(int argc, char **argv)
{
	const char *devname = "rxe0";
	int iters = 200, opt, keep = 0, perf = 0;
	T0 = now();
	while ((opt = getopt(argc, argv, "d:g:n:kp")) != -1) {
		switch (opt) {
		case 'k': keep = 1; break;
		case 'p': perf = 1; break;
		case 'd': devname = optarg; break;
		case 'g': gidx = atoi(optarg); break;
		case 'n': iters = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-d dev] [-g gid_index] [-p] [-n iters] [-k]\n", argv[0]);
			return 2;
		}
	}
	setvbuf(stdout, NULL, _IOLBF, 0);

	int ndev;
	struct ibv_device **dl = ibv_get_device_list(&ndev);
	if (!dl) { perror("ibv_get_device_list (no RDMA support in this kernel? run inside scripts/rxe-vm)"); return 2; }
	for (int i = 0; i < ndev; i++)
		if (!strcmp(ibv_get_device_name(dl[i]), devname))
			ctx = ibv_open_device(dl[i]);
	if (!ctx) { fprintf(stderr, "device %s not found/openable\n", devname); return 2; }

	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da)) { perror("ibv_query_device"); return 2; }
	printf("device %s: max_mw=%d MEM_WINDOW=%d TYPE_2A=%d TYPE_2B=%d max_qp_rd_atom=%d\n", devname, da.max_mw,
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW), !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A),
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B), da.max_qp_rd_atom);
	if (ibv_query_gid(ctx, port, gidx, &gid)) { perror("ibv_query_gid"); return 2; }
	char gs[64];
	snprintf(gs, sizeof gs, "%x:%x:%x:%x (last 4 bytes %u.%u.%u.%u)", gid.raw[0], gid.raw[1], gid.raw[10], gid.raw[11],
		 gid.raw[12], gid.raw[13], gid.raw[14], gid.raw[15]);
	printf("using gid index %d: %s\n", gidx, gs);

	pd = ibv_alloc_pd(ctx);
	if (!pd) { perror("ibv_alloc_pd"); return 2; }
	ownbuf = aligned_alloc(4096, BUFSZ);
	reqbuf = aligned_alloc(4096, BUFSZ);
	memset(ownbuf, 'o', BUFSZ);
	memset(reqbuf, 0, BUFSZ);
	/* the owner MR has NO remote rights itself: remote access is only possible through the MW */
	mr_own = ibv_reg_mr(pd, ownbuf, BUFSZ, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	mr_req = ibv_reg_mr(pd, reqbuf, BUFSZ, IBV_ACCESS_LOCAL_WRITE);
	if (!mr_own || !mr_req) { perror("ibv_reg_mr"); return 2; }
	printf("mr_own lkey=0x%x rkey=0x%x  mr_req lkey=0x%x\n", mr_own->lkey, mr_own->rkey, mr_req->lkey);

	printf("\n[0] allocate type-2 MW\n");
	struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	if (!mw) { printf("  FAIL ibv_alloc_mw(IBV_MW_TYPE_2): %s\n", strerror(errno)); return 1; }
	printf("  OK   ibv_alloc_mw(pd, IBV_MW_TYPE_2) -> rkey=0x%08x type=%d\n", mw->rkey, mw->type);
	{
		struct pair px = mkpair("Ax", "Bx");
		struct ibv_mw_bind b = { .wr_id = 9, .send_flags = IBV_SEND_SIGNALED,
			.bind_info = { .mr = mr_own, .addr = (uintptr_t)ownbuf, .length = 4096, .mw_access_flags = RW } };
		int rc = ibv_bind_mw(px.a.qp, mw, &b);
		printf("  %-4s ibv_bind_mw() (type-1 verb) on a type-2 MW returns %d (%s)\n", rc == EINVAL ? "OK" : "NOTE", rc, strerror(rc));
	}

	/* ---------------- positive path ---------------- */
	printf("\n[1] bind MW (IBV_WR_BIND_MW) on QP A1, access from the connected peer B1\n");
	struct pair p1 = mkpair("A1", "B1");
	uint32_t k0 = mw->rkey, k1 = ibv_inc_rkey(k0);
	uint64_t base = (uintptr_t)ownbuf;
	expect("BIND_MW on A1 (rkey k1=ibv_inc_rkey(mw->rkey), 4096B, REMOTE_READ|WRITE)", bind_mw(&p1.a, mw, k1, base, 4096, RW), IBV_WC_SUCCESS);
	printf("  k0=0x%08x k1=0x%08x; mw->rkey after bind completion = 0x%08x (%s)\n", k0, k1, mw->rkey,
	       mw->rkey == k1 ? "provider updated it" : "NOT updated by post_send path; app must track it");
	strcpy(reqbuf, "hello through a type-2 MW");
	expect("B1 RDMA_WRITE 64B via k1", rdma(&p1.b, IBV_WR_RDMA_WRITE, base, k1, 0, 64), IBV_WC_SUCCESS);
	printf("  owner buffer now: \"%s\"\n", ownbuf);
	if (strcmp(ownbuf, "hello through a type-2 MW")) { printf("  FAIL data mismatch\n"); failures++; }
	memcpy(ownbuf + 4000, "tail-of-window", 15);
	expect("B1 RDMA_READ 96B via k1 at offset 4000 (ends at 4096, inside window)", rdma(&p1.b, IBV_WR_RDMA_READ, base + 4000, k1, 1024, 96), IBV_WC_SUCCESS);
	printf("  read back: \"%s\"\n", reqbuf + 1024);
	if (strcmp(reqbuf + 1024, "tail-of-window")) { printf("  FAIL data mismatch\n"); failures++; }
	printf("  direct access with the owner MR's own rkey (MR registered without REMOTE rights):\n");
	{
		struct pair pm = mkpair("Am", "Bm");
		expect("  -> Bm RDMA_READ via mr_own->rkey", rdma(&pm.b, IBV_WR_RDMA_READ, base, mr_own->rkey, 0, 8), IBV_WC_REM_ACCESS_ERR);
	}

	/* ---------------- performance (software numbers) ---------------- */
	if (perf) {
		printf("\n[perf] RDMA_READ 8B latency through the MW (B1->A1), %d iterations\n", iters);
	    {
		double t0 = now();
		int bad = 0;
		for (int i = 0; i < iters; i++)
			if (rdma(&p1.b, IBV_WR_RDMA_READ, base, k1, 0, 8) != IBV_WC_SUCCESS) bad++;
		double dt = now() - t0;
		printf("  %d reads in %.3f s: avg %.1f us/read, %d errors\n", iters, dt, dt / iters * 1e6, bad);
		if (bad) failures++;
	    }
	    {
		mr_plain = ibv_reg_mr(pd, ownbuf + 32768, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
		double t0 = now();
		int bad = 0;
		for (int i = 0; i < iters; i++)
			if (rdma(&p1.b, IBV_WR_RDMA_READ, base + 32768, mr_plain->rkey, 0, 8) != IBV_WC_SUCCESS) bad++;
		double dt = now() - t0;
		printf("  (reference) %d reads via a plain MR rkey in %.3f s: avg %.1f us/read, %d errors\n", iters, dt, dt / iters * 1e6, bad);
		if (bad) failures++;
		ibv_dereg_mr(mr_plain);
	    }
	}

	/* ---------------- (a) QP binding enforcement ---------------- */
	printf("\n[a] same rkey k1 used through a different QP pair (A2<-B2, same PD)\n");
	struct pair p2 = mkpair("A2", "B2");
	expect("B2 RDMA_READ via k1 (MW bound to A1, request arrives at A2)", rdma(&p2.b, IBV_WR_RDMA_READ, base, k1, 0, 8), IBV_WC_REM_ACCESS_ERR);
	printf("  QP states after: A2=%s B2=%s (A1=%s B1=%s)\n", qp_state_str(&p2.a), qp_state_str(&p2.b), qp_state_str(&p1.a), qp_state_str(&p1.b));
	struct pair p2w = mkpair("A2w", "B2w");
	memset(ownbuf + 128, 'o', 64);
	strcpy(reqbuf + 2048, "SHOULD-NOT-LAND");
	expect("B2w RDMA_WRITE via k1 (request arrives at A2w)", rdma(&p2w.b, IBV_WR_RDMA_WRITE, base + 128, k1, 2048, 16), IBV_WC_REM_ACCESS_ERR);
	printf("  owner bytes at +128 after rejected write: \"%.15s\"\n", ownbuf + 128);
	if (!memcmp(ownbuf + 128, "SHOULD", 6)) { printf("  FAIL data landed\n"); failures++; }
	expect("B1 RDMA_READ via k1 still works on the bound pair", rdma(&p1.b, IBV_WR_RDMA_READ, base, k1, 0, 8), IBV_WC_SUCCESS);

	/* ---------------- (b) local invalidate ---------------- */
	printf("\n[b] IBV_WR_LOCAL_INV(k1) posted on the bound QP A1, then access with k1\n");
	expect("LOCAL_INV k1 on A1", local_inv(&p1.a, k1), IBV_WC_SUCCESS);
	expect("B1 RDMA_READ via k1 after invalidate", rdma(&p1.b, IBV_WR_RDMA_READ, base, k1, 0, 8), IBV_WC_REM_ACCESS_ERR);
	printf("  QP states after: A1=%s B1=%s\n", qp_state_str(&p1.a), qp_state_str(&p1.b));

	/* ---------------- (c) re-bind with ibv_inc_rkey ---------------- */
	printf("\n[c] re-bind the (now free) MW with k2=ibv_inc_rkey(k1) on a fresh pair A3<-B3\n");
	uint32_t k2 = ibv_inc_rkey(k1);
	if (mw->rkey != k1) {
		struct pair p3x = mkpair("A3x", "B3x");
		printf("  note: mw->rkey=0x%08x (stale, provider sends it as the MW handle)\n", mw->rkey);
		expect("BIND_MW k2 on A3x WITHOUT updating mw->rkey to k1", bind_mw(&p3x.a, mw, k2, base, 4096, RW), IBV_WC_MW_BIND_ERR);
		printf("  QP state after: A3x=%s\n", qp_state_str(&p3x.a));
		mw->rkey = k1; /* the application tracks the current rkey */
	}
	struct pair p3 = mkpair("A3", "B3");
	expect("BIND_MW k2 on A3 (mw->rkey=k1)", bind_mw(&p3.a, mw, k2, base, 4096, RW), IBV_WC_SUCCESS);
	mw->rkey = k2;
	printf("  k2=0x%08x\n", k2);
	expect("B3 RDMA_READ via k2", rdma(&p3.b, IBV_WR_RDMA_READ, base, k2, 0, 8), IBV_WC_SUCCESS);
	expect("B3 RDMA_WRITE via k2", rdma(&p3.b, IBV_WR_RDMA_WRITE, base, k2, 0, 8), IBV_WC_SUCCESS);
	expect("B3 RDMA_READ via stale k1", rdma(&p3.b, IBV_WR_RDMA_READ, base, k1, 0, 8), IBV_WC_REM_ACCESS_ERR);
	printf("  QP states after: A3=%s B3=%s\n", qp_state_str(&p3.a), qp_state_str(&p3.b));

	/* ---------------- extras ---------------- */
	printf("\n[x1] bind again while the MW is still bound (no invalidate first) on a fresh QP A4\n");
	struct pair p4 = mkpair("A4", "B4");
	expect("BIND_MW k3 on A4 while bound to A3", bind_mw(&p4.a, mw, ibv_inc_rkey(k2), base, 4096, RW), IBV_WC_MW_BIND_ERR);
	printf("  QP state after: A4=%s\n", qp_state_str(&p4.a));

	printf("\n[x2] LOCAL_INV(k2) posted on a QP (A5) other than the bound one (A3), same PD\n");
	struct pair p5 = mkpair("A5", "B5");
	int s = local_inv(&p5.a, k2);
	printf("  NOTE LOCAL_INV from non-bound QP -> %s (%d), A5=%s\n", st(s), s, qp_state_str(&p5.a));
	if (s != IBV_WC_SUCCESS) { /* invalidate via the bound QP is impossible now (A3 is in error); stop extras */
		printf("  skipping remaining extras\n");
		goto perf2;
	}

	printf("\n[x3] read-only bind of 256 bytes, then WRITE / out-of-bounds READ\n");
	{
		uint32_t k3 = ibv_inc_rkey(k2);
		struct pair p6 = mkpair("A6", "B6");
		expect("BIND_MW k3 READ-only 256B on A6", bind_mw(&p6.a, mw, k3, base, 256, IBV_ACCESS_REMOTE_READ), IBV_WC_SUCCESS);
		mw->rkey = k3;
		expect("B6 RDMA_READ 256B via k3", rdma(&p6.b, IBV_WR_RDMA_READ, base, k3, 0, 256), IBV_WC_SUCCESS);
		deviation("B6 RDMA_READ 257B via k3 (1 byte past the 256B window, inside MR)", rdma(&p6.b, IBV_WR_RDMA_READ, base, k3, 0, 257), IBV_WC_REM_ACCESS_ERR);
		printf("  QP states after: A6=%s B6=%s\n", qp_state_str(&p6.a), qp_state_str(&p6.b));
		deviation("B6 RDMA_READ 8B via k3 at base+8192 (far outside window, inside MR)", rdma(&p6.b, IBV_WR_RDMA_READ, base + 8192, k3, 0, 8), IBV_WC_REM_ACCESS_ERR);
		expect("B6 RDMA_READ 8B via k3 at base+65536 (outside the MR too)", rdma(&p6.b, IBV_WR_RDMA_READ, base + BUFSZ, k3, 0, 8), IBV_WC_REM_ACCESS_ERR);
		printf("  QP states after: A6=%s B6=%s\n", qp_state_str(&p6.a), qp_state_str(&p6.b));
		/* A6 is now in error; use A5-style invalidation from another QP to free the MW */
		struct pair p8 = mkpair("A8", "B8");
		expect("LOCAL_INV k3 on A8 (non-bound QP)", local_inv(&p8.a, k3), IBV_WC_SUCCESS);
		uint32_t k4 = ibv_inc_rkey(k3);
		expect("BIND_MW k4 READ-only on A8", bind_mw(&p8.a, mw, k4, base, 256, IBV_ACCESS_REMOTE_READ), IBV_WC_SUCCESS);
		mw->rkey = k4;
		expect("B8 RDMA_WRITE via read-only k4", rdma(&p8.b, IBV_WR_RDMA_WRITE, base, k4, 0, 8), IBV_WC_REM_ACCESS_ERR);
	}

perf2:
	if (perf) {
	printf("\n[perf] bind + local-invalidate cycles on a fresh QP (new MW), %d cycles, each WR signaled and waited\n", iters);
	{
		struct pair pb = mkpair("Ab", "Bb");
		struct ibv_mw *m2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
		uint32_t k = m2->rkey;
		int bad = 0;
		double t0 = now();
		for (int i = 0; i < iters; i++) {
			uint32_t nk = ibv_inc_rkey(k);
			m2->rkey = k;
			if (bind_mw(&pb.a, m2, nk, base, 4096, RW) != IBV_WC_SUCCESS) { bad++; break; }
			if (local_inv(&pb.a, nk) != IBV_WC_SUCCESS) { bad++; break; }
			k = nk;
		}
		double dt = now() - t0;
		printf("  %d bind+inv cycles in %.3f s: %.0f cycles/s (%.0f WRs/s), %.1f us/cycle, errors=%d\n", iters, dt,
		       iters / dt, 2 * iters / dt, dt / iters * 1e6, bad);
		if (bad) failures++;

		/* batched: 32 MWs, post 32 x (BIND, LOCAL_INV) in one chain, only the last WR signaled */
		enum { NM = 32 };
		struct ibv_mw *mws[NM];
		uint32_t ks[NM];
		for (int j = 0; j < NM; j++) { mws[j] = ibv_alloc_mw(pd, IBV_MW_TYPE_2); ks[j] = mws[j]->rkey; }
		struct ibv_send_wr wrs[2 * NM], *badwr;
		int rounds = iters / NM > 0 ? iters / NM : 1;
		bad = 0;
		t0 = now();
		for (int r = 0; r < rounds && !bad; r++) {
			memset(wrs, 0, sizeof(wrs));
			for (int j = 0; j < NM; j++) {
				uint32_t nk = ibv_inc_rkey(ks[j]);
				mws[j]->rkey = ks[j];
				struct ibv_send_wr *b = &wrs[2 * j], *v = &wrs[2 * j + 1];
				b->opcode = IBV_WR_BIND_MW; b->bind_mw.mw = mws[j]; b->bind_mw.rkey = nk;
				b->bind_mw.bind_info.mr = mr_own; b->bind_mw.bind_info.addr = base;
				b->bind_mw.bind_info.length = 4096; b->bind_mw.bind_info.mw_access_flags = RW;
				b->next = v;
				v->opcode = IBV_WR_LOCAL_INV; v->invalidate_rkey = nk;
				v->next = j + 1 < NM ? &wrs[2 * j + 2] : NULL;
				ks[j] = nk;
			}
			wrs[2 * NM - 1].send_flags = IBV_SEND_SIGNALED;
			if (ibv_post_send(pb.a.qp, wrs, &badwr)) { bad++; break; }
			struct ibv_wc wc;
			double tp = now();
			int n;
			while ((n = ibv_poll_cq(pb.a.cq, 1, &wc)) == 0 && now() - tp < 5) ;
			if (n != 1 || wc.status != IBV_WC_SUCCESS) {
				printf("  batched round %d: %s\n", r, n == 1 ? ibv_wc_status_str(wc.status) : "timeout");
				bad++;
			}
		}
		dt = now() - t0;
		printf("  batched (%d MWs, chains of %d WRs, 1 signaled): %d bind+inv cycles in %.3f s: %.0f cycles/s, errors=%d\n",
		       NM, 2 * NM, rounds * NM, dt, rounds * NM / dt, bad);
		if (bad) failures++;
		for (int j = 0; j < NM; j++) ibv_dealloc_mw(mws[j]);
		ibv_dealloc_mw(m2);
	}
	}

	printf("\n[cleanup] t=%.3fs\n", now() - T0);
	if (keep) {
		printf("  -k: leaving everything to process exit (MW still bound to a QP)\n");
	} else {
		double t = now();
		struct pair pc = mkpair("Ac", "Bc");
		printf("  LOCAL_INV of the still-bound MW from Ac -> %s\n", st(local_inv(&pc.a, mw->rkey)));
		printf("  ibv_dealloc_mw -> %d\n", ibv_dealloc_mw(mw));
		for (int i = 0; i < nallqp; i++) {
			double tq = now();
			int r = ibv_destroy_qp(allqp[i].qp);
			double d = now() - tq;
			if (r || d > 0.05) printf("  ibv_destroy_qp(%s) -> %d in %.3f s\n", allqp[i].name, r, d);
		}
		printf("  explicit cleanup took %.3f s\n", now() - t);
	}
	printf("\nRESULT: %s (%d failed expectations, %d rxe deviations from IBTA), t=%.3fs\n", failures ? "FAIL" : "PASS", failures, deviations, now() - T0);
	return failures ? 1 : 0;
}
