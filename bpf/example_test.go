package bpf_test

import (
	"fmt"
	"log/slog"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// A cell checks its Go types against the map spec, then opens the pinned map,
// keeping entries across a resize by copying them into the new map.
func ExampleOpenPinnedMap() {
	type backendValue struct {
		Address   [4]byte
		Port      bpf.Be16
		Proto     uint8
		State     uint8
		ClusterID uint16
		Zone      uint8
		Pad       uint8
	}
	spec := &ebpf.MapSpec{
		Name:       "lb4_backends",
		Type:       ebpf.Hash,
		KeySize:    4,
		ValueSize:  12,
		MaxEntries: 65536,
	}
	if err := bpf.CheckLayout[uint32, backendValue](spec); err != nil {
		panic(err)
	}

	if err := bpf.EnsureFS(bpf.DefaultFSRoot); err != nil {
		panic(err)
	}
	m, err := bpf.OpenPinnedMap(slog.Default(), spec, "/sys/fs/bpf/apiary", bpf.CopyEntries[uint32, backendValue])
	if err != nil {
		panic(err)
	}
	defer m.Close()

	if m.Outcome == bpf.PinReplaced {
		fmt.Println("resized:", m.Mismatch)
	}
}
