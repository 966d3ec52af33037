package reconcilers

import (
	"bufio"
	"cmp"
	"fmt"
	"io"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// WriteLBMaps writes every entry of the three load-balancing maps to w, one
// line each: the service entries by address, protocol and slot, then the
// backends and the reverse NAT entries by ID.
//
//	SVC 10.96.0.10:80/TCP SLOT=0 ID=1 COUNT=2 QCOUNT=0 FLAGS=ClusterIP
//	SVC 10.96.0.10:80/TCP SLOT=1 ID=1 BEID=1
//	BE ID=1 ADDR=10.244.0.1:8080/TCP STATE=active
//	REV ID=1 ADDR=10.96.0.10:80
//
// `apiary bpf lb list` and the lb/maps-dump script command print with it.
func WriteLBMaps(w io.Writer, services, backends, revNat *ebpf.Map) error {
	type svcEntry struct {
		k bpf.LB4ServiceKey
		v bpf.LB4ServiceValue
	}
	var svcs []svcEntry
	if err := bpf.Walk(services, lbWalkBatch, func(keys []bpf.LB4ServiceKey, values []bpf.LB4ServiceValue) error {
		for i := range keys {
			svcs = append(svcs, svcEntry{keys[i], values[i]})
		}
		return nil
	}); err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4ServicesMap, err)
	}
	slices.SortFunc(svcs, func(a, b svcEntry) int {
		return cmp.Or(keyAddr(a.k).Compare(keyAddr(b.k)), cmp.Compare(a.k.Slot, b.k.Slot))
	})

	type beEntry struct {
		id uint32
		v  bpf.LB4BackendValue
	}
	var bes []beEntry
	if err := bpf.Walk(backends, lbWalkBatch, func(ids []uint32, values []bpf.LB4BackendValue) error {
		for i := range ids {
			bes = append(bes, beEntry{ids[i], values[i]})
		}
		return nil
	}); err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4BackendsMap, err)
	}
	slices.SortFunc(bes, func(a, b beEntry) int { return cmp.Compare(a.id, b.id) })

	type revEntry struct {
		id uint16
		v  bpf.LB4RevNatValue
	}
	var revs []revEntry
	if err := bpf.Walk(revNat, lbWalkBatch, func(keys []bpf.Be16, values []bpf.LB4RevNatValue) error {
		for i := range keys {
			revs = append(revs, revEntry{keys[i].Uint16(), values[i]})
		}
		return nil
	}); err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4RevNatMap, err)
	}
	slices.SortFunc(revs, func(a, b revEntry) int { return cmp.Compare(a.id, b.id) })

	bw := bufio.NewWriter(w)
	for _, e := range svcs {
		if e.k.Slot == 0 {
			fmt.Fprintf(bw, "SVC %s SLOT=0 ID=%d COUNT=%d QCOUNT=%d FLAGS=%s\n",
				keyAddr(e.k), e.v.RevNat.Uint16(), e.v.Count, e.v.QCount, e.v.Flags)
		} else {
			fmt.Fprintf(bw, "SVC %s SLOT=%d ID=%d BEID=%d\n", keyAddr(e.k), e.k.Slot, e.v.RevNat.Uint16(), e.v.BackendID)
		}
	}
	for _, e := range bes {
		addr := tables.L4Addr{Addr: e.v.L4Addr().Addr(), Port: e.v.Port.Uint16(), Proto: tables.Proto(e.v.Proto)}
		fmt.Fprintf(bw, "BE ID=%d ADDR=%s STATE=%s\n", e.id, addr, e.v.State)
	}
	for _, e := range revs {
		fmt.Fprintf(bw, "REV ID=%d ADDR=%s\n", e.id, e.v.L4Addr())
	}
	return bw.Flush()
}

// WritePinnedLB writes the load-balancing maps pinned in pinDir to w, as
// WriteLBMaps does, opening the pins read-only: this is `apiary bpf lb
// list`, which works whether the agent runs or not.
func WritePinnedLB(w io.Writer, pinDir string) error {
	var maps [numLBMaps]*ebpf.Map
	for i, name := range lbMapNames {
		path := filepath.Join(pinDir, name)
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err == nil {
			// Entries of another layout would fail to decode with a
			// puzzling "buffer too small".
			var spec *ebpf.MapSpec
			if spec, err = bpf.LBMapSpec(name, m.MaxEntries()); err == nil {
				err = bpf.CheckLayoutOf(m, spec, path)
			}
			if err != nil {
				m.Close()
			}
		}
		if err != nil {
			for _, o := range maps[:i] {
				o.Close()
			}
			return fmt.Errorf("open %s: %w", name, err)
		}
		maps[i] = m
	}
	defer func() {
		for _, m := range maps {
			m.Close()
		}
	}()
	return WriteLBMaps(w, maps[lbServices], maps[lbBackends], maps[lbRevNat])
}
