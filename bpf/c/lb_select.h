/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * How a backend is chosen among a frontend's slots, shared by the socket
 * hooks (socklb.c) and the north-south programs (nodeport.c) so that the
 * two cannot drift apart: slots 1..count hold the active backends, the
 * next qcount the terminating ones, used only when no backend is active
 * (see reconcilers/lb_slots.go).
 */
#ifndef APIARY_LB_SELECT_H
#define APIARY_LB_SELECT_H

#define BACKEND_ACTIVE 0
#define BACKEND_TERMINATING 1

/* Keep in line with the states the agent writes; only active and
 * terminating backends are ever placed in slots, this is a second guard. */
static __always_inline int backend_usable(__u8 state)
{
	return state == BACKEND_ACTIVE || state == BACKEND_TERMINATING;
}

/* How many slots to choose from: the active backends, or with none, the
 * terminating ones, which then follow in slots 1..qcount. */
static __always_inline __u32 slots(__u16 count, __u16 qcount)
{
	return count ? count : qcount;
}

static __always_inline __u16 random_slot(__u32 n)
{
	return (__u16)(bpf_get_prandom_u32() % n + 1);
}

#define LB_ROL32(x, k) (((x) << (k)) | ((x) >> (32 - (k))))

/* flow_hash mixes three words of a flow (Bob Jenkins' lookup3 final mix):
 * the same flow hashes the same on every node, which is what a Maglev
 * table needs to keep a flow on its backend when another node takes it
 * over. */
static __always_inline __u32 flow_hash(__u32 a, __u32 b, __u32 c)
{
	a += 0xdeadbeef;
	b += 0xdeadbeef;
	c += 0xdeadbeef;
	c ^= b; c -= LB_ROL32(b, 14);
	a ^= c; a -= LB_ROL32(c, 11);
	b ^= a; b -= LB_ROL32(a, 25);
	c ^= b; c -= LB_ROL32(b, 16);
	a ^= c; a -= LB_ROL32(c, 4);
	b ^= a; b -= LB_ROL32(a, 14);
	c ^= b; c -= LB_ROL32(b, 24);
	return c;
}

#endif /* APIARY_LB_SELECT_H */
