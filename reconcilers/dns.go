package reconcilers

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// DNSMaps are the pinned maps of DNS interception (bpf/c/dns_redirect.h):
// dns_sock, dns_origin (a map per endpoint with DNS rules, in which its
// sockets publish the resolver they asked), dns_config (the proxy's
// addresses) and dns_origin_lost. They are opened through a bpf.Opener on
// first use, by the policy programs' loader and by the DNS proxy's
// interceptor, and kept open until Close. Safe for concurrent use.
//
// As EndpointMaps, DNSMaps is the only writer of dns_origin's outer map:
// the endpoint-policy reconciler gives each endpoint with DNS rules its
// inner map.
type DNSMaps struct {
	log    *slog.Logger
	opener bpf.Opener
	pinDir string
	// sockSpec returns dns_sock's spec, the programs' own definition.
	sockSpec func() (*ebpf.MapSpec, error)

	mu                         sync.Mutex
	sock, origin, config, lost bpf.Map
}

var _ EndpointMaps = (*DNSMaps)(nil)

// NewDNSMaps returns the DNS maps pinned in pinDir, none open yet;
// sockSpec gives the spec of dns_sock (the programs' definition).
func NewDNSMaps(log *slog.Logger, opener bpf.Opener, pinDir string, sockSpec func() (*ebpf.MapSpec, error)) *DNSMaps {
	return &DNSMaps{log: log, opener: opener, pinDir: pinDir, sockSpec: sockSpec}
}

// openLocked opens (or creates and pins) the maps the first time.
func (d *DNSMaps) openLocked() error {
	if d.sock != nil {
		return nil
	}
	sockSpec, err := d.sockSpec()
	if err != nil {
		return err
	}
	sock, err := d.opener.OpenMap(d.log, sockSpec, d.pinDir, nil)
	if err != nil {
		// The other side (the DNS proxy's or the programs' loader) may
		// have pinned it meanwhile.
		sock, err = d.opener.OpenMap(d.log, sockSpec, d.pinDir, nil)
	}
	if err != nil {
		return err
	}
	// No migration: what they hold is rebuilt by the next query (or, for
	// the origins' inner maps, by the endpoint-policy reconciler, whose
	// Prune after a replacement makes none: its Update of each row does,
	// retried until the map is there).
	rest, err := bpf.OpenMaps(d.opener, d.log, d.pinDir, bpf.DNSOriginMapSpec(), bpf.DNSConfigMapSpec(), bpf.DNSOriginLostMapSpec())
	if err != nil {
		sock.Map.Close()
		return err
	}
	d.sock, d.origin, d.config, d.lost = sock.Map, rest[0], rest[1], rest[2]
	return nil
}

// DNSProgramMaps are the kernel's DNS maps, for loading programs on them.
type DNSProgramMaps struct {
	Sock, Origin, Config, OriginLost *ebpf.Map
}

// Programs opens the maps and returns them as the kernel's, for the
// programs; maps in memory are an error.
func (d *DNSMaps) Programs() (DNSProgramMaps, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return DNSProgramMaps{}, err
	}
	var out DNSProgramMaps
	if err := bpf.ToKernelMaps(bpf.Into(&out.Sock, d.sock), bpf.Into(&out.Origin, d.origin), bpf.Into(&out.Config, d.config), bpf.Into(&out.OriginLost, d.lost)); err != nil {
		return DNSProgramMaps{}, err
	}
	return out, nil
}

// Open opens the maps unless they are open.
func (d *DNSMaps) Open() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.openLocked()
}

// Origin returns what the sockets of endpoint id published in their map
// of dns_origin under key (the query's protocol and client), if it is
// there and the endpoint's.
func (d *DNSMaps) Origin(id uint32, key bpf.DNSOriginKey) (bpf.DNSOrigin, bool) {
	d.mu.Lock()
	origin := d.origin
	d.mu.Unlock()
	if origin == nil {
		return bpf.DNSOrigin{}, false
	}
	inner, err := bpf.LookupInner(origin, id)
	if err != nil {
		return bpf.DNSOrigin{}, false
	}
	defer inner.Close()
	var v bpf.DNSOrigin
	if err := inner.Lookup(key, &v); err != nil || v.EndpointID != id {
		return bpf.DNSOrigin{}, false
	}
	return v, true
}

// SetConfig writes dns_config, the proxy's addresses.
func (d *DNSMaps) SetConfig(cfg bpf.DNSConfig) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return err
	}
	if err := d.config.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("write %s: %w", bpf.DNSConfigMap, err)
	}
	return nil
}

// LostOrigins returns how many origins the programs could not publish.
func (d *DNSMaps) LostOrigins() (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return 0, err
	}
	var n [1]uint64
	err := bpf.SumPerCPU(d.lost, bpf.DNSOriginLostMap, n[:])
	return n[0], err
}

// Close closes the maps; the pins stay.
func (d *DNSMaps) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range []bpf.Map{d.sock, d.origin, d.config, d.lost} {
		if m != nil {
			m.Close()
		}
	}
	d.sock, d.origin, d.config, d.lost = nil, nil, nil, nil
}

// Ensure implements EndpointMaps: an endpoint with DNS rules has a map of
// its own in dns_origin, which only its sockets write; one without has
// none.
func (d *DNSMaps) Ensure(e *tables.EndpointPolicy) error {
	if len(e.DNS) == 0 {
		return d.Remove(e.ID)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return err
	}
	if ok, err := bpf.HasInner(d.origin, e.ID); ok || err != nil {
		// Kept: its entries are still the endpoint's.
		return err
	}
	if err := bpf.PutInner(d.origin, e.ID, bpf.DNSOriginInnerSpec()); err != nil {
		return fmt.Errorf("the %s map of endpoint ID %d: %w", bpf.DNSOriginMap, e.ID, err)
	}
	return nil
}

// Remove implements EndpointMaps.
func (d *DNSMaps) Remove(id uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return err
	}
	return d.removeLocked(id)
}

func (d *DNSMaps) removeLocked(id uint32) error {
	if err := d.origin.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s[%d]: %w", bpf.DNSOriginMap, id, err)
	}
	return nil
}

// Prune implements EndpointMaps.
func (d *DNSMaps) Prune(keep map[uint32]struct{}) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return err
	}
	var stale []uint32
	err := bpf.Walk(d.origin, 1024, func(ids []uint32, _ []uint32) error {
		for _, id := range ids {
			if _, ok := keep[id]; !ok {
				stale = append(stale, id)
			}
		}
		return nil
	})
	errs := []error{err}
	for _, id := range stale {
		errs = append(errs, d.removeLocked(id))
	}
	return errors.Join(errs...)
}
