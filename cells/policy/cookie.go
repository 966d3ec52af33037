package policy

import "hash/fnv"

// policyCookie is the number a policy's entries carry in the policy map,
// which the datapath reports with each verdict: a hash of the policy's
// name, so that it is the same after a restart (an unchanged restart
// writes nothing) without a record of its own. Two names of the same hash
// (about one chance in 10⁵ among 300 policies) would be reported as one of
// the two; the entries still enforce what each policy says.
func policyCookie(name string) uint32 {
	if name == "" {
		return 0
	}
	h := fnv.New32a()
	h.Write([]byte(name))
	if c := h.Sum32(); c != 0 {
		return c
	}
	return 1
}
