package socklb

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// BenchmarkConnect measures a TCP connect (dial, accept, close) over
// loopback from a cgroup the benchmark process moves itself into: without
// programs (nohook), with the programs attached to a non-service address
// (direct), and to a service frontend whose only backend is the listener
// (vip). conns/s is connections per second.
func BenchmarkConnect(b *testing.B) {
	testenv.RequireRoot(b)
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	backend := netip.MustParseAddrPort(l.Addr().String())
	vip := netip.MustParseAddrPort("10.96.0.99:80")

	m := benchMaps(b, vip, backend)
	progs, err := Load(m)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		for _, p := range progs {
			p.Close()
		}
	}()
	cg := enterCgroup(b)
	attach := func() {
		for _, h := range Hooks {
			lk, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: h.Attach, Program: progs[h.Program]})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { lk.Close() })
		}
	}

	for _, tc := range []struct {
		name   string
		addr   netip.AddrPort
		before func()
	}{
		// Without programs; then a non-service address, which costs
		// the hook a lookup; then the frontend.
		{"nohook", backend, nil},
		{"direct", backend, attach},
		{"vip", vip, nil},
	} {
		if tc.before != nil {
			tc.before()
		}
		b.Run(tc.name, func(b *testing.B) {
			for b.Loop() {
				c, err := net.Dial("tcp4", tc.addr.String())
				if err != nil {
					b.Fatal(err)
				}
				if tc.name == "vip" && c.RemoteAddr().String() != vip.String() {
					b.Fatalf("peer %s, want the frontend %s", c.RemoteAddr(), vip)
				}
				c.Close()
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
		})
	}
}

// benchMaps returns unpinned lb4 maps holding one service, vip, with one
// backend.
func benchMaps(b *testing.B, vip, backend netip.AddrPort) Maps {
	newMap := func(spec *ebpf.MapSpec, err error) *ebpf.Map {
		if err != nil {
			b.Fatal(err)
		}
		m, err := ebpf.NewMap(spec)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
	m := Maps{
		Services:   newMap(bpf.LBMapSpec(bpf.LB4ServicesMap, 1024)),
		Backends:   newMap(bpf.LBMapSpec(bpf.LB4BackendsMap, 1024)),
		RevNat:     newMap(bpf.LBMapSpec(bpf.LB4RevNatMap, 1024)),
		SockRevNat: newMap(SockRevNatSpec(1024)),
	}
	key := bpf.LB4ServiceKey{Address: vip.Addr().As4(), Port: bpf.NewBe16(vip.Port()), Proto: 6}
	put := func(m *ebpf.Map, k, v any) {
		if err := m.Put(k, v); err != nil {
			b.Fatal(err)
		}
	}
	put(m.Services, key, bpf.LB4ServiceValue{Count: 1, RevNat: bpf.NewBe16(1)})
	key.Slot = 1
	put(m.Services, key, bpf.LB4ServiceValue{BackendID: 1, RevNat: bpf.NewBe16(1)})
	put(m.Backends, uint32(1), bpf.LB4BackendValue{Address: backend.Addr().As4(), Port: bpf.NewBe16(backend.Port()), Proto: 6})
	put(m.RevNat, bpf.NewBe16(1), bpf.LB4RevNatValue{Address: vip.Addr().As4(), Port: bpf.NewBe16(vip.Port())})
	return m
}

// enterCgroup moves the whole process into a new cgroup v2 directory, and
// back to where it was at the end.
func enterCgroup(b *testing.B) string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		b.Fatal(err)
	}
	var mount string
	for line := range strings.SplitSeq(string(data), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if f := strings.Fields(pre); ok && strings.HasPrefix(post, "cgroup2 ") && len(f) >= 5 {
			mount = f[4]
			break
		}
	}
	if mount == "" {
		testenv.Skip(b, "no cgroup v2 mount")
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		b.Fatal(err)
	}
	var orig string
	for line := range strings.SplitSeq(strings.TrimSpace(string(self)), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			orig = filepath.Join(mount, p)
		}
	}
	if orig == "" {
		b.Fatal("the process's cgroup v2 path is unknown")
	}
	dir, err := os.MkdirTemp(mount, "apiary-socklb-bench-")
	if err != nil {
		testenv.Skip(b, "cannot create a cgroup: "+err.Error())
	}
	pid := strconv.Itoa(os.Getpid())
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(pid), 0); err != nil {
		os.Remove(dir)
		b.Fatal(fmt.Errorf("enter cgroup: %w", err))
	}
	b.Cleanup(func() {
		err := os.WriteFile(filepath.Join(orig, "cgroup.procs"), []byte(pid), 0)
		if err := errors.Join(err, os.Remove(dir)); err != nil {
			b.Errorf("leave cgroup: %s", err)
		}
	})
	return dir
}
