// Package memmap provides BPF maps in memory, for running the reconcilers
// and the cells built on them without the kernel: Map, a map that behaves as
// the kernel's hash and LPM trie maps do towards their writers; Faulty, a
// wrapper that makes chosen operations fail (a full map, EBUSY, an error in
// the middle of a batch); and Pins, a pin directory of such maps that
// survives a hive restart.
//
// Keys and values are encoded as the kernel would see them (encoding/binary,
// native byte order), so a key or value of the wrong size is refused as the
// kernel refuses it. Lookups are by exact key: an LPM trie's longest-prefix
// match is the datapath's business, not its writers'. An array's entries
// exist from the start (zero); a per-CPU array holds one value, not one per
// CPU. A hash or array of maps stores the inner maps bpf.PutInner makes
// (Map.PutInner) under an ID, which is what a lookup reads, as the kernel's
// answer.
package memmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// Map is a BPF map in memory. It implements bpf.Map and is safe for
// concurrent use.
type Map struct {
	name       string
	typ        ebpf.MapType
	keySize    uint32
	valueSize  uint32
	maxEntries uint32

	mu      sync.Mutex
	entries map[string][]byte
	// cursors are where each batch lookup in progress stands: the last key
	// it returned.
	cursors map[*ebpf.MapBatchCursor]string
	// inner are the maps PutInner made, by the ID stored for them.
	inner   map[uint32]*Map
	innerID uint32
}

var (
	_ bpf.Map        = (*Map)(nil)
	_ bpf.InnerMaker = (*Map)(nil)
)

// New returns an empty map of spec's type, key and value sizes and max
// entries. spec.Contents are not written.
func New(spec *ebpf.MapSpec) *Map {
	return &Map{
		name: spec.Name, typ: spec.Type,
		keySize: spec.KeySize, valueSize: spec.ValueSize, maxEntries: spec.MaxEntries,
		entries: map[string][]byte{},
		cursors: map[*ebpf.MapBatchCursor]string{},
	}
}

// String implements bpf.Map.
func (m *Map) String() string { return fmt.Sprintf("memmap.Map(%s)", m.name) }

// Close implements bpf.Map; the contents stay, as a pinned map's do.
func (m *Map) Close() error { return nil }

// Len returns how many entries the map holds.
func (m *Map) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.entries)
}

// MaxEntries implements bpf.Map: the map's capacity.
func (m *Map) MaxEntries() uint32 { return m.maxEntries }

// Type implements bpf.Map.
func (m *Map) Type() ebpf.MapType { return m.typ }

// KeySize implements bpf.Map.
func (m *Map) KeySize() uint32 { return m.keySize }

// ValueSize implements bpf.Map.
func (m *Map) ValueSize() uint32 { return m.valueSize }

// Put implements bpf.Map.
func (m *Map) Put(key, value any) error {
	return m.Update(key, value, ebpf.UpdateAny)
}

// Update implements bpf.Map.
func (m *Map) Update(key, value any, flags ebpf.MapUpdateFlags) error {
	k, err := m.encode(key, m.keySize, "key")
	if err != nil {
		return fmt.Errorf("update: %w", err)
	}
	v, err := m.encode(value, m.valueSize, "value")
	if err != nil {
		return fmt.Errorf("update: %w", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.updateLocked(k, []byte(v), flags)
}

func (m *Map) updateLocked(k string, v []byte, flags ebpf.MapUpdateFlags) error {
	_, exists := m.entries[k]
	switch {
	case flags&ebpf.UpdateNoExist != 0 && exists:
		return fmt.Errorf("update: %w", unix.EEXIST)
	case flags&ebpf.UpdateExist != 0 && !exists:
		return fmt.Errorf("update: %w", ebpf.ErrKeyNotExist)
	case !exists && uint32(len(m.entries)) >= m.maxEntries:
		return fmt.Errorf("update: %w", fullError(m.typ))
	}
	m.entries[k] = v
	return nil
}

// fullError is what the kernel answers a write into a full map of typ.
func fullError(typ ebpf.MapType) error {
	if typ == ebpf.LPMTrie {
		return unix.ENOSPC
	}
	return unix.E2BIG
}

// Lookup implements bpf.Map.
func (m *Map) Lookup(key, valueOut any) error {
	k, err := m.encode(key, m.keySize, "key")
	if err != nil {
		return fmt.Errorf("lookup: %w", err)
	}
	m.mu.Lock()
	v, ok := m.entries[k]
	m.mu.Unlock()
	if !ok && m.isArray() && binary.NativeEndian.Uint32([]byte(k)) < m.maxEntries {
		// An array's entries all exist, zero until written.
		v, ok = make([]byte, m.valueSize), true
	}
	if !ok {
		return fmt.Errorf("lookup: %w", ebpf.ErrKeyNotExist)
	}
	return decode(v, valueOut)
}

// isArray tells whether the map is an array (of one value or one per
// CPU; the values of a per-CPU array are not told apart), whose keys are
// 4-byte indexes.
func (m *Map) isArray() bool {
	return (m.typ == ebpf.Array || m.typ == ebpf.PerCPUArray) && m.keySize == 4
}

// Delete implements bpf.Map.
func (m *Map) Delete(key any) error {
	k, err := m.encode(key, m.keySize, "key")
	if err != nil {
		return fmt.Errorf("delete: %w", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.entries[k]; !ok {
		return fmt.Errorf("delete: %w", ebpf.ErrKeyNotExist)
	}
	delete(m.entries, k)
	return nil
}

// BatchUpdate implements bpf.Map.
func (m *Map) BatchUpdate(keys, values any, _ *ebpf.BatchOptions) (int, error) {
	ks, err := m.encodeAll(keys, m.keySize, "key")
	if err != nil {
		return 0, fmt.Errorf("batch update: %w", err)
	}
	vs, err := m.encodeAll(values, m.valueSize, "value")
	if err != nil {
		return 0, fmt.Errorf("batch update: %w", err)
	}
	if len(ks) != len(vs) {
		return 0, fmt.Errorf("batch update: %d keys and %d values", len(ks), len(vs))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range ks {
		if err := m.updateLocked(k, []byte(vs[i]), ebpf.UpdateAny); err != nil {
			return i, fmt.Errorf("batch %w", err)
		}
	}
	return len(ks), nil
}

// BatchDelete implements bpf.Map.
func (m *Map) BatchDelete(keys any, _ *ebpf.BatchOptions) (int, error) {
	ks, err := m.encodeAll(keys, m.keySize, "key")
	if err != nil {
		return 0, fmt.Errorf("batch delete: %w", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range ks {
		if _, ok := m.entries[k]; !ok {
			return i, fmt.Errorf("batch delete: %w", ebpf.ErrKeyNotExist)
		}
		delete(m.entries, k)
	}
	return len(ks), nil
}

// BatchLookup implements bpf.Map. Entries come in the order of their keys'
// bytes; a cursor goes on after the last key it returned, so entries
// deleted meanwhile are not seen and none is seen twice.
func (m *Map) BatchLookup(cursor *ebpf.MapBatchCursor, keysOut, valuesOut any, _ *ebpf.BatchOptions) (int, error) {
	ko, vo := reflect.ValueOf(keysOut), reflect.ValueOf(valuesOut)
	if ko.Kind() != reflect.Slice || vo.Kind() != reflect.Slice {
		return 0, fmt.Errorf("batch lookup: keys and values must be slices, not %T and %T", keysOut, valuesOut)
	}
	size := min(ko.Len(), vo.Len())
	if size == 0 {
		return 0, errors.New("batch lookup: empty slices")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	after, started := m.cursors[cursor]
	keys := make([]string, 0, len(m.entries))
	for k := range m.entries {
		if !started || k > after {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	n := min(size, len(keys))
	for i, k := range keys[:n] {
		if err := decode([]byte(k), ko.Index(i).Addr().Interface()); err != nil {
			return i, fmt.Errorf("batch lookup: %w", err)
		}
		if err := decode(m.entries[k], vo.Index(i).Addr().Interface()); err != nil {
			return i, fmt.Errorf("batch lookup: %w", err)
		}
	}
	if n == len(keys) {
		delete(m.cursors, cursor)
		return n, fmt.Errorf("batch lookup: %w", ebpf.ErrKeyNotExist)
	}
	m.cursors[cursor] = keys[n-1]
	return n, nil
}

// encode returns the bytes of v (a value or a pointer to one), which must
// be size long.
func (m *Map) encode(v any, size uint32, what string) (string, error) {
	b, err := binary.Append(nil, binary.NativeEndian, v)
	if err != nil {
		return "", fmt.Errorf("%s %s of %T: %w", m.name, what, v, err)
	}
	if uint32(len(b)) != size {
		return "", fmt.Errorf("%s %s of %T has %d bytes, the map's have %d: %w", m.name, what, v, len(b), size, unix.EINVAL)
	}
	return string(b), nil
}

// encodeAll encodes each element of the slice vs.
func (m *Map) encodeAll(vs any, size uint32, what string) ([]string, error) {
	rv := reflect.ValueOf(vs)
	if rv.Kind() != reflect.Slice {
		return nil, fmt.Errorf("%ss must be a slice, not %T", what, vs)
	}
	out := make([]string, rv.Len())
	for i := range out {
		b, err := m.encode(rv.Index(i).Interface(), size, what)
		if err != nil {
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}

func decode(b []byte, out any) error {
	if _, err := binary.Decode(b, binary.NativeEndian, out); err != nil {
		return fmt.Errorf("decode into %T: %w", out, err)
	}
	return nil
}

// PutInner implements bpf.InnerMaker for a hash or array of maps: the
// value stored is the new inner map's ID, as the kernel answers a lookup
// with, and Inner returns the map.
func (m *Map) PutInner(key any, spec *ebpf.MapSpec) error {
	if m.typ != ebpf.HashOfMaps && m.typ != ebpf.ArrayOfMaps {
		return fmt.Errorf("update: %s can't store a map", m.typ)
	}
	m.mu.Lock()
	if m.inner == nil {
		m.inner = map[uint32]*Map{}
	}
	m.innerID++
	id := m.innerID
	m.inner[id] = New(spec)
	m.mu.Unlock()
	return m.Put(key, id)
}

// LookupInner implements bpf.InnerMaker.
func (m *Map) LookupInner(key any) (bpf.Map, error) {
	var id uint32
	if err := m.Lookup(key, &id); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	inner := m.inner[id]
	if inner == nil {
		return nil, fmt.Errorf("lookup: no map %d: %w", id, ebpf.ErrKeyNotExist)
	}
	return inner, nil
}

// Inner returns the inner map stored under key by PutInner, or nil.
func (m *Map) Inner(key any) *Map {
	var id uint32
	if m.Lookup(key, &id) != nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.inner[id]
}
