// Package socklb holds the socket load-balancing programs (bpf/c/socklb.c) and the
// Go bindings bpf2go generates for them. The generated files and objects are
// committed, so building apiary needs no clang; `make bpf` regenerates them.
//
// See docs/datapath.md.
package socklb

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -go-package socklb socklb ../c/socklb.c -- -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu -fdebug-prefix-map=${PWD}=. -fmacro-prefix-map=${PWD}=. -ffile-prefix-map=${PWD}=.
