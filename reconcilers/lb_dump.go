package reconcilers

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// WriteLBMaps writes every entry of the load-balancing maps to w, one line
// each: the service entries of both families by address, protocol and
// slot, then the backends and the reverse NAT entries by ID, then the
// affinity matches by service and backend ID.
//
//	SVC 10.96.0.10:80/TCP SLOT=0 ID=1 COUNT=2 QCOUNT=0 FLAGS=ClusterIP
//	SVC 10.96.0.10:80/TCP SLOT=1 ID=1 BEID=1
//	SVC [fd00::10]:80/TCP SLOT=0 ID=2 COUNT=1 QCOUNT=0 AFFINITY=10800 FLAGS=ClusterIP+sessionAffinity
//	BE ID=1 ADDR=10.244.0.1:8080/TCP STATE=active
//	REV ID=1 ADDR=10.96.0.10:80
//	MATCH ID=2 BEID=3
//
// `apiary bpf lb list` and the lb/maps-dump script command print with it.
func WriteLBMaps(w io.Writer, m LBMaps) error {
	type svcEntry struct {
		addr tables.L4Addr
		slot uint16
		v    bpf.LB4ServiceValue
	}
	var svcs []svcEntry
	err := walkIfOpen(m.Services4, lbWalkBatch, func(keys []bpf.LB4ServiceKey, values []bpf.LB4ServiceValue) error {
		for i, k := range keys {
			svcs = append(svcs, svcEntry{keyAddr(k), k.Slot, values[i]})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4ServicesMap, err)
	}
	err = walkIfOpen(m.Services6, lbWalkBatch, func(keys []bpf.LB6ServiceKey, values []bpf.LB6ServiceValue) error {
		for i, k := range keys {
			svcs = append(svcs, svcEntry{key6Addr(k), k.Slot, values[i]})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB6ServicesMap, err)
	}
	slices.SortFunc(svcs, func(a, b svcEntry) int {
		return cmp.Or(a.addr.Compare(b.addr), cmp.Compare(a.slot, b.slot))
	})

	type idEntry struct {
		id    uint32
		addr  tables.L4Addr
		state bpf.BackendState
	}
	var bes []idEntry
	err = walkIfOpen(m.Backends4, lbWalkBatch, func(ids []uint32, values []bpf.LB4BackendValue) error {
		for i, v := range values {
			bes = append(bes, idEntry{ids[i], tables.L4Addr{Addr: netip.AddrFrom4(v.Address), Port: v.Port.Uint16(), Proto: tables.Proto(v.Proto)}, v.State})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4BackendsMap, err)
	}
	err = walkIfOpen(m.Backends6, lbWalkBatch, func(ids []uint32, values []bpf.LB6BackendValue) error {
		for i, v := range values {
			bes = append(bes, idEntry{ids[i], tables.L4Addr{Addr: netip.AddrFrom16(v.Address), Port: v.Port.Uint16(), Proto: tables.Proto(v.Proto)}, v.State})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB6BackendsMap, err)
	}
	byID := func(a, b idEntry) int { return cmp.Or(cmp.Compare(a.id, b.id), a.addr.Compare(b.addr)) }
	slices.SortFunc(bes, byID)

	var revs []idEntry
	err = walkIfOpen(m.RevNat4, lbWalkBatch, func(keys []bpf.Be16, values []bpf.LB4RevNatValue) error {
		for i, k := range keys {
			revs = append(revs, idEntry{id: uint32(k.Uint16()), addr: tables.L4Addr{Addr: values[i].L4Addr().Addr(), Port: values[i].Port.Uint16()}})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4RevNatMap, err)
	}
	err = walkIfOpen(m.RevNat6, lbWalkBatch, func(keys []bpf.Be16, values []bpf.LB6RevNatValue) error {
		for i, k := range keys {
			revs = append(revs, idEntry{id: uint32(k.Uint16()), addr: tables.L4Addr{Addr: values[i].L4Addr().Addr(), Port: values[i].Port.Uint16()}})
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB6RevNatMap, err)
	}
	slices.SortFunc(revs, byID)

	var matches []bpf.LBAffinityMatchKey
	err = walkIfOpen(m.AffinityMatch, lbWalkBatch, func(keys []bpf.LBAffinityMatchKey, _ []uint8) error {
		matches = append(matches, keys...)
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LBAffinityMatchMap, err)
	}
	slices.SortFunc(matches, func(a, b bpf.LBAffinityMatchKey) int {
		return cmp.Or(cmp.Compare(a.RevNat.Uint16(), b.RevNat.Uint16()), cmp.Compare(a.BackendID, b.BackendID))
	})

	bw := bufio.NewWriter(w)
	for _, e := range svcs {
		switch {
		case e.slot > 0:
			fmt.Fprintf(bw, "SVC %s SLOT=%d ID=%d BEID=%d\n", e.addr, e.slot, e.v.RevNat.Uint16(), e.v.BackendID)
		case e.v.Flags&bpf.SvcFlagSessionAffinity != 0:
			fmt.Fprintf(bw, "SVC %s SLOT=0 ID=%d COUNT=%d QCOUNT=%d AFFINITY=%d FLAGS=%s\n",
				e.addr, e.v.RevNat.Uint16(), e.v.Count, e.v.QCount, e.v.BackendID&bpf.AffinityTimeoutMask, e.v.Flags)
		default:
			fmt.Fprintf(bw, "SVC %s SLOT=0 ID=%d COUNT=%d QCOUNT=%d FLAGS=%s\n",
				e.addr, e.v.RevNat.Uint16(), e.v.Count, e.v.QCount, e.v.Flags)
		}
	}
	for _, e := range bes {
		fmt.Fprintf(bw, "BE ID=%d ADDR=%s STATE=%s\n", e.id, e.addr, e.state)
	}
	for _, e := range revs {
		fmt.Fprintf(bw, "REV ID=%d ADDR=%s\n", e.id, netip.AddrPortFrom(e.addr.Addr, e.addr.Port))
	}
	for _, k := range matches {
		fmt.Fprintf(bw, "MATCH ID=%d BEID=%d\n", k.RevNat.Uint16(), k.BackendID)
	}
	return bw.Flush()
}

// walkIfOpen is bpf.Walk for a map that may be missing (nil), which has
// no entries.
func walkIfOpen[K, V any](m bpf.Map, batchSize int, fn func([]K, []V) error) error {
	if m == nil {
		return nil
	}
	return bpf.Walk(m, batchSize, fn)
}

// WritePinnedLB writes the load-balancing maps pinned in pinDir to w, as
// WriteLBMaps does, opening the pins read-only: this is `apiary bpf lb
// list`, which works whether the agent runs or not. A map that is not
// pinned (an agent of an older version made no lb6 maps) is shown empty.
func WritePinnedLB(w io.Writer, pinDir string) error {
	var maps lbMaps
	defer func() {
		for _, m := range maps {
			if m != nil {
				m.Close()
			}
		}
	}()
	for kind, name := range lbMapNames {
		path := filepath.Join(pinDir, name)
		spec, err := bpf.LBMapSpec(name, 1)
		if err != nil {
			return err
		}
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err == nil {
			// Entries of another layout would fail to decode with a
			// puzzling "buffer too small".
			spec.MaxEntries = m.MaxEntries()
			if err = bpf.CheckLayoutOf(m, spec, path); err != nil {
				m.Close()
			}
		} else if errors.Is(err, fs.ErrNotExist) && lbMapKind(kind) > lb4RevNat {
			continue
		}
		if err != nil {
			return fmt.Errorf("open %s: %w", name, err)
		}
		maps[kind] = m
	}
	return WriteLBMaps(w, maps.public())
}
