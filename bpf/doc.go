// Package bpf is apiary's boundary to the kernel's BPF objects.
//
// It mounts bpffs when needed ([EnsureFS]), opens or creates the pinned maps
// that carry the datapath's state across agent restarts ([OpenPinnedMap]),
// replacing and migrating a pin whose attributes no longer match the spec, and
// provides the building blocks for Go types whose byte layout must match the
// datapath's C structs exactly ([Be16], [Be32], [CheckLayout]).
//
// The package holds no global state: every function works on the paths and
// specs it is given, so tests can use their own bpffs directories.
package bpf
