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
 * Each decision on a new connection or flow, never a packet of a known
 * one, is reported in policy_events, a ring buffer the agent reads: which
 * endpoint, peer, ports, verdict, why, and the cookie of the entry that
 * decided. The programs never wait for the reader: an event that finds
 * the ring full is counted as lost in policy_stats. Nor do they wake it up
 * for each event (see emit): the reader polls.
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
	__u8 flags;           /* POLICY_DENY, POLICY_AUDIT */
	__u8 port_prefix_len; /* for people: the lookup does not return it */
	__u16 pad;
	__u32 cookie;
};

/* policy_endpoints: cgroup id (u64) -> endpoint. */
struct policy_endpoint {
	__u32 endpoint_id;
	__u32 flags; /* EP_ENFORCE_*, EP_AUDIT, EP_AUDIT_DEFAULT_* */
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

/*
 * policy_events: one decision, seen from the endpoint. Addresses and ports
 * are in network order; a connect4 or sendmsg4 event has the socket's own
 * address and port when it is bound already, else 0.
 */
struct policy_event {
	__u64 time_ns; /* bpf_ktime_get_ns() */
	__u32 endpoint_id;
	__u32 remote_identity;
	__u32 cookie; /* of the entry that decided, 0 when none did */
	__be32 local_addr;
	__be32 remote_addr;
	__be16 local_port;
	__be16 remote_port;
	__u8 protocol;
	__u8 direction; /* enum direction */
	__u8 verdict;   /* enum verdict */
	__u8 reason;    /* enum reason */
	__u8 hook;      /* enum hook */
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
	__uint(max_entries, 9); /* STATS_ENTRIES */
} policy_stats SEC(".maps");

/* The agent's map replaces this one, with the size it was told. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} policy_events SEC(".maps");

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
/* A deny entry that only audits: what it matches is allowed, as audited. */
#define POLICY_AUDIT 0x2

#define EP_ENFORCE_INGRESS 0x1
#define EP_ENFORCE_EGRESS 0x2
/* Nothing is denied: what would be is allowed, as audited. */
#define EP_AUDIT 0x4
/* The default deny of a direction only audits; deny entries still deny. */
#define EP_AUDIT_DEFAULT_INGRESS 0x8
#define EP_AUDIT_DEFAULT_EGRESS 0x10

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

/* policy_stats index: direction * VERDICTS + verdict, then STATS_LOST. */
enum verdict {
	VERDICT_ALLOWED = 0,
	VERDICT_DENIED = 1,
	VERDICT_AUDITED = 2,
	VERDICTS = 4,
};

/* Events that found policy_events full. */
#define STATS_LOST (2 * VERDICTS)
#define STATS_ENTRIES (STATS_LOST + 1)

/* Why a decision was taken, as policy_events says it. */
enum reason {
	REASON_ENTRY = 0,        /* an entry matched: its cookie is reported */
	REASON_DEFAULT_DENY = 1, /* none did, in an enforced direction */
	REASON_NO_POLICY = 2,    /* the direction is not enforced */
};

/* The program that decided, as policy_events says it. */
enum hook {
	HOOK_CONNECT4 = 0,
	HOOK_SENDMSG4 = 1,
	HOOK_INGRESS = 2,
	HOOK_EGRESS = 3,
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

/* An entry's cookie (upper half) and flags, with ENTRY_FOUND set, or 0
 * when nothing matches. The verdict works on these numbers, never on two
 * map pointers at once: clang may merge pointer tests into an OR of the
 * pointers, which the verifier refuses. */
#define ENTRY_FOUND 0x100

static __always_inline __u64 lookup_entry(const struct policy_key *key)
{
	struct policy_value *v = bpf_map_lookup_elem(&policy, key);

	return v ? (__u64)v->cookie << 32 | ENTRY_FOUND | v->flags : 0;
}

/* A decision, and what policy_events reports of it. */
struct decision {
	__u32 identity; /* the peer's */
	__u32 cookie;   /* of the entry that decided, 0 when none did */
	__u8 verdict;   /* enum verdict */
	__u8 reason;    /* enum reason */
};

static __always_inline struct decision by_entry(__u64 entry, enum verdict v)
{
	return (struct decision){
		.cookie = (__u32)(entry >> 32),
		.verdict = v,
		.reason = REASON_ENTRY,
	};
}

/* A deny entry that denies, not one that only audits. */
#define ENFORCED_DENY(entry) (((entry) & (POLICY_DENY | POLICY_AUDIT)) == POLICY_DENY)

/*
 * lookup_verdict applies the policy of an endpoint to a peer and port. The
 * longest match for the peer's own identity comes first, then the longest
 * for any peer (identity 0): a deny in either wins; else an audited deny
 * in either makes it audited; else an entry in either allows; else
 * nothing does (default deny). The entry that decided is the peer's own
 * when both could have.
 */
static __always_inline struct decision lookup_verdict(__u32 endpoint_id, __u32 identity,
						       enum direction dir, __u8 protocol,
						       __be16 dport)
{
	struct policy_key key = {
		.prefixlen = POLICY_LOOKUP_BITS,
		.endpoint_id = endpoint_id,
		.identity = identity,
		.egress = (__u8)dir,
		.protocol = protocol,
		.dport = dport,
	};
	__u64 l3, l4;

	l3 = lookup_entry(&key);
	if (ENFORCED_DENY(l3))
		return by_entry(l3, VERDICT_DENIED);
	key.identity = 0;
	l4 = lookup_entry(&key);
	if (ENFORCED_DENY(l4))
		return by_entry(l4, VERDICT_DENIED);
	if (l3 & POLICY_DENY)
		return by_entry(l3, VERDICT_AUDITED);
	if (l4 & POLICY_DENY)
		return by_entry(l4, VERDICT_AUDITED);
	if (l3 & ENTRY_FOUND)
		return by_entry(l3, VERDICT_ALLOWED);
	if (l4 & ENTRY_FOUND)
		return by_entry(l4, VERDICT_ALLOWED);
	return (struct decision){ .verdict = VERDICT_DENIED, .reason = REASON_DEFAULT_DENY };
}

static __always_inline void count_at(__u32 idx)
{
	__u64 *n = bpf_map_lookup_elem(&policy_stats, &idx);

	/* Per CPU, but a packet's softirq can interrupt a connect() on the
	 * same CPU: an atomic add keeps both counts. */
	if (n)
		__sync_fetch_and_add(n, 1);
}

static __always_inline void count(enum direction dir, enum verdict v)
{
	count_at((__u32)dir * VERDICTS + (__u32)v);
}

/* A connection or packet, seen from the endpoint (network order). */
struct conn4 {
	__be32 local_addr;
	__be32 remote_addr;
	__be16 local_port;
	__be16 remote_port;
	__u8 protocol;
};

/*
 * decide applies the endpoint's policy in direction dir to c, and counts
 * the decision. A denial is audited instead when the endpoint audits
 * everything, or when it is a default deny that the endpoint audits in
 * that direction.
 */
static __always_inline struct decision decide(__u32 endpoint_id, __u32 ep_flags,
					      const struct conn4 *c, enum direction dir)
{
	__u32 audit_default = dir == DIR_EGRESS ? EP_AUDIT_DEFAULT_EGRESS : EP_AUDIT_DEFAULT_INGRESS;
	__be16 dport = dir == DIR_EGRESS ? c->remote_port : c->local_port;
	__u32 identity = identity_of(c->remote_addr);
	struct decision d = lookup_verdict(endpoint_id, identity, dir, c->protocol, dport);

	d.identity = identity;
	if (d.verdict == VERDICT_DENIED &&
	    ((ep_flags & EP_AUDIT) ||
	     (d.reason == REASON_DEFAULT_DENY && (ep_flags & audit_default))))
		d.verdict = VERDICT_AUDITED;
	count(dir, d.verdict);
	return d;
}

/* The decision of a direction the endpoint does not enforce; not counted. */
static __always_inline struct decision no_policy(const struct conn4 *c)
{
	return (struct decision){
		.identity = identity_of(c->remote_addr),
		.verdict = VERDICT_ALLOWED,
		.reason = REASON_NO_POLICY,
	};
}

/*
 * The reader is woken when this share of the ring (1/8) waits to be read,
 * not for each event: a wakeup is an interrupt (in a VM, an exit), and
 * costs several times the rest of a decision. Below that, the reader
 * finds the events when it polls.
 */
#define EVENTS_WAKEUP_SHIFT 3

/*
 * emit puts ev into policy_events. It never waits for room: when the ring
 * is full (the agent reads too slowly, or not at all), the event is
 * counted as lost instead. Out of line, so that struct policy_event is in
 * the object's BTF, where a test compares it with the agent's Go type.
 */
static __noinline void emit(const struct policy_event *ev)
{
	struct policy_event *e = bpf_ringbuf_reserve(&policy_events, sizeof(*e), 0);
	__u64 pending, wakeup_at;

	if (!e) {
		count_at(STATS_LOST);
		return;
	}
	*e = *ev;
	pending = bpf_ringbuf_query(&policy_events, BPF_RB_AVAIL_DATA);
	wakeup_at = bpf_ringbuf_query(&policy_events, BPF_RB_RING_SIZE) >> EVENTS_WAKEUP_SHIFT;
	bpf_ringbuf_submit(e, pending >= wakeup_at ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

/* report puts the decision d on c into policy_events. */
static __always_inline void report(__u32 endpoint_id, const struct decision *d,
				   const struct conn4 *c, enum direction dir, enum hook hook)
{
	struct policy_event ev = {
		.time_ns = bpf_ktime_get_ns(),
		.endpoint_id = endpoint_id,
		.remote_identity = d->identity,
		.cookie = d->cookie,
		.local_addr = c->local_addr,
		.remote_addr = c->remote_addr,
		.local_port = c->local_port,
		.remote_port = c->remote_port,
		.protocol = c->protocol,
		.direction = (__u8)dir,
		.verdict = d->verdict,
		.reason = d->reason,
		.hook = (__u8)hook,
	};

	emit(&ev);
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
 * destination is the backend, the address the packets will carry. src is
 * the source a sendmsg() asks for, 0 for none.
 */
static __always_inline int sock4_egress(struct bpf_sock_addr *ctx, enum hook hook, __be32 src)
{
	struct conn4 c = {
		.remote_addr = ctx->user_ip4,
		.remote_port = (__be16)ctx->user_port,
		.protocol = (__u8)ctx->protocol,
	};
	struct policy_endpoint *ep;
	struct bpf_sock *sk;
	struct decision d;
	__u32 ep_id, flags;
	__u64 cookie;

	if (c.protocol != IPPROTO_TCP && c.protocol != IPPROTO_UDP)
		return 1;
	ep = endpoint_of_current();
	if (!ep)
		return 1;
	ep_id = ep->endpoint_id;
	flags = ep->flags;

	cookie = bpf_get_socket_cookie(ctx);
	/* A known flow: a UDP socket sending again to the same peer, or a
	 * server's reply to a datagram its ingress policy let in. */
	if (flow_known(cookie, c.remote_addr, c.remote_port, c.protocol))
		return 1;
	/* The socket's own address and port, if bound already (an unbound
	 * one gets them after this program). */
	sk = ctx->sk;
	c.local_addr = src ? src : sk->src_ip4;
	c.local_port = bpf_htons((__u16)sk->src_port);

	if (flags & EP_ENFORCE_EGRESS) {
		d = decide(ep_id, flags, &c, DIR_EGRESS);
		report(ep_id, &d, &c, DIR_EGRESS, hook);
		if (d.verdict == VERDICT_DENIED)
			return 0; /* connect() and sendmsg() fail with EPERM */
	} else {
		d = no_policy(&c);
		report(ep_id, &d, &c, DIR_EGRESS, hook);
		/* Each connect() is reported; a connection of an endpoint
		 * that enforces nothing needs no flow. */
		if (hook == HOOK_CONNECT4 && !(flags & EP_ENFORCE_INGRESS))
			return 1;
	}
	/* Also with egress not enforced: the replies need the flow to pass
	 * an enforced ingress, and the next datagrams to the peer are not
	 * reported again. */
	remember_flow(cookie, c.remote_addr, c.remote_port, c.protocol, ep_id, DIR_EGRESS);
	return 1;
}

SEC("cgroup/connect4")
int policy_connect4(struct bpf_sock_addr *ctx)
{
	return sock4_egress(ctx, HOOK_CONNECT4, 0);
}

SEC("cgroup/sendmsg4")
int policy_sendmsg4(struct bpf_sock_addr *ctx)
{
	/* The source of an IP_PKTINFO message, if any. */
	return sock4_egress(ctx, HOOK_SENDMSG4, ctx->msg_src_ip4);
}

/* What the skb programs need of an IPv4 packet. */
struct pkt4 {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 protocol;
	__u8 l4_off; /* where the TCP, UDP or SCTP header starts */
};

#define IP_FRAG_OFFSET 0x1fff
/* The flags byte of a TCP header, and its SYN bit. */
#define TCP_FLAGS_OFF 13
#define TCP_FLAG_SYN 0x02

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
	p->l4_off = iph.ihl * 4;
	if (iph.frag_off & bpf_htons(IP_FRAG_OFFSET))
		return 0;
	switch (iph.protocol) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		/* The three start with source and destination port. */
		if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
			return 0;
		p->sport = ports[0];
		p->dport = ports[1];
	}
	return 0;
}

/* on_listener tells whether the packet's socket is a TCP listener. */
static __always_inline int on_listener(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;

	if (!sk)
		return 0;
	sk = bpf_sk_fullsock(sk);
	return sk && sk->state == BPF_TCP_LISTEN;
}

/*
 * opens_flow tells whether an incoming packet that policy judged starts a
 * flow. Every one does but a TCP packet without SYN to a listener: the
 * last ACK of a handshake (its SYN was judged, and reported, already).
 */
static __always_inline int opens_flow(struct __sk_buff *skb, const struct pkt4 *p)
{
	__u8 tcp_flags;

	if (p->protocol != IPPROTO_TCP || !on_listener(skb))
		return 1;
	if (bpf_skb_load_bytes(skb, p->l4_off + TCP_FLAGS_OFF, &tcp_flags, 1) < 0)
		return 1;
	return tcp_flags & TCP_FLAG_SYN;
}

SEC("cgroup_skb/ingress")
int policy_ingress(struct __sk_buff *skb)
{
	struct policy_endpoint *ep;
	struct decision d;
	struct conn4 c;
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
	if (flags & EP_ENFORCE_INGRESS) {
		c = (struct conn4){
			.local_addr = p.daddr,
			.remote_addr = p.saddr,
			.local_port = p.dport,
			.remote_port = p.sport,
			.protocol = p.protocol,
		};
		d = decide(ep_id, flags, &c, DIR_INGRESS);
		/* The handshake's last ACK is judged again, but a TCP
		 * connection is one decision, its SYN's: only a denial of
		 * it is reported. */
		if (d.verdict == VERDICT_DENIED || opens_flow(skb, &p))
			report(ep_id, &d, &c, DIR_INGRESS, HOOK_INGRESS);
		if (d.verdict == VERDICT_DENIED)
			return 0;
	}
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
	struct decision d;
	struct conn4 c;
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
	if (p.protocol == IPPROTO_TCP && on_listener(skb))
		return 1;
	c = (struct conn4){
		.local_addr = p.saddr,
		.remote_addr = p.daddr,
		.local_port = p.sport,
		.remote_port = p.dport,
		.protocol = p.protocol,
	};
	d = decide(ep_id, flags, &c, DIR_EGRESS);
	report(ep_id, &d, &c, DIR_EGRESS, HOOK_EGRESS);
	if (d.verdict == VERDICT_DENIED)
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
