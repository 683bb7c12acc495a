/*
 * Golden vectors for omw-core's mlx5 encodings (core/tests/mlx5_golden.rs compiles and runs
 * this). Everything comes from the installed rdma-core header <infiniband/mlx5dv.h>: the
 * segment structs, mlx5dv_set_ctrl_seg / mlx5dv_set_data_seg, and the enums. Where rdma-core
 * fills a segment in providers/mlx5/qp.c (v44.0: set_raddr_seg, _set_atomic_seg,
 * set_umr_control_seg, set_umr_mkey_seg, set_umr_data_seg), the same assignments are made
 * here on the header's structs, so offsets and sizes come from the header, not from Rust.
 *
 * Output: one line per vector, "name hexbytes" or "name = value".
 */
#include <infiniband/mlx5dv.h>
#include <endian.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static void hex(const char *name, const void *p, size_t n)
{
	const uint8_t *b = p;
	printf("%s ", name);
	for (size_t i = 0; i < n; i++)
		printf("%02x", b[i]);
	printf("\n");
}

#define VAL(name) printf(#name " = %llu\n", (unsigned long long)(name))
#define OFF(t, f) printf("offsetof(" #t "." #f ") = %zu\n", offsetof(struct t, f))
#define SIZE(t) printf("sizeof(" #t ") = %zu\n", sizeof(struct t))

/*
 * The fence rdma-core's mlx5_post_send (providers/mlx5/qp.c v44.0, lines 857-861 and
 * 919-980) gives each WQE of a sequence: its own IBV_SEND_FENCE selects MLX5_WQE_CTRL_FENCE,
 * otherwise the INITIATOR_SMALL fence a preceding BIND_MW / LOCAL_INV left in next_fence.
 */
enum op { OP_READ, OP_WRITE, OP_SEND, OP_BIND, OP_LOCAL_INV, OP_NOP };
enum { F_SIGNALED = 1, F_FENCE = 2, F_SOLICITED = 4 };
static void fence_sequence(void)
{
	static const struct { enum op op; int flags; } seq[] = {
		{ OP_READ, F_SIGNALED }, { OP_BIND, F_SIGNALED }, { OP_READ, F_SIGNALED },
		{ OP_BIND, 0 }, { OP_WRITE, F_FENCE | F_SIGNALED }, { OP_LOCAL_INV, F_SIGNALED },
		{ OP_NOP, 0 }, { OP_READ, F_FENCE }, { OP_SEND, F_SOLICITED }, { OP_BIND, 0 },
		{ OP_BIND, F_FENCE }, { OP_SEND, 0 },
	};
	uint8_t next_fence = 0, fence;
	printf("fence_sequence ");
	for (size_t i = 0; i < sizeof(seq) / sizeof(seq[0]); i++) {
		fence = (seq[i].flags & F_FENCE) ? MLX5_WQE_CTRL_FENCE : next_fence;
		next_fence = 0;
		if (seq[i].op == OP_BIND || seq[i].op == OP_LOCAL_INV)
			next_fence = MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE;
		printf("%02x", (unsigned)(fence | ((seq[i].flags & F_SIGNALED) ? MLX5_WQE_CTRL_CQ_UPDATE : 0) |
					  ((seq[i].flags & F_SOLICITED) ? MLX5_WQE_CTRL_SOLICITED : 0)));
	}
	printf("\n");
}

/* rdma-core providers/mlx5/qp.c (v44.0) get_klm_octo */
static __be16 klm_octo(int n) { return htobe16((((n) + 7) & ~7) / 2); }

int main(void)
{
	uint8_t wqe[192];
	struct mlx5_wqe_ctrl_seg *ctrl = (void *)wqe;

	/* ---- constants */
	VAL(MLX5_OPCODE_NOP); VAL(MLX5_OPCODE_SEND_INVAL); VAL(MLX5_OPCODE_RDMA_WRITE);
	VAL(MLX5_OPCODE_RDMA_WRITE_IMM); VAL(MLX5_OPCODE_SEND); VAL(MLX5_OPCODE_SEND_IMM);
	VAL(MLX5_OPCODE_RDMA_READ); VAL(MLX5_OPCODE_ATOMIC_CS); VAL(MLX5_OPCODE_ATOMIC_FA);
	VAL(MLX5_OPCODE_ATOMIC_MASKED_CS); VAL(MLX5_OPCODE_ATOMIC_MASKED_FA); VAL(MLX5_OPCODE_UMR);
	VAL(MLX5_WQE_CTRL_CQ_UPDATE); VAL(MLX5_WQE_CTRL_SOLICITED); VAL(MLX5_WQE_CTRL_FENCE);
	VAL(MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE); VAL(MLX5_SEND_WQE_BB); VAL(MLX5_SEND_WQE_SHIFT);
	VAL(MLX5_WQE_UMR_CTRL_FLAG_INLINE); VAL(MLX5_WQE_UMR_CTRL_FLAG_CHECK_FREE);
	VAL(MLX5_WQE_UMR_CTRL_FLAG_TRNSLATION_OFFSET); VAL(MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN);
	VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_LEN); VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_START_ADDR);
	VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_MKEY); VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_QPN);
	VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_LOCAL_WRITE); VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_READ);
	VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_WRITE); VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_ATOMIC);
	VAL(MLX5_WQE_UMR_CTRL_MKEY_MASK_FREE); VAL(MLX5_WQE_MKEY_CONTEXT_FREE);
	VAL(MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_ATOMIC); VAL(MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_WRITE);
	VAL(MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_READ); VAL(MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_LOCAL_WRITE);
	VAL(MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_LOCAL_READ);
	VAL(MLX5DV_CONTEXT_FLAGS_DEVX); VAL(MLX5DV_OBJ_PD); VAL(MLX5DV_OBJ_AH);

	/* ---- layouts of every segment struct */
	SIZE(mlx5_wqe_ctrl_seg); OFF(mlx5_wqe_ctrl_seg, qpn_ds); OFF(mlx5_wqe_ctrl_seg, signature);
	OFF(mlx5_wqe_ctrl_seg, dci_stream_channel_id); OFF(mlx5_wqe_ctrl_seg, fm_ce_se); OFF(mlx5_wqe_ctrl_seg, imm);
	SIZE(mlx5_wqe_data_seg); OFF(mlx5_wqe_data_seg, lkey); OFF(mlx5_wqe_data_seg, addr);
	SIZE(mlx5_wqe_raddr_seg); OFF(mlx5_wqe_raddr_seg, rkey);
	SIZE(mlx5_wqe_atomic_seg); OFF(mlx5_wqe_atomic_seg, compare);
	SIZE(mlx5_wqe_umr_ctrl_seg); OFF(mlx5_wqe_umr_ctrl_seg, klm_octowords);
	OFF(mlx5_wqe_umr_ctrl_seg, translation_offset); OFF(mlx5_wqe_umr_ctrl_seg, mkey_mask);
	SIZE(mlx5_wqe_mkey_context_seg); OFF(mlx5_wqe_mkey_context_seg, access_flags);
	OFF(mlx5_wqe_mkey_context_seg, qpn_mkey); OFF(mlx5_wqe_mkey_context_seg, flags_pd);
	OFF(mlx5_wqe_mkey_context_seg, start_addr); OFF(mlx5_wqe_mkey_context_seg, len);
	OFF(mlx5_wqe_mkey_context_seg, translations_octword_size); OFF(mlx5_wqe_mkey_context_seg, log_page_size);
	SIZE(mlx5_wqe_umr_klm_seg); OFF(mlx5_wqe_umr_klm_seg, mkey); OFF(mlx5_wqe_umr_klm_seg, address);
	SIZE(mlx5_cqe64); OFF(mlx5_cqe64, imm_inval_pkey); OFF(mlx5_cqe64, byte_cnt);
	OFF(mlx5_cqe64, sop_drop_qpn); OFF(mlx5_cqe64, wqe_counter); OFF(mlx5_cqe64, op_own);
	SIZE(mlx5_err_cqe); OFF(mlx5_err_cqe, vendor_err_synd); OFF(mlx5_err_cqe, syndrome);
	OFF(mlx5_err_cqe, s_wqe_opcode_qpn); OFF(mlx5_err_cqe, wqe_counter);
	VAL(MLX5_CQE_REQ); VAL(MLX5_CQE_RESP_WR_IMM); VAL(MLX5_CQE_RESP_SEND); VAL(MLX5_CQE_RESP_SEND_IMM);
	VAL(MLX5_CQE_RESP_SEND_INV); VAL(MLX5_CQE_REQ_ERR); VAL(MLX5_CQE_RESP_ERR); VAL(MLX5_CQE_INVALID);
	VAL(MLX5_CQE_OWNER_MASK); VAL(MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR); VAL(MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR);
	VAL(MLX5_CQE_SYNDROME_LOCAL_PROT_ERR); VAL(MLX5_CQE_SYNDROME_WR_FLUSH_ERR); VAL(MLX5_CQE_SYNDROME_MW_BIND_ERR);
	VAL(MLX5_CQE_SYNDROME_BAD_RESP_ERR); VAL(MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR);
	VAL(MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR); VAL(MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR);
	VAL(MLX5_CQE_SYNDROME_REMOTE_OP_ERR); VAL(MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR);
	VAL(MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR); VAL(MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR);
	/* the DEVX structs the backend declares itself */
	SIZE(mlx5dv_context_attr); OFF(mlx5dv_context_attr, comp_mask);
	SIZE(mlx5dv_devx_uar); OFF(mlx5dv_devx_uar, reg_addr); OFF(mlx5dv_devx_uar, base_addr);
	OFF(mlx5dv_devx_uar, page_id); OFF(mlx5dv_devx_uar, mmap_off); OFF(mlx5dv_devx_uar, comp_mask);
	SIZE(mlx5dv_devx_umem); SIZE(mlx5dv_pd); OFF(mlx5dv_pd, comp_mask);
	SIZE(mlx5dv_obj); OFF(mlx5dv_obj, ah); OFF(mlx5dv_obj, pd); SIZE(mlx5dv_ah);
	SIZE(mlx5_wqe_av); OFF(mlx5_wqe_av, rmac); OFF(mlx5_wqe_av, rgid);

	/* ---- control and data segments through the header's own setters */
	{
		struct mlx5_wqe_ctrl_seg c;
		memset(&c, 0xff, sizeof(c));
		mlx5dv_set_ctrl_seg(&c, 0xBEEF, MLX5_OPCODE_RDMA_READ, 0x09, 0x123456,
				    MLX5_WQE_CTRL_CQ_UPDATE | MLX5_WQE_CTRL_FENCE, 3, 0, htobe32(0xA1B2C3D4));
		/* signature and dci_stream_channel_id are left alone by the setter */
		c.dci_stream_channel_id = 0;
		hex("ctrl", &c, sizeof(c));
		struct mlx5_wqe_data_seg d;
		mlx5dv_set_data_seg(&d, 0x11223344, 0x55667788, 0x0102030405060708ull);
		hex("data", &d, sizeof(d));
	}

	/* ---- READ: ctrl + raddr + data (ds 3), qp.c mlx5_post_send */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 7, MLX5_OPCODE_RDMA_READ, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 3, 0, 0);
	{
		struct mlx5_wqe_raddr_seg *r = (void *)(ctrl + 1);
		r->raddr = htobe64(0x6666777788889990ull); r->rkey = htobe32(0xAABBCC); r->reserved = 0;
		mlx5dv_set_data_seg((void *)(r + 1), 64, 0x55, 0x1111222233334444ull);
	}
	hex("wqe_read", wqe, 64);

	/* ---- WRITE_WITH_IMM: imm as is (already big-endian in verbs) */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 8, MLX5_OPCODE_RDMA_WRITE_IMM, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 3, 0, htobe32(0xDEADBEEF));
	{
		struct mlx5_wqe_raddr_seg *r = (void *)(ctrl + 1);
		r->raddr = htobe64(0x30); r->rkey = htobe32(0x40); r->reserved = 0;
		mlx5dv_set_data_seg((void *)(r + 1), 8, 0x20, 0x10);
	}
	hex("wqe_write_imm", wqe, 64);

	/* ---- SEND_WITH_INV: imm = htobe32(invalidate_rkey) */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 9, MLX5_OPCODE_SEND_INVAL, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 2, 0, htobe32(0x12345601));
	mlx5dv_set_data_seg((void *)(ctrl + 1), 16, 0x20, 0x10);
	hex("wqe_send_inv", wqe, 64);

	/* ---- FETCH_ADD and COMPARE_SWAP: ctrl + raddr + atomic + data (ds 4), _set_atomic_seg */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 10, MLX5_OPCODE_ATOMIC_FA, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 4, 0, 0);
	{
		struct mlx5_wqe_raddr_seg *r = (void *)(ctrl + 1);
		r->raddr = htobe64(0x200); r->rkey = htobe32(2); r->reserved = 0;
		struct mlx5_wqe_atomic_seg *a = (void *)(r + 1);
		a->swap_add = htobe64(0x0102030405060708ull);
		mlx5dv_set_data_seg((void *)(a + 1), 8, 1, 0x100);
	}
	hex("wqe_fetch_add", wqe, 64);
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 11, MLX5_OPCODE_ATOMIC_CS, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 4, 0, 0);
	{
		struct mlx5_wqe_raddr_seg *r = (void *)(ctrl + 1);
		r->raddr = htobe64(0x200); r->rkey = htobe32(2); r->reserved = 0;
		struct mlx5_wqe_atomic_seg *a = (void *)(r + 1);
		a->swap_add = htobe64(9);   /* swap */
		a->compare = htobe64(7);
		mlx5dv_set_data_seg((void *)(a + 1), 8, 1, 0x100);
	}
	hex("wqe_compare_swap", wqe, 64);

	/* ---- type-2 BIND_MW: UMR, ds 12, 3 WQEBBs (set_bind_wr with length != 0). As
	 * mlx5_post_send: ctrl->imm = htobe32(wr->bind_mw.mw->rkey) -- the window's CURRENT rkey
	 * (0x00123404) -- and the new key byte (0x05, wr->bind_mw.rkey) in qpn_mkey. */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 12, MLX5_OPCODE_UMR, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 12, 0, htobe32(0x00123404));
	{
		struct mlx5_wqe_umr_ctrl_seg *u = (void *)(ctrl + 1);
		u->flags = MLX5_WQE_UMR_CTRL_FLAG_TRNSLATION_OFFSET | MLX5_WQE_UMR_CTRL_FLAG_INLINE;
		u->mkey_mask = htobe64(MLX5_WQE_UMR_CTRL_MKEY_MASK_FREE | MLX5_WQE_UMR_CTRL_MKEY_MASK_MKEY);
		u->translation_offset = 0;
		u->mkey_mask |= htobe64(MLX5_WQE_UMR_CTRL_MKEY_MASK_QPN);
		u->klm_octowords = klm_octo(1);
		u->flags |= MLX5_WQE_UMR_CTRL_FLAG_CHECK_FREE;
		u->mkey_mask |= htobe64(MLX5_WQE_UMR_CTRL_MKEY_MASK_LEN | MLX5_WQE_UMR_CTRL_MKEY_MASK_START_ADDR |
					MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_LOCAL_WRITE |
					MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_READ |
					MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_WRITE |
					MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_ATOMIC);
		struct mlx5_wqe_mkey_context_seg *m = (void *)(u + 1);
		m->qpn_mkey = htobe32((0x00123405 & 0xFF) | (0xABCDEF << 8));
		m->access_flags = MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_WRITE |
				  MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_READ;
		m->free = 0;
		m->start_addr = htobe64(0x70000000);
		m->len = htobe64(4096);
		struct mlx5_wqe_umr_klm_seg *k = (void *)(m + 1);
		k->byte_count = htobe32(4096);
		k->mkey = htobe32(0x77);
		k->address = htobe64(0x70000000);
	}
	hex("wqe_bind_mw", wqe, 192);

	/* ---- LOCAL_INV: UMR, ds 8, 2 WQEBBs (set_bind_wr with length == 0, type 2) */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 13, MLX5_OPCODE_UMR, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE, 8, 0, htobe32(0x00123405));
	{
		struct mlx5_wqe_umr_ctrl_seg *u = (void *)(ctrl + 1);
		u->flags = MLX5_WQE_UMR_CTRL_FLAG_TRNSLATION_OFFSET | MLX5_WQE_UMR_CTRL_FLAG_INLINE;
		u->mkey_mask = htobe64(MLX5_WQE_UMR_CTRL_MKEY_MASK_FREE | MLX5_WQE_UMR_CTRL_MKEY_MASK_MKEY);
		u->mkey_mask |= htobe64(MLX5_WQE_UMR_CTRL_MKEY_MASK_QPN);
		u->klm_octowords = klm_octo(0);
		u->flags |= MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN;
		struct mlx5_wqe_mkey_context_seg *m = (void *)(u + 1);
		m->qpn_mkey = htobe32((0 & 0xFF) | 0xFFFFFF00);
		m->free = MLX5_WQE_MKEY_CONTEXT_FREE;
	}
	hex("wqe_local_inv", wqe, 128);

	/* ---- a FENCEd, signaled READ right after a BIND_MW: fm_ce_se as mlx5_post_send makes it */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 15, MLX5_OPCODE_RDMA_READ, 0, 0x99, MLX5_WQE_CTRL_CQ_UPDATE | MLX5_WQE_CTRL_FENCE, 3,
			    0, 0);
	{
		struct mlx5_wqe_raddr_seg *r = (void *)(ctrl + 1);
		r->raddr = htobe64(0x6666777788889990ull); r->rkey = htobe32(0xAABBCC); r->reserved = 0;
		mlx5dv_set_data_seg((void *)(r + 1), 64, 0x55, 0x1111222233334444ull);
	}
	hex("wqe_fenced_read_after_bind", wqe, 64);
	fence_sequence();

	/* ---- NOP */
	memset(wqe, 0, sizeof(wqe));
	mlx5dv_set_ctrl_seg(ctrl, 0xFFFF, MLX5_OPCODE_NOP, 0, 0x99, 0, 1, 0, 0);
	hex("wqe_nop", wqe, 64);
	return 0;
}
