package selectors

import (
	"maps"
	"slices"

	"github.com/apiary-net/apiary/tables"
)

// selectorCache keeps, for every selector in use, the identities it
// selects, updated incrementally: a new identity is matched against every
// selector once, a new selector against every identity once.
type selectorCache struct {
	identities map[uint32]tables.Labels
	selectors  map[string]*selectorState
	// dirty are the selectors whose users or identities changed since the
	// last takeDirty.
	dirty map[string]struct{}
}

type selectorState struct {
	sel   Selector
	users map[string]struct{}
	ids   map[uint32]struct{}
}

func newSelectorCache() *selectorCache {
	return &selectorCache{
		identities: map[uint32]tables.Labels{},
		selectors:  map[string]*selectorState{},
		dirty:      map[string]struct{}{},
	}
}

// upsertIdentity adds an identity or changes its labels.
func (c *selectorCache) upsertIdentity(id uint32, labels tables.Labels) {
	if old, ok := c.identities[id]; ok && old.Equal(labels) {
		return
	}
	c.identities[id] = labels
	for key, s := range c.selectors {
		_, had := s.ids[id]
		if has := s.sel.Matches(labels); has != had {
			if has {
				s.ids[id] = struct{}{}
			} else {
				delete(s.ids, id)
			}
			c.dirty[key] = struct{}{}
		}
	}
}

// deleteIdentity removes an identity from every selection.
func (c *selectorCache) deleteIdentity(id uint32) {
	if _, ok := c.identities[id]; !ok {
		return
	}
	delete(c.identities, id)
	for key, s := range c.selectors {
		if _, had := s.ids[id]; had {
			delete(s.ids, id)
			c.dirty[key] = struct{}{}
		}
	}
}

// addUser records that policy uses sel, matching a new selector against
// every identity.
func (c *selectorCache) addUser(sel Selector, policy string) {
	key := sel.String()
	s, ok := c.selectors[key]
	if !ok {
		s = &selectorState{sel: sel, users: map[string]struct{}{}, ids: map[uint32]struct{}{}}
		for id, labels := range c.identities {
			if sel.Matches(labels) {
				s.ids[id] = struct{}{}
			}
		}
		c.selectors[key] = s
	}
	s.users[policy] = struct{}{}
	c.dirty[key] = struct{}{}
}

// removeUser drops policy from the users of the selector key; a selector
// nobody uses goes.
func (c *selectorCache) removeUser(key, policy string) {
	s, ok := c.selectors[key]
	if !ok {
		return
	}
	delete(s.users, policy)
	if len(s.users) == 0 {
		delete(c.selectors, key)
	}
	c.dirty[key] = struct{}{}
}

// takeDirty returns the rows of the selectors changed since the last call;
// a nil row means the selector is gone.
func (c *selectorCache) takeDirty() map[string]*tables.Selector {
	out := make(map[string]*tables.Selector, len(c.dirty))
	for key := range c.dirty {
		s, ok := c.selectors[key]
		if !ok {
			out[key] = nil
			continue
		}
		// Non-nil, so that JSON has [] rather than null.
		out[key] = &tables.Selector{
			Selector:   key,
			Identities: append([]uint32{}, slices.Sorted(maps.Keys(s.ids))...),
			Policies:   append([]string{}, slices.Sorted(maps.Keys(s.users))...),
		}
	}
	clear(c.dirty)
	return out
}
