// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Socket load balancing for IPv4: cgroup sock_addr hooks that send a
 * connect() or sendmsg() aimed at a service frontend to one of its backends,
 * and translate the backend's address back to the frontend's in recvmsg()
 * and getpeername(), so that the application only ever sees the service.
 *
 * The three lb4_* maps are the agent's own: the loader replaces these
 * definitions with the maps the load balancer keeps pinned, so the structs
 * below must match the Go types in bpf/lb.go byte for byte (a Go test
 * compares them through the object's BTF).
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

/* lb4_services: key (frontend, slot), slot 0 the service, 1.. the backends. */
struct lb4_key {
	__be32 address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb4_service {
	__u32 backend_id; /* slot 0: algorithm and affinity; else the backend */
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

/* Owned by these programs: which frontend a socket's backend stands for. */
struct lb4_sock_key {
	__u64 cookie;
	__be32 address; /* backend */
	__be16 port;
	__u16 pad;
};

struct lb4_sock_value {
	__be32 address; /* frontend */
	__be16 port;
	__be16 rev_nat_index;
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
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb4_sock_key);
	__type(value, struct lb4_sock_value);
	__uint(max_entries, 65536);
} lb4_sock_revnat SEC(".maps");

#define BACKEND_TERMINATING 1

/* Keep in line with the states the agent writes; only active and
 * terminating backends are ever placed in slots, this is a second guard. */
static __always_inline int backend_usable(const struct lb4_backend *be)
{
	return be->flags == 0 || be->flags == BACKEND_TERMINATING;
}

/*
 * xlate rewrites ctx's destination when it is a service frontend with at
 * least one backend. Active backends are chosen at random; the terminating
 * ones only when there is no active backend. A frontend without backends is
 * left alone, as is anything that is not a frontend.
 */
static __always_inline int xlate(struct bpf_sock_addr *ctx)
{
	struct lb4_key key = {};
	struct lb4_service *svc, *slot;
	struct lb4_backend *be;
	__u32 backend_id, n;

	if (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)
		return 1;
	key.address = ctx->user_ip4;
	key.dport = (__be16)ctx->user_port;
	key.proto = (__u8)ctx->protocol;

	svc = bpf_map_lookup_elem(&lb4_services, &key);
	if (!svc)
		return 1;
	/* With no active backend, the terminating ones follow in slots
	 * 1..qcount (count+1.. with count 0). */
	n = svc->count ? svc->count : svc->qcount;
	if (n == 0)
		return 1;
	key.backend_slot = (__u16)(bpf_get_prandom_u32() % n + 1);

	slot = bpf_map_lookup_elem(&lb4_services, &key);
	if (!slot)
		return 1;
	backend_id = slot->backend_id;
	be = bpf_map_lookup_elem(&lb4_backends, &backend_id);
	if (!be || !backend_usable(be))
		return 1;

	/* Remembered before the rewrite, so that a reply never arrives
	 * without its way back. Failing to remember (a full LRU cannot fail,
	 * but stay safe) only costs the translation of replies. */
	struct lb4_sock_key skey = {
		.cookie = bpf_get_socket_cookie(ctx),
		.address = be->address,
		.port = be->port,
	};
	struct lb4_sock_value sval = {
		.address = key.address,
		.port = key.dport,
		.rev_nat_index = svc->rev_nat_index,
	};
	bpf_map_update_elem(&lb4_sock_revnat, &skey, &sval, BPF_ANY);

	ctx->user_ip4 = be->address;
	ctx->user_port = (__u32)be->port;
	return 1;
}

/*
 * revxlate gives a backend's address back as the frontend it was chosen
 * for, if this socket was sent there by xlate and the service still
 * exists (its rev-NAT entry is the authority on the frontend's address).
 */
static __always_inline int revxlate(struct bpf_sock_addr *ctx)
{
	struct lb4_sock_key skey = {
		.cookie = bpf_get_socket_cookie(ctx),
		.address = ctx->user_ip4,
		.port = (__be16)ctx->user_port,
	};
	struct lb4_sock_value *sval;
	struct lb4_reverse_nat *rnat;
	__be16 idx;

	sval = bpf_map_lookup_elem(&lb4_sock_revnat, &skey);
	if (!sval)
		return 1;
	idx = sval->rev_nat_index;
	rnat = bpf_map_lookup_elem(&lb4_reverse_nat, &idx);
	if (!rnat || rnat->address != sval->address || rnat->port != sval->port) {
		/* The service went away or changed address. */
		bpf_map_delete_elem(&lb4_sock_revnat, &skey);
		return 1;
	}
	ctx->user_ip4 = rnat->address;
	ctx->user_port = (__u32)rnat->port;
	return 1;
}

SEC("cgroup/connect4")
int sock4_connect(struct bpf_sock_addr *ctx)
{
	return xlate(ctx);
}

SEC("cgroup/sendmsg4")
int sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	return xlate(ctx);
}

SEC("cgroup/recvmsg4")
int sock4_recvmsg(struct bpf_sock_addr *ctx)
{
	return revxlate(ctx);
}

SEC("cgroup/getpeername4")
int sock4_getpeername(struct bpf_sock_addr *ctx)
{
	return revxlate(ctx);
}

char __license[] SEC("license") = "Dual BSD/GPL";
