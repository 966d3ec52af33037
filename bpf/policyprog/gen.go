// Package policyprog holds the policy enforcement programs (bpf/c/policy.c)
// and the Go bindings bpf2go generates for them: cgroup sock_addr, skb and
// sockops programs that apply each endpoint's (pod cgroup's) network policy
// to its connections and packets. The generated files and objects are
// committed, so building apiary needs no clang; `make bpf` regenerates them.
package policyprog

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -go-package policyprog policyprog ../c/policy.c -- -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu -fdebug-prefix-map=${PWD}=. -fmacro-prefix-map=${PWD}=. -ffile-prefix-map=${PWD}=.
