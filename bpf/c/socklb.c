// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Socket load balancing: cgroup sock_addr hooks that send a connect() or
 * sendmsg() aimed at a service frontend to one of its backends, and
 * translate the backend's address back to the frontend's in recvmsg() and
 * getpeername(), so that the application only ever sees the service.
 *
 * IPv4 frontends are in the lb4_* maps, IPv6 ones in lb6_*. An AF_INET6
 * socket reaches an IPv4 frontend through its IPv4-mapped address
 * (::ffff:a.b.c.d); the IPv6 hooks handle those with the lb4 maps, so that
 * a dual-stack application is balanced like an IPv4 one.
 *
 * A service address that cannot serve the connection refuses it at once
 * (ECONNREFUSED), as a host with nothing listening would: a frontend
 * without backends, or a port of the address that no service port names.
 * Services with session affinity send the connections of a client (a
 * network namespace: the source address is not chosen yet at connect())
 * to the backend it used last, within the service's timeout.
 *
 * The lb4_*, lb6_* and lb_affinity_match maps are the agent's own: the
 * loader replaces these definitions with the maps the load balancer keeps
 * pinned, so the structs below must match the Go types in bpf/lb.go byte
 * for byte (a Go test compares them through the object's BTF). The
 * *_sock_revnat (socket storage) and *_affinity maps are written by these
 * programs; the agent only pins them and removes stale affinity entries.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/errno.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* Only the restore of intercepted DNS: see dns_redirect.h. */
#define DNS_REDIRECT_RESTORE_ONLY
#include "addr.h"
#include "dns_redirect.h"
#include "lb_select.h"

/* lb4_services: key (frontend, slot), slot 0 the service, 1.. the backends. */
struct lb4_key {
	__be32 address;
	__be16 dport;   /* 0 with proto 0: the wildcard of a service address */
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb4_service {
	__u32 backend_id; /* slot 0: algorithm and affinity timeout; else the backend */
	__u16 count;      /* active backends, slots 1..count */
	__be16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u16 qcount;     /* terminating backends, slots count+1..count+qcount */
};

struct lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags; /* state: 0 active, 1 terminating, 2 quarantined, 3 maintenance */
	__u16 cluster_id;
	__u8 zone;
	__u8 pad;
};

/* Packed: the agent's map has 6-byte values. */
struct lb4_reverse_nat {
	__be32 address;
	__be16 port;
} __attribute__((packed));

struct lb6_key {
	union v6addr address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb6_service {
	__u32 backend_id;
	__u16 count;
	__be16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u16 qcount;
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

/* Packed: the agent's map has 18-byte values. */
struct lb6_reverse_nat {
	union v6addr address;
	__be16 port;
} __attribute__((packed));

/* Owned by these programs: which frontend a socket's backend stands for.
 * An IPv4-mapped destination of an AF_INET6 socket is remembered in the
 * lb4 map, with its IPv4 address: socket cookies are unique, so it cannot
 * meet an AF_INET socket's entry. */
/*
 * Per socket (socket storage, freed with the socket): the backends it was
 * sent to and the frontend each was chosen for, so that its replies and
 * getpeername show the frontend. A socket keeps its last SOCK_XLATS
 * backends (an unconnected UDP socket may reach several); a new one
 * takes a free slot, else the oldest. Being per socket, no other socket's
 * traffic can push these out (issue 35 item 11).
 */
#define SOCK_XLATS 8 /* a power of two: slots are taken modulo it */

struct lb4_sock_xlat {
	__be32 backend;
	__be16 backend_port; /* 0: a free slot */
	__be16 rev_nat_index;
	__be32 frontend;
	__be16 frontend_port;
	__u16 pad;
};

struct lb4_sock_state {
	struct lb4_sock_xlat x[SOCK_XLATS];
	__u32 next; /* the slot the next new backend takes */
	__u32 pad;
};

struct lb6_sock_xlat {
	union v6addr backend;
	__be16 backend_port; /* 0: a free slot */
	__be16 rev_nat_index;
	union v6addr frontend;
	__be16 frontend_port;
	__u16 pad;
};

struct lb6_sock_state {
	struct lb6_sock_xlat x[SOCK_XLATS];
	__u32 next;
	__u32 pad;
};

/* The agent's: (backend, service) for every active backend of a service
 * with session affinity. A remembered backend is followed only while its
 * entry exists, so the agent withdraws a backend by deleting it. */
struct lb_affinity_match {
	__u32 backend_id;
	__be16 rev_nat_id;
	__u16 pad;
};

/* Owned by these programs: per client and service, the backend chosen
 * last. The socket LB's client is the network namespace (netns_cookie 1):
 * the source address is not known yet at connect(). */
struct lb4_affinity_key {
	__u64 client_id;
	__be16 rev_nat_id;
	__u8 netns_cookie;
	__u8 pad1;
	__u32 pad2;
};

/* client_id has room for an IPv6 address; the namespace cookie takes its
 * first 8 bytes. */
struct lb6_affinity_key {
	union v6addr client_id;
	__be16 rev_nat_id;
	__u8 netns_cookie;
	__u8 pad1;
	__u32 pad2;
};

struct lb_affinity_val {
	__u64 last_used; /* bpf_ktime_get_ns */
	__u32 backend_id;
	__u32 pad;
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

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be16);
	__type(value, struct lb4_reverse_nat);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb4_reverse_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb6_key);
	__type(value, struct lb6_service);
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

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be16);
	__type(value, struct lb6_reverse_nat);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb6_reverse_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_affinity_match);
	__type(value, __u8);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} lb_affinity_match SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct lb4_sock_state);
} lb4_sock_revnat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct lb6_sock_state);
} lb6_sock_revnat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb4_affinity_key);
	__type(value, struct lb_affinity_val);
	__uint(max_entries, 65536);
} lb4_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb6_affinity_key);
	__type(value, struct lb_affinity_val);
	__uint(max_entries, 65536);
} lb6_affinity SEC(".maps");

/*
 * xlate_events: each translation of a connect() or sendmsg(), for Hubble's
 * trace-sock flows (the frontend asked for, the backend chosen). Written
 * only when the loader sets trace_xlate (the agent serves Hubble): a
 * ring nobody reads costs nothing then. A full ring drops the event, which
 * xlate_lost counts.
 */
struct xlate_event {
	__u64 time_ns; /* bpf_ktime_get_ns() */
	__u64 cgroup_id;
	__u64 sock_cookie;
	union v6addr frontend; /* IPv4: IPv4-mapped */
	union v6addr backend;
	__be16 frontend_port;
	__be16 backend_port;
	__u8 protocol;
	__u8 pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 18);
} xlate_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} xlate_lost SEC(".maps");

volatile const __u8 trace_xlate = 0;

#define SVC_FLAG_AFFINITY	(1 << 4)
#define AFFINITY_TIMEOUT_MASK	0xFFFFFF /* of slot 0's backend_id, seconds */
#define NSEC_PER_SEC		1000000000ULL

/* What a forward lookup decided. */
enum fwd {
	FWD_PASS,   /* not a frontend (or a backend vanished): leave it alone */
	FWD_XLATE,  /* send it to the backend found */
	FWD_REFUSE, /* a frontend with no backend, or an unserved port */
};

/* Only TCP and UDP are balanced; anything else goes where it was sent. */
static __always_inline int proto_balanced(const struct bpf_sock_addr *ctx)
{
	return ctx->protocol == IPPROTO_TCP || ctx->protocol == IPPROTO_UDP;
}

/*
 * refuse fails the connect() or sendmsg() with ECONNREFUSED, what an
 * application expects of a service nobody serves, rather than the EPERM
 * of a bare return 0. Only connect and sendmsg hooks may call it (the
 * kernel offers bpf_set_retval to those).
 */
static __always_inline int refuse(void)
{
	bpf_set_retval(-ECONNREFUSED);
	return 0;
}

/*
 * affinity_fresh says whether a remembered choice of backend_id, last used
 * at last_used, still holds at now: within the timeout, and still a backend
 * of the service per lb_affinity_match. The difference is signed because
 * another CPU may have stored a time a little after now.
 */
static __always_inline int affinity_fresh(__u64 last_used, __u32 backend_id,
					  __be16 rev_nat, __u32 timeout, __u64 now)
{
	struct lb_affinity_match match = {
		.backend_id = backend_id,
		.rev_nat_id = rev_nat,
	};

	if ((__s64)(now - last_used) > (__s64)((__u64)timeout * NSEC_PER_SEC))
		return 0;
	return bpf_map_lookup_elem(&lb_affinity_match, &match) != NULL;
}

/*
 * lb4_affinity_backend returns the backend the client of akey used for the
 * service last, when that choice still holds and the backend is active;
 * following it refreshes the entry.
 */
static __always_inline const struct lb4_backend *
lb4_affinity_backend(const struct lb4_affinity_key *akey, __u32 timeout, __u64 now)
{
	struct lb_affinity_val *val;
	const struct lb4_backend *be;
	__u32 backend_id;

	val = bpf_map_lookup_elem(&lb4_affinity, akey);
	if (!val)
		return NULL;
	/* Read once: another CPU may be storing a new choice. */
	backend_id = val->backend_id;
	if (!affinity_fresh(val->last_used, backend_id, akey->rev_nat_id, timeout, now))
		return NULL;
	be = bpf_map_lookup_elem(&lb4_backends, &backend_id);
	if (!be || be->flags != BACKEND_ACTIVE)
		return NULL;
	val->last_used = now;
	return be;
}

/* take_slot returns the slot a backend no slot holds takes: the oldest
 * one (they are taken in turn, free ones first). */
static __always_inline __u32 take_slot(__u32 *next)
{
	__u32 slot = *next & (SOCK_XLATS - 1);

	*next = slot + 1;
	return slot;
}

/* lb4_remember records in the socket's storage that backend (be, be_port)
 * was chosen for frontend (fe, fe_port) of service rev_nat. */
static __always_inline void lb4_remember(struct bpf_sock_addr *ctx, __be32 be, __be16 be_port,
					 __be32 fe, __be16 fe_port, __be16 rev_nat)
{
	struct lb4_sock_state *st;
	__u32 i, slot;

	if (!ctx->sk)
		return;
	st = bpf_sk_storage_get(&lb4_sock_revnat, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	for (i = 0; i < SOCK_XLATS; i++) {
		if (st->x[i].backend == be && st->x[i].backend_port == be_port)
			break;
	}
	slot = i < SOCK_XLATS ? i : take_slot(&st->next);
	st->x[slot & (SOCK_XLATS - 1)] = (struct lb4_sock_xlat){
		.backend = be,
		.backend_port = be_port,
		.rev_nat_index = rev_nat,
		.frontend = fe,
		.frontend_port = fe_port,
	};
}

static __always_inline int v6_equal(const union v6addr *a, const union v6addr *b)
{
	return a->p[0] == b->p[0] && a->p[1] == b->p[1] && a->p[2] == b->p[2] && a->p[3] == b->p[3];
}

/* lb6_remember is lb4_remember for IPv6 addresses. */
static __always_inline void lb6_remember(struct bpf_sock_addr *ctx, const union v6addr *be,
					 __be16 be_port, const union v6addr *fe, __be16 fe_port,
					 __be16 rev_nat)
{
	struct lb6_sock_state *st;
	struct lb6_sock_xlat *x;
	__u32 i;

	if (!ctx->sk)
		return;
	st = bpf_sk_storage_get(&lb6_sock_revnat, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	for (i = 0; i < SOCK_XLATS; i++) {
		if (st->x[i].backend_port == be_port && v6_equal(&st->x[i].backend, be))
			break;
	}
	x = &st->x[(i < SOCK_XLATS ? i : take_slot(&st->next)) & (SOCK_XLATS - 1)];
	x->backend = *be;
	x->backend_port = be_port;
	x->rev_nat_index = rev_nat;
	x->frontend = *fe;
	x->frontend_port = fe_port;
}

/*
 * lb4_fwd decides where a connect() or sendmsg() to the IPv4 address
 * (addr, port) goes: to a backend (*out), when it is a frontend with
 * backends; nowhere, when it is a frontend without backends or a port of a
 * service address that no service port names (the agent's wildcard entry,
 * port 0 and protocol 0); and where it was sent otherwise.
 *
 * Active backends are chosen at random, or the one the client's network
 * namespace used last if the service has session affinity; the terminating
 * ones only when there is no active backend.
 */
static __always_inline enum fwd lb4_fwd(struct bpf_sock_addr *ctx, __be32 addr, __be16 port,
					const struct lb4_backend **out)
{
	struct lb4_key key = {
		.address = addr,
		.dport = port,
		.proto = (__u8)ctx->protocol,
	};
	struct lb4_affinity_key akey = {};
	const struct lb4_service *svc, *slot;
	const struct lb4_backend *be = NULL;
	__u32 backend_id, n;
	__be16 rev_nat;
	__u64 now = 0;
	__u8 flags;

	svc = bpf_map_lookup_elem(&lb4_services, &key);
	if (!svc) {
		key.dport = 0;
		key.proto = 0;
		return bpf_map_lookup_elem(&lb4_services, &key) ? FWD_REFUSE : FWD_PASS;
	}
	n = slots(svc->count, svc->qcount);
	if (n == 0)
		return FWD_REFUSE;
	rev_nat = svc->rev_nat_index;
	flags = svc->flags;

	if (flags & SVC_FLAG_AFFINITY) {
		now = bpf_ktime_get_ns();
		akey.client_id = bpf_get_netns_cookie(ctx);
		akey.rev_nat_id = rev_nat;
		akey.netns_cookie = 1;
		be = lb4_affinity_backend(&akey, svc->backend_id & AFFINITY_TIMEOUT_MASK, now);
	}
	if (!be) {
		key.backend_slot = random_slot(n);
		slot = bpf_map_lookup_elem(&lb4_services, &key);
		if (!slot)
			return FWD_PASS;
		backend_id = slot->backend_id;
		be = bpf_map_lookup_elem(&lb4_backends, &backend_id);
		if (!be || !backend_usable(be->flags))
			return FWD_PASS;
		if (flags & SVC_FLAG_AFFINITY) {
			struct lb_affinity_val val = {
				.last_used = now,
				.backend_id = backend_id,
			};
			bpf_map_update_elem(&lb4_affinity, &akey, &val, BPF_ANY);
		}
	}

	/* Remembered before the rewrite, so that a reply never arrives
	 * without its way back. Failing to remember (no memory for the
	 * socket's storage) only costs the translation of its replies. */
	lb4_remember(ctx, be->address, be->port, addr, port, rev_nat);
	*out = be;
	return FWD_XLATE;
}

/* lb6_affinity_backend is lb4_affinity_backend for IPv6 services. */
static __always_inline const struct lb6_backend *
lb6_affinity_backend(const struct lb6_affinity_key *akey, __u32 timeout, __u64 now)
{
	struct lb_affinity_val *val;
	const struct lb6_backend *be;
	__u32 backend_id;

	val = bpf_map_lookup_elem(&lb6_affinity, akey);
	if (!val)
		return NULL;
	backend_id = val->backend_id;
	if (!affinity_fresh(val->last_used, backend_id, akey->rev_nat_id, timeout, now))
		return NULL;
	be = bpf_map_lookup_elem(&lb6_backends, &backend_id);
	if (!be || be->flags != BACKEND_ACTIVE)
		return NULL;
	val->last_used = now;
	return be;
}

/* lb6_fwd is lb4_fwd for IPv6 addresses, on the lb6 maps. */
static __always_inline enum fwd lb6_fwd(struct bpf_sock_addr *ctx, const union v6addr *addr,
					__be16 port, const struct lb6_backend **out)
{
	struct lb6_key key = {
		.address = *addr,
		.dport = port,
		.proto = (__u8)ctx->protocol,
	};
	struct lb6_affinity_key akey = {};
	const struct lb6_service *svc, *slot;
	const struct lb6_backend *be = NULL;
	__u32 backend_id, n;
	__be16 rev_nat;
	__u64 now = 0;
	__u8 flags;

	svc = bpf_map_lookup_elem(&lb6_services, &key);
	if (!svc) {
		key.dport = 0;
		key.proto = 0;
		return bpf_map_lookup_elem(&lb6_services, &key) ? FWD_REFUSE : FWD_PASS;
	}
	n = slots(svc->count, svc->qcount);
	if (n == 0)
		return FWD_REFUSE;
	rev_nat = svc->rev_nat_index;
	flags = svc->flags;

	if (flags & SVC_FLAG_AFFINITY) {
		__u64 cookie = bpf_get_netns_cookie(ctx);

		now = bpf_ktime_get_ns();
		__builtin_memcpy(&akey.client_id, &cookie, sizeof(cookie));
		akey.rev_nat_id = rev_nat;
		akey.netns_cookie = 1;
		be = lb6_affinity_backend(&akey, svc->backend_id & AFFINITY_TIMEOUT_MASK, now);
	}
	if (!be) {
		key.backend_slot = random_slot(n);
		slot = bpf_map_lookup_elem(&lb6_services, &key);
		if (!slot)
			return FWD_PASS;
		backend_id = slot->backend_id;
		be = bpf_map_lookup_elem(&lb6_backends, &backend_id);
		if (!be || !backend_usable(be->flags))
			return FWD_PASS;
		if (flags & SVC_FLAG_AFFINITY) {
			struct lb_affinity_val val = {
				.last_used = now,
				.backend_id = backend_id,
			};
			bpf_map_update_elem(&lb6_affinity, &akey, &val, BPF_ANY);
		}
	}

	lb6_remember(ctx, &be->address, be->port, addr, port, rev_nat);
	*out = be;
	return FWD_XLATE;
}

/*
 * lb4_rev gives a backend's address (*addr, *port) back as the frontend it
 * was chosen for, if this socket was sent there by lb4_fwd and the service
 * still exists (its rev-NAT entry is the authority on the frontend's
 * address). It returns whether it did.
 */
static __always_inline int lb4_rev(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port)
{
	struct lb4_reverse_nat *rnat;
	struct lb4_sock_state *st;
	struct lb4_sock_xlat *x;
	__u32 i, slot = SOCK_XLATS;
	__be16 idx;

	if (!ctx->sk || !*port)
		return 0;
	st = bpf_sk_storage_get(&lb4_sock_revnat, ctx->sk, 0, 0);
	if (!st)
		return 0;
	for (i = 0; i < SOCK_XLATS; i++) {
		if (st->x[i].backend == *addr && st->x[i].backend_port == *port) {
			slot = i;
			break;
		}
	}
	if (slot >= SOCK_XLATS)
		return 0;
	x = &st->x[slot & (SOCK_XLATS - 1)];
	idx = x->rev_nat_index;
	rnat = bpf_map_lookup_elem(&lb4_reverse_nat, &idx);
	if (!rnat || rnat->address != x->frontend || rnat->port != x->frontend_port) {
		/* The service went away or changed address. */
		x->backend_port = 0;
		return 0;
	}
	*addr = rnat->address;
	*port = rnat->port;
	return 1;
}

/* lb6_rev is lb4_rev for IPv6 addresses. */
static __always_inline int lb6_rev(struct bpf_sock_addr *ctx, union v6addr *addr, __be16 *port)
{
	struct lb6_reverse_nat *rnat;
	const union v6addr *front;
	struct lb6_sock_state *st;
	struct lb6_sock_xlat *x;
	__u32 i, slot = SOCK_XLATS;
	__be16 idx;

	if (!ctx->sk || !*port)
		return 0;
	st = bpf_sk_storage_get(&lb6_sock_revnat, ctx->sk, 0, 0);
	if (!st)
		return 0;
	for (i = 0; i < SOCK_XLATS; i++) {
		if (st->x[i].backend_port == *port && v6_equal(&st->x[i].backend, addr)) {
			slot = i;
			break;
		}
	}
	if (slot >= SOCK_XLATS)
		return 0;
	x = &st->x[slot & (SOCK_XLATS - 1)];
	idx = x->rev_nat_index;
	rnat = bpf_map_lookup_elem(&lb6_reverse_nat, &idx);
	if (!rnat)
		goto stale;
	/* The value is packed (18 bytes) but a map value starts 8-byte
	 * aligned: read the address a word at a time, not byte by byte. */
	front = (const union v6addr *)rnat;
	if (!v6_equal(front, &x->frontend) || rnat->port != x->frontend_port)
		goto stale;
	*addr = *front;
	*port = rnat->port;
	return 1;
stale:
	/* The service went away or changed address. */
	x->backend_port = 0;
	return 0;
}

static __always_inline void get_user_ip6(const struct bpf_sock_addr *ctx, union v6addr *a)
{
	a->p[0] = ctx->user_ip6[0];
	a->p[1] = ctx->user_ip6[1];
	a->p[2] = ctx->user_ip6[2];
	a->p[3] = ctx->user_ip6[3];
}

static __always_inline void set_user_ip6(struct bpf_sock_addr *ctx, const union v6addr *a)
{
	ctx->user_ip6[0] = a->p[0];
	ctx->user_ip6[1] = a->p[1];
	ctx->user_ip6[2] = a->p[2];
	ctx->user_ip6[3] = a->p[3];
}

/* Out of line, so that struct xlate_event is in the object's BTF, where a
 * test compares it with the agent's Go type. */
static __noinline void trace(struct bpf_sock_addr *ctx, struct xlate_event *ev)
{
	__u32 zero = 0;
	__u64 *lost, flags;

	ev->time_ns = bpf_ktime_get_ns();
	ev->cgroup_id = bpf_get_current_cgroup_id();
	ev->sock_cookie = bpf_get_socket_cookie(ctx);
	ev->protocol = (__u8)ctx->protocol;
	/* The reader is woken only once an eighth of the ring waits (a
	 * wake-up per event would cost each connection several times what the
	 * translation does); below that, it polls. */
	flags = bpf_ringbuf_query(&xlate_events, BPF_RB_AVAIL_DATA) >=
			bpf_ringbuf_query(&xlate_events, BPF_RB_RING_SIZE) >> 3 ?
		BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_output(&xlate_events, ev, sizeof(*ev), flags) == 0)
		return;
	lost = bpf_map_lookup_elem(&xlate_lost, &zero);
	if (lost)
		*lost += 1;
}

/* sock4_xlate rewrites an AF_INET destination that is a frontend. */
static __always_inline int sock4_xlate(struct bpf_sock_addr *ctx)
{
	const struct lb4_backend *be;

	if (!proto_balanced(ctx))
		return 1;
	switch (lb4_fwd(ctx, ctx->user_ip4, (__be16)ctx->user_port, &be)) {
	case FWD_XLATE:
		if (trace_xlate) {
			struct xlate_event ev = {
				.frontend_port = (__be16)ctx->user_port,
				.backend_port = be->port,
			};
			set_v4mapped(&ev.frontend, ctx->user_ip4);
			set_v4mapped(&ev.backend, be->address);
			trace(ctx, &ev);
		}
		ctx->user_ip4 = be->address;
		ctx->user_port = (__u32)be->port;
		break;
	case FWD_REFUSE:
		return refuse();
	case FWD_PASS:
		break;
	}
	return 1;
}

/*
 * sock6_xlate rewrites an AF_INET6 destination that is a frontend, IPv6 or
 * IPv4-mapped. (The kernel hands an unconnected UDP socket's datagram to an
 * IPv4-mapped address to sendmsg4 rather than sendmsg6, as IPv4; connect6
 * sees mapped addresses, of TCP and UDP sockets alike.)
 */
static __always_inline int sock6_xlate(struct bpf_sock_addr *ctx)
{
	__be16 port = (__be16)ctx->user_port;
	const struct lb6_backend *be6;
	const struct lb4_backend *be4;
	union v6addr addr;
	enum fwd fwd;

	if (!proto_balanced(ctx))
		return 1;
	get_user_ip6(ctx, &addr);
	if (is_v4mapped(&addr)) {
		fwd = lb4_fwd(ctx, addr.p[3], port, &be4);
		if (fwd == FWD_XLATE) {
			if (trace_xlate) {
				struct xlate_event ev = {
					.frontend = addr,
					.frontend_port = port,
					.backend_port = be4->port,
				};
				set_v4mapped(&ev.backend, be4->address);
				trace(ctx, &ev);
			}
			ctx->user_ip6[3] = be4->address;
			ctx->user_port = (__u32)be4->port;
		}
	} else {
		fwd = lb6_fwd(ctx, &addr, port, &be6);
		if (fwd == FWD_XLATE) {
			if (trace_xlate) {
				struct xlate_event ev = {
					.frontend = addr,
					.backend = be6->address,
					.frontend_port = port,
					.backend_port = be6->port,
				};
				trace(ctx, &ev);
			}
			set_user_ip6(ctx, &be6->address);
			ctx->user_port = (__u32)be6->port;
		}
	}
	if (fwd == FWD_REFUSE)
		return refuse();
	return 1;
}

static __always_inline int sock4_revxlate(struct bpf_sock_addr *ctx)
{
	__be32 addr;
	__be16 port;

	/* An intercepted DNS socket's proxy is first its resolver, the
	 * backend this then turns into the service address. */
	dns_restore4(ctx);
	addr = ctx->user_ip4;
	port = (__be16)ctx->user_port;

	if (lb4_rev(ctx, &addr, &port)) {
		ctx->user_ip4 = addr;
		ctx->user_port = (__u32)port;
	}
	return 1;
}

static __always_inline int sock6_revxlate(struct bpf_sock_addr *ctx)
{
	union v6addr addr;
	__be16 port;

	dns_restore6(ctx);
	port = (__be16)ctx->user_port;
	get_user_ip6(ctx, &addr);
	if (is_v4mapped(&addr)) {
		if (lb4_rev(ctx, &addr.p[3], &port)) {
			ctx->user_ip6[3] = addr.p[3];
			ctx->user_port = (__u32)port;
		}
	} else if (lb6_rev(ctx, &addr, &port)) {
		set_user_ip6(ctx, &addr);
		ctx->user_port = (__u32)port;
	}
	return 1;
}

SEC("cgroup/connect4")
int sock4_connect(struct bpf_sock_addr *ctx)
{
	return sock4_xlate(ctx);
}

SEC("cgroup/sendmsg4")
int sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	return sock4_xlate(ctx);
}

SEC("cgroup/recvmsg4")
int sock4_recvmsg(struct bpf_sock_addr *ctx)
{
	return sock4_revxlate(ctx);
}

SEC("cgroup/getpeername4")
int sock4_getpeername(struct bpf_sock_addr *ctx)
{
	return sock4_revxlate(ctx);
}

SEC("cgroup/connect6")
int sock6_connect(struct bpf_sock_addr *ctx)
{
	return sock6_xlate(ctx);
}

SEC("cgroup/sendmsg6")
int sock6_sendmsg(struct bpf_sock_addr *ctx)
{
	return sock6_xlate(ctx);
}

SEC("cgroup/recvmsg6")
int sock6_recvmsg(struct bpf_sock_addr *ctx)
{
	return sock6_revxlate(ctx);
}

SEC("cgroup/getpeername6")
int sock6_getpeername(struct bpf_sock_addr *ctx)
{
	return sock6_revxlate(ctx);
}

char __license[] SEC("license") = "Dual BSD/GPL";
