// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Network policy enforcement for IPv4 at the cgroup level.
 *
 * An endpoint is a pod's cgroup, registered in policy_endpoints; the
 * processes in it, or in any cgroup below it, are the endpoint. Their
 * connect() and sendmsg() are checked against the endpoint's egress policy
 * (cgroup/connect4, cgroup/sendmsg4), their packets against both
 * directions (cgroup_skb/ingress, cgroup_skb/egress). A flow that was
 * allowed one way is remembered in policy_flows (by socket cookie and
 * peer), so that its replies pass whatever the other direction says;
 * sockops remembers the TCP connections a listener accepts.
 *
 * Every map is the agent's: the loader replaces these definitions with the
 * maps the agent keeps pinned, so the structs below must match the Go types
 * in bpf/policy.go and bpf/ipcache.go byte for byte (a Go test compares
 * them through the object's BTF).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/*
 * policy: LPM trie. The prefix always covers endpoint_id, identity and
 * egress (72 bits), then protocol (8), then 0-16 bits of the port.
 * Identity 0 stands for any peer; protocol 0 (prefix 72) for any protocol.
 */
struct policy_key {
	__u32 prefixlen;
	__u32 endpoint_id;
	__u32 identity;
	__u8 egress;
	__u8 protocol;
	__be16 dport;
};

struct policy_value {
	__u8 flags;           /* POLICY_DENY */
	__u8 port_prefix_len; /* for people: the lookup does not return it */
	__u16 pad;
	__u32 cookie;
};

/* policy_endpoints: cgroup id (u64) -> endpoint. */
struct policy_endpoint {
	__u32 endpoint_id;
	__u32 flags; /* EP_ENFORCE_INGRESS, EP_ENFORCE_EGRESS, EP_AUDIT */
};

/* policy_flows: an allowed flow of a socket, seen from the endpoint. */
struct policy_flow_key {
	__u64 cookie;
	__be32 peer;
	__be16 peer_port;
	__u8 protocol;
	__u8 pad;
};

struct policy_flow {
	__u32 endpoint_id;
	__u8 egress; /* 1: the endpoint opened it */
	__u8 pad[3];
};

/* ipcache: the agent's map from prefixes to security identities. */
struct ipcache_key {
	__u32 prefixlen; /* IPCACHE_STATIC_BITS + the address's prefix bits */
	__u16 cluster_id;
	__u8 pad;
	__u8 family;
	__u8 addr[16]; /* network order; IPv4 in the first 4 bytes */
};

struct remote_endpoint_info {
	__u32 sec_identity;
	__u8 tunnel_endpoint[16];
	__u8 pad[2];
	__u8 key;
	__u8 flags;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct policy_key);
	__type(value, struct policy_value);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u64);
	__type(value, struct policy_endpoint);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy_endpoints SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct policy_flow_key);
	__type(value, struct policy_flow);
	__uint(max_entries, 65536);
} policy_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 8);
} policy_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct ipcache_key);
	__type(value, struct remote_endpoint_info);
	__uint(max_entries, 512000);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} ipcache SEC(".maps");

/* linux/socket.h has no address families. */
#define AF_INET 2
#define AF_INET6 10

#define POLICY_DENY 0x1

#define EP_ENFORCE_INGRESS 0x1
#define EP_ENFORCE_EGRESS 0x2
#define EP_AUDIT 0x4

/* endpoint_id + identity + egress + protocol + port, all matched. */
#define POLICY_LOOKUP_BITS 96
/* cluster_id + pad + family precede the address in the ipcache key. */
#define IPCACHE_STATIC_BITS 32
#define IPCACHE_FAMILY_IPV4 1
/* reserved:world, the identity of any address the ipcache does not know. */
#define IDENTITY_WORLD 2

/* Deeper endpoint cgroups than this are not found; a pod's cgroup sits a
 * handful of levels down (kubepods/<qos>/<pod>), so this is plenty. */
#define MAX_CGROUP_LEVEL 16

enum direction {
	DIR_INGRESS = 0,
	DIR_EGRESS = 1,
};

/* policy_stats index: direction * VERDICTS + verdict. */
enum verdict {
	VERDICT_ALLOWED = 0,
	VERDICT_DENIED = 1,
	VERDICT_AUDITED = 2,
	VERDICTS = 4,
};

/*
 * The ancestor walks go from the top (level 1) down to the cgroup itself
 * (below it, the helpers return 0): the shallowest registered cgroup is the
 * endpoint, so a pod's containers (cgroups below it) are the pod. The
 * level-based helpers are the only way to see a cgroup's ancestors; they
 * differ between program types, hence two walks.
 */
static __always_inline struct policy_endpoint *endpoint_of_current(void)
{
	for (int level = 1; level <= MAX_CGROUP_LEVEL; level++) {
		__u64 id = bpf_get_current_ancestor_cgroup_id(level);
		struct policy_endpoint *ep;

		if (!id)
			return NULL;
		ep = bpf_map_lookup_elem(&policy_endpoints, &id);
		if (ep)
			return ep;
	}
	return NULL;
}

/* The same for the packet's socket, which may belong to no process that
 * is running now (softirq) or to another process than the current one. */
static __always_inline struct policy_endpoint *endpoint_of_skb(struct __sk_buff *skb)
{
	for (int level = 1; level <= MAX_CGROUP_LEVEL; level++) {
		__u64 id = bpf_skb_ancestor_cgroup_id(skb, level);
		struct policy_endpoint *ep;

		if (!id)
			return NULL;
		ep = bpf_map_lookup_elem(&policy_endpoints, &id);
		if (ep)
			return ep;
	}
	return NULL;
}

static __always_inline __u32 identity_of(__be32 addr)
{
	struct ipcache_key key = {
		.prefixlen = IPCACHE_STATIC_BITS + 32,
		.family = IPCACHE_FAMILY_IPV4,
	};
	struct remote_endpoint_info *info;

	__builtin_memcpy(key.addr, &addr, sizeof(addr));
	info = bpf_map_lookup_elem(&ipcache, &key);
	return info ? info->sec_identity : IDENTITY_WORLD;
}

/* An entry's flags, with ENTRY_FOUND set, or 0 when nothing matches. The
 * verdict works on these numbers, never on two map pointers at once: clang
 * may merge pointer tests into an OR of the pointers, which the verifier
 * refuses. */
#define ENTRY_FOUND 0x100

static __always_inline __u32 lookup_entry(const struct policy_key *key)
{
	struct policy_value *v = bpf_map_lookup_elem(&policy, key);

	return v ? ENTRY_FOUND | v->flags : 0;
}

/*
 * lookup_verdict applies the policy of an endpoint to a peer and port. The
 * longest match for the peer's own identity comes first, then the longest
 * for any peer (identity 0): a deny in either wins, else an entry in
 * either allows, else nothing does (default deny).
 */
static __always_inline enum verdict lookup_verdict(__u32 endpoint_id, __u32 identity,
						   enum direction dir, __u8 protocol, __be16 dport)
{
	struct policy_key key = {
		.prefixlen = POLICY_LOOKUP_BITS,
		.endpoint_id = endpoint_id,
		.identity = identity,
		.egress = (__u8)dir,
		.protocol = protocol,
		.dport = dport,
	};
	__u32 l3, l4;

	l3 = lookup_entry(&key);
	if (l3 & POLICY_DENY)
		return VERDICT_DENIED;
	key.identity = 0;
	l4 = lookup_entry(&key);
	if (l4 & POLICY_DENY)
		return VERDICT_DENIED;
	return ((l3 | l4) & ENTRY_FOUND) ? VERDICT_ALLOWED : VERDICT_DENIED;
}

static __always_inline void count(enum direction dir, enum verdict v)
{
	__u32 idx = (__u32)dir * VERDICTS + (__u32)v;
	__u64 *n = bpf_map_lookup_elem(&policy_stats, &idx);

	/* Per CPU, but a packet's softirq can interrupt a connect() on the
	 * same CPU: an atomic add keeps both counts. */
	if (n)
		__sync_fetch_and_add(n, 1);
}

/*
 * decide returns 1 when the endpoint may talk to the peer (allowed, or
 * denied but audited) and 0 when not, and counts the decision.
 */
static __always_inline int decide(__u32 endpoint_id, __u32 ep_flags, __be32 peer,
				  enum direction dir, __u8 protocol, __be16 dport)
{
	enum verdict v = lookup_verdict(endpoint_id, identity_of(peer), dir, protocol, dport);

	if (v == VERDICT_DENIED && (ep_flags & EP_AUDIT))
		v = VERDICT_AUDITED;
	count(dir, v);
	return v != VERDICT_DENIED;
}

static __always_inline int flow_known(__u64 cookie, __be32 peer, __be16 port, __u8 protocol)
{
	struct policy_flow_key key = {
		.cookie = cookie,
		.peer = peer,
		.peer_port = port,
		.protocol = protocol,
	};

	return bpf_map_lookup_elem(&policy_flows, &key) != NULL;
}

/* A full LRU evicts its oldest flow, so the update cannot fail for room;
 * if it failed anyway, only the flow's replies would be checked by policy. */
static __always_inline void remember_flow(__u64 cookie, __be32 peer, __be16 port, __u8 protocol,
					  __u32 endpoint_id, enum direction dir)
{
	struct policy_flow_key key = {
		.cookie = cookie,
		.peer = peer,
		.peer_port = port,
		.protocol = protocol,
	};
	struct policy_flow val = {
		.endpoint_id = endpoint_id,
		.egress = (__u8)dir,
	};

	bpf_map_update_elem(&policy_flows, &key, &val, BPF_ANY);
}

/*
 * sock4_egress checks a connect() or an unconnected sendmsg() of a process
 * in an endpoint. It runs after the socket load balancer, so the
 * destination is the backend, the address the packets will carry.
 */
static __always_inline int sock4_egress(struct bpf_sock_addr *ctx)
{
	__u8 protocol = (__u8)ctx->protocol;
	__be32 dst = ctx->user_ip4;
	__be16 dport = (__be16)ctx->user_port;
	struct policy_endpoint *ep;
	__u32 ep_id, flags;
	__u64 cookie;

	if (protocol != IPPROTO_TCP && protocol != IPPROTO_UDP)
		return 1;
	ep = endpoint_of_current();
	if (!ep)
		return 1;
	ep_id = ep->endpoint_id;
	flags = ep->flags;
	/* An endpoint that enforces nothing needs no flows either. */
	if (!(flags & (EP_ENFORCE_INGRESS | EP_ENFORCE_EGRESS)))
		return 1;

	cookie = bpf_get_socket_cookie(ctx);
	/* A known flow: a UDP socket sending again to the same peer, or a
	 * server's reply to a datagram its ingress policy let in. */
	if (flow_known(cookie, dst, dport, protocol))
		return 1;
	if ((flags & EP_ENFORCE_EGRESS) && !decide(ep_id, flags, dst, DIR_EGRESS, protocol, dport))
		return 0; /* connect() and sendmsg() fail with EPERM */
	/* Also with egress not enforced: the replies need the flow to pass
	 * an enforced ingress. */
	remember_flow(cookie, dst, dport, protocol, ep_id, DIR_EGRESS);
	return 1;
}

SEC("cgroup/connect4")
int policy_connect4(struct bpf_sock_addr *ctx)
{
	return sock4_egress(ctx);
}

SEC("cgroup/sendmsg4")
int policy_sendmsg4(struct bpf_sock_addr *ctx)
{
	return sock4_egress(ctx);
}

/* What the skb programs need of an IPv4 packet. */
struct pkt4 {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 protocol;
};

#define IP_FRAG_OFFSET 0x1fff

/*
 * parse4 reads the addresses, protocol and (TCP, UDP, SCTP) ports of the
 * packet; the data of a cgroup_skb program starts at the IP header.
 * Other protocols, and fragments after the first, have port 0. Returns
 * -1 when not even the IP header can be read.
 */
static __always_inline int parse4(struct __sk_buff *skb, struct pkt4 *p)
{
	struct iphdr iph;
	__be16 ports[2];

	if (bpf_skb_load_bytes(skb, 0, &iph, sizeof(iph)) < 0)
		return -1;
	p->saddr = iph.saddr;
	p->daddr = iph.daddr;
	p->protocol = iph.protocol;
	p->sport = 0;
	p->dport = 0;
	if (iph.frag_off & bpf_htons(IP_FRAG_OFFSET))
		return 0;
	switch (iph.protocol) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		/* The three start with source and destination port. */
		if (bpf_skb_load_bytes(skb, iph.ihl * 4, ports, sizeof(ports)) < 0)
			return 0;
		p->sport = ports[0];
		p->dport = ports[1];
	}
	return 0;
}

SEC("cgroup_skb/ingress")
int policy_ingress(struct __sk_buff *skb)
{
	struct policy_endpoint *ep;
	__u32 ep_id, flags;
	struct pkt4 p;
	__u64 cookie;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 1;
	ep = endpoint_of_skb(skb);
	if (!ep)
		return 1;
	ep_id = ep->endpoint_id;
	flags = ep->flags;
	if (!(flags & (EP_ENFORCE_INGRESS | EP_ENFORCE_EGRESS)))
		return 1;
	/* The kernel checked the IP header before any socket saw it. */
	if (parse4(skb, &p) < 0)
		return 1;
	/* With only egress enforced, ingress is here for the UDP flows its
	 * replies need. */
	if (!(flags & EP_ENFORCE_INGRESS) && p.protocol != IPPROTO_UDP)
		return 1;

	cookie = bpf_get_socket_cookie(skb);
	/* A reply of a flow the endpoint opened, or more of one let in. */
	if (flow_known(cookie, p.saddr, p.sport, p.protocol))
		return 1;
	if ((flags & EP_ENFORCE_INGRESS) &&
	    !decide(ep_id, flags, p.saddr, DIR_INGRESS, p.protocol, p.dport))
		return 0;
	/* TCP is remembered by sockops once accepted (the SYN arrives on the
	 * listener, whose cookie is not the connection's); a UDP socket's
	 * replies go out on the socket that received, so remember it here. */
	if (p.protocol == IPPROTO_UDP)
		remember_flow(cookie, p.saddr, p.sport, p.protocol, ep_id, DIR_INGRESS);
	return 1;
}

SEC("cgroup_skb/egress")
int policy_egress(struct __sk_buff *skb)
{
	struct policy_endpoint *ep;
	struct bpf_sock *sk;
	__u32 ep_id, flags;
	struct pkt4 p;
	__u64 cookie;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 1;
	ep = endpoint_of_skb(skb);
	if (!ep)
		return 1;
	ep_id = ep->endpoint_id;
	flags = ep->flags;
	if (!(flags & EP_ENFORCE_EGRESS))
		return 1;
	if (parse4(skb, &p) < 0)
		return 1;

	cookie = bpf_get_socket_cookie(skb);
	if (flow_known(cookie, p.daddr, p.dport, p.protocol))
		return 1;
	/* A SYN-ACK leaves on the listener (its request socket is not a full
	 * socket, so the kernel runs the hook with the listener): it answers
	 * a SYN that ingress already judged. */
	if (p.protocol == IPPROTO_TCP) {
		sk = skb->sk;
		if (sk) {
			sk = bpf_sk_fullsock(sk);
			if (sk && sk->state == BPF_TCP_LISTEN)
				return 1;
		}
	}
	if (!decide(ep_id, flags, p.daddr, DIR_EGRESS, p.protocol, p.dport))
		return 0;
	remember_flow(cookie, p.daddr, p.dport, p.protocol, ep_id, DIR_EGRESS);
	return 1;
}

/*
 * policy_sockops remembers every TCP connection a listener accepts: its
 * SYN and final ACK passed ingress on the listener, and from now on both
 * directions of the connection are its flow (the server's replies pass
 * its egress policy, the client's next packets skip the policy lookup).
 *
 * Sockops has no helper that gives a socket's cgroup (the ancestor helpers
 * are refused, and the current task is whoever the softirq interrupted),
 * so the endpoint is not known here: the flow says endpoint 0, and
 * connections accepted outside any endpoint are remembered too (one LRU
 * update per accepted connection).
 */
SEC("sockops")
int policy_sockops(struct bpf_sock_ops *ctx)
{
	if (ctx->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	switch (ctx->family) {
	case AF_INET:
		break;
	case AF_INET6:
		/* An IPv4 client of a dual-stack listener (an IPv6 wildcard,
		 * as most servers open) has a mapped address, ::ffff:a.b.c.d,
		 * and IPv4 packets; remote_ip4 holds its address as for any
		 * IPv4 socket. */
		if (ctx->remote_ip6[0] == 0 && ctx->remote_ip6[1] == 0 &&
		    ctx->remote_ip6[2] == bpf_htonl(0xffff))
			break;
		return 1;
	default:
		return 1;
	}
	/* remote_port holds the port in network order in its upper 16 bits:
	 * the kernel loads sk_dport and shifts it left by 16 (little endian;
	 * the object is only built for bpfel). */
	remember_flow(bpf_get_socket_cookie(ctx), ctx->remote_ip4, (__be16)(ctx->remote_port >> 16),
		      IPPROTO_TCP, 0, DIR_INGRESS);
	return 1;
}

char __license[] SEC("license") = "Dual BSD/GPL";
