// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * North-south load balancing: a pair of tc programs on the node's external
 * devices that translate traffic from outside the node to a Service's
 * NodePort (node address : nodePort), LoadBalancer ingress IPs and
 * external IPs to one of its backends, IPv4 and IPv6 (the IPv6 half at
 * the end, the same design on the lb6 maps and nodeport_nat6).
 *
 * The frontends and backends are the load balancer's own maps (lb4_*),
 * the ones the socket hooks read: a frontend is translated here only when
 * its service entry is marked routable (every type but ClusterIP).
 *
 * A new flow picks a backend at random (the active ones; the terminating
 * ones only when none is active; lb_select.h, shared with socklb.c), or
 * with --lb-algorithm=maglev from the frontend's Maglev table (lb_maglev)
 * by a hash of the client's address and port, the same on every node. Where the kernel would route the
 * backend decides how it is reached:
 *   - through a device that is not one of the external devices (a pod's
 *     veth): a local backend. The destination is rewritten in place and the
 *     client's address kept; the backend's replies leave through an
 *     external device, whose egress program (nodeport_egress) gives them
 *     the frontend's address back.
 *   - through one of the external devices (nodeport_devices): a remote
 *     backend, on another node. The source is rewritten too, to that
 *     device's address and a port of the NAT range chosen so that no two
 *     flows to the same backend share it; the backend's replies come back
 *     to an external device's ingress and are translated back there.
 *
 * Each flow has two entries in nodeport_nat4: its forward tuple (as the
 * client sent it) and its reply tuple (as the reply arrives), both with a
 * last-seen time; the agent removes those idle past the TCP or UDP
 * timeout. The map is a plain hash: a full map is counted
 * (NP_STAT_NAT_FULL) and the new flow dropped, never an old flow evicted
 * behind its back.
 *
 * A frontend with no usable backend refuses, as a host with nothing
 * listening does and kube-proxy's reject rules do: a TCP packet gets a
 * reset back (reset4, reset6), a UDP datagram an ICMP or ICMPv6 port
 * unreachable (unreach4, unreach6), sent back out of the device it came
 * in through; counted (NP_STAT_NO_BACKEND, and NP_STAT_RESET or
 * NP_STAT_UNREACH). Fragments after the first carry no ports and pass
 * untranslated.
 *
 * The translated packet goes on through the kernel: a local backend's
 * pod-interface programs (policy.c) then judge it with the client's
 * address, i.e. as the world for a client outside the cluster.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "addr.h"
#include "lb_select.h"

/* The load balancer's maps: see socklb.c and bpf/lb.go. */
struct lb4_key {
	__be32 address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb4_service {
	__u32 backend_id;
	__u16 count;
	__be16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u16 qcount;
};

struct lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags;
	__u16 cluster_id;
	__u8 zone;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb4_key);
	__type(value, struct lb4_service);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb4_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct lb4_backend);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb4_backends SEC(".maps");

struct lb6_key {
	union v6addr address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb6_backend {
	union v6addr address;
	__be16 port;
	__u8 proto;
	__u8 flags;
	__u16 cluster_id;
	__u8 zone;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb6_key);
	__type(value, struct lb4_service); /* struct lb6_service: the same layout */
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb6_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct lb6_backend);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb6_backends SEC(".maps");

/* lb_affinity_match (the load balancer's): (backend, service) of each
 * active backend of a service with session affinity. */
struct lb_affinity_match {
	__u32 backend_id;
	__be16 rev_nat_id;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_affinity_match);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb_affinity_match SEC(".maps");

/* nodeport_affinity4 (these programs'): per client address and frontend,
 * the backend chosen last, for ClientIP session affinity. An LRU: when
 * full, the clients seen least recently lose their affinity. */
struct np4_affinity_key {
	__be32 client;
	__be16 rev_nat;
	__u16 pad;
};

struct np_affinity_val {
	__u64 last_used; /* bpf_ktime_get_ns */
	__u32 backend_id;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct np4_affinity_key);
	__type(value, struct np_affinity_val);
	__uint(max_entries, 65536);
} nodeport_affinity4 SEC(".maps");

struct np6_affinity_key {
	union v6addr client;
	__be16 rev_nat;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct np6_affinity_key);
	__type(value, struct np_affinity_val);
	__uint(max_entries, 65536);
} nodeport_affinity6 SEC(".maps");

/* nodeport_devices (the agent's): an external device's ifindex -> the
 * address remote backends see as the source of what leaves through it. */
struct np_device {
	__be32 addr4; /* 0: none, a remote backend behind it is unreachable */
	__u32 flags;
	union v6addr addr6; /* :: for none */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct np_device);
	__uint(max_entries, 256);
} nodeport_devices SEC(".maps");

/* nodeport_nat4: a flow's forward and reply tuples. */
#define NP_DIR_FWD 0 /* as the client sent it */
#define NP_DIR_REV 1 /* as the backend's reply arrives */

struct np4_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

#define NP_FLAG_SNAT 0x1 /* a remote backend: the source was rewritten */

/*
 * Forward: addr/port the backend, nat_addr/nat_port the source it sees
 * (0 when the client's is kept). Reply: addr/port the client,
 * nat_addr/nat_port the frontend the client sent to.
 */
struct np4_entry {
	__u64 last_seen; /* bpf_ktime_get_ns */
	__be32 addr;
	__be32 nat_addr;
	__be16 port;
	__be16 nat_port;
	__u8 flags;
	__u8 proto;
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct np4_key);
	__type(value, struct np4_entry);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nodeport_nat4 SEC(".maps");

/*
 * nodeport_srcrange4 (the agent's): the client prefixes each LoadBalancer
 * frontend (by its rev-NAT index) takes traffic from. A frontend with
 * ranges has an entry for itself alone (prefixlen 32: any address, value
 * 0), under those of its prefixes (value 1): the longest match says
 * whether a client is let in; no match, the frontend has no ranges.
 */
struct np_srcrange4_key {
	__u32 prefixlen; /* 32 + the prefix's bits */
	__be16 rev_nat;
	__u16 pad;
	__be32 addr;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct np_srcrange4_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nodeport_srcrange4 SEC(".maps");

/* nodeport_nat6 and nodeport_srcrange6: the IPv6 twins. */
struct np6_key {
	union v6addr saddr;
	union v6addr daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u8 pad[2];
};

struct np6_entry {
	__u64 last_seen;
	union v6addr addr;
	union v6addr nat_addr;
	__be16 port;
	__be16 nat_port;
	__u8 flags;
	__u8 proto;
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct np6_key);
	__type(value, struct np6_entry);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nodeport_nat6 SEC(".maps");

struct np_srcrange6_key {
	__u32 prefixlen; /* 32 + the prefix's bits */
	__be16 rev_nat;
	__u16 pad;
	union v6addr addr;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct np_srcrange6_key);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} nodeport_srcrange6 SEC(".maps");

/*
 * lb_maglev (the agent's, reconcilers/maglev.go): with --lb-algorithm=maglev,
 * per frontend (by its rev-NAT index) the Maglev lookup table of its
 * active backends, maglev_size backend IDs. The agent sizes the value
 * from --lb-maglev-table-size; the size here is only the default's.
 */
struct lb_maglev_key {
	__be16 rev_nat;
	__u16 pad;
};

#define MAGLEV_DEFAULT_SIZE 16381

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_maglev_key);
	__type(value, __u32[MAGLEV_DEFAULT_SIZE]);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb_maglev SEC(".maps");

/* nodeport_stats: per-CPU counts by NP_STAT_*. */
enum {
	NP_STAT_NEW_LOCAL,   /* new flows to a local backend */
	NP_STAT_NEW_REMOTE,  /* new flows to a remote backend (SNAT) */
	NP_STAT_FWD,         /* packets of known flows, client to backend */
	NP_STAT_REV,         /* replies translated back */
	NP_STAT_NO_BACKEND,  /* dropped: a frontend without a usable backend */
	NP_STAT_NAT_FULL,    /* dropped: nodeport_nat4 is full */
	NP_STAT_NAT_PORTS,   /* dropped: no free NAT port for the backend */
	NP_STAT_NO_SNAT_ADDR,/* dropped: the device to the backend has no address */
	NP_STAT_NO_ROUTE,    /* dropped: no route to a translated destination */
	NP_STAT_SOURCE_RANGE,/* dropped: a client outside loadBalancerSourceRanges */
	NP_STAT_RESET,       /* TCP resets sent for a frontend without backends */
	NP_STAT_UNREACH,     /* ICMP port unreachable sent for one (UDP) */
	NP_STAT_ENTRIES,
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, NP_STAT_ENTRIES);
} nodeport_stats SEC(".maps");

/* The NAT port range: above Linux's default ephemeral ports
 * (32768-60999), so that the node's own sockets rarely meet it. A port is
 * unique per backend, so each backend takes this many flows per address. */
volatile const __u16 nat_port_min = 61000;
volatile const __u16 nat_port_max = 65535;
/* Idle times after which an entry may be taken over, nanoseconds. */
volatile const __u64 tcp_timeout_ns = 6 * 3600 * 1000000000ULL;
volatile const __u64 udp_timeout_ns = 60 * 1000000000ULL;
/* The Maglev tables' size (a prime); 0: new flows pick a backend at
 * random (--lb-algorithm=random). */
volatile const __u32 maglev_size = 0;

#define NAT_TRIES 16

#define TCX_NEXT -1
#define TCX_DROP 2
/* NP_REFUSE: not a verdict; new_flow4/6 and ingress4/6 say with it that
 * the packet is to be answered as refused (refuse4, refuse6). */
#define NP_REFUSE 1000

#define SVC_FLAG_AFFINITY (1 << 4)
#define AFFINITY_TIMEOUT_MASK 0xFFFFFF /* of slot 0's backend_id, seconds */
#define NSEC_PER_SEC 1000000000ULL
#define SVC_FLAG_LOADBALANCER (1 << 5)
#define SVC_FLAG_ROUTABLE (1 << 6)

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

#define IP_OFF ETH_HLEN
#define IP_CSUM_OFF (IP_OFF + offsetof(struct iphdr, check))
#define IP_SRC_OFF (IP_OFF + offsetof(struct iphdr, saddr))
#define IP_DST_OFF (IP_OFF + offsetof(struct iphdr, daddr))

static __always_inline void count(__u32 what)
{
	__u64 *n = bpf_map_lookup_elem(&nodeport_stats, &what);

	if (n)
		*n += 1;
}

/* A parsed IPv4 TCP or UDP packet. */
struct pkt4 {
	__be32 saddr, daddr;
	__be16 sport, dport;
	__u32 l4_off;
	__u8 proto;
};

/* parse4 reads an IPv4 TCP or UDP packet's addresses and ports; 0 for
 * anything else, which passes untouched. */
static __always_inline int parse4(struct __sk_buff *skb, struct pkt4 *p)
{
	struct iphdr ip;
	__be16 ports[2];

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 0;
	if (bpf_skb_load_bytes(skb, IP_OFF, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.ihl < 5 || (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP))
		return 0;
	if (ip.frag_off & bpf_htons(IP_OFFSET))
		return 0;
	p->l4_off = IP_OFF + ip.ihl * 4;
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return 0;
	p->saddr = ip.saddr;
	p->daddr = ip.daddr;
	p->sport = ports[0];
	p->dport = ports[1];
	p->proto = ip.protocol;
	return 1;
}

static __always_inline __u32 l4_csum_off(const struct pkt4 *p)
{
	return p->l4_off + (p->proto == IPPROTO_TCP ? offsetof(struct tcphdr, check) :
						       offsetof(struct udphdr, check));
}

/* l4_flags: UDP's checksum may be 0 (none), which must stay 0. */
static __always_inline __u64 l4_flags(const struct pkt4 *p)
{
	return p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* set_addr4 rewrites the address at off (source or destination) from old
 * to new, with the IP and pseudo-header checksums. */
static __always_inline int set_addr4(struct __sk_buff *skb, const struct pkt4 *p, __u32 off,
				     __be32 old, __be32 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4_csum_off(p), old, new,
				BPF_F_PSEUDO_HDR | sizeof(new) | l4_flags(p)) < 0)
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* set_port rewrites the port at off (source or destination). */
static __always_inline int set_port(struct __sk_buff *skb, const struct pkt4 *p, __u32 off,
				    __be16 old, __be16 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4_csum_off(p), old, new, sizeof(new) | l4_flags(p)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* rewrite4 gives the packet the source (saddr, sport) and destination
 * (daddr, dport). */
static __always_inline int rewrite4(struct __sk_buff *skb, const struct pkt4 *p, __be32 saddr,
				    __be16 sport, __be32 daddr, __be16 dport)
{
	if (set_addr4(skb, p, IP_SRC_OFF, p->saddr, saddr) < 0 ||
	    set_addr4(skb, p, IP_DST_OFF, p->daddr, daddr) < 0 ||
	    set_port(skb, p, p->l4_off, p->sport, sport) < 0 ||
	    set_port(skb, p, p->l4_off + 2, p->dport, dport) < 0)
		return TCX_DROP;
	return TCX_NEXT;
}

static __always_inline __u64 timeout_of(__u8 proto)
{
	return proto == IPPROTO_TCP ? tcp_timeout_ns : udp_timeout_ns;
}

static __always_inline int stale(const struct np4_entry *e, __u64 now)
{
	return (__s64)(now - e->last_seen) > (__s64)timeout_of(e->proto);
}

/*
 * maglev_backend_id returns the backend ID the frontend's Maglev table
 * holds for a flow's hash, 0 when there is no table (random, or not
 * written yet: the caller then picks at random). Only active backends are
 * in a table; with none active, the terminating ones are picked at random.
 */
static __always_inline __u32 maglev_backend_id(const struct lb4_service *svc, __u32 hash)
{
	struct lb_maglev_key mk = { .rev_nat = svc->rev_nat_index };
	__u32 size = maglev_size, idx;
	__u32 *lut;

	if (!size || !svc->count)
		return 0;
	lut = bpf_map_lookup_elem(&lb_maglev, &mk);
	if (!lut)
		return 0;
	idx = hash % size;
	/* The verifier knows size (read-only data) and the value's size,
	 * which the agent made size entries, but not what % gives: the
	 * check it needs, which the compiler would drop as always false
	 * unless it forgets what idx is. */
	asm volatile("" : "+r"(idx));
	if (idx >= size)
		return 0;
	return lut[idx];
}

/* pick_backend chooses one of the service's usable backends: from its
 * Maglev table by the flow's hash, or at random. */
static __always_inline const struct lb4_backend *pick_backend(struct lb4_key *key,
							       const struct lb4_service *svc, __u32 hash,
							       __u32 *out_id)
{
	const struct lb4_service *slot;
	const struct lb4_backend *be;
	__u32 n = slots(svc->count, svc->qcount);
	__u32 id;

	if (n == 0)
		return NULL;
	id = maglev_backend_id(svc, hash);
	if (id) {
		be = bpf_map_lookup_elem(&lb4_backends, &id);
		if (be && be->flags == BACKEND_ACTIVE) {
			*out_id = id;
			return be;
		}
	}
	key->backend_slot = random_slot(n);
	slot = bpf_map_lookup_elem(&lb4_services, key);
	if (!slot)
		return NULL;
	id = slot->backend_id;
	be = bpf_map_lookup_elem(&lb4_backends, &id);
	if (!be || !backend_usable(be->flags))
		return NULL;
	*out_id = id;
	return be;
}

/*
 * affinity_backend returns the backend the client used last for the
 * frontend, while that choice holds: within the service's timeout, still
 * one of its active backends (lb_affinity_match, as the socket hooks
 * check). Following it refreshes it.
 */
static __always_inline const struct lb4_backend *affinity_backend(const struct np4_affinity_key *akey,
								   __u32 timeout, __u64 now)
{
	struct lb_affinity_match match = { .rev_nat_id = akey->rev_nat };
	struct np_affinity_val *val = bpf_map_lookup_elem(&nodeport_affinity4, akey);
	const struct lb4_backend *be;
	__u32 id;

	if (!val)
		return NULL;
	id = val->backend_id;
	if ((__s64)(now - val->last_used) > (__s64)((__u64)timeout * NSEC_PER_SEC))
		return NULL;
	match.backend_id = id;
	if (!bpf_map_lookup_elem(&lb_affinity_match, &match))
		return NULL;
	be = bpf_map_lookup_elem(&lb4_backends, &id);
	if (!be || be->flags != BACKEND_ACTIVE)
		return NULL;
	val->last_used = now;
	return be;
}

/* snat_addr returns the address a remote backend at addr sees as the
 * source, when the kernel routes it through an external device: that
 * device's; 0 when it routes it elsewhere (a local backend). *none says
 * the device has no address. */
static __always_inline __be32 snat_addr(struct __sk_buff *skb, const struct pkt4 *p, __be32 addr,
					int *none, __u32 *out_ifindex)
{
	struct bpf_fib_lookup fib = {
		.family = 2, /* AF_INET */
		.l4_protocol = p->proto,
		.sport = p->sport,
		.dport = p->dport,
		.ipv4_src = p->saddr,
		.ipv4_dst = addr,
		.ifindex = skb->ingress_ifindex,
	};
	struct np_device *dev;
	__u32 ifindex;
	long rc;

	*none = 0;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	ifindex = fib.ifindex;
	*out_ifindex = ifindex;
	dev = bpf_map_lookup_elem(&nodeport_devices, &ifindex);
	if (!dev)
		return 0;
	if (!dev->addr4)
		*none = 1;
	return dev->addr4;
}

/*
 * out4 sends a packet whose source is now one of the node's addresses
 * straight out of the device the kernel routes daddr through (ifindex, or
 * looked up when 0), with the neighbour resolved there: through the
 * kernel's input path, a packet arriving with a local source address
 * would be dropped as a martian.
 */
static __always_inline int out4(struct __sk_buff *skb, __be32 saddr, __be32 daddr, __u32 ifindex)
{
	struct bpf_fib_lookup fib = {
		.family = 2, /* AF_INET */
		.ipv4_src = saddr,
		.ipv4_dst = daddr,
		.ifindex = skb->ingress_ifindex,
	};
	long rc;

	if (!ifindex) {
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH) {
			count(NP_STAT_NO_ROUTE);
			return TCX_DROP;
		}
		ifindex = fib.ifindex;
	}
	return (int)bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

/* The headers of a TCP reset built in place of a packet. */
struct rst4 {
	struct iphdr ip;
	struct tcphdr tcp;
};

struct pseudo4 {
	__be32 saddr;
	__be32 daddr;
	__u8 zero;
	__u8 proto;
	__be16 len;
};

static __always_inline __u16 csum_fold(__s64 sum)
{
	__u32 s = (__u32)sum;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/*
 * reset4 answers a TCP packet to a frontend nobody serves with a reset,
 * as a host with nothing listening would (and as kube-proxy's reject
 * does): the packet is cut to its headers, turned around, and sent back
 * out of the device it came in through. A reset, or a packet with IP
 * options, is only dropped.
 */
static __attribute__((noinline)) int reset4(struct __sk_buff *skb, const struct pkt4 *p)
{
	if (!skb || !p)
		return TCX_DROP;
	struct iphdr ip;
	struct tcphdr tcp;
	struct rst4 r = {};
	struct pseudo4 ph = {};
	__u8 mac[2 * ETH_ALEN], omac[2 * ETH_ALEN];
	__u32 payload;
	__s64 sum;

	if (p->proto != IPPROTO_TCP)
		return TCX_DROP;
	if (bpf_skb_load_bytes(skb, 0, mac, sizeof(mac)) < 0 ||
	    bpf_skb_load_bytes(skb, IP_OFF, &ip, sizeof(ip)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l4_off, &tcp, sizeof(tcp)) < 0)
		return TCX_DROP;
	if (ip.ihl != 5 || tcp.rst || tcp.doff < 5)
		return TCX_DROP;
	payload = bpf_ntohs(ip.tot_len) - 20 - tcp.doff * 4;

	r.ip.version = 4;
	r.ip.ihl = 5;
	r.ip.tot_len = bpf_htons(40);
	r.ip.ttl = 64;
	r.ip.protocol = IPPROTO_TCP;
	r.ip.saddr = p->daddr;
	r.ip.daddr = p->saddr;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&r.ip, sizeof(r.ip), 0);
	if (sum < 0)
		return TCX_DROP;
	r.ip.check = csum_fold(sum);

	r.tcp.source = p->dport;
	r.tcp.dest = p->sport;
	r.tcp.doff = 5;
	r.tcp.rst = 1;
	if (tcp.ack) {
		r.tcp.seq = tcp.ack_seq;
	} else {
		r.tcp.ack = 1;
		r.tcp.ack_seq = bpf_htonl(bpf_ntohl(tcp.seq) + payload + tcp.syn + tcp.fin);
	}
	ph.saddr = r.ip.saddr;
	ph.daddr = r.ip.daddr;
	ph.proto = IPPROTO_TCP;
	ph.len = bpf_htons(sizeof(r.tcp));
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&ph, sizeof(ph), 0);
	if (sum < 0)
		return TCX_DROP;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&r.tcp, sizeof(r.tcp), (__u32)sum);
	if (sum < 0)
		return TCX_DROP;
	r.tcp.check = csum_fold(sum);

	/* Turned around: the destination MAC is the sender's. */
	__builtin_memcpy(omac, mac + ETH_ALEN, ETH_ALEN);
	__builtin_memcpy(omac + ETH_ALEN, mac, ETH_ALEN);
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(r), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, omac, sizeof(omac), 0) < 0 ||
	    bpf_skb_store_bytes(skb, IP_OFF, &r, sizeof(r), 0) < 0)
		return TCX_DROP;
	count(NP_STAT_RESET);
	return (int)bpf_redirect(skb->ifindex, 0);
}

/* The headers of an ICMP error built in place of a packet: the error's
 * own, then the start of the packet it answers (its IP header and the
 * first 8 bytes after, as RFC 792 asks; all a host needs to find the
 * socket). */
/* ICMP's and ICMPv6's error header (linux/icmp.h would pull in libc's
 * headers): type, code, checksum, 4 unused bytes. */
struct icmp_err {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__u32 unused;
};

#define ICMP_DEST_UNREACH 3
#define ICMP_PORT_UNREACH 3
#define ICMPV6_DEST_UNREACH 1
#define ICMPV6_PORT_UNREACH 4

struct unreach4 {
	struct iphdr ip;
	struct icmp_err icmp;
	struct iphdr orig;
	__u8 orig_l4[8];
};

/*
 * unreach4 answers a UDP datagram to a frontend nobody serves with an
 * ICMP port unreachable from the frontend, as a host with nothing
 * listening does (and kube-proxy's reject): a connected socket gets
 * ECONNREFUSED instead of waiting. A datagram with IP options is only
 * dropped.
 */
static __attribute__((noinline)) int unreach4(struct __sk_buff *skb, const struct pkt4 *p)
{
	if (!skb || !p)
		return TCX_DROP;
	struct unreach4 u = {};
	__u8 mac[2 * ETH_ALEN], omac[2 * ETH_ALEN];
	__s64 sum;

	if (bpf_skb_load_bytes(skb, 0, mac, sizeof(mac)) < 0 ||
	    bpf_skb_load_bytes(skb, IP_OFF, &u.orig, sizeof(u.orig)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l4_off, u.orig_l4, sizeof(u.orig_l4)) < 0)
		return TCX_DROP;
	if (u.orig.ihl != 5)
		return TCX_DROP;

	u.ip.version = 4;
	u.ip.ihl = 5;
	u.ip.tot_len = bpf_htons(sizeof(u));
	u.ip.ttl = 64;
	u.ip.protocol = IPPROTO_ICMP;
	u.ip.saddr = p->daddr;
	u.ip.daddr = p->saddr;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&u.ip, sizeof(u.ip), 0);
	if (sum < 0)
		return TCX_DROP;
	u.ip.check = csum_fold(sum);

	u.icmp.type = ICMP_DEST_UNREACH;
	u.icmp.code = ICMP_PORT_UNREACH;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&u.icmp, sizeof(u) - sizeof(u.ip), 0);
	if (sum < 0)
		return TCX_DROP;
	u.icmp.checksum = csum_fold(sum);

	__builtin_memcpy(omac, mac + ETH_ALEN, ETH_ALEN);
	__builtin_memcpy(omac + ETH_ALEN, mac, ETH_ALEN);
	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(u), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, omac, sizeof(omac), 0) < 0 ||
	    bpf_skb_store_bytes(skb, IP_OFF, &u, sizeof(u), 0) < 0)
		return TCX_DROP;
	count(NP_STAT_UNREACH);
	return (int)bpf_redirect(skb->ifindex, 0);
}

/* refuse4 answers a new flow to a frontend without a usable backend
 * (new_flow4 said NP_REFUSE): TCP with a reset, UDP with a port
 * unreachable. Called from the program itself, not from ingress4, and
 * parsing the packet again: the answer's stack then comes on top of
 * nothing (the verifier allows 512 bytes for a chain of calls, which
 * ingress6's path nearly takes alone). */
static __attribute__((noinline)) int refuse4(struct __sk_buff *skb)
{
	struct pkt4 p;

	if (!skb || !parse4(skb, &p))
		return TCX_DROP;
	if (p.proto == IPPROTO_TCP)
		return reset4(skb, &p);
	return unreach4(skb, &p);
}

/* new_flow4 sends a new flow to frontend (p->daddr, p->dport) to a
 * backend: TCX_NEXT with the packet translated, TCX_DROP, or -2 when the
 * destination is no routable frontend. */
static __always_inline int new_flow4(struct __sk_buff *skb, const struct pkt4 *p)
{
	struct lb4_key key = {
		.address = p->daddr,
		.dport = p->dport,
		.proto = p->proto,
	};
	const struct lb4_service *svc;
	const struct lb4_backend *be = NULL;
	struct np4_affinity_key akey = {};
	struct np4_key fk = {}, rk = {};
	__u32 be_id = 0;
	struct np4_entry fe = {}, re = {};
	__be32 be_addr, nat_addr;
	__be16 be_port, nat_port = p->sport;
	__u32 out_ifindex = 0;
	__u64 now;
	int none, i;
	long err;

	svc = bpf_map_lookup_elem(&lb4_services, &key);
	if (!svc || !(svc->flags & SVC_FLAG_ROUTABLE))
		return -2;
	if (svc->flags & SVC_FLAG_LOADBALANCER) {
		struct np_srcrange4_key rk = {
			.prefixlen = 64,
			.rev_nat = svc->rev_nat_index,
			.addr = p->saddr,
		};
		__u8 *allowed = bpf_map_lookup_elem(&nodeport_srcrange4, &rk);

		if (allowed && !*allowed) {
			count(NP_STAT_SOURCE_RANGE);
			return TCX_DROP;
		}
	}
	now = bpf_ktime_get_ns();
	if (svc->flags & SVC_FLAG_AFFINITY) {
		akey.client = p->saddr;
		akey.rev_nat = svc->rev_nat_index;
		be = affinity_backend(&akey, svc->backend_id & AFFINITY_TIMEOUT_MASK, now);
	}
	if (!be) {
		/* The flow without the node's address: on an ECMP'd LoadBalancer
		 * IP every node computes the same hash. */
		be = pick_backend(&key, svc,
				  flow_hash(p->saddr, ((__u32)p->sport << 16) | p->dport, p->proto), &be_id);
		if (!be) {
			count(NP_STAT_NO_BACKEND);
			return NP_REFUSE;
		}
		if (svc->flags & SVC_FLAG_AFFINITY) {
			struct np_affinity_val av = {
				.last_used = now,
				.backend_id = be_id,
			};

			bpf_map_update_elem(&nodeport_affinity4, &akey, &av, BPF_ANY);
		}
	}
	be_addr = be->address;
	be_port = be->port;

	nat_addr = snat_addr(skb, p, be_addr, &none, &out_ifindex);
	if (none) {
		count(NP_STAT_NO_SNAT_ADDR);
		return TCX_DROP;
	}

	rk.saddr = be_addr;
	rk.sport = be_port;
	rk.proto = p->proto;
	rk.dir = NP_DIR_REV;
	re.last_seen = now;
	re.addr = p->saddr;
	re.port = p->sport;
	re.nat_addr = p->daddr;
	re.nat_port = p->dport;
	re.proto = p->proto;
	if (nat_addr) {
		re.flags = NP_FLAG_SNAT;
		rk.daddr = nat_addr;
		for (i = 0; i < NAT_TRIES; i++) {
			__u32 span = (__u32)nat_port_max - nat_port_min + 1;
			struct np4_entry *old;

			nat_port = bpf_htons((__u16)(nat_port_min + bpf_get_prandom_u32() % span));
			rk.dport = nat_port;
			err = bpf_map_update_elem(&nodeport_nat4, &rk, &re, BPF_NOEXIST);
			if (err == 0)
				break;
			if (err != -17 /* EEXIST */) {
				count(NP_STAT_NAT_FULL);
				return TCX_DROP;
			}
			/* Taken: by an idle flow, whose port this one may have. */
			old = bpf_map_lookup_elem(&nodeport_nat4, &rk);
			if (old && stale(old, now)) {
				/* The idle flow goes whole: its forward entry
				 * would send its client's packets with this port. */
				struct np4_key ofk = {
					.saddr = old->addr,
					.daddr = old->nat_addr,
					.sport = old->port,
					.dport = old->nat_port,
					.proto = old->proto,
					.dir = NP_DIR_FWD,
				};

				bpf_map_delete_elem(&nodeport_nat4, &ofk);
				*old = re;
				break;
			}
		}
		if (i == NAT_TRIES) {
			count(NP_STAT_NAT_PORTS);
			return TCX_DROP;
		}
	} else {
		rk.daddr = p->saddr;
		rk.dport = p->sport;
		if (bpf_map_update_elem(&nodeport_nat4, &rk, &re, BPF_ANY) < 0) {
			count(NP_STAT_NAT_FULL);
			return TCX_DROP;
		}
	}

	fk.saddr = p->saddr;
	fk.daddr = p->daddr;
	fk.sport = p->sport;
	fk.dport = p->dport;
	fk.proto = p->proto;
	fk.dir = NP_DIR_FWD;
	fe.last_seen = now;
	fe.addr = be_addr;
	fe.port = be_port;
	fe.nat_addr = nat_addr;
	fe.nat_port = nat_addr ? nat_port : 0;
	fe.flags = re.flags;
	fe.proto = p->proto;
	if (bpf_map_update_elem(&nodeport_nat4, &fk, &fe, BPF_ANY) < 0) {
		bpf_map_delete_elem(&nodeport_nat4, &rk);
		count(NP_STAT_NAT_FULL);
		return TCX_DROP;
	}
	count(nat_addr ? NP_STAT_NEW_REMOTE : NP_STAT_NEW_LOCAL);
	if (!nat_addr)
		return rewrite4(skb, p, p->saddr, p->sport, be_addr, be_port);
	if (rewrite4(skb, p, nat_addr, nat_port, be_addr, be_port) != TCX_NEXT)
		return TCX_DROP;
	return out4(skb, nat_addr, be_addr, out_ifindex);
}

/* reply4 translates a reply of a known flow back, when key names one
 * whose translation is this side's (snat: a remote backend's, at
 * ingress; else a local one's, at egress). -2: not a reply. */
static __always_inline int reply4(struct __sk_buff *skb, const struct pkt4 *p, int snat)
{
	struct np4_key k = {
		.saddr = p->saddr,
		.daddr = p->daddr,
		.sport = p->sport,
		.dport = p->dport,
		.proto = p->proto,
		.dir = NP_DIR_REV,
	};
	struct np4_entry *e = bpf_map_lookup_elem(&nodeport_nat4, &k);
	__be32 caddr, faddr;
	__be16 cport, fport;

	if (!e || !(e->flags & NP_FLAG_SNAT) != !snat)
		return -2;
	e->last_seen = bpf_ktime_get_ns();
	caddr = e->addr;
	cport = e->port;
	faddr = e->nat_addr;
	fport = e->nat_port;
	count(NP_STAT_REV);
	if (rewrite4(skb, p, faddr, fport, caddr, cport) != TCX_NEXT)
		return TCX_DROP;
	return snat ? out4(skb, faddr, caddr, 0) : TCX_NEXT;
}

/* ---- IPv6: the same for packets without extension headers. ---- */

#define IP6_OFF ETH_HLEN
#define IP6_SRC_OFF (IP6_OFF + offsetof(struct ipv6hdr, saddr))
#define IP6_DST_OFF (IP6_OFF + offsetof(struct ipv6hdr, daddr))

struct pkt6 {
	union v6addr saddr, daddr;
	__be16 sport, dport;
	__u32 l4_off;
	__u8 proto;
};

static __always_inline int v6_zero(const union v6addr *a)
{
	return !(a->p[0] | a->p[1] | a->p[2] | a->p[3]);
}

static __always_inline int v6_eq(const union v6addr *a, const union v6addr *b)
{
	return a->p[0] == b->p[0] && a->p[1] == b->p[1] && a->p[2] == b->p[2] && a->p[3] == b->p[3];
}

/* parse6 reads an IPv6 TCP or UDP packet whose next header is TCP or UDP
 * at once; 0 for anything else (extension headers included), which
 * passes untouched. */
static __always_inline int parse6(struct __sk_buff *skb, struct pkt6 *p)
{
	struct ipv6hdr ip;
	__be16 ports[2];

	if (skb->protocol != bpf_htons(ETH_P_IPV6))
		return 0;
	if (bpf_skb_load_bytes(skb, IP6_OFF, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.nexthdr != IPPROTO_TCP && ip.nexthdr != IPPROTO_UDP)
		return 0;
	p->l4_off = IP6_OFF + sizeof(ip);
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return 0;
	__builtin_memcpy(&p->saddr, &ip.saddr, 16);
	__builtin_memcpy(&p->daddr, &ip.daddr, 16);
	p->sport = ports[0];
	p->dport = ports[1];
	p->proto = ip.nexthdr;
	return 1;
}

static __always_inline __u32 l4_csum_off6(const struct pkt6 *p)
{
	return p->l4_off + (p->proto == IPPROTO_TCP ? offsetof(struct tcphdr, check) :
						       offsetof(struct udphdr, check));
}

/* set_addr6 rewrites the address at off from old to new, with the
 * pseudo-header checksum (IPv6 has no header checksum). */
static __always_inline int set_addr6(struct __sk_buff *skb, const struct pkt6 *p, __u32 off,
				     const union v6addr *old, const union v6addr *new)
{
	__s64 diff;

	if (v6_eq(old, new))
		return 0;
	diff = bpf_csum_diff((__be32 *)old, 16, (__be32 *)new, 16, 0);
	if (diff < 0)
		return -1;
	/* UDP over IPv6 must carry a checksum: no MANGLED_0. */
	if (bpf_l4_csum_replace(skb, l4_csum_off6(p), 0, diff, BPF_F_PSEUDO_HDR) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, new, 16, 0);
}

static __always_inline int set_port6(struct __sk_buff *skb, const struct pkt6 *p, __u32 off,
				     __be16 old, __be16 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, l4_csum_off6(p), old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int rewrite6(struct __sk_buff *skb, const struct pkt6 *p,
				    const union v6addr *saddr, __be16 sport,
				    const union v6addr *daddr, __be16 dport)
{
	if (set_addr6(skb, p, IP6_SRC_OFF, &p->saddr, saddr) < 0 ||
	    set_addr6(skb, p, IP6_DST_OFF, &p->daddr, daddr) < 0 ||
	    set_port6(skb, p, p->l4_off, p->sport, sport) < 0 ||
	    set_port6(skb, p, p->l4_off + 2, p->dport, dport) < 0)
		return TCX_DROP;
	return TCX_NEXT;
}

static __always_inline int stale6(const struct np6_entry *e, __u64 now)
{
	return (__s64)(now - e->last_seen) > (__s64)timeout_of(e->proto);
}

/* fib6 returns the device the kernel routes daddr through, 0 for none. */
static __always_inline __u32 fib6(struct __sk_buff *skb, const union v6addr *saddr,
				  const union v6addr *daddr)
{
	struct bpf_fib_lookup fib = {
		.family = 10, /* AF_INET6 */
		.ifindex = skb->ingress_ifindex,
	};
	long rc;

	__builtin_memcpy(fib.ipv6_src, saddr, 16);
	__builtin_memcpy(fib.ipv6_dst, daddr, 16);
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return 0;
	return fib.ifindex;
}

static __always_inline int out6(struct __sk_buff *skb, const union v6addr *saddr,
				const union v6addr *daddr, __u32 ifindex)
{
	if (!ifindex)
		ifindex = fib6(skb, saddr, daddr);
	if (!ifindex) {
		count(NP_STAT_NO_ROUTE);
		return TCX_DROP;
	}
	return (int)bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

static __always_inline const struct lb6_backend *pick_backend6(struct lb6_key *key,
								const struct lb4_service *svc, __u32 hash,
								__u32 *out_id)
{
	const struct lb4_service *slot;
	const struct lb6_backend *be;
	__u32 n = slots(svc->count, svc->qcount);
	__u32 id;

	if (n == 0)
		return NULL;
	id = maglev_backend_id(svc, hash);
	if (id) {
		be = bpf_map_lookup_elem(&lb6_backends, &id);
		if (be && be->flags == BACKEND_ACTIVE) {
			*out_id = id;
			return be;
		}
	}
	key->backend_slot = random_slot(n);
	slot = bpf_map_lookup_elem(&lb6_services, key);
	if (!slot)
		return NULL;
	id = slot->backend_id;
	be = bpf_map_lookup_elem(&lb6_backends, &id);
	if (!be || !backend_usable(be->flags))
		return NULL;
	*out_id = id;
	return be;
}

/* affinity_backend6 is affinity_backend for IPv6 clients. */
static __always_inline const struct lb6_backend *affinity_backend6(const struct np6_affinity_key *akey,
								    __u32 timeout, __u64 now)
{
	struct lb_affinity_match match = { .rev_nat_id = akey->rev_nat };
	struct np_affinity_val *val = bpf_map_lookup_elem(&nodeport_affinity6, akey);
	const struct lb6_backend *be;
	__u32 id;

	if (!val)
		return NULL;
	id = val->backend_id;
	if ((__s64)(now - val->last_used) > (__s64)((__u64)timeout * NSEC_PER_SEC))
		return NULL;
	match.backend_id = id;
	if (!bpf_map_lookup_elem(&lb_affinity_match, &match))
		return NULL;
	be = bpf_map_lookup_elem(&lb6_backends, &id);
	if (!be || be->flags != BACKEND_ACTIVE)
		return NULL;
	val->last_used = now;
	return be;
}

struct rst6 {
	struct ipv6hdr ip;
	struct tcphdr tcp;
};

/* mac_turned reads the frame's MAC addresses swapped: the answer goes
 * back to the sender. */
static __always_inline int mac_turned(struct __sk_buff *skb, __u8 *omac)
{
	__u8 mac[2 * ETH_ALEN];

	if (bpf_skb_load_bytes(skb, 0, mac, sizeof(mac)) < 0)
		return -1;
	__builtin_memcpy(omac, mac + ETH_ALEN, ETH_ALEN);
	__builtin_memcpy(omac + ETH_ALEN, mac, ETH_ALEN);
	return 0;
}

/* csum6 is the checksum of n bytes at data (a multiple of 4) under the
 * IPv6 pseudo-header (RFC 8200 8.1) of ip, whose addresses are in place:
 * summed where they are, so that no copy takes stack. */
static __always_inline __s64 csum6(struct ipv6hdr *ip, __u8 next, void *data, __u32 n)
{
	__be32 tail[2] = { bpf_htonl(n), bpf_htonl(next) };
	__s64 sum;

	sum = bpf_csum_diff(NULL, 0, (__be32 *)&ip->saddr, 32, 0);
	if (sum < 0)
		return sum;
	sum = bpf_csum_diff(NULL, 0, tail, sizeof(tail), (__u32)sum);
	if (sum < 0)
		return sum;
	return bpf_csum_diff(NULL, 0, data, n, (__u32)sum);
}

/* reset6 is reset4 for IPv6: a TCP packet to a frontend nobody serves is
 * answered with a reset from the frontend. */
static __attribute__((noinline)) int reset6(struct __sk_buff *skb, const struct pkt6 *p)
{
	if (!skb || !p)
		return TCX_DROP;
	struct tcphdr tcp;
	struct rst6 r = {};
	__u8 omac[2 * ETH_ALEN];
	__u32 payload;
	__s64 sum;

	if (mac_turned(skb, omac) < 0 || bpf_skb_load_bytes(skb, p->l4_off, &tcp, sizeof(tcp)) < 0)
		return TCX_DROP;
	if (tcp.rst || tcp.doff < 5)
		return TCX_DROP;
	payload = skb->len - p->l4_off - tcp.doff * 4;

	r.ip.version = 6;
	r.ip.payload_len = bpf_htons(sizeof(r.tcp));
	r.ip.nexthdr = IPPROTO_TCP;
	r.ip.hop_limit = 64;
	__builtin_memcpy(&r.ip.saddr, &p->daddr, 16);
	__builtin_memcpy(&r.ip.daddr, &p->saddr, 16);
	r.tcp.source = p->dport;
	r.tcp.dest = p->sport;
	r.tcp.doff = 5;
	r.tcp.rst = 1;
	if (tcp.ack) {
		r.tcp.seq = tcp.ack_seq;
	} else {
		r.tcp.ack = 1;
		r.tcp.ack_seq = bpf_htonl(bpf_ntohl(tcp.seq) + payload + tcp.syn + tcp.fin);
	}
	sum = csum6(&r.ip, IPPROTO_TCP, &r.tcp, sizeof(r.tcp));
	if (sum < 0)
		return TCX_DROP;
	r.tcp.check = csum_fold(sum);

	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(r), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, omac, sizeof(omac), 0) < 0 ||
	    bpf_skb_store_bytes(skb, IP6_OFF, &r, sizeof(r), 0) < 0)
		return TCX_DROP;
	count(NP_STAT_RESET);
	return (int)bpf_redirect(skb->ifindex, 0);
}

struct unreach6 {
	struct ipv6hdr ip;
	struct icmp_err icmp;
	struct ipv6hdr orig;
	__u8 orig_l4[8];
};

/* unreach6 is unreach4 for IPv6: an ICMPv6 port unreachable (RFC 4443
 * 3.1) carrying the datagram's IPv6 header and UDP header. */
static __attribute__((noinline)) int unreach6(struct __sk_buff *skb, const struct pkt6 *p)
{
	if (!skb || !p)
		return TCX_DROP;
	struct unreach6 u = {};
	__u8 omac[2 * ETH_ALEN];
	__s64 sum;

	if (mac_turned(skb, omac) < 0 ||
	    bpf_skb_load_bytes(skb, IP6_OFF, &u.orig, sizeof(u.orig)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l4_off, u.orig_l4, sizeof(u.orig_l4)) < 0)
		return TCX_DROP;

	u.ip.version = 6;
	u.ip.payload_len = bpf_htons(sizeof(u) - sizeof(u.ip));
	u.ip.nexthdr = IPPROTO_ICMPV6;
	u.ip.hop_limit = 64;
	__builtin_memcpy(&u.ip.saddr, &p->daddr, 16);
	__builtin_memcpy(&u.ip.daddr, &p->saddr, 16);
	u.icmp.type = ICMPV6_DEST_UNREACH;
	u.icmp.code = ICMPV6_PORT_UNREACH;
	sum = csum6(&u.ip, IPPROTO_ICMPV6, &u.icmp, sizeof(u) - sizeof(u.ip));
	if (sum < 0)
		return TCX_DROP;
	u.icmp.checksum = csum_fold(sum);

	if (bpf_skb_change_tail(skb, ETH_HLEN + sizeof(u), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, omac, sizeof(omac), 0) < 0 ||
	    bpf_skb_store_bytes(skb, IP6_OFF, &u, sizeof(u), 0) < 0)
		return TCX_DROP;
	count(NP_STAT_UNREACH);
	return (int)bpf_redirect(skb->ifindex, 0);
}

/* refuse6 is refuse4 for IPv6. */
static __attribute__((noinline)) int refuse6(struct __sk_buff *skb)
{
	struct pkt6 p;

	if (!skb || !parse6(skb, &p))
		return TCX_DROP;
	if (p.proto == IPPROTO_TCP)
		return reset6(skb, &p);
	return unreach6(skb, &p);
}

static __always_inline int new_flow6(struct __sk_buff *skb, const struct pkt6 *p)
{
	struct lb6_key key = {
		.dport = p->dport,
		.proto = p->proto,
	};
	const struct lb4_service *svc;
	const struct lb6_backend *be = NULL;
	struct np6_affinity_key akey = {};
	struct np6_key fk = {}, rk = {};
	__u32 be_id = 0;
	struct np6_entry fe = {}, re = {};
	union v6addr be_addr, nat_addr = {};
	__be16 be_port, nat_port = p->sport;
	struct np_device *dev = NULL;
	__u32 ifindex;
	__u64 now;
	int i;
	long err;

	key.address = p->daddr;
	svc = bpf_map_lookup_elem(&lb6_services, &key);
	if (!svc || !(svc->flags & SVC_FLAG_ROUTABLE))
		return -2;
	if (svc->flags & SVC_FLAG_LOADBALANCER) {
		struct np_srcrange6_key sk = {
			.prefixlen = 32 + 128,
			.rev_nat = svc->rev_nat_index,
			.addr = p->saddr,
		};
		__u8 *allowed = bpf_map_lookup_elem(&nodeport_srcrange6, &sk);

		if (allowed && !*allowed) {
			count(NP_STAT_SOURCE_RANGE);
			return TCX_DROP;
		}
	}
	now = bpf_ktime_get_ns();
	if (svc->flags & SVC_FLAG_AFFINITY) {
		akey.client = p->saddr;
		akey.rev_nat = svc->rev_nat_index;
		be = affinity_backend6(&akey, svc->backend_id & AFFINITY_TIMEOUT_MASK, now);
	}
	if (!be) {
		be = pick_backend6(&key, svc,
				   flow_hash(p->saddr.p[0] ^ p->saddr.p[1] ^ p->saddr.p[2] ^ p->saddr.p[3],
					     ((__u32)p->sport << 16) | p->dport, p->proto),
				   &be_id);
		if (!be) {
			count(NP_STAT_NO_BACKEND);
			return NP_REFUSE;
		}
		if (svc->flags & SVC_FLAG_AFFINITY) {
			struct np_affinity_val av = {
				.last_used = now,
				.backend_id = be_id,
			};

			bpf_map_update_elem(&nodeport_affinity6, &akey, &av, BPF_ANY);
		}
	}
	be_addr = be->address;
	be_port = be->port;

	ifindex = fib6(skb, &p->saddr, &be_addr);
	if (ifindex)
		dev = bpf_map_lookup_elem(&nodeport_devices, &ifindex);
	if (dev) {
		nat_addr = dev->addr6;
		if (v6_zero(&nat_addr)) {
			count(NP_STAT_NO_SNAT_ADDR);
			return TCX_DROP;
		}
	}

	rk.saddr = be_addr;
	rk.sport = be_port;
	rk.proto = p->proto;
	rk.dir = NP_DIR_REV;
	re.last_seen = now;
	re.addr = p->saddr;
	re.port = p->sport;
	re.nat_addr = p->daddr;
	re.nat_port = p->dport;
	re.proto = p->proto;
	if (dev) {
		re.flags = NP_FLAG_SNAT;
		rk.daddr = nat_addr;
		for (i = 0; i < NAT_TRIES; i++) {
			__u32 span = (__u32)nat_port_max - nat_port_min + 1;
			struct np6_entry *old;

			nat_port = bpf_htons((__u16)(nat_port_min + bpf_get_prandom_u32() % span));
			rk.dport = nat_port;
			err = bpf_map_update_elem(&nodeport_nat6, &rk, &re, BPF_NOEXIST);
			if (err == 0)
				break;
			if (err != -17 /* EEXIST */) {
				count(NP_STAT_NAT_FULL);
				return TCX_DROP;
			}
			old = bpf_map_lookup_elem(&nodeport_nat6, &rk);
			if (old && stale6(old, now)) {
				struct np6_key ofk = {
					.saddr = old->addr,
					.daddr = old->nat_addr,
					.sport = old->port,
					.dport = old->nat_port,
					.proto = old->proto,
					.dir = NP_DIR_FWD,
				};

				bpf_map_delete_elem(&nodeport_nat6, &ofk);
				*old = re;
				break;
			}
		}
		if (i == NAT_TRIES) {
			count(NP_STAT_NAT_PORTS);
			return TCX_DROP;
		}
	} else {
		rk.daddr = p->saddr;
		rk.dport = p->sport;
		if (bpf_map_update_elem(&nodeport_nat6, &rk, &re, BPF_ANY) < 0) {
			count(NP_STAT_NAT_FULL);
			return TCX_DROP;
		}
	}

	fk.saddr = p->saddr;
	fk.daddr = p->daddr;
	fk.sport = p->sport;
	fk.dport = p->dport;
	fk.proto = p->proto;
	fk.dir = NP_DIR_FWD;
	fe.last_seen = now;
	fe.addr = be_addr;
	fe.port = be_port;
	fe.nat_addr = nat_addr;
	fe.nat_port = dev ? nat_port : 0;
	fe.flags = re.flags;
	fe.proto = p->proto;
	if (bpf_map_update_elem(&nodeport_nat6, &fk, &fe, BPF_ANY) < 0) {
		bpf_map_delete_elem(&nodeport_nat6, &rk);
		count(NP_STAT_NAT_FULL);
		return TCX_DROP;
	}
	count(dev ? NP_STAT_NEW_REMOTE : NP_STAT_NEW_LOCAL);
	if (!dev)
		return rewrite6(skb, p, &p->saddr, p->sport, &be_addr, be_port);
	if (rewrite6(skb, p, &nat_addr, nat_port, &be_addr, be_port) != TCX_NEXT)
		return TCX_DROP;
	return out6(skb, &nat_addr, &be_addr, ifindex);
}

static __always_inline int reply6(struct __sk_buff *skb, const struct pkt6 *p, int snat)
{
	struct np6_key k = {
		.sport = p->sport,
		.dport = p->dport,
		.proto = p->proto,
		.dir = NP_DIR_REV,
	};
	struct np6_entry *e;
	union v6addr caddr, faddr;
	__be16 cport, fport;

	k.saddr = p->saddr;
	k.daddr = p->daddr;
	e = bpf_map_lookup_elem(&nodeport_nat6, &k);
	if (!e || !(e->flags & NP_FLAG_SNAT) != !snat)
		return -2;
	e->last_seen = bpf_ktime_get_ns();
	caddr = e->addr;
	cport = e->port;
	faddr = e->nat_addr;
	fport = e->nat_port;
	count(NP_STAT_REV);
	if (rewrite6(skb, p, &faddr, fport, &caddr, cport) != TCX_NEXT)
		return TCX_DROP;
	return snat ? out6(skb, &faddr, &caddr, 0) : TCX_NEXT;
}

/* ingress6 and egress6 are functions of their own (not inlined): the
 * IPv6 path's stack is then not added to the IPv4 path's. */
static __attribute__((noinline)) int ingress6(struct __sk_buff *skb)
{
	struct np6_key k = {};
	struct np6_entry *e;
	struct pkt6 pkt, *p = &pkt;
	int ret;

	if (!skb || !parse6(skb, p))
		return TCX_NEXT;
	k.sport = p->sport;
	k.dport = p->dport;
	k.proto = p->proto;
	k.dir = NP_DIR_FWD;
	ret = reply6(skb, p, 1);
	if (ret != -2)
		return ret;
	k.saddr = p->saddr;
	k.daddr = p->daddr;
	e = bpf_map_lookup_elem(&nodeport_nat6, &k);
	if (e) {
		union v6addr be_addr = e->addr, nat_addr = e->nat_addr;
		__be16 be_port = e->port, nat_port = e->nat_port;
		int snat = e->flags & NP_FLAG_SNAT;

		e->last_seen = bpf_ktime_get_ns();
		count(NP_STAT_FWD);
		if (!snat)
			return rewrite6(skb, p, &p->saddr, p->sport, &be_addr, be_port);
		if (rewrite6(skb, p, &nat_addr, nat_port, &be_addr, be_port) != TCX_NEXT)
			return TCX_DROP;
		return out6(skb, &nat_addr, &be_addr, 0);
	}
	ret = new_flow6(skb, p);
	return ret == -2 ? TCX_NEXT : ret;
}

static __attribute__((noinline)) int egress6(struct __sk_buff *skb)
{
	struct pkt6 p;
	int ret;

	if (!skb || !parse6(skb, &p))
		return TCX_NEXT;
	ret = reply6(skb, &p, 0);
	return ret == -2 ? TCX_NEXT : ret;
}

static __attribute__((noinline)) int ingress4(struct __sk_buff *skb)
{
	struct np4_key k = {};
	struct np4_entry *e;
	struct pkt4 p;
	int ret;

	if (!skb || !parse4(skb, &p))
		return TCX_NEXT;
	ret = reply4(skb, &p, 1);
	if (ret != -2)
		return ret;

	k.saddr = p.saddr;
	k.daddr = p.daddr;
	k.sport = p.sport;
	k.dport = p.dport;
	k.proto = p.proto;
	k.dir = NP_DIR_FWD;
	e = bpf_map_lookup_elem(&nodeport_nat4, &k);
	if (e) {
		__be32 be_addr = e->addr, nat_addr = e->nat_addr;
		__be16 be_port = e->port, nat_port = e->nat_port;

		e->last_seen = bpf_ktime_get_ns();
		count(NP_STAT_FWD);
		if (!nat_addr)
			return rewrite4(skb, &p, p.saddr, p.sport, be_addr, be_port);
		if (rewrite4(skb, &p, nat_addr, nat_port, be_addr, be_port) != TCX_NEXT)
			return TCX_DROP;
		return out4(skb, nat_addr, be_addr, 0);
	}
	ret = new_flow4(skb, &p);
	return ret == -2 ? TCX_NEXT : ret;
}

/* nodeport_ingress: what arrives at an external device. */
SEC("tc")
int nodeport_ingress(struct __sk_buff *skb)
{
	int ret;

	if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		ret = ingress6(skb);
		return ret == NP_REFUSE ? refuse6(skb) : ret;
	}
	ret = ingress4(skb);
	return ret == NP_REFUSE ? refuse4(skb) : ret;
}

/* nodeport_egress: what leaves through an external device; a local
 * backend's replies get their frontend back. */
SEC("tc")
int nodeport_egress(struct __sk_buff *skb)
{
	struct pkt4 p;
	int ret;

	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return egress6(skb);
	if (!parse4(skb, &p))
		return TCX_NEXT;
	ret = reply4(skb, &p, 0);
	return ret == -2 ? TCX_NEXT : ret;
}

char __license[] SEC("license") = "Dual BSD/GPL";
