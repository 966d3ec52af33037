// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Transparent DNS interception at the socket hooks.
 *
 * A connect() or sendmsg() to port 53 (TCP or UDP) of an endpoint whose
 * egress policy has a DNS rule (EP_DNS in policy_endpoints) is sent to the
 * agent's DNS proxy instead (dns_config). The socket remembers, in its own
 * storage (dns_sk), the resolver it asked: recvmsg() and getpeername()
 * give that address back in place of the proxy's, so the application only
 * ever sees its resolver. Each packet such a socket sends to the proxy
 * publishes (client address, port, protocol) -> resolver in the
 * socket's endpoint's map in dns_origin, where the proxy (which knows the
 * endpoint by the client's address) finds whom to forward the query to.
 *
 * The resolver is the destination after the socket load balancer's
 * translation (the policy programs run after it): the proxy forwards to
 * the backend the load balancer chose, and the restore gives back the
 * backend, which the load balancer's own recvmsg()/getpeername() then
 * turns into the service address. The socket LB object includes this
 * header with DNS_REDIRECT_RESTORE_ONLY and restores before its own
 * reverse translation, so the result is the service address whichever of
 * the two programs the kernel runs first.
 *
 * Fails closed: an endpoint with a DNS rule whose DNS cannot be
 * intercepted (interception off, no proxy address of a usable family, no
 * memory for the socket's storage) has its DNS denied, not let through
 * unfiltered. A query to the proxy's own address (any port) is treated as
 * intercepted, with the proxy as its resolver: the proxy applies the
 * endpoint's DNS rules and forwards it to its upstream.
 *
 * Every map is the agent's: the structs must match the Go types in
 * bpf/dns.go byte for byte (a Go test compares them through the BTF).
 */
#ifndef DNS_REDIRECT_H
#define DNS_REDIRECT_H

#include "addr.h"

/* dns_sk: where a socket's DNS was sent (socket storage). Addresses are
 * IPv6 or IPv4-mapped, ports in network order. */
struct dns_sock {
	__be32 resolver[4]; /* what the socket asked (after socket LB) */
	__be32 proxy[4];    /* where it went instead */
	__be16 resolver_port;
	__be16 proxy_port;
	__u32 endpoint_id;
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__type(key, int);
	__type(value, struct dns_sock);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} dns_sk SEC(".maps");

static __always_inline int dns_same(const __be32 *a, const __be32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* dns_restore4 gives an AF_INET socket's recvmsg()/getpeername() its
 * resolver back where the proxy answered. */
static __always_inline void dns_restore4(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct dns_sock *st;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&dns_sk, sk, 0, 0);
	if (!st || !v4mapped_words(st->proxy) || !v4mapped_words(st->resolver))
		return;
	if (ctx->user_ip4 != st->proxy[3] || (__be16)ctx->user_port != st->proxy_port)
		return;
	ctx->user_ip4 = st->resolver[3];
	ctx->user_port = (__u32)st->resolver_port;
}

/* dns_restore6 is dns_restore4 for AF_INET6 sockets (IPv6 or mapped). */
static __always_inline void dns_restore6(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct dns_sock *st;
	__be32 a[4];

	if (!sk)
		return;
	st = bpf_sk_storage_get(&dns_sk, sk, 0, 0);
	if (!st)
		return;
	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
	if (!dns_same(a, st->proxy) || (__be16)ctx->user_port != st->proxy_port)
		return;
	ctx->user_ip6[0] = st->resolver[0];
	ctx->user_ip6[1] = st->resolver[1];
	ctx->user_ip6[2] = st->resolver[2];
	ctx->user_ip6[3] = st->resolver[3];
	ctx->user_port = (__u32)st->resolver_port;
}

#ifndef DNS_REDIRECT_RESTORE_ONLY

/* dns_config: where intercepted queries go (one entry, key 0). */
struct dns_config {
	__be32 proxy4;    /* IPv4 address of the proxy, 0: none */
	__be16 port4;     /* its port */
	__be16 port6;     /* the port of proxy6 */
	__be32 proxy6[4]; /* IPv6 address of the proxy, all 0: none */
	__u32 flags;      /* DNS_CONFIG_INTERCEPT */
};

/* dns_origin: a query's client, as the proxy sees it. */
struct dns_origin_key {
	__be32 client[4]; /* IPv6 or IPv4-mapped */
	__be16 client_port;
	__u8 protocol;
	__u8 pad;
};

/* dns_origin: whom the client asked, and which endpoint it is. */
struct dns_origin {
	__be32 resolver[4];
	__be16 resolver_port;
	__u16 pad;
	__u32 endpoint_id;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct dns_config);
	__uint(max_entries, 1);
} dns_config SEC(".maps");

/* dns_origin holds one LRU per endpoint ID with DNS rules, the agent's
 * (made and deleted with the endpoint's policy_endpoints entry): a pod's
 * queries, from however many sources, push out only its own entries, and
 * a socket bound to another pod's address (IP_FREEBIND, IP_TRANSPARENT)
 * writes into its own endpoint's map, where the proxy never looks for the
 * other pod's queries. */
struct dns_origins {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct dns_origin_key);
	__type(value, struct dns_origin);
	__uint(max_entries, 1024);
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, 65536);
	__array(values, struct dns_origins);
} dns_origin SEC(".maps");

/* dns_origin_lost counts queries whose origin could not be published (no
 * map for the endpoint, or the write failed): the proxy asks its upstream
 * for them. One per-CPU counter. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} dns_origin_lost SEC(".maps");

/* Intercept: the proxy takes the queries. Without it, DNS of endpoints
 * with a DNS rule is denied (but for the proxy's own address). */
#define DNS_CONFIG_INTERCEPT 0x1

#define DNS_PORT 53

/* What to do with a connect() or sendmsg(). */
enum dns_plan {
	DNS_PASS = 0,     /* not DNS */
	DNS_REDIRECT = 1, /* to the proxy: see struct dns_target */
	DNS_DENY = 2,     /* DNS that cannot be intercepted */
};

struct dns_target {
	__be32 addr[4]; /* IPv6 or IPv4-mapped */
	__be16 port;
};

/*
 * dns_plan_for decides for a destination (addr, IPv6 or mapped; port in
 * network order) of protocol, seen by a connect or sendmsg hook of family
 * 4 (v6ctx 0: only an IPv4 address can be written) or 6. An AF_INET6
 * socket may reach an IPv4 proxy through its mapped address, and the
 * proxy's IPv6 address from an IPv4-mapped destination.
 */
static __always_inline enum dns_plan dns_plan_for(int v6ctx, __u8 protocol, const __be32 *addr,
						  __be16 port, struct dns_target *out)
{
	__u32 zero = 0;
	struct dns_config *cfg;
	int has4, has6;

	if (protocol != IPPROTO_TCP && protocol != IPPROTO_UDP)
		return DNS_PASS;
	cfg = bpf_map_lookup_elem(&dns_config, &zero);
	if (!cfg)
		return port == bpf_htons(DNS_PORT) ? DNS_DENY : DNS_PASS;
	has4 = cfg->proxy4 != 0;
	has6 = (cfg->proxy6[0] | cfg->proxy6[1] | cfg->proxy6[2] | cfg->proxy6[3]) != 0;
	/* Asking the proxy directly, on any port: it goes there as it is,
	 * but as intercepted, so that the endpoint's DNS rules apply (the
	 * proxy then forwards to its upstream). */
	if ((v4mapped_words(addr) && has4 && addr[3] == cfg->proxy4 && port == cfg->port4) ||
	    (has6 && dns_same(addr, cfg->proxy6) && port == cfg->port6)) {
		__builtin_memcpy(out->addr, addr, sizeof(out->addr));
		out->port = port;
		return DNS_REDIRECT;
	}
	if (port != bpf_htons(DNS_PORT))
		return DNS_PASS;
	if (!(cfg->flags & DNS_CONFIG_INTERCEPT))
		return DNS_DENY;
	/* Of the two families, the destination's first. */
	if (has4 && (!v6ctx || v4mapped_words(addr) || !has6)) {
		set_v4mapped_words(out->addr, cfg->proxy4);
		out->port = cfg->port4;
		return DNS_REDIRECT;
	}
	if (has6 && v6ctx) {
		out->addr[0] = cfg->proxy6[0];
		out->addr[1] = cfg->proxy6[1];
		out->addr[2] = cfg->proxy6[2];
		out->addr[3] = cfg->proxy6[3];
		out->port = cfg->port6;
		return DNS_REDIRECT;
	}
	return DNS_DENY;
}

/*
 * dns_apply sends the connect() or sendmsg() to the proxy (t), and has the
 * socket remember the resolver (addr, port) it asked. Returns 0 when the
 * socket cannot remember: the caller denies rather than lose the
 * resolver.
 */
static __always_inline int dns_apply(struct bpf_sock_addr *ctx, int v6ctx, __u32 endpoint_id,
				     const __be32 *addr, __be16 port, const struct dns_target *t)
{
	struct bpf_sock *sk = ctx->sk;
	struct dns_sock *st;

	if (!sk)
		return 0;
	/* clang would reuse a pointer into the context it computed for an
	 * earlier read (ctx + offset), which the verifier refuses to write
	 * through: hide ctx so that each write starts from it. A failure
	 * below denies, so the rewrite then does not matter. */
	asm volatile("" : "+r"(ctx));
	if (v6ctx) {
		ctx->user_ip6[0] = t->addr[0];
		ctx->user_ip6[1] = t->addr[1];
		ctx->user_ip6[2] = t->addr[2];
		ctx->user_ip6[3] = t->addr[3];
	} else {
		ctx->user_ip4 = t->addr[3];
	}
	ctx->user_port = (__u32)t->port;
	st = bpf_sk_storage_get(&dns_sk, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;
	st->resolver[0] = addr[0];
	st->resolver[1] = addr[1];
	st->resolver[2] = addr[2];
	st->resolver[3] = addr[3];
	st->resolver_port = port;
	st->proxy[0] = t->addr[0];
	st->proxy[1] = t->addr[1];
	st->proxy[2] = t->addr[2];
	st->proxy[3] = t->addr[3];
	st->proxy_port = t->port;
	st->endpoint_id = endpoint_id;
	return 1;
}

static __always_inline void dns_origin_count_lost(void)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&dns_origin_lost, &zero);

	if (n)
		__sync_fetch_and_add(n, 1);
}

/*
 * dns_origin_put writes val under key in an endpoint's origins, only when
 * it changes (a socket that sends to another resolver, or a new socket on
 * a port reused); non-zero when the write failed. Out of line, so that
 * the key's and value's structs are in the object's BTF: the inner map's
 * definition alone gives only its name.
 */
static __noinline int dns_origin_put(void *origins, const struct dns_origin_key *key,
				     const struct dns_origin *val)
{
	struct dns_origin *cur = bpf_map_lookup_elem(origins, key);

	if (cur && dns_same(cur->resolver, val->resolver) && cur->resolver_port == val->resolver_port &&
	    cur->endpoint_id == val->endpoint_id)
		return 0;
	return bpf_map_update_elem(origins, key, val, BPF_ANY) ? 1 : 0;
}

/*
 * dns_publish runs for each packet an endpoint with a DNS rule sends:
 * when the packet goes from a redirected socket to its proxy, the proxy
 * learns from the endpoint's map in dns_origin, keyed by the packet's
 * source, whom the socket asked. A loss (no map for the endpoint, a
 * failed write) is counted in dns_origin_lost.
 */
static __always_inline void dns_publish(struct bpf_sock *sk, const __be32 *saddr, __be16 sport,
					const __be32 *daddr, __be16 dport, __u8 protocol)
{
	struct dns_origin_key key = {};
	struct dns_origin val = {};
	struct dns_sock *st;
	void *origins;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&dns_sk, sk, 0, 0);
	if (!st || dport != st->proxy_port || !dns_same(daddr, st->proxy))
		return;
	key.client[0] = saddr[0];
	key.client[1] = saddr[1];
	key.client[2] = saddr[2];
	key.client[3] = saddr[3];
	key.client_port = sport;
	key.protocol = protocol;
	val.resolver[0] = st->resolver[0];
	val.resolver[1] = st->resolver[1];
	val.resolver[2] = st->resolver[2];
	val.resolver[3] = st->resolver[3];
	val.resolver_port = st->resolver_port;
	val.endpoint_id = st->endpoint_id;
	/* The socket's own endpoint's map only (the hook's endpoint ID,
	 * which no pod forges). */
	origins = bpf_map_lookup_elem(&dns_origin, &st->endpoint_id);
	if (!origins) {
		dns_origin_count_lost();
		return;
	}
	if (dns_origin_put(origins, &key, &val))
		dns_origin_count_lost();
}

#endif /* DNS_REDIRECT_RESTORE_ONLY */
#endif /* DNS_REDIRECT_H */
