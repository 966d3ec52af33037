package reconcilers

// Slot layout of one frontend in lb4_services: slot 0 is the service entry,
// slots 1..count hold the active backends and the next qcount slots the
// terminating ones. The datapath picks slot = random % count + 1 and uses
// the terminating slots only when count is 0, so a slot it may pick must
// always exist and name a backend whose entry exists.

// slotClass says which region of the layout a backend belongs in.
type slotClass uint8

const (
	classNone slotClass = iota
	classActive
	classTerminating
)

// smallClassSet is the size up to which backend classes are looked up by
// linear search instead of a map: most services have few backends, and a
// map would cost an allocation per update.
const smallClassSet = 16

// classSet maps backend IDs to their wanted region, and forgets an ID once
// it has been placed so that a duplicate is never placed twice.
type classSet struct {
	small []idClass
	large map[uint32]slotClass
}

type idClass struct {
	id    uint32
	class slotClass
}

func newClassSet(active, terminating []uint32) classSet {
	n := len(active) + len(terminating)
	if n <= smallClassSet {
		s := make([]idClass, 0, n)
		for _, id := range active {
			s = append(s, idClass{id, classActive})
		}
		for _, id := range terminating {
			s = append(s, idClass{id, classTerminating})
		}
		return classSet{small: s}
	}
	m := make(map[uint32]slotClass, n)
	for _, id := range active {
		m[id] = classActive
	}
	for _, id := range terminating {
		m[id] = classTerminating
	}
	return classSet{large: m}
}

func (s classSet) get(id uint32) slotClass {
	if s.large != nil {
		return s.large[id]
	}
	for _, e := range s.small {
		if e.id == id {
			return e.class
		}
	}
	return classNone
}

func (s classSet) take(id uint32) {
	if s.large != nil {
		delete(s.large, id)
		return
	}
	for i := range s.small {
		if s.small[i].id == id {
			s.small[i].class = classNone
		}
	}
}

// planSlots returns the new contents of slots 1..len(active)+len(terminating)
// given the current contents cur (cur[i] is slot i+1, 0 where a slot is
// missing): the active backends first, then the terminating ones.
//
// It moves as little as it can. A backend already in the right region keeps
// its slot. The holes are filled first with backends taken from the end of
// the current layout, then with new backends in the order given. So removing
// one backend moves only the last one into its hole, and adding one appends.
func planSlots(cur, active, terminating []uint32) []uint32 {
	n, q := len(active), len(terminating)
	out := make([]uint32, n+q)
	want := newClassSet(active, terminating)
	for i, id := range cur {
		if i >= n+q {
			break
		}
		region := classActive
		if i >= n {
			region = classTerminating
		}
		if id != 0 && want.get(id) == region {
			out[i] = id
			want.take(id)
		}
	}

	var moveActive, moveTerm []uint32
	collect := func(id uint32) {
		switch want.get(id) {
		case classActive:
			moveActive = append(moveActive, id)
		case classTerminating:
			moveTerm = append(moveTerm, id)
		default:
			return
		}
		want.take(id)
	}
	for i := len(cur) - 1; i >= 0; i-- {
		collect(cur[i])
	}
	for _, id := range active {
		collect(id)
	}
	for _, id := range terminating {
		collect(id)
	}

	fill := func(region []uint32, from []uint32) {
		for i := range region {
			if region[i] == 0 && len(from) > 0 {
				region[i], from = from[0], from[1:]
			}
		}
	}
	fill(out[:n], moveActive)
	fill(out[n:], moveTerm)
	return out
}
