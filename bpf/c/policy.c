// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Network policy enforcement at the cgroup level, IPv4 and IPv6.
 *
 * An endpoint is a pod's cgroup, registered in policy_endpoints; the
 * processes in it, or in any cgroup below it, are the endpoint. Their
 * connect() and sendmsg() are checked against the endpoint's egress policy
 * (cgroup/connect4, connect6, sendmsg4, sendmsg6), their packets against
 * both directions (cgroup_skb/ingress, cgroup_skb/egress). An IPv4-mapped
 * address (::ffff:a.b.c.d) is judged as the IPv4 address it is.
 *
 * A flow that was allowed one way is remembered with its socket, in the
 * socket's own storage (policy_sk, freed with the socket), so that its
 * replies pass whatever the other direction says; sockops remembers the
 * TCP connections a listener accepts. No endpoint's traffic can push out
 * another's flows: each socket holds FLOW_SLOTS peers, and only its own
 * traffic replaces them. A listener never uses what its socket remembered
 * before listen().
 *
 * A cgroup marked EP_POD_TREE (the kubelet's kubepods tree) makes every
 * process below it that is in no endpoint unclassified: denied both ways
 * until the agent registers its pod. The programs and maps are pinned, so
 * this holds while the agent is away.
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
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "addr.h"
#include "dns_redirect.h"

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
	__u8 flags;           /* POLICY_DENY, POLICY_AUDIT, POLICY_POD_ADDRS, POLICY_FINAL, POLICY_PASS, POLICY_DROP */
	__u8 port_prefix_len; /* for people: the lookup does not return it */
	__u16 pad;
	__u32 cookie;
};

/* policy_endpoints: cgroup id (u64) -> endpoint. */
struct policy_endpoint {
	__u32 endpoint_id;
	__u32 flags; /* EP_ENFORCE_*, EP_AUDIT, EP_AUDIT_DEFAULT_*, EP_POD_TREE, EP_DNS, EP_IFACE */
};

/* policy_sk: a flow the socket may carry, seen from the endpoint. */
struct flow_slot {
	union v6addr peer;
	__be16 peer_port;
	__u8 protocol;
	__u8 used;
};

#define FLOW_SLOTS 8

/* policy_sk: what a socket remembers (socket storage, freed with it). */
struct policy_sk {
	struct bpf_spin_lock lock;
	__u8 next; /* the slot the next new flow takes */
	__u8 pad[3];
	struct flow_slot slots[FLOW_SLOTS];
};

/*
 * policy_events: one decision, seen from the endpoint. Addresses are IPv6
 * or IPv4-mapped, ports in network order; a connect or sendmsg event has
 * the socket's own address and port when it is bound already, else 0.
 */
struct policy_event {
	__u64 time_ns; /* bpf_ktime_get_ns() */
	__u32 endpoint_id;
	__u32 remote_identity;
	__u32 cookie; /* of the entry that decided, 0 when none did */
	union v6addr local_addr;
	union v6addr remote_addr;
	__be16 local_port;
	__be16 remote_port;
	__u8 protocol;
	__u8 direction; /* enum direction */
	__u8 verdict;   /* enum verdict */
	__u8 reason;    /* enum reason */
	__u8 hook;      /* enum hook */
	__u8 family;    /* 4 or 6: how the peer was judged */
	__u8 pad[2];
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

/*
 * policy_endpoints_gen: one counter the agent increments after each change
 * of policy_endpoints. policy_cgroup_cache (the programs' own) remembers
 * what the ancestor walk found for a socket's or process's cgroup, and
 * the counter it read before walking: an entry of an older counter is
 * walked again. A cgroup then costs one lookup per hook instead of one per
 * level, most of a connection's program time where nothing is enforced.
 * Used only when the loader sets endpoint_cache (it has the agent's
 * counter): with the object's own, nothing would ever increment it.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} policy_endpoints_gen SEC(".maps");

struct ep_cache {
	__u64 gen;
	__u32 id;
	__u32 flags;
	__u32 found;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, __u64); /* the cgroup's own ID */
	__type(value, struct ep_cache);
	__uint(max_entries, 8192);
} policy_cgroup_cache SEC(".maps");

volatile const __u32 endpoint_cache = 0;

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__type(key, int);
	__type(value, struct policy_sk);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy_sk SEC(".maps");

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

/*
 * policy_event_budget: each endpoint's share of policy_events, per CPU (a
 * token bucket counted in nanoseconds of credit), and the events its
 * budget dropped. policy_events is one ring for every endpoint: without a
 * budget, one pod's flood of denials would fill it and other pods'
 * verdicts would be lost; with it, a flooding pod loses its own events.
 * Budgets apply only while the ring fills (see emit), so that a busy pod
 * loses nothing while the reader keeps up.
 * The loader may set other rates (events_per_sec, events_burst).
 */
struct event_budget {
	__u64 credit_ns; /* events_per_sec: NSEC_PER_SEC / events_per_sec each */
	__u64 last_ns;   /* when credit_ns was last brought up to date */
	__u64 lost;      /* events dropped for want of credit */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, __u32); /* endpoint ID, 0 for a pod tree's processes */
	__type(value, struct event_budget);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy_event_budget SEC(".maps");

/* Events an endpoint may emit a second, and at once, on each CPU. */
volatile const __u32 events_per_sec = 2000;
volatile const __u32 events_burst = 512;

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct ipcache_key);
	__type(value, struct remote_endpoint_info);
	__uint(max_entries, 512000);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} ipcache SEC(".maps");

/*
 * policy_prefixes: the prefixes policies name, alone, each with the
 * identity an address outside the cluster inside it has (its cidr:
 * labels), where the ipcache gives a pod's, node's or the host's address
 * their own identity. See by_address.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct ipcache_key);
	__type(value, struct remote_endpoint_info);
	__uint(max_entries, 512000);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy_prefixes SEC(".maps");

/* policy_ifaces: the host side of a pod's interface -> the pod. */
#define IFACE_ADDRS 4

struct policy_iface {
	__u64 cgroup_id; /* the pod's cgroup, its key in policy_endpoints */
	__u32 flags;     /* IFACE_* */
	__u8 naddrs;     /* how many of addrs are the pod's */
	__u8 pad[3];
	union v6addr addrs[IFACE_ADDRS]; /* the only sources the pod may use */
	/* The pod's network namespace, by its id in the host's (the host
	 * side's IFLA_LINK_NETNSID), when flags has IFACE_NETNS: where the
	 * kernel is asked for the pod's TCP connections (pod_connection). */
	__s32 netns_id;
	__u32 pad2;
};

/* A pod whose cgroup is in no endpoint (not registered yet, or no
 * identity yet) is denied both ways (--unclassified-pods=deny). */
#define IFACE_UNCLASSIFIED_DENY 0x1
/* netns_id is the pod's network namespace. */
#define IFACE_NETNS 0x2

/* policy_iface_flows (one map per interface): a flow of the pod that was
 * allowed one way, so that its packets the other way pass. */
struct iface_flow {
	union v6addr peer;
	__be16 peer_port;
	__be16 local_port;
	__u8 protocol;
	__u8 pad[3];
};

/* policy_iface_frags (one map per interface): the first fragment of a
 * datagram passed, so the later ones (which carry no ports) do. Per
 * interface, so that no pod's fragments can push out another pod's. */
struct iface_frag {
	__u32 id; /* the IPv4 identification or the IPv6 fragment id */
	union v6addr saddr;
	union v6addr daddr;
	__u8 protocol;
	__u8 pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct policy_iface);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} policy_ifaces SEC(".maps");

/* The inner maps are the agent's, made per interface with this layout. */
struct iface_flows {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct iface_flow);
	__type(value, __u32);
	__uint(max_entries, 4096);
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, 65536);
	__array(values, struct iface_flows);
} policy_iface_flows SEC(".maps");

/* The inner maps are the agent's, made per interface with this layout. */
struct iface_frags {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct iface_frag);
	__type(value, __u32);
	__uint(max_entries, 1024);
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, 65536);
	__array(values, struct iface_frags);
} policy_iface_frags SEC(".maps");

/* Packet-level counts: direction * VERDICTS + verdict, then the
 * IFACE_STATS_* drops. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 12); /* IFACE_STATS_ENTRIES */
} policy_iface_stats SEC(".maps");

/* linux/socket.h has no address families. */
#define AF_INET 2
#define AF_INET6 10

#define POLICY_DENY 0x1
/* A deny entry that only audits: what it matches is allowed, as audited. */
#define POLICY_AUDIT 0x2
/* An allow entry a NetworkPolicy ipBlock made: it matches the addresses
 * inside the block, a pod's too (by_address). */
#define POLICY_POD_ADDRS 0x4
/* An entry of the peer's own identity whose decision the agent computed
 * from every layer (ClusterNetworkPolicy Admin tier, NetworkPolicy and
 * CNP, Baseline tier, the identity-0 entries included): it decides alone,
 * the identity-0 lookup is not made. */
#define POLICY_FINAL 0x8
/* An entry of the peer's own identity that decides nothing (an Admin tier
 * Pass, then no rule below matched): the lookup goes on as if it had not
 * matched, by identity 0, then the default; its cookie names the Pass in
 * a default deny's event. */
#define POLICY_PASS 0x10
/* A deny entry a ClusterNetworkPolicy Deny rule decided (Admin or
 * Baseline tier): the API says it drops. The socket hooks let it through
 * where the endpoint's interface is enforced (EP_IFACE), and the
 * interface program drops it (dropped_at_iface); elsewhere it is EPERM
 * as any deny. */
#define POLICY_DROP 0x20

/* The identity of an endpoint's reference entry: its cookie is the ID of
 * the policy set (a pseudo-endpoint) whose allows it shares in that
 * direction. No identity is this number. */
#define POLICY_SET_REF 0xffffffff

#define EP_ENFORCE_INGRESS 0x1
#define EP_ENFORCE_EGRESS 0x2
/* Nothing is denied: what would be is allowed, as audited. */
#define EP_AUDIT 0x4
/* The default deny of a direction only audits; deny entries still deny. */
#define EP_AUDIT_DEFAULT_INGRESS 0x8
#define EP_AUDIT_DEFAULT_EGRESS 0x10
/* Not an endpoint: the root of the kubelet's pod cgroups. A process below
 * it in no endpoint is unclassified. */
#define EP_POD_TREE 0x20
/* The endpoint's egress policy has a DNS rule: its DNS goes to the proxy
 * (dns_redirect.h). */
#define EP_DNS 0x40
/* The endpoint's pod interface is enforced: policy_from_pod and
 * policy_to_pod are attached to its host side, and its policy_ifaces
 * entry names the endpoint's cgroup. Only then may a POLICY_DROP deny
 * pass the socket hooks, to be dropped there. */
#define EP_IFACE 0x80
/* With EP_IFACE, the index of the interface's pod side in the pod's
 * network namespace (bits 16-30): only a packet leaving by it crosses the
 * interface. */
#define EP_IFINDEX_SHIFT 16
#define EP_IFINDEX_MASK 0x7fff
/* Never in the map: what endpoint_of says of an unclassified process. */
#define EP_UNCLASSIFIED 0x80000000

/* endpoint_id + identity + egress + protocol + port, all matched. */
#define POLICY_LOOKUP_BITS 96
/* cluster_id + pad + family precede the address in the ipcache key. */
#define IPCACHE_STATIC_BITS 32
#define IPCACHE_FAMILY_IPV4 1
#define IPCACHE_FAMILY_IPV6 2
/* reserved:world, the identity of any address the ipcache does not know. */
#define IDENTITY_WORLD 2
/* The first identity that is no reserved one (host, world, remote-node...):
 * workloads', then CIDRs'. */
#define IDENTITY_MIN_CLUSTER 256

/* Deeper endpoint cgroups than this are not found; a pod's cgroup sits a
 * handful of levels down (kubepods/<qos>/<pod>), so this is plenty. */
#define MAX_CGROUP_LEVEL 16

#define IPPROTO_ICMPV6_ 58

/* A read of a context field where the code says, by its own offset. */
#define READ_CTX(field) (*(volatile typeof(field) *)&(field))

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
	REASON_UNCLASSIFIED = 3, /* a pod cgroup the agent has not registered */
	REASON_SPOOFED = 4,      /* a pod's packet from an address not its own */
	REASON_DNS_PROXY = 5,    /* DNS of an endpoint with a DNS rule that
				  * cannot go to the proxy (dns_redirect.h) */
	REASON_DNS_BYPASS = 6,   /* a packet to port 53 of an endpoint with a
				  * DNS rule that did not go to the proxy */
	REASON_UNPARSABLE = 7,   /* a packet whose headers cannot be read to
				  * the ports (parse) */
	REASON_NOT_ROUTER = 8,   /* a router's ICMPv6 (advertisement,
				  * redirect) from a pod (link_control) */
};

/* The program that decided, as policy_events says it. */
enum hook {
	HOOK_CONNECT4 = 0,
	HOOK_SENDMSG4 = 1,
	HOOK_INGRESS = 2,
	HOOK_EGRESS = 3,
	HOOK_CONNECT6 = 4,
	HOOK_SENDMSG6 = 5,
	HOOK_FROM_POD = 6, /* tc, the host side of the pod's interface */
	HOOK_TO_POD = 7,
};

/* Packets from a pod with a source not its own, frames that are neither
 * IP nor ARP, IP packets whose headers cannot be read (parse), and later
 * fragments whose first fragment the interface does not know (it was
 * denied, or pushed out by the pod's newer ones). */
#define IFACE_STATS_SPOOFED (2 * VERDICTS)
#define IFACE_STATS_NOT_IP (IFACE_STATS_SPOOFED + 1)
#define IFACE_STATS_UNPARSABLE (IFACE_STATS_NOT_IP + 1)
#define IFACE_STATS_FRAG_UNKNOWN (IFACE_STATS_UNPARSABLE + 1)

/* The endpoint a process or packet belongs to. */
struct ep_ref {
	__u32 id;
	__u32 flags;
};

/*
 * found_endpoint fills out from the policy_endpoints entry of one ancestor
 * cgroup: 1 when it is the endpoint, 0 to keep walking (none, or a pod
 * tree, which *tree then records).
 */
static __always_inline int found_endpoint(struct policy_endpoint *ep, struct ep_ref *out, __u32 *tree)
{
	if (!ep)
		return 0;
	if (ep->flags & EP_POD_TREE) {
		*tree = ep->flags | EP_POD_TREE;
		return 0;
	}
	out->id = ep->endpoint_id;
	out->flags = ep->flags;
	return 1;
}

/* unclassified fills out for a process of a pod tree in no endpoint:
 * enforced both ways with nothing allowed, audited if the tree says so. */
static __always_inline int unclassified(__u32 tree, struct ep_ref *out)
{
	if (!tree)
		return 0;
	out->id = 0;
	out->flags = EP_ENFORCE_INGRESS | EP_ENFORCE_EGRESS | EP_UNCLASSIFIED | (tree & EP_AUDIT);
	return 1;
}

/* cache_gen reads policy_endpoints_gen, 0 when the cache is off. */
static __always_inline __u64 cache_gen(void)
{
	__u32 zero = 0;
	__u64 *gen;

	if (!endpoint_cache)
		return 0;
	gen = bpf_map_lookup_elem(&policy_endpoints_gen, &zero);
	/* 0 is no counter: the agent's starts at 1. */
	return gen ? *gen : 0;
}

/* cached_endpoint returns 1 and fills *found and out when cgroup cg's
 * entry is of generation gen. */
static __always_inline int cached_endpoint(__u64 cg, __u64 gen, int *found, struct ep_ref *out)
{
	struct ep_cache *e;

	if (!gen || !cg)
		return 0;
	e = bpf_map_lookup_elem(&policy_cgroup_cache, &cg);
	if (!e || e->gen != gen)
		return 0;
	*found = e->found;
	out->id = e->id;
	out->flags = e->flags;
	return 1;
}

static __always_inline int cache_endpoint(__u64 cg, __u64 gen, int found, const struct ep_ref *out)
{
	struct ep_cache e = { .gen = gen, .found = found };

	if (!gen || !cg)
		return found;
	if (found) {
		e.id = out->id;
		e.flags = out->flags;
	}
	bpf_map_update_elem(&policy_cgroup_cache, &cg, &e, BPF_ANY);
	return found;
}

/*
 * The ancestor walks go from the top (level 1) down to the cgroup itself
 * (below it, the helpers return 0): the shallowest registered cgroup that
 * is not a pod tree is the endpoint, so a pod's containers (cgroups below
 * it) are the pod. The level-based helpers are the only way to see a
 * cgroup's ancestors; they differ between program types, hence two walks.
 * Both return 0 when the process or packet is no endpoint's;
 * endpoint_of_current and endpoint_of_skb walk only when the cache has
 * nothing of the current policy_endpoints_gen for the cgroup.
 */
static __always_inline int walk_current(struct ep_ref *out)
{
	__u32 tree = 0;

	for (int level = 1; level <= MAX_CGROUP_LEVEL; level++) {
		__u64 id = bpf_get_current_ancestor_cgroup_id(level);

		if (!id)
			break;
		if (found_endpoint(bpf_map_lookup_elem(&policy_endpoints, &id), out, &tree))
			return 1;
	}
	return unclassified(tree, out);
}

static __always_inline int endpoint_of_current(struct ep_ref *out)
{
	__u64 gen = cache_gen(), cg = gen ? bpf_get_current_cgroup_id() : 0;
	int found;

	if (cached_endpoint(cg, gen, &found, out))
		return found;
	/* gen was read before the walk: an entry the agent changes meanwhile
	 * comes with a newer counter, and this one is walked again. */
	return cache_endpoint(cg, gen, walk_current(out), out);
}

/* The same for the packet's socket, which may belong to no process that
 * is running now (softirq) or to another process than the current one. */
static __always_inline int walk_skb(struct __sk_buff *skb, struct ep_ref *out)
{
	__u32 tree = 0;

	for (int level = 1; level <= MAX_CGROUP_LEVEL; level++) {
		__u64 id = bpf_skb_ancestor_cgroup_id(skb, level);

		if (!id)
			break;
		if (found_endpoint(bpf_map_lookup_elem(&policy_endpoints, &id), out, &tree))
			return 1;
	}
	return unclassified(tree, out);
}

static __always_inline int endpoint_of_skb(struct __sk_buff *skb, struct ep_ref *out)
{
	__u64 gen = cache_gen(), cg = gen ? bpf_skb_cgroup_id(skb) : 0;
	int found;

	if (cached_endpoint(cg, gen, &found, out))
		return found;
	return cache_endpoint(cg, gen, walk_skb(skb, out), out);
}

/* prefix_identity returns the identity an LPM map keyed like the ipcache
 * (ipcache, policy_prefixes) gives an address, or none when it has no
 * prefix holding it: IPv4 (mapped) is looked up in the IPv4 family,
 * anything else in the IPv6 family. */
static __always_inline __u32 prefix_identity(void *map, const union v6addr *a, __u32 none)
{
	struct ipcache_key key = {};
	struct remote_endpoint_info *info;

	if (is_v4mapped(a)) {
		key.prefixlen = IPCACHE_STATIC_BITS + 32;
		key.family = IPCACHE_FAMILY_IPV4;
		__builtin_memcpy(key.addr, &a->p[3], 4);
	} else {
		key.prefixlen = IPCACHE_STATIC_BITS + 128;
		key.family = IPCACHE_FAMILY_IPV6;
		__builtin_memcpy(key.addr, a->addr, 16);
	}
	info = bpf_map_lookup_elem(map, &key);
	return info ? info->sec_identity : none;
}

/* identity_of returns the identity of a peer's address. */
static __always_inline __u32 identity_of(const union v6addr *a)
{
	return prefix_identity(&ipcache, a, IDENTITY_WORLD);
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
	__u8 drop;      /* the entry has POLICY_DROP */
};

static __always_inline struct decision by_entry(__u64 entry, enum verdict v)
{
	return (struct decision){
		.cookie = (__u32)(entry >> 32),
		.verdict = v,
		.reason = REASON_ENTRY,
		.drop = !!(entry & POLICY_DROP),
	};
}

/*
 * dropped_at_iface tells whether a socket hook lets denial d of an
 * endpoint's egress through, for the endpoint's interface to drop: a
 * ClusterNetworkPolicy Deny drops (a peer sees no answer, as the API
 * says), where every other denial is EPERM at once. Only where the
 * interface is enforced (EP_IFACE): anywhere else it is EPERM too, so
 * that nothing leaves because of it. No flow is remembered for it.
 */
static __always_inline int dropped_at_iface(const struct ep_ref *ep, const struct decision *d)
{
	return d->verdict == VERDICT_DENIED && d->drop && (ep->flags & EP_IFACE);
}

/* A deny entry that denies, not one that only audits. */
#define ENFORCED_DENY(entry) (((entry) & (POLICY_DENY | POLICY_AUDIT)) == POLICY_DENY)

/*
 * lookup_verdict applies the policy of an endpoint to a peer and port. The
 * longest match for the peer's own identity comes first, then the longest
 * for any peer (identity 0): a deny in either wins; else an audited deny
 * in either makes it audited; else an entry in either allows; else
 * nothing does (default deny). The entry that decided is the peer's own
 * when both could have. A POLICY_FINAL entry of the peer's own decides
 * alone (one lookup); a POLICY_PASS one counts as none. Before a default
 * deny, the endpoint's shared set may allow (two lookups more at most).
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

	__u32 passed = 0;

	l3 = lookup_entry(&key);
	if (l3 & POLICY_FINAL) {
		if (ENFORCED_DENY(l3))
			return by_entry(l3, VERDICT_DENIED);
		return by_entry(l3, (l3 & POLICY_DENY) ? VERDICT_AUDITED : VERDICT_ALLOWED);
	}
	if (l3 & POLICY_PASS) {
		passed = (__u32)(l3 >> 32);
		l3 = 0;
	}
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
	/* The allows of the endpoint's shared policy set, if it has one
	 * (the reference entry's cookie is the set's ID): only where its own
	 * entries leave a default deny, so a decided verdict costs what it
	 * did. A set holds no deny, and none of a tiered direction. */
	if (identity) {
		__u64 ref, shared;

		key.identity = POLICY_SET_REF;
		ref = lookup_entry(&key);
		if (ref & ENTRY_FOUND) {
			key.endpoint_id = (__u32)(ref >> 32);
			key.identity = identity;
			shared = lookup_entry(&key);
			if ((shared & (ENTRY_FOUND | POLICY_DENY)) == ENTRY_FOUND)
				return by_entry(shared, VERDICT_ALLOWED);
		}
	}
	return (struct decision){ .cookie = passed, .verdict = VERDICT_DENIED, .reason = REASON_DEFAULT_DENY };
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

/*
 * by_address gives a peer that no entry allows for its identity a second
 * chance, by its address: a NetworkPolicy ipBlock selects addresses,
 * pods' included, where every other peer a policy names (a CNP's CIDR
 * rule too, as in the reference) selects identities. The address is
 * looked up among the policy prefixes alone (policy_prefixes), and the
 * endpoint's entry for that prefix's identity decides if it is an allow
 * an ipBlock made (POLICY_POD_ADDRS); else d, a default deny, stands.
 * Only a workload's address needs this: reserved identities (the host,
 * other nodes) keep the reference's semantics, and an address outside
 * the cluster had its prefix's identity already.
 */
static __always_inline void by_address(struct decision *d, __u32 endpoint_id, const union v6addr *a,
				       enum direction dir, __u8 protocol, __be16 dport)
{
	struct policy_key key = {
		.prefixlen = POLICY_LOOKUP_BITS,
		.endpoint_id = endpoint_id,
		.egress = (__u8)dir,
		.protocol = protocol,
		.dport = dport,
	};
	__u64 entry;

	if (d->identity < IDENTITY_MIN_CLUSTER)
		return;
	key.identity = prefix_identity(&policy_prefixes, a, 0);
	if (!key.identity || key.identity == d->identity)
		return;
	entry = lookup_entry(&key);
	if ((entry & (ENTRY_FOUND | POLICY_DENY | POLICY_POD_ADDRS)) != (ENTRY_FOUND | POLICY_POD_ADDRS))
		return;
	*d = by_entry(entry, VERDICT_ALLOWED);
	d->identity = key.identity;
}

/* A connection or packet, seen from the endpoint. */
struct conn {
	union v6addr local_addr;
	union v6addr remote_addr;
	__be16 local_port;
	__be16 remote_port;
	__u8 protocol;
};

/*
 * judge applies the endpoint's policy in direction dir to c. A denial is
 * audited instead when the endpoint audits everything, or when it is a
 * default deny that the endpoint audits in that direction. An
 * unclassified process is denied whatever the entries. A default deny
 * may yet be an allow by the peer's address (by_address).
 */
static __always_inline struct decision judge(const struct ep_ref *ep, const struct conn *c,
					     enum direction dir)
{
	__u32 audit_default = dir == DIR_EGRESS ? EP_AUDIT_DEFAULT_EGRESS : EP_AUDIT_DEFAULT_INGRESS;
	__be16 dport = dir == DIR_EGRESS ? c->remote_port : c->local_port;
	__u32 identity = identity_of(&c->remote_addr);
	struct decision d;

	if (ep->flags & EP_UNCLASSIFIED) {
		d = (struct decision){ .verdict = VERDICT_DENIED, .reason = REASON_UNCLASSIFIED };
		d.identity = identity;
	} else {
		d = lookup_verdict(ep->id, identity, dir, c->protocol, dport);
		d.identity = identity;
		if (d.reason == REASON_DEFAULT_DENY)
			by_address(&d, ep->id, &c->remote_addr, dir, c->protocol, dport);
	}
	if (d.verdict == VERDICT_DENIED &&
	    ((ep->flags & EP_AUDIT) ||
	     (d.reason == REASON_DEFAULT_DENY && (ep->flags & audit_default))))
		d.verdict = VERDICT_AUDITED;
	return d;
}

/* decide is judge, counted in policy_stats: a socket-level decision. */
static __always_inline struct decision decide(const struct ep_ref *ep, const struct conn *c,
					      enum direction dir)
{
	struct decision d = judge(ep, c, dir);

	count(dir, d.verdict);
	return d;
}

/* The decision of a direction the endpoint does not enforce; not counted. */
static __always_inline struct decision no_policy(const struct conn *c)
{
	return (struct decision){
		.identity = identity_of(&c->remote_addr),
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

/* The endpoints' budgets (within_budget) apply once this share of the
 * ring (1/4) waits to be read. */
#define EVENTS_BUDGET_SHIFT 2

/*
 * emit puts ev into policy_events, within the endpoint's budget once the
 * ring fills (an event beyond it is counted as the endpoint's loss, in
 * policy_event_budget). It
 * never waits for room: when the ring is full (the agent reads too slowly,
 * or not at all), the event is counted as lost instead. Out of line, so that struct policy_event is in
 * the object's BTF, where a test compares it with the agent's Go type.
 */
/*
 * within_budget takes one event's credit from the endpoint's budget on
 * this CPU, if it has it; else it counts the event as the endpoint's
 * loss. An endpoint seen for the first time starts with a full burst; one
 * that finds the map full is not bounded (events are not enforcement).
 */
static __always_inline int within_budget(__u32 endpoint_id, __u64 now)
{
	__u64 per_event = 1000000000ULL / (events_per_sec ? events_per_sec : 1);
	__u64 cap = per_event * (events_burst ? events_burst : 1);
	struct event_budget *b, fresh = {};
	__u64 credit;

	b = bpf_map_lookup_elem(&policy_event_budget, &endpoint_id);
	if (!b) {
		fresh.credit_ns = cap - per_event;
		fresh.last_ns = now;
		bpf_map_update_elem(&policy_event_budget, &endpoint_id, &fresh, BPF_NOEXIST);
		return 1;
	}
	credit = b->credit_ns;
	if (now > b->last_ns)
		credit += now - b->last_ns;
	if (credit > cap)
		credit = cap;
	b->last_ns = now;
	if (credit < per_event) {
		b->credit_ns = credit;
		b->lost++;
		return 0;
	}
	b->credit_ns = credit - per_event;
	return 1;
}

static __noinline void emit(const struct policy_event *ev)
{
	__u64 size = bpf_ringbuf_query(&policy_events, BPF_RB_RING_SIZE);
	struct policy_event *e;
	__u64 pending;

	/* Budgets apply once the ring fills (a quarter of it waits): until
	 * then the reader keeps up and every endpoint's events fit. */
	pending = bpf_ringbuf_query(&policy_events, BPF_RB_AVAIL_DATA);
	if (pending >= size >> EVENTS_BUDGET_SHIFT && !within_budget(ev->endpoint_id, ev->time_ns))
		return;
	e = bpf_ringbuf_reserve(&policy_events, sizeof(*e), 0);
	if (!e) {
		count_at(STATS_LOST);
		return;
	}
	*e = *ev;
	pending += sizeof(*e);
	bpf_ringbuf_submit(e, pending >= size >> EVENTS_WAKEUP_SHIFT ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

/* report puts the decision d on c into policy_events. */
static __always_inline void report(const struct ep_ref *ep, const struct decision *d,
				   const struct conn *c, enum direction dir, enum hook hook)
{
	struct policy_event ev = {
		.time_ns = bpf_ktime_get_ns(),
		.endpoint_id = ep->id,
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
		.family = is_v4mapped(&c->remote_addr) ? 4 : 6,
	};

	emit(&ev);
}

static __always_inline int slot_matches(const struct flow_slot *s, const union v6addr *peer,
					__be16 port, __u8 protocol)
{
	return s->used && s->peer_port == port && s->protocol == protocol && s->peer.p[0] == peer->p[0] &&
	       s->peer.p[1] == peer->p[1] && s->peer.p[2] == peer->p[2] && s->peer.p[3] == peer->p[3];
}

/* flow_known tells whether the socket sk (a full socket, or NULL) carries
 * an allowed flow with the peer. */
static __always_inline int flow_known(struct bpf_sock *sk, const union v6addr *peer, __be16 port,
				      __u8 protocol)
{
	struct policy_sk *st;
	int found = 0;

	if (!sk)
		return 0;
	st = bpf_sk_storage_get(&policy_sk, sk, 0, 0);
	if (!st)
		return 0;
	bpf_spin_lock(&st->lock);
	for (int i = 0; i < FLOW_SLOTS; i++) {
		if (slot_matches(&st->slots[i], peer, port, protocol)) {
			found = 1;
			break;
		}
	}
	bpf_spin_unlock(&st->lock);
	return found;
}

/*
 * remember_flow records an allowed flow of the socket sk with the peer.
 * A socket with more peers than FLOW_SLOTS (an unconnected UDP socket)
 * forgets its oldest: that flow's next packets are judged again, by the
 * same policy. Without memory for the storage, the flow is not
 * remembered, with the same effect.
 */
static __always_inline void remember_flow(struct bpf_sock *sk, const union v6addr *peer, __be16 port,
					  __u8 protocol)
{
	struct policy_sk *st;
	__u32 slot;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&policy_sk, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	bpf_spin_lock(&st->lock);
	for (int i = 0; i < FLOW_SLOTS; i++) {
		if (slot_matches(&st->slots[i], peer, port, protocol)) {
			bpf_spin_unlock(&st->lock);
			return;
		}
	}
	slot = st->next % FLOW_SLOTS;
	st->next = (__u8)(slot + 1);
	st->slots[slot].peer = *peer;
	st->slots[slot].peer_port = port;
	st->slots[slot].protocol = protocol;
	st->slots[slot].used = 1;
	bpf_spin_unlock(&st->lock);
}

static __always_inline int is_v6_hook(enum hook hook)
{
	return hook == HOOK_CONNECT6 || hook == HOOK_SENDMSG6;
}

/*
 * sock_egress checks a connect() or an unconnected sendmsg() of a process
 * in an endpoint to c's remote address. It runs after the socket load
 * balancer, so the destination is the backend, the address the packets
 * will carry. DNS of an endpoint with a DNS rule, once the policy allows
 * it to the resolver, goes to the DNS proxy (dns_redirect.h); the socket
 * then carries both flows, to the resolver (so that it is not judged
 * again) and to the proxy (which its packets carry).
 */
static __always_inline int sock_egress(struct bpf_sock_addr *ctx, struct conn *c, enum hook hook)
{
	enum dns_plan dns = DNS_PASS;
	struct bpf_sock *sk = ctx->sk;
	struct dns_target proxy = {};
	struct decision d;
	struct ep_ref ep;

	if (c->protocol != IPPROTO_TCP && c->protocol != IPPROTO_UDP)
		return 1;
	if (!endpoint_of_current(&ep))
		return 1;
	if (ep.flags & EP_DNS)
		dns = dns_plan_for(is_v6_hook(hook), c->protocol, c->remote_addr.p, c->remote_port, &proxy);
	/* A known flow: a UDP socket sending again to the same peer, or a
	 * server's reply to a datagram its ingress policy let in. */
	if (dns == DNS_PASS && flow_known(sk, &c->remote_addr, c->remote_port, c->protocol))
		return 1;
	if (dns == DNS_REDIRECT && flow_known(sk, &c->remote_addr, c->remote_port, c->protocol)) {
		if (!dns_apply(ctx, is_v6_hook(hook), ep.id, c->remote_addr.p, c->remote_port, &proxy))
			return 0;
		/* Again: the socket may have forgotten it meanwhile. */
		remember_flow(sk, (const union v6addr *)proxy.addr, proxy.port, c->protocol);
		return 1;
	}
	c->local_port = bpf_htons((__u16)sk->src_port);

	if (ep.flags & EP_ENFORCE_EGRESS) {
		d = judge(&ep, c, DIR_EGRESS);
		/* connect() succeeds and the packets are dropped at the
		 * interface, which counts and reports them. DNS the proxy
		 * should get stays EPERM. */
		if (dns == DNS_PASS && dropped_at_iface(&ep, &d))
			return 1;
		count(DIR_EGRESS, d.verdict);
	} else {
		d = no_policy(c);
	}
	if (dns == DNS_DENY && d.verdict != VERDICT_DENIED) {
		/* Fail closed: the DNS rule cannot be enforced. */
		d.verdict = VERDICT_DENIED;
		d.reason = REASON_DNS_PROXY;
		d.cookie = 0;
	}
	report(&ep, &d, c, DIR_EGRESS, hook);
	if (d.verdict == VERDICT_DENIED)
		return 0; /* connect() and sendmsg() fail with EPERM */
	if (dns == DNS_REDIRECT) {
		if (!dns_apply(ctx, is_v6_hook(hook), ep.id, c->remote_addr.p, c->remote_port, &proxy))
			return 0;
		remember_flow(sk, &c->remote_addr, c->remote_port, c->protocol);
		__builtin_memcpy(c->remote_addr.p, proxy.addr, sizeof(proxy.addr));
		c->remote_port = proxy.port;
	} else if (!(ep.flags & EP_ENFORCE_EGRESS) && (hook == HOOK_CONNECT4 || hook == HOOK_CONNECT6) &&
		   !(ep.flags & EP_ENFORCE_INGRESS)) {
		/* Each connect() is reported; a connection of an endpoint
		 * that enforces nothing needs no flow. */
		return 1;
	}
	/* Also with egress not enforced: the replies need the flow to pass
	 * an enforced ingress, and the next datagrams to the peer are not
	 * reported again. */
	remember_flow(sk, &c->remote_addr, c->remote_port, c->protocol);
	return 1;
}

/* sock4_egress: an AF_INET socket; src is the source a sendmsg() asks
 * for, 0 for none. */
static __always_inline int sock4_egress(struct bpf_sock_addr *ctx, enum hook hook, __be32 src)
{
	struct conn c = {
		.remote_port = (__be16)ctx->user_port,
		.protocol = (__u8)ctx->protocol,
	};

	set_v4mapped(&c.remote_addr, ctx->user_ip4);
	set_v4mapped(&c.local_addr, src ? src : ctx->sk->src_ip4);
	return sock_egress(ctx, &c, hook);
}

/* sock6_egress: an AF_INET6 socket, to an IPv6 or IPv4-mapped address
 * (judged as IPv4); src is whether a sendmsg() asks for a source. */
static __always_inline int sock6_egress(struct bpf_sock_addr *ctx, enum hook hook, int src)
{
	struct conn c = {
		.remote_port = (__be16)ctx->user_port,
		.protocol = (__u8)ctx->protocol,
	};

	c.remote_addr.p[0] = ctx->user_ip6[0];
	c.remote_addr.p[1] = ctx->user_ip6[1];
	c.remote_addr.p[2] = ctx->user_ip6[2];
	c.remote_addr.p[3] = ctx->user_ip6[3];
	if (src) {
		c.local_addr.p[0] = ctx->msg_src_ip6[0];
		c.local_addr.p[1] = ctx->msg_src_ip6[1];
		c.local_addr.p[2] = ctx->msg_src_ip6[2];
		c.local_addr.p[3] = ctx->msg_src_ip6[3];
	}
	if (!(c.local_addr.p[0] | c.local_addr.p[1] | c.local_addr.p[2] | c.local_addr.p[3])) {
		struct bpf_sock *sk = ctx->sk;

		c.local_addr.p[0] = sk->src_ip6[0];
		c.local_addr.p[1] = sk->src_ip6[1];
		c.local_addr.p[2] = sk->src_ip6[2];
		c.local_addr.p[3] = sk->src_ip6[3];
	}
	return sock_egress(ctx, &c, hook);
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

SEC("cgroup/connect6")
int policy_connect6(struct bpf_sock_addr *ctx)
{
	return sock6_egress(ctx, HOOK_CONNECT6, 0);
}

SEC("cgroup/sendmsg6")
int policy_sendmsg6(struct bpf_sock_addr *ctx)
{
	return sock6_egress(ctx, HOOK_SENDMSG6, 1);
}

/* DNS answers from the proxy show the resolver the socket asked. */
SEC("cgroup/recvmsg4")
int policy_recvmsg4(struct bpf_sock_addr *ctx)
{
	dns_restore4(ctx);
	return 1;
}

SEC("cgroup/getpeername4")
int policy_getpeername4(struct bpf_sock_addr *ctx)
{
	dns_restore4(ctx);
	return 1;
}

SEC("cgroup/recvmsg6")
int policy_recvmsg6(struct bpf_sock_addr *ctx)
{
	dns_restore6(ctx);
	return 1;
}

SEC("cgroup/getpeername6")
int policy_getpeername6(struct bpf_sock_addr *ctx)
{
	dns_restore6(ctx);
	return 1;
}

/* What the skb programs need of a packet. */
struct pkt {
	union v6addr saddr;
	union v6addr daddr;
	__be16 sport;
	__be16 dport;
	__u8 protocol;
	__u8 icmp_type; /* of ICMPv6 */
	__u8 later_fragment; /* a fragment after the first: no ports */
	__u8 first_fragment; /* the first of several fragments */
	__u16 l4_off; /* where the TCP, UDP or SCTP header starts */
	__u32 frag_id; /* IPv4's identification or IPv6's fragment id */
	__u8 hop_limit; /* of IPv6 */
	__u8 pad[3];
};

/* What parse says of a packet it cannot judge: not IP at all, or IP whose
 * headers cannot be read to the ports (more IPv6 extension headers than
 * it walks, a header cut short). An unparsable packet is dropped where
 * its direction is enforced: judged as port 0, it would pass a deny of
 * some ports. */
#define PARSE_NOT_IP -1
#define PARSE_BAD -2

#define IP_FRAG_OFFSET 0x1fff
#define IP_MF_ 0x2000
/* The flags byte of a TCP header, and its SYN bit. */
#define TCP_FLAGS_OFF 13
#define TCP_FLAG_SYN 0x02

/* read_ports reads the ports of TCP, UDP and SCTP (the three start with
 * source and destination port); other protocols have port 0. PARSE_BAD
 * when the packet ends before them. */
static __always_inline int read_ports(struct __sk_buff *skb, struct pkt *p)
{
	__be16 ports[2];

	switch (p->protocol) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
			return PARSE_BAD;
		p->sport = ports[0];
		p->dport = ports[1];
	}
	return 0;
}

/*
 * parse4 reads the addresses, protocol and ports of an IPv4 packet whose
 * IP header starts at nh: 0 for a cgroup_skb program, the Ethernet
 * header's length for tc. Fragments after the first have port 0. Returns
 * PARSE_BAD when the IP header or the ports cannot be read.
 */
static __always_inline int parse4(struct __sk_buff *skb, __u32 nh, struct pkt *p)
{
	struct iphdr iph;

	if (bpf_skb_load_bytes(skb, nh, &iph, sizeof(iph)) < 0 || iph.ihl < 5)
		return PARSE_BAD;
	set_v4mapped(&p->saddr, iph.saddr);
	set_v4mapped(&p->daddr, iph.daddr);
	p->protocol = iph.protocol;
	p->l4_off = (__u16)(nh + iph.ihl * 4);
	p->frag_id = iph.id;
	if (iph.frag_off & bpf_htons(IP_FRAG_OFFSET)) {
		p->later_fragment = 1;
		return 0;
	}
	p->first_fragment = !!(iph.frag_off & bpf_htons(IP_MF_));
	return read_ports(skb, p);
}

/* Extension headers parse6 steps over: RFC 8200's order has at most six
 * (hop-by-hop, destination options twice, routing, fragment, AH) before
 * ESP or the upper layer. A packet with more is unparsable. */
#define IPV6_MAX_EXT 8

static __always_inline int ipv6_ext(__u8 nexthdr)
{
	switch (nexthdr) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_DSTOPTS:
	case IPPROTO_AH:
	case IPPROTO_FRAGMENT:
		return 1;
	}
	return 0;
}

/*
 * parse6 is parse4 for IPv6: it steps over the extension headers to the
 * upper-layer protocol, and reads the ports (or the ICMPv6 type) of a
 * packet that is not a later fragment. PARSE_BAD when a header cannot be
 * read, or when more than IPV6_MAX_EXT extension headers come first.
 */
static __always_inline int parse6(struct __sk_buff *skb, __u32 nh, struct pkt *p)
{
	struct ipv6hdr ip6;
	__u32 off = nh + sizeof(ip6);
	__u8 nexthdr;

	if (bpf_skb_load_bytes(skb, nh, &ip6, sizeof(ip6)) < 0)
		return PARSE_BAD;
	__builtin_memcpy(p->saddr.addr, &ip6.saddr, 16);
	__builtin_memcpy(p->daddr.addr, &ip6.daddr, 16);
	p->hop_limit = ip6.hop_limit;
	nexthdr = ip6.nexthdr;
	for (int i = 0; i < IPV6_MAX_EXT; i++) {
		__u8 hdr[8];

		switch (nexthdr) {
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_DSTOPTS:
			if (bpf_skb_load_bytes(skb, off, hdr, 2) < 0)
				return PARSE_BAD;
			nexthdr = hdr[0];
			off += ((__u32)hdr[1] + 1) * 8;
			continue;
		case IPPROTO_AH:
			if (bpf_skb_load_bytes(skb, off, hdr, 2) < 0)
				return PARSE_BAD;
			nexthdr = hdr[0];
			off += ((__u32)hdr[1] + 2) * 4;
			continue;
		case IPPROTO_FRAGMENT:
			if (bpf_skb_load_bytes(skb, off, hdr, 8) < 0)
				return PARSE_BAD;
			nexthdr = hdr[0];
			off += 8;
			__builtin_memcpy(&p->frag_id, &hdr[4], 4);
			/* A later fragment: no upper-layer header. */
			if ((((__u16)hdr[2] << 8) | hdr[3]) & 0xfff8) {
				p->protocol = nexthdr;
				p->later_fragment = 1;
				return 0;
			}
			p->first_fragment = hdr[3] & 1;
			continue;
		}
		break;
	}
	if (ipv6_ext(nexthdr))
		return PARSE_BAD;
	p->protocol = nexthdr;
	p->l4_off = (__u16)off;
	if (nexthdr == IPPROTO_ICMPV6_)
		return bpf_skb_load_bytes(skb, off, &p->icmp_type, 1) < 0 ? PARSE_BAD : 0;
	return read_ports(skb, p);
}

/* parse reads the packet of either family, its IP header at nh:
 * PARSE_NOT_IP for anything else (ARP never reaches a cgroup program),
 * PARSE_BAD for IP it cannot read. */
static __always_inline int parse(struct __sk_buff *skb, __u32 nh, struct pkt *p)
{
	__builtin_memset(p, 0, sizeof(*p));
	if (skb->protocol == bpf_htons(ETH_P_IP))
		return parse4(skb, nh, p);
	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return parse6(skb, nh, p);
	return PARSE_NOT_IP;
}

/* conn_of is packet p as a connection of the endpoint it is judged for:
 * dir DIR_EGRESS when the endpoint sent it, DIR_INGRESS when it receives
 * it. */
static __always_inline struct conn conn_of(const struct pkt *p, enum direction dir)
{
	if (dir == DIR_EGRESS)
		return (struct conn){
			.local_addr = p->saddr,
			.remote_addr = p->daddr,
			.local_port = p->sport,
			.remote_port = p->dport,
			.protocol = p->protocol,
		};
	return (struct conn){
		.local_addr = p->daddr,
		.remote_addr = p->saddr,
		.local_port = p->dport,
		.remote_port = p->sport,
		.protocol = p->protocol,
	};
}

/* What link_control says of a packet. */
enum link_verdict {
	LINK_JUDGE = 0, /* no link control: policy judges it, as any packet */
	LINK_PASS = 1,  /* link control as the link needs it: no policy */
	LINK_DROP = 2,  /* a router's message from a pod */
	LINK_SPOOFED = 3, /* a pod's advertisement of an address not its own */
};

#define ICMP6_RS 133
#define ICMP6_RA 134
#define ICMP6_NS 135
#define ICMP6_NA 136
#define ICMP6_REDIRECT 137
/* Where an NS or NA keeps its target address. */
#define ND_TARGET_OFF 8
/* reserved:host, the node's own addresses. */
#define IDENTITY_HOST 1

static __always_inline int addr_unspecified(const union v6addr *a)
{
	return !(a->p[0] | a->p[1] | a->p[2] | a->p[3]);
}

/* fe80::/10 */
static __always_inline int addr_link_local(const union v6addr *a)
{
	return a->addr[0] == 0xfe && (a->addr[1] & 0xc0) == 0x80;
}

/* Multicast of link scope (ff02::/16, and its transient variants). */
static __always_inline int addr_link_multicast(const union v6addr *a)
{
	return a->addr[0] == 0xff && (a->addr[1] & 0x0f) == 0x02;
}

static __always_inline int own_addr(const struct policy_iface *ifc, const union v6addr *a);

/*
 * link_dest tells whether a pod's neighbour discovery to a stays on the
 * link: link-local, link-scope multicast, or the node's own address (the
 * host side of the pod's interface is its only neighbour; the node
 * delivers what goes there, it routes nothing of it on).
 */
static __always_inline int link_dest(const union v6addr *a)
{
	return addr_link_local(a) || addr_link_multicast(a) || identity_of(a) == IDENTITY_HOST;
}

/* nd_target_ok tells whether the target of a pod's NS or NA is its own
 * or link-local (an NA claims it; an NS may ask for the node's too). The
 * socket level (ifc NULL) does not know the pod's addresses: the
 * interface checks them. */
static __always_inline int nd_target_ok(struct __sk_buff *skb, const struct pkt *p,
					const struct policy_iface *ifc)
{
	union v6addr target;

	if (bpf_skb_load_bytes(skb, p->l4_off + ND_TARGET_OFF, &target, sizeof(target)) < 0)
		return 0;
	if (addr_link_local(&target) || (ifc && own_addr(ifc, &target)))
		return 1;
	return !ifc || (p->icmp_type == ICMP6_NS && identity_of(&target) == IDENTITY_HOST);
}

/*
 * link_control sorts out the ICMPv6 the link needs whatever the policy:
 * neighbour discovery (RFC 4861: hop limit 255, so never routed) and
 * multicast listener messages (RFC 3810: hop limit 1, to link-scope
 * groups). dir is DIR_EGRESS for what a pod sends, ifc its interface
 * (NULL at the socket level). From a pod, only solicitations and
 * advertisements pass, from no address (duplicate address detection), a
 * link-local one or the pod's own, to the link (link-local, link-scope
 * multicast, the node), an advertisement only for the pod's own or a
 * link-local address; a pod is no router, so its router advertisements
 * and redirects are dropped. Into a pod, discovery from the node's side
 * of the link passes. Everything else of these types, another pod's
 * forged advertisement or a solicitation with a payload to a routed
 * address, is policy's, as any ICMPv6, after anti-spoofing.
 */
static __always_inline enum link_verdict link_control(struct __sk_buff *skb, const struct pkt *p,
						      enum direction dir, const struct policy_iface *ifc)
{
	__u8 type = p->icmp_type;

	if (p->protocol != IPPROTO_ICMPV6_)
		return LINK_JUDGE;
	switch (type) {
	case 130 ... 132:
	case 143:
		/* Multicast listener messages. */
		return p->hop_limit == 1 && addr_link_multicast(&p->daddr) &&
				       (addr_link_local(&p->saddr) || addr_unspecified(&p->saddr)) ?
			       LINK_PASS :
			       LINK_JUDGE;
	case ICMP6_RS ... ICMP6_REDIRECT:
		break;
	default:
		return LINK_JUDGE;
	}
	if (dir == DIR_INGRESS)
		return p->hop_limit == 255 &&
				       (addr_unspecified(&p->saddr) || addr_link_local(&p->saddr) ||
					identity_of(&p->saddr) == IDENTITY_HOST) ?
			       LINK_PASS :
			       LINK_JUDGE;
	if (type == ICMP6_RA || type == ICMP6_REDIRECT)
		return LINK_DROP;
	/* An advertisement of another's address is a claim on it (on a
	 * bridge, the node's or a pod's neighbour entry of another pod),
	 * whatever its hop limit, addresses and the pod's policy. */
	if (type == ICMP6_NA && ifc && !nd_target_ok(skb, p, ifc))
		return LINK_SPOOFED;
	if (p->hop_limit != 255)
		return LINK_JUDGE;
	/* No source: only while the pod checks its addresses (DAD). */
	if (addr_unspecified(&p->saddr) ? type == ICMP6_NA : !(addr_link_local(&p->saddr) ||
								(ifc ? own_addr(ifc, &p->saddr) : 1)))
		return LINK_JUDGE;
	if (!link_dest(&p->daddr))
		return LINK_JUDGE;
	if (type != ICMP6_RS && !nd_target_ok(skb, p, ifc))
		return LINK_JUDGE;
	return LINK_PASS;
}

/* full_sock returns the packet's socket if it is a full one. */
static __always_inline struct bpf_sock *full_sock(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;

	return sk ? bpf_sk_fullsock(sk) : NULL;
}

static __always_inline int is_listener(struct bpf_sock *sk)
{
	return sk && sk->state == BPF_TCP_LISTEN;
}

/*
 * opens_flow tells whether an incoming packet that policy judged starts a
 * flow. Every one does but a TCP packet without SYN to a listener: the
 * last ACK of a handshake (its SYN was judged, and reported, already).
 */
static __always_inline int opens_flow(struct __sk_buff *skb, struct bpf_sock *sk, const struct pkt *p)
{
	__u8 tcp_flags;

	if (p->protocol != IPPROTO_TCP || !is_listener(sk))
		return 1;
	if (bpf_skb_load_bytes(skb, p->l4_off + TCP_FLAGS_OFF, &tcp_flags, 1) < 0)
		return 1;
	return tcp_flags & TCP_FLAG_SYN;
}

/* tcp_syn tells whether a TCP packet has SYN (or its flags cannot be
 * read). */
static __always_inline int tcp_syn(struct __sk_buff *skb, const struct pkt *p)
{
	__u8 tcp_flags;

	if (bpf_skb_load_bytes(skb, p->l4_off + TCP_FLAGS_OFF, &tcp_flags, 1) < 0)
		return 1;
	return tcp_flags & TCP_FLAG_SYN;
}

/* to_dns_proxy tells whether c goes to the DNS proxy (dns_config). */
static __always_inline int to_dns_proxy(const struct conn *c)
{
	__u32 zero = 0;
	struct dns_config *cfg = bpf_map_lookup_elem(&dns_config, &zero);

	if (!cfg || (c->protocol != IPPROTO_TCP && c->protocol != IPPROTO_UDP))
		return 0;
	if (is_v4mapped(&c->remote_addr))
		return cfg->proxy4 && c->remote_addr.p[3] == cfg->proxy4 && c->remote_port == cfg->port4;
	return (cfg->proxy6[0] | cfg->proxy6[1] | cfg->proxy6[2] | cfg->proxy6[3]) &&
	       dns_same(c->remote_addr.p, cfg->proxy6) && c->remote_port == cfg->port6;
}

/*
 * dns_bypass tells whether a packet of an endpoint with a DNS rule goes to
 * port 53 (TCP or UDP) somewhere else than the DNS proxy, and reports it:
 * the socket hooks send all such DNS to the proxy, so this one passed
 * none of them (a raw or packet socket, a socket connected before the
 * endpoint had its DNS rule or its entry in policy_endpoints, a process
 * outside the pod's cgroup). The L4 policy may allow the resolver; the DNS
 * rules would not have been applied, so it is dropped whatever the policy
 * or audit mode says. A later fragment carries no port: it passes only
 * where its first fragment passed (the interface's fragment state; the
 * local stack fragments after the cgroup hook).
 */
static __always_inline int dns_bypass(const struct ep_ref *ep, const struct pkt *p, enum hook hook)
{
	struct decision d = { .verdict = VERDICT_DENIED, .reason = REASON_DNS_BYPASS };
	struct conn c = conn_of(p, DIR_EGRESS);

	if (p->protocol != IPPROTO_TCP && p->protocol != IPPROTO_UDP)
		return 0;
	/* A first fragment too short to hold the ports reads port 0, which
	 * no query goes to: it could be one to port 53. */
	if (p->later_fragment || (p->dport != bpf_htons(DNS_PORT) && !(p->first_fragment && !p->dport)))
		return 0;
	if (to_dns_proxy(&c))
		return 0;
	d.identity = identity_of(&c.remote_addr);
	report(ep, &d, &c, DIR_EGRESS, hook);
	return 1;
}

/*
 * sock_unjudged counts and reports a packet of an endpoint that the
 * socket level does not judge by its entries, c seen from the endpoint:
 * one parse could not read, or a router's ICMPv6 from the endpoint.
 * Always denied, as a decision.
 */
static __always_inline int sock_unjudged(const struct ep_ref *ep, const struct conn *c, enum direction dir,
					 enum hook hook, enum reason reason)
{
	struct decision d = { .verdict = VERDICT_DENIED, .reason = reason };

	d.identity = identity_of(&c->remote_addr);
	count(dir, VERDICT_DENIED);
	report(ep, &d, c, dir, hook);
	return 0;
}

SEC("cgroup_skb/ingress")
int policy_ingress(struct __sk_buff *skb)
{
	struct bpf_sock *sk;
	struct decision d;
	struct ep_ref ep;
	struct conn c;
	struct pkt p;
	int parsed;

	if (!endpoint_of_skb(skb, &ep))
		return 1;
	if (!(ep.flags & (EP_ENFORCE_INGRESS | EP_ENFORCE_EGRESS)))
		return 1;
	parsed = parse(skb, 0, &p);
	if (parsed == PARSE_NOT_IP)
		return 1;
	c = conn_of(&p, DIR_INGRESS);
	if (parsed == PARSE_BAD)
		return ep.flags & EP_ENFORCE_INGRESS ?
			       sock_unjudged(&ep, &c, DIR_INGRESS, HOOK_INGRESS, REASON_UNPARSABLE) :
			       1;
	if (link_control(skb, &p, DIR_INGRESS, NULL) == LINK_PASS)
		return 1;
	/* With only egress enforced, ingress is here for the UDP flows its
	 * replies need. */
	if (!(ep.flags & EP_ENFORCE_INGRESS) && p.protocol != IPPROTO_UDP)
		return 1;

	sk = full_sock(skb);
	/* A reply of a flow the endpoint opened, or more of one let in; a
	 * listener carries no flow, whatever its socket did before listen(). */
	if (!is_listener(sk) && flow_known(sk, &p.saddr, p.sport, p.protocol))
		return 1;
	if (ep.flags & EP_ENFORCE_INGRESS) {
		d = decide(&ep, &c, DIR_INGRESS);
		/* The handshake's last ACK is judged again, but a TCP
		 * connection is one decision, its SYN's: only a denial of
		 * it is reported. */
		if (d.verdict == VERDICT_DENIED || opens_flow(skb, sk, &p))
			report(&ep, &d, &c, DIR_INGRESS, HOOK_INGRESS);
		if (d.verdict == VERDICT_DENIED)
			return 0;
	}
	/* TCP is remembered by sockops once accepted (the SYN arrives on the
	 * listener, not the connection's socket); a UDP socket's replies go
	 * out on the socket that received, so remember it here. */
	if (p.protocol == IPPROTO_UDP)
		remember_flow(sk, &p.saddr, p.sport, p.protocol);
	return 1;
}

SEC("cgroup_skb/egress")
int policy_egress(struct __sk_buff *skb)
{
	struct bpf_sock *sk;
	struct decision d;
	struct ep_ref ep;
	struct conn c;
	struct pkt p;
	int parsed;

	if (!endpoint_of_skb(skb, &ep))
		return 1;
	if (!(ep.flags & (EP_ENFORCE_EGRESS | EP_DNS)))
		return 1;
	parsed = parse(skb, 0, &p);
	if (parsed == PARSE_NOT_IP)
		return 1;
	c = conn_of(&p, DIR_EGRESS);
	if (parsed == PARSE_BAD)
		return sock_unjudged(&ep, &c, DIR_EGRESS, HOOK_EGRESS, REASON_UNPARSABLE);
	switch (link_control(skb, &p, DIR_EGRESS, NULL)) {
	case LINK_PASS:
		return 1;
	case LINK_DROP:
		return sock_unjudged(&ep, &c, DIR_EGRESS, HOOK_EGRESS, REASON_NOT_ROUTER);
	default:
		break;
	}

	sk = full_sock(skb);
	if (ep.flags & EP_DNS) {
		/* Before any flow the socket knows: one connected to the
		 * resolver before the DNS rule existed knows it. */
		if (dns_bypass(&ep, &p, HOOK_EGRESS)) {
			count(DIR_EGRESS, VERDICT_DENIED);
			return 0;
		}
		dns_publish(sk, p.saddr.p, p.sport, p.daddr.p, p.dport, p.protocol);
	}
	if (!(ep.flags & EP_ENFORCE_EGRESS))
		return 1;
	/* A SYN-ACK leaves on the listener (its request socket is not a full
	 * socket, so the kernel runs the hook with the listener): it answers
	 * a SYN that ingress already judged. A listener carries no flow. */
	if (is_listener(sk)) {
		if (p.protocol == IPPROTO_TCP && !(ep.flags & EP_UNCLASSIFIED))
			return 1;
	} else if (flow_known(sk, &p.daddr, p.dport, p.protocol)) {
		return 1;
	}
	d = judge(&ep, &c, DIR_EGRESS);
	/* A ClusterNetworkPolicy Deny is the interface's to drop (as at
	 * connect), but only what leaves by the interface's pod side: not
	 * what goes through lo (the pod's own addresses) or another device
	 * of the pod's (a second interface, a tunnel), which the interface
	 * never sees; and not a TCP segment without SYN, which no connect()
	 * the hooks let through can send (its SYN was dropped): a socket
	 * made connected without one (TCP_REPAIR) is refused here. Nothing
	 * of it is remembered. */
	if (dropped_at_iface(&ep, &d) && skb->ifindex == ((ep.flags >> EP_IFINDEX_SHIFT) & EP_IFINDEX_MASK) &&
	    (p.protocol != IPPROTO_TCP || tcp_syn(skb, &p)))
		return 1;
	count(DIR_EGRESS, d.verdict);
	report(&ep, &d, &c, DIR_EGRESS, HOOK_EGRESS);
	if (d.verdict == VERDICT_DENIED)
		return 0;
	remember_flow(sk, &p.daddr, p.dport, p.protocol);
	return 1;
}

/*
 * Packet-level enforcement: tc programs on the host side of each pod's
 * interface (its veth), from-pod on the device's ingress and to-pod on its
 * egress. They judge every packet of a pod's network namespace whatever
 * made it (a packet socket, a socket created outside the pod's cgroup,
 * forwarded traffic), with the same entries as the socket hooks, and let
 * a pod send only from its own addresses. They keep their own flows, per
 * interface; a packet they pass goes on to the next program (TCX_NEXT).
 * Only drops are reported: an allowed connection was reported by the
 * socket hook that opened it.
 */
#define TCX_NEXT -1
#define TCX_DROP 2
#define ETH_HLEN_ 14
#define ETH_P_ARP_ 0x0806
/* Where an ARP packet for IPv4 over Ethernet keeps its sender's address. */
#define ARP_SPA_OFF (ETH_HLEN_ + 14)

static __always_inline int addr_eq(const union v6addr *a, const union v6addr *b)
{
	return a->p[0] == b->p[0] && a->p[1] == b->p[1] && a->p[2] == b->p[2] && a->p[3] == b->p[3];
}

/* own_addr tells whether a is one of the pod's addresses. */
static __always_inline int own_addr(const struct policy_iface *ifc, const union v6addr *a)
{
	for (int i = 0; i < IFACE_ADDRS; i++) {
		if (i >= ifc->naddrs)
			break;
		if (addr_eq(&ifc->addrs[i], a))
			return 1;
	}
	return 0;
}

static __always_inline void count_iface(__u32 idx)
{
	__u64 *n = bpf_map_lookup_elem(&policy_iface_stats, &idx);

	if (n)
		__sync_fetch_and_add(n, 1);
}

/* iface_endpoint fills out with the endpoint of the pod behind ifc: 0 when
 * it has none and unclassified pods run unenforced. */
static __always_inline int iface_endpoint(const struct policy_iface *ifc, struct ep_ref *out)
{
	__u64 cgroup_id = ifc->cgroup_id;
	struct policy_endpoint *ep = bpf_map_lookup_elem(&policy_endpoints, &cgroup_id);

	if (ep && !(ep->flags & EP_POD_TREE)) {
		out->id = ep->endpoint_id;
		out->flags = ep->flags;
		return 1;
	}
	return unclassified(ifc->flags & IFACE_UNCLASSIFIED_DENY ? EP_POD_TREE : 0, out);
}

/*
 * iface_flow_known tells whether the interface's flows (or NULL) hold key.
 * Out of line, so that struct iface_flow is in the object's BTF: the inner
 * map's definition alone gives only its name, and the agent makes the
 * inner maps from that definition.
 */
static __noinline int iface_flow_known(void *flows, const struct iface_flow *key)
{
	return flows && bpf_map_lookup_elem(flows, key);
}

static __always_inline struct iface_frag frag_key(const struct pkt *p)
{
	return (struct iface_frag){
		.id = p->frag_id,
		.saddr = p->saddr,
		.daddr = p->daddr,
		.protocol = p->protocol,
	};
}

/* Out of line, so that struct iface_frag is in the object's BTF (see
 * iface_flow_known). */
static __noinline int iface_frag_known(void *frags, const struct iface_frag *key)
{
	return frags && bpf_map_lookup_elem(frags, key);
}

/* A TCP state in which a connection carries segments without SYN both
 * ways: not a listener, not one whose SYN is still unanswered, not one
 * that is gone (time-wait, closed). */
static __always_inline int tcp_connected(__u32 state)
{
	switch (state) {
	case BPF_TCP_ESTABLISHED:
	case BPF_TCP_FIN_WAIT1:
	case BPF_TCP_FIN_WAIT2:
	case BPF_TCP_CLOSE_WAIT:
	case BPF_TCP_LAST_ACK:
	case BPF_TCP_CLOSING:
		return 1;
	}
	return 0;
}

/*
 * pod_connection tells whether the pod's network namespace has a TCP
 * connection with exactly c's addresses and ports, the pod's socket the
 * local side: a connection opened before the interface knew its flow
 * (programs attached after it opened, its flow pushed out by the pod's
 * newer ones). The kernel is asked in the namespace the agent read from
 * the host side of the interface, never the pod.
 */
static __always_inline int pod_connection(struct __sk_buff *skb, const struct policy_iface *ifc,
					  const struct conn *c)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 size, state;

	if (!(ifc->flags & IFACE_NETNS) || ifc->netns_id < 0)
		return 0;
	/* The tuple is as the pod's socket would receive a packet: the
	 * peer is its source. */
	if (is_v4mapped(&c->remote_addr)) {
		t.ipv4.saddr = c->remote_addr.p[3];
		t.ipv4.daddr = c->local_addr.p[3];
		t.ipv4.sport = c->remote_port;
		t.ipv4.dport = c->local_port;
		size = sizeof(t.ipv4);
	} else {
		__builtin_memcpy(t.ipv6.saddr, c->remote_addr.p, 16);
		__builtin_memcpy(t.ipv6.daddr, c->local_addr.p, 16);
		t.ipv6.sport = c->remote_port;
		t.ipv6.dport = c->local_port;
		size = sizeof(t.ipv6);
	}
	sk = bpf_skc_lookup_tcp(skb, &t, size, (__u64)(__u32)ifc->netns_id, 0);
	if (!sk)
		return 0;
	state = sk->state;
	bpf_sk_release(sk);
	return tcp_connected(state);
}

/*
 * iface_decide judges a packet of the pod's interface (ifc) in direction
 * dir (egress: from the pod), c seen from the pod; 1 passes it. A packet
 * of a flow the interface knows passes, and so does a later fragment of a
 * datagram whose first fragment passed. Else the direction's policy
 * decides, when enforced; a TCP packet without SYN that it denies passes
 * only if it belongs to a connection the pod's kernel has (opened before
 * the interface knew it: an agent upgrade, a flow pushed out by the pod's
 * newer ones), never on what policy would have said of a SYN.
 */
static __always_inline int iface_decide(struct __sk_buff *skb, __u32 ifindex, const struct policy_iface *ifc,
					const struct ep_ref *ep, const struct pkt *p, const struct conn *c,
					enum direction dir, enum hook hook)
{
	__u32 enforce = dir == DIR_EGRESS ? EP_ENFORCE_EGRESS : EP_ENFORCE_INGRESS;
	struct iface_flow key = {
		.peer = c->remote_addr,
		.peer_port = c->remote_port,
		.local_port = c->local_port,
		.protocol = c->protocol,
	};
	struct iface_frag fk;
	struct decision d;
	__u32 one = 1;
	void *flows;
	void *frags;

	if (!(ep->flags & (EP_ENFORCE_INGRESS | EP_ENFORCE_EGRESS)))
		return 1;
	if (p->later_fragment) {
		fk = frag_key(p);
		frags = bpf_map_lookup_elem(&policy_iface_frags, &ifindex);
		if (iface_frag_known(frags, &fk))
			return 1;
		count_iface(IFACE_STATS_FRAG_UNKNOWN);
		count_iface((__u32)dir * VERDICTS + VERDICT_DENIED);
		return 0;
	}
	/* DNS that went past the socket hooks, before any flow the
	 * interface knows (one to the resolver from before the DNS rule). */
	if (dir == DIR_EGRESS && (ep->flags & EP_DNS) && dns_bypass(ep, p, hook)) {
		count_iface(DIR_EGRESS * VERDICTS + VERDICT_DENIED);
		return 0;
	}
	flows = bpf_map_lookup_elem(&policy_iface_flows, &ifindex);
	if (iface_flow_known(flows, &key))
		goto pass;
	/* The queries the socket hooks sent to the DNS proxy, whose policy
	 * they judged on the resolver asked: the proxy applies the pod's DNS
	 * rules to them, and to any other packet it gets from the pod. */
	if (dir == DIR_EGRESS && (ep->flags & EP_DNS) && to_dns_proxy(c))
		goto remember;
	if (ep->flags & enforce) {
		d = judge(ep, c, dir);
		/* Not for a ClusterNetworkPolicy Deny of the pod's egress:
		 * the socket hooks let its connect() through for this
		 * program to drop, so a socket the pod made connected
		 * without a handshake (TCP_REPAIR) must not open it. */
		if (d.verdict == VERDICT_DENIED && c->protocol == IPPROTO_TCP && !(ep->flags & EP_UNCLASSIFIED) &&
		    !(d.drop && dir == DIR_EGRESS) && !tcp_syn(skb, p) && pod_connection(skb, ifc, c))
			d.verdict = VERDICT_ALLOWED;
		count_iface((__u32)dir * VERDICTS + d.verdict);
		if (d.verdict == VERDICT_DENIED) {
			report(ep, &d, c, dir, hook);
			return 0;
		}
	}
remember:
	if (flows)
		bpf_map_update_elem(flows, &key, &one, BPF_ANY);
pass:
	if (p->first_fragment) {
		fk = frag_key(p);
		frags = bpf_map_lookup_elem(&policy_iface_frags, &ifindex);
		if (frags)
			bpf_map_update_elem(frags, &fk, &one, BPF_ANY);
	}
	return 1;
}

/* mapped_in_v6 tells whether an IPv6 packet has an IPv4-mapped source,
 * which no host may use (RFC 4291 2.5.5.2) and own_addr would take for the
 * IPv4 address. */
static __always_inline int mapped_in_v6(struct __sk_buff *skb, const struct pkt *p)
{
	return skb->protocol == bpf_htons(ETH_P_IPV6) && is_v4mapped(&p->saddr);
}

/* spoofed counts and reports a pod's packet from a source not its own. */
static __always_inline int spoofed(const struct policy_iface *ifc, const struct pkt *p)
{
	struct decision d = { .verdict = VERDICT_DENIED, .reason = REASON_SPOOFED };
	struct conn c = conn_of(p, DIR_EGRESS);
	struct ep_ref ep = {};

	iface_endpoint(ifc, &ep);
	count_iface(IFACE_STATS_SPOOFED);
	report(&ep, &d, &c, DIR_EGRESS, HOOK_FROM_POD);
	return TCX_DROP;
}

/*
 * iface_unjudged drops, counts and reports a packet in direction dir that
 * the interface does not judge by policy: unparsable (counted as such
 * too, whatever the pod enforces), or a router's ICMPv6 from the pod.
 */
static __always_inline int iface_unjudged(const struct policy_iface *ifc, const struct pkt *p, enum direction dir,
					  enum reason reason)
{
	struct decision d = { .verdict = VERDICT_DENIED, .reason = reason };
	struct conn c = conn_of(p, dir);
	struct ep_ref ep = {};

	iface_endpoint(ifc, &ep);
	d.identity = identity_of(&c.remote_addr);
	if (reason == REASON_UNPARSABLE)
		count_iface(IFACE_STATS_UNPARSABLE);
	count_iface((__u32)dir * VERDICTS + VERDICT_DENIED);
	report(&ep, &d, &c, dir, dir == DIR_EGRESS ? HOOK_FROM_POD : HOOK_TO_POD);
	return TCX_DROP;
}

/* arp_ok tells whether an ARP packet from the pod claims only the pod's
 * own IPv4 address (or none: a probe has sender 0.0.0.0). */
static __always_inline int arp_ok(struct __sk_buff *skb, const struct policy_iface *ifc)
{
	union v6addr sender;
	__be32 spa;

	if (bpf_skb_load_bytes(skb, ARP_SPA_OFF, &spa, sizeof(spa)) < 0)
		return 0;
	if (spa == 0)
		return 1;
	set_v4mapped(&sender, spa);
	return own_addr(ifc, &sender);
}

/*
 * iface_packet judges a packet on the host side of a pod's interface:
 * dir is DIR_EGRESS for what the pod sends (the device's ingress),
 * DIR_INGRESS for what it receives (the device's egress).
 */
static __always_inline int iface_packet(struct __sk_buff *skb, enum direction dir)
{
	__u32 ifindex = skb->ifindex;
	struct policy_iface *ifc = bpf_map_lookup_elem(&policy_ifaces, &ifindex);
	struct ep_ref ep;
	struct conn c;
	struct pkt p;

	if (!ifc)
		return TCX_NEXT;
	if (skb->protocol == bpf_htons(ETH_P_ARP_)) {
		/* The host's ARP passes; the pod's claims its own addresses. */
		if (dir == DIR_INGRESS || arp_ok(skb, ifc))
			return TCX_NEXT;
		__builtin_memset(&p, 0, sizeof(p));
		return spoofed(ifc, &p);
	}
	/* What is neither IP nor ARP has no business crossing a pod's
	 * interface, nor has IP that cannot be judged. */
	switch (parse(skb, ETH_HLEN_, &p)) {
	case PARSE_NOT_IP:
		count_iface(IFACE_STATS_NOT_IP);
		return TCX_DROP;
	case PARSE_BAD:
		return iface_unjudged(ifc, &p, dir, REASON_UNPARSABLE);
	}
	/* Neighbour discovery on the link, from the pod's own or link-local
	 * addresses (link_control checks them); anything else of it meets
	 * anti-spoofing and policy. */
	switch (link_control(skb, &p, dir, ifc)) {
	case LINK_PASS:
		return TCX_NEXT;
	case LINK_DROP:
		return iface_unjudged(ifc, &p, dir, REASON_NOT_ROUTER);
	case LINK_SPOOFED:
		return spoofed(ifc, &p);
	default:
		break;
	}
	if (dir == DIR_EGRESS) {
		if (!own_addr(ifc, &p.saddr) || mapped_in_v6(skb, &p))
			return spoofed(ifc, &p);
	} else if (mapped_in_v6(skb, &p)) {
		/* The kernel drops these when it receives them; a hand-made
		 * one must not be judged as the IPv4 peer it names. */
		count_iface((__u32)dir * VERDICTS + VERDICT_DENIED);
		return TCX_DROP;
	}
	if (!iface_endpoint(ifc, &ep))
		return TCX_NEXT;
	c = conn_of(&p, dir);
	return iface_decide(skb, ifindex, ifc, &ep, &p, &c, dir, dir == DIR_EGRESS ? HOOK_FROM_POD : HOOK_TO_POD) ?
		       TCX_NEXT :
		       TCX_DROP;
}

SEC("tc")
int policy_from_pod(struct __sk_buff *skb)
{
	return iface_packet(skb, DIR_EGRESS);
}

SEC("tc")
int policy_to_pod(struct __sk_buff *skb)
{
	return iface_packet(skb, DIR_INGRESS);
}

/*
 * policy_sockops remembers every TCP connection a listener accepts, in the
 * new connection's own storage: its SYN and final ACK passed ingress on
 * the listener, and from now on both directions of the connection are its
 * flow (the server's replies pass its egress policy, the client's next
 * packets skip the policy lookup).
 *
 * Sockops has no helper that gives a socket's cgroup (the ancestor helpers
 * are refused, and the current task is whoever the softirq interrupted),
 * so connections accepted outside any endpoint are remembered too: one
 * storage update per accepted connection.
 */
SEC("sockops")
int policy_sockops(struct bpf_sock_ops *ctx)
{
	struct bpf_sock *sk;
	union v6addr peer;

	__u32 family, v4;

	if (ctx->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	/* Every field is read up front, each by its own fixed offset
	 * (volatile): clang would otherwise move the reads after the switch
	 * through one pointer into the context, which the verifier refuses. */
	family = READ_CTX(ctx->family);
	v4 = READ_CTX(ctx->remote_ip4);
	peer.p[0] = READ_CTX(ctx->remote_ip6[0]);
	peer.p[1] = READ_CTX(ctx->remote_ip6[1]);
	peer.p[2] = READ_CTX(ctx->remote_ip6[2]);
	peer.p[3] = READ_CTX(ctx->remote_ip6[3]);
	switch (family) {
	case AF_INET:
		set_v4mapped(&peer, v4);
		break;
	case AF_INET6:
		/* An IPv4 client of a dual-stack listener has a mapped
		 * address, as the packets' flows are written. */
		break;
	default:
		return 1;
	}
	sk = ctx->sk;
	if (!sk)
		return 1;
	/* remote_port holds the port in network order in its upper 16 bits:
	 * the kernel loads sk_dport and shifts it left by 16 (little endian;
	 * the object is only built for bpfel). */
	remember_flow(sk, &peer, (__be16)(ctx->remote_port >> 16), IPPROTO_TCP);
	return 1;
}

char __license[] SEC("license") = "Dual BSD/GPL";
