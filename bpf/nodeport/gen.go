// Package nodeport holds the north-south load-balancing programs
// (bpf/c/nodeport.c) and the Go bindings bpf2go generates for them: a tc
// program pair for the node's external devices that translates traffic to
// NodePort, LoadBalancer and external-IP frontends from outside the node
// to a backend, and the replies back. The generated files and objects are
// committed, so building apiary needs no clang; `make bpf` regenerates them.
//
// See docs/datapath.md.
package nodeport

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -go-package nodeport nodeport ../c/nodeport.c -- -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu -fdebug-prefix-map=${PWD}=. -fmacro-prefix-map=${PWD}=. -ffile-prefix-map=${PWD}=.
