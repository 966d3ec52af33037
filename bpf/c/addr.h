/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Addresses as the programs share them: IPv6, or IPv4 as the IPv4-mapped
 * ::ffff:a.b.c.d, in network order, so that one key or field holds
 * either family. Included by every program after the BPF headers
 * (bpf_htonl).
 */
#ifndef APIARY_ADDR_H
#define APIARY_ADDR_H

/* Word access for comparisons and for ctx->user_ip6, bytes for the layout. */
union v6addr {
	__u8 addr[16];
	__be32 p[4];
};

/* v4mapped_words tells whether the address whose four words are p is
 * IPv4-mapped. */
static __always_inline int v4mapped_words(const __be32 *p)
{
	return p[0] == 0 && p[1] == 0 && p[2] == bpf_htonl(0xffff);
}

static __always_inline int is_v4mapped(const union v6addr *a)
{
	return v4mapped_words(a->p);
}

/* set_v4mapped_words makes the four words p the IPv4-mapped form of v4. */
static __always_inline void set_v4mapped_words(__be32 *p, __be32 v4)
{
	p[0] = 0;
	p[1] = 0;
	p[2] = bpf_htonl(0xffff);
	p[3] = v4;
}

static __always_inline void set_v4mapped(union v6addr *a, __be32 v4)
{
	set_v4mapped_words(a->p, v4);
}

#endif /* APIARY_ADDR_H */
