// Package maglev computes Maglev lookup tables (Eisenbud et al., "Maglev:
// A Fast and Reliable Software Network Load Balancer", NSDI 2016, section
// 3.4): a table of m slots, m prime, each naming one backend, filled so
// that every backend has about m/N slots and removing one backend moves
// only the slots it had (about 1/N of the flows).
//
// The table is a function of the backends' names and m alone: two nodes
// that know the same backends compute the same table, whatever order they
// learnt them in and whatever IDs they gave them, so a flow hashed to a
// slot keeps its backend when another node takes it over.
package maglev

import (
	"fmt"
	"hash/fnv"
	"slices"
)

// Bounds of the table size: at least a few slots per backend for the
// services one sees, at most what one BPF map value holds comfortably
// (4 bytes a slot).
const (
	MinTableSize     = 251
	MaxTableSize     = 131071
	DefaultTableSize = 16381
)

// ValidateTableSize says why m cannot be a table size: it must be a
// prime between MinTableSize and MaxTableSize (the permutations of the
// algorithm only cover every slot when m is prime).
func ValidateTableSize(m uint32) error {
	if m < MinTableSize || m > MaxTableSize {
		return fmt.Errorf("maglev table size %d is out of range %d-%d", m, MinTableSize, MaxTableSize)
	}
	if !isPrime(m) {
		return fmt.Errorf("maglev table size %d is not a prime (try one of 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071)", m)
	}
	return nil
}

func isPrime(n uint32) bool {
	if n < 2 {
		return false
	}
	for d := uint32(2); d*d <= n; d++ {
		if n%d == 0 {
			return false
		}
	}
	return true
}

// hash64 is FNV-1a over seed and name, finished with SplitMix64's mixer:
// FNV alone spreads names that differ in one late byte (10.0.0.1,
// 10.0.0.2) poorly over the low bits the permutation uses. Fixed, so that
// every node computes the same.
func hash64(seed byte, name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte{seed})
	h.Write([]byte(name))
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Table returns the lookup table of size m (a prime; see
// ValidateTableSize) for backends named names, which must be distinct:
// for each slot, the index in names of the backend it holds. No backends,
// no table (nil).
func Table(names []string, m uint32) ([]uint32, error) {
	if err := ValidateTableSize(m); err != nil {
		return nil, err
	}
	n := len(names)
	if n == 0 {
		return nil, nil
	}
	// The algorithm's turns go in the backends' name order, not the
	// caller's, so that the result does not depend on it.
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case names[a] < names[b]:
			return -1
		case names[a] > names[b]:
			return 1
		}
		return 0
	})
	for i := 1; i < n; i++ {
		if names[order[i]] == names[order[i-1]] {
			return nil, fmt.Errorf("maglev: backend %q twice", names[order[i]])
		}
	}
	offset := make([]uint64, n)
	skip := make([]uint64, n)
	next := make([]uint64, n) // each backend's position in its permutation
	for i, o := range order {
		offset[i] = hash64('o', names[o]) % uint64(m)
		skip[i] = hash64('s', names[o])%uint64(m-1) + 1
	}
	const empty = ^uint32(0)
	table := make([]uint32, m)
	for i := range table {
		table[i] = empty
	}
	filled := uint32(0)
	for {
		for i, o := range order {
			// Backend i takes the next slot of its permutation
			// (offset + j*skip mod m) that nobody holds yet.
			c := (offset[i] + next[i]*skip[i]) % uint64(m)
			for table[c] != empty {
				next[i]++
				c = (offset[i] + next[i]*skip[i]) % uint64(m)
			}
			table[c] = uint32(o)
			next[i]++
			filled++
			if filled == m {
				return table, nil
			}
		}
	}
}
