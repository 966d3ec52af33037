package identitymode

import (
	"slices"
	"sync"

	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/tables"
)

// OperatorNumbers is the operator mode's identity.ClusterNumbers: the
// number of a label set is that of its Identity (the lowest free one when
// there are duplicates), or a temporary one while it has none.
type OperatorNumbers struct {
	mu       sync.Mutex
	byLabels map[string][]uint32 // sorted
	byID     map[uint32]string
	temp     *identity.NumberRange
	synced   bool
	changed  chan struct{}
}

var _ identity.Renumberer = (*OperatorNumbers)(nil)

// NewOperatorNumbers returns the numbers with size temporary numbers.
func NewOperatorNumbers(size uint32) *OperatorNumbers {
	return &OperatorNumbers{
		byLabels: map[string][]uint32{},
		byID:     map[uint32]string{},
		temp:     identity.NewNumberRange("temporary", identity.MinTemporary, identity.MinTemporary+size-1),
		changed:  make(chan struct{}),
	}
}

// notify closes the changed channel; mu must be held.
func (o *OperatorNumbers) notify() {
	close(o.changed)
	o.changed = make(chan struct{})
}

// Set records the Identity num for l.
func (o *OperatorNumbers) Set(num uint32, l tables.Labels) {
	o.mu.Lock()
	defer o.mu.Unlock()
	key := l.Key()
	if old, ok := o.byID[num]; ok {
		if old == key {
			return
		}
		o.removeLocked(num)
	}
	o.byID[num] = key
	ids := append(o.byLabels[key], num)
	slices.Sort(ids)
	o.byLabels[key] = ids
	o.notify()
}

// Remove forgets the Identity num.
func (o *OperatorNumbers) Remove(num uint32) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.byID[num]; ok {
		o.removeLocked(num)
		o.notify()
	}
}

func (o *OperatorNumbers) removeLocked(num uint32) {
	key := o.byID[num]
	delete(o.byID, num)
	ids := slices.DeleteFunc(o.byLabels[key], func(n uint32) bool { return n == num })
	if len(ids) == 0 {
		delete(o.byLabels, key)
	} else {
		o.byLabels[key] = ids
	}
}

// Synced says that every Identity has been listed: from now on a number
// without an Identity is not kept for its label set.
func (o *OperatorNumbers) Synced() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.synced {
		o.synced = true
		o.notify()
	}
}

// IsSynced reports whether Synced was called.
func (o *OperatorNumbers) IsSynced() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.synced
}

// Len returns how many Identities are known.
func (o *OperatorNumbers) Len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.byID)
}

// Source implements identity.ClusterNumbers.
func (o *OperatorNumbers) Source() string { return identity.SourceCluster }

// SourceOf implements identity.Renumberer.
func (o *OperatorNumbers) SourceOf(id uint32) string {
	if isTemporary(id) {
		return identity.SourceTemporary
	}
	return identity.SourceCluster
}

func isTemporary(id uint32) bool {
	return id >= identity.MinTemporary && id <= identity.MaxTemporary
}

func isCluster(id uint32) bool {
	return id >= identity.MinCluster && id <= identity.MaxCluster
}

// clusterNumber returns the lowest free Identity number of l; mu held.
func (o *OperatorNumbers) clusterNumber(l tables.Labels, free func(uint32) bool) (uint32, bool) {
	for _, n := range o.byLabels[l.Key()] {
		if free(n) {
			return n, true
		}
	}
	return 0, false
}

// Assign implements identity.ClusterNumbers: the Identity's number, else a
// temporary one. Before the Identities are listed, a cluster number the
// old ipcache map had (hint) is trusted, so that a restart does not flip
// every endpoint to a temporary number and back.
func (o *OperatorNumbers) Assign(l tables.Labels, free func(uint32) bool, hint uint32) (uint32, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if n, ok := o.clusterNumber(l, free); ok {
		return n, nil
	}
	if !o.synced && isCluster(hint) && free(hint) {
		return hint, nil
	}
	return o.temp.Allocate(free, hint)
}

// Want implements identity.Renumberer.
func (o *OperatorNumbers) Want(l tables.Labels, cur uint32, free func(uint32) bool) (uint32, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ids := o.byLabels[l.Key()]
	if slices.Contains(ids, cur) {
		return cur, nil
	}
	if n, ok := o.clusterNumber(l, free); ok {
		return n, nil
	}
	if isTemporary(cur) || !o.synced {
		return cur, nil
	}
	// A cluster number without an Identity (deleted, or from a restart or
	// the agent mode): a temporary one until the operator creates it.
	return o.temp.Allocate(free, 0)
}

// Changed implements identity.Renumberer.
func (o *OperatorNumbers) Changed() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.changed
}

// Contains implements identity.ClusterNumbers.
func (o *OperatorNumbers) Contains(id uint32) bool {
	return isCluster(id) || isTemporary(id)
}

// Freed implements identity.ClusterNumbers.
func (o *OperatorNumbers) Freed(id uint32) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.temp.Freed(id)
}
