package memmap

import (
	"fmt"
	"reflect"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// Errors the kernel answers map writers with, for Faulty.
var (
	// ErrFull is a write into a full hash map.
	ErrFull error = unix.E2BIG
	// ErrBusy is a map locked by someone else (a batch operation racing
	// another one on the same bucket).
	ErrBusy error = unix.EBUSY
)

// Op is a kind of map operation a Fault applies to.
type Op int

const (
	// OpWrite is Put, Update and BatchUpdate.
	OpWrite Op = iota
	// OpDelete is Delete and BatchDelete.
	OpDelete
	// OpRead is Lookup and BatchLookup.
	OpRead
)

// Fault makes operations of kind Op fail with Err.
type Fault struct {
	Op Op
	// Err is the error the operation returns (wrapped, as *ebpf.Map wraps
	// the kernel's).
	Err error
	// After is how many entries of a batch are done before it fails (at
	// most all but the last); a single-entry operation fails whatever
	// After says.
	After int
	// Times is how many operations fail; 0 is every one from now on.
	Times int
}

// Faulty is a bpf.Map that passes operations to Map except those a fault
// says fail. Faults are used in the order they were added.
type Faulty struct {
	bpf.Map

	mu     sync.Mutex
	faults []*Fault
	// failed counts the operations that failed by a fault.
	failed int
}

// NewFaulty wraps m.
func NewFaulty(m bpf.Map) *Faulty { return &Faulty{Map: m} }

// Inject adds f.
func (f *Faulty) Inject(fault Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = append(f.faults, &fault)
}

// Clear removes every fault.
func (f *Faulty) Clear() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = nil
}

// Failed returns how many operations failed by a fault.
func (f *Faulty) Failed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}

// take returns the fault for the next operation of kind op, if any, and
// uses it up.
func (f *Faulty) take(op Op) *Fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, fault := range f.faults {
		if fault.Op != op {
			continue
		}
		if fault.Times > 0 {
			fault.Times--
			if fault.Times == 0 {
				f.faults = append(f.faults[:i:i], f.faults[i+1:]...)
			}
		}
		f.failed++
		return fault
	}
	return nil
}

func (f *Fault) error(what string) error {
	return fmt.Errorf("%s: %w", what, f.Err)
}

// Put implements bpf.Map.
func (f *Faulty) Put(key, value any) error {
	if fault := f.take(OpWrite); fault != nil {
		return fault.error("update")
	}
	return f.Map.Put(key, value)
}

// Update implements bpf.Map.
func (f *Faulty) Update(key, value any, flags ebpf.MapUpdateFlags) error {
	if fault := f.take(OpWrite); fault != nil {
		return fault.error("update")
	}
	return f.Map.Update(key, value, flags)
}

// PutInner implements bpf.InnerMaker when the wrapped map does; a write
// fault fails it.
func (f *Faulty) PutInner(key any, spec *ebpf.MapSpec) error {
	if fault := f.take(OpWrite); fault != nil {
		return fault.error("update")
	}
	im, ok := f.Map.(bpf.InnerMaker)
	if !ok {
		return fmt.Errorf("update: %s can't store a map", f.Map)
	}
	return im.PutInner(key, spec)
}

// LookupInner implements bpf.InnerMaker when the wrapped map does; a read
// fault fails it.
func (f *Faulty) LookupInner(key any) (bpf.Map, error) {
	if fault := f.take(OpRead); fault != nil {
		return nil, fault.error("lookup")
	}
	im, ok := f.Map.(bpf.InnerMaker)
	if !ok {
		return nil, fmt.Errorf("lookup: %s holds no maps", f.Map)
	}
	return im.LookupInner(key)
}

// Lookup implements bpf.Map.
func (f *Faulty) Lookup(key, valueOut any) error {
	if fault := f.take(OpRead); fault != nil {
		return fault.error("lookup")
	}
	return f.Map.Lookup(key, valueOut)
}

// Delete implements bpf.Map.
func (f *Faulty) Delete(key any) error {
	if fault := f.take(OpDelete); fault != nil {
		return fault.error("delete")
	}
	return f.Map.Delete(key)
}

// BatchUpdate implements bpf.Map: a fault lets the first After entries be
// written.
func (f *Faulty) BatchUpdate(keys, values any, opts *ebpf.BatchOptions) (int, error) {
	fault := f.take(OpWrite)
	if fault == nil {
		return f.Map.BatchUpdate(keys, values, opts)
	}
	n := failAt(fault, keys)
	done, err := f.Map.BatchUpdate(head(keys, n), head(values, n), opts)
	if err != nil {
		return done, err
	}
	return done, fault.error("batch update")
}

// BatchDelete implements bpf.Map: a fault lets the first After keys be
// deleted.
func (f *Faulty) BatchDelete(keys any, opts *ebpf.BatchOptions) (int, error) {
	fault := f.take(OpDelete)
	if fault == nil {
		return f.Map.BatchDelete(keys, opts)
	}
	n := failAt(fault, keys)
	done, err := f.Map.BatchDelete(head(keys, n), opts)
	if err != nil {
		return done, err
	}
	return done, fault.error("batch delete")
}

// BatchLookup implements bpf.Map.
func (f *Faulty) BatchLookup(cursor *ebpf.MapBatchCursor, keysOut, valuesOut any, opts *ebpf.BatchOptions) (int, error) {
	if fault := f.take(OpRead); fault != nil {
		return 0, fault.error("batch lookup")
	}
	return f.Map.BatchLookup(cursor, keysOut, valuesOut, opts)
}

// failAt is the entry of the batch keys at which fault fails it: After,
// or the last entry of a shorter batch (as in the kernel, a batch that
// fails has an entry that failed).
func failAt(fault *Fault, keys any) int {
	return max(0, min(fault.After, reflect.ValueOf(keys).Len()-1))
}

// head returns the first n elements of the slice s.
func head(s any, n int) any {
	return reflect.ValueOf(s).Slice(0, n).Interface()
}
