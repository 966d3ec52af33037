package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/nodeport"
	"github.com/apiary-net/apiary/internal/maglev"
	"github.com/apiary-net/apiary/tables"
)

// ErrMaglevNotReady means a Maglev table cannot be written yet: lb_maglev
// is not open, or the load balancer has not written the frontend's
// backends; the reconciler tries again.
var ErrMaglevNotReady = errors.New("not ready")

// Maglev converges the nodeport-maglev table into lb_maglev: for each
// frontend, the Maglev lookup table of its active backends, computed from
// their addresses (so that every node computes the same) and written as
// the backend IDs this node's load balancer gave them, which it reads
// from the frontend's slots in lb4_services / lb6_services. It implements
// reconciler.Operations for *tables.Maglev.
type Maglev struct {
	log  *slog.Logger
	size uint32
	lb   func(fn func(LBMaps) error) error

	// Computed counts the tables computed and written.
	Computed atomic.Uint64

	mu sync.Mutex
	m  *ebpf.Map
}

// NewMaglev returns the operations for tables of size slots (a prime),
// reading backend IDs through lbMaps (the load balancer's Maps).
func NewMaglev(log *slog.Logger, size uint32, lbMaps func(fn func(LBMaps) error) error) (*Maglev, error) {
	if err := maglev.ValidateTableSize(size); err != nil {
		return nil, err
	}
	return &Maglev{log: log, size: size, lb: lbMaps}, nil
}

// SetMap gives the operations lb_maglev once it is open (nil: closed);
// they keep their own handle.
func (g *Maglev) SetMap(m *ebpf.Map) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.m != nil {
		g.m.Close()
		g.m = nil
	}
	if m == nil {
		return nil
	}
	c, err := m.Clone()
	if err != nil {
		return fmt.Errorf("%s: %w", nodeport.MaglevMap, err)
	}
	g.m = c
	return nil
}

func (g *Maglev) lutMap() (*ebpf.Map, error) {
	if g.m == nil {
		return nil, fmt.Errorf("%s is not open: %w", nodeport.MaglevMap, ErrMaglevNotReady)
	}
	return g.m, nil
}

// backendIDs reads the IDs of the frontend's active backends from its
// slots: address -> ID.
func (g *Maglev) backendIDs(fe tables.L4Addr, id uint16) (map[tables.L4Addr]uint32, error) {
	out := map[tables.L4Addr]uint32{}
	err := g.lb(func(lm LBMaps) error {
		var master bpf.LB4ServiceValue
		lookup := func(slot uint16, v *bpf.LB4ServiceValue) error {
			if fe.Addr.Is4() {
				return lm.Services4.Lookup(bpf.LB4ServiceKey{Address: fe.Addr.As4(), Port: bpf.NewBe16(fe.Port), Slot: slot, Proto: uint8(fe.Proto)}, v)
			}
			return lm.Services6.Lookup(bpf.LB6ServiceKey{Address: fe.Addr.As16(), Port: bpf.NewBe16(fe.Port), Slot: slot, Proto: uint8(fe.Proto)}, v)
		}
		if err := lookup(0, &master); err != nil {
			return fmt.Errorf("frontend %s: %w (%w)", fe, err, ErrMaglevNotReady)
		}
		if master.RevNat.Uint16() != id {
			return fmt.Errorf("frontend %s has ID %d in the maps, %d in the table: %w", fe, master.RevNat.Uint16(), id, ErrMaglevNotReady)
		}
		for slot := uint16(1); slot <= master.Count; slot++ {
			var v bpf.LB4ServiceValue
			if err := lookup(slot, &v); err != nil {
				return fmt.Errorf("frontend %s slot %d: %w", fe, slot, err)
			}
			var addr tables.L4Addr
			if fe.Addr.Is4() {
				var be bpf.LB4BackendValue
				if err := lm.Backends4.Lookup(v.BackendID, &be); err != nil {
					return fmt.Errorf("backend %d: %w", v.BackendID, err)
				}
				addr = tables.L4Addr{Addr: netip.AddrFrom4(be.Address), Port: be.Port.Uint16(), Proto: tables.Proto(be.Proto)}
			} else {
				var be bpf.LB6BackendValue
				if err := lm.Backends6.Lookup(v.BackendID, &be); err != nil {
					return fmt.Errorf("backend %d: %w", v.BackendID, err)
				}
				addr = tables.L4Addr{Addr: netip.AddrFrom16(be.Address), Port: be.Port.Uint16(), Proto: tables.Proto(be.Proto)}
			}
			out[addr] = v.BackendID
		}
		return nil
	})
	return out, err
}

// Lookup computes the frontend's table: for each slot, the backend ID.
func (g *Maglev) Lookup(m *tables.Maglev) ([]uint32, error) {
	ids, err := g.backendIDs(m.Frontend, m.ID)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(m.Backends))
	for i, b := range m.Backends {
		if _, ok := ids[b]; !ok {
			return nil, fmt.Errorf("frontend %s: backend %s is not in its slots yet: %w", m.Frontend, b, ErrMaglevNotReady)
		}
		names[i] = b.String()
	}
	idx, err := maglev.Table(names, g.size)
	if err != nil {
		return nil, err
	}
	lut := make([]uint32, g.size)
	for i, b := range idx {
		lut[i] = ids[m.Backends[b]]
	}
	return lut, nil
}

// Update implements reconciler.Operations.
func (g *Maglev) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, m *tables.Maglev) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	lm, err := g.lutMap()
	if err != nil {
		return err
	}
	key := nodeport.MaglevKey{RevNat: bpf.NewBe16(m.ID)}
	if len(m.Backends) == 0 {
		// Nothing to choose from: the programs refuse, as without a
		// table.
		if err := lm.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete %s[%d]: %w", nodeport.MaglevMap, m.ID, err)
		}
		return nil
	}
	lut, err := g.Lookup(m)
	if err != nil {
		return err
	}
	if err := lm.Put(key, lut); err != nil {
		return fmt.Errorf("write %s[%d]: %w", nodeport.MaglevMap, m.ID, err)
	}
	g.Computed.Add(1)
	return nil
}

// Delete implements reconciler.Operations.
func (g *Maglev) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, m *tables.Maglev) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	lm, err := g.lutMap()
	if err != nil {
		return err
	}
	if err := lm.Delete(nodeport.MaglevKey{RevNat: bpf.NewBe16(m.ID)}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s[%d]: %w", nodeport.MaglevMap, m.ID, err)
	}
	return nil
}

// Prune implements reconciler.Operations: tables of frontends that are
// no longer wanted (left by an agent before a restart) go.
func (g *Maglev) Prune(_ context.Context, _ statedb.ReadTxn, objs iter.Seq2[*tables.Maglev, statedb.Revision]) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	lm, err := g.lutMap()
	if err != nil {
		return err
	}
	want := map[uint16]bool{}
	for m := range objs {
		want[m.ID] = true
	}
	// Only the keys: a value is a whole table. Deleting after the walk,
	// so that the walk does not restart.
	var stale []nodeport.MaglevKey
	var k nodeport.MaglevKey
	var prev any // nil: the first key
	for {
		err := lm.NextKey(prev, &k)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return fmt.Errorf("iterate %s: %w", nodeport.MaglevMap, err)
		}
		if !want[k.RevNat.Uint16()] {
			stale = append(stale, k)
		}
		cur := k
		prev = cur
	}
	var errs []error
	for _, k := range stale {
		if err := lm.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
