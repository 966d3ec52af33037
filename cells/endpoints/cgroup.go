package endpoints

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// A local pod's endpoint carries the pod's kubelet cgroup, which policy
// enforcement uses to tell the pod's processes (those in it and below it)
// apart. The kubelet names the cgroup after the pod's UID, so the
// controller computes the few places it can be and stats them: no
// directory walk, no inotify. A cgroup can appear after the pod (the
// kubelet creates it when it starts the pod) and be removed and made anew
// (a new inode, so a new ID), so the controller looks again, from one timer
// in its loop:
//
//   - pods whose cgroup is not found: every recheckUnresolved;
//   - pods whose cgroup is known: every recheckResolved (one stat each,
//     the full search only when the cgroup is gone or has a new ID).
//
// With no local pods the timer is off; an unusable root is looked at again
// every recheckResolved, or recheckUnresolved while pods wait for it.
const (
	recheckUnresolved = time.Second
	recheckResolved   = 10 * time.Second
)

// cgroupRef is where a pod's cgroup was found: its path relative to the
// cgroup root and its ID. The zero value is "not found".
type cgroupRef struct {
	path string
	id   uint64
}

// cgroupCandidates returns the paths, relative to the cgroup root, where
// the kubelet puts the cgroup of the pod with the given UID: with the
// cgroupfs driver, then with the systemd one (which writes the UID's dashes
// as underscores), for each QoS class (guaranteed, burstable, best effort).
func cgroupCandidates(uid string) []string {
	u := strings.ReplaceAll(uid, "-", "_")
	return []string{
		"kubepods/pod" + uid,
		"kubepods/burstable/pod" + uid,
		"kubepods/besteffort/pod" + uid,
		"kubepods.slice/kubepods-pod" + u + ".slice",
		"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + u + ".slice",
		"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + u + ".slice",
	}
}

// validUID says whether uid can name a kubelet cgroup. UIDs are UUIDs; a
// pod from --config-dir can say anything, and a '/' or ".." would make the
// agent take some other cgroup for the pod's.
func validUID(uid string) bool {
	if uid == "" || len(uid) > 64 {
		return false
	}
	for _, r := range uid {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
			return false
		}
	}
	return true
}

// cgroupError says why the local pod s has no cgroup, "" when it has one.
func cgroupError(s *podState) string {
	switch {
	case s.cgroup.id != 0:
		return ""
	case !validUID(s.uid):
		return fmt.Sprintf("UID %q cannot name a kubelet cgroup (1-64 letters, digits and '-')", s.uid)
	case s.pod.Status.Phase == corev1.PodSucceeded || s.pod.Status.Phase == corev1.PodFailed:
		return "the pod has terminated"
	}
	return "no cgroup of UID " + s.uid + " under the cgroup root (yet)"
}

// findCgroup returns the cgroup of the pod with the given UID under root,
// or the zero cgroupRef when there is none (yet). known is where it was
// found before: when it is still there with the same ID, one stat does.
// The error is an unexpected one (not "no such file") met on the way.
func findCgroup(root, uid string, known cgroupRef) (cgroupRef, error) {
	if !validUID(uid) {
		return cgroupRef{}, nil
	}
	if known.path != "" {
		if id, err := cgroups.ID(filepath.Join(root, known.path)); err == nil && id == known.id {
			return known, nil
		}
	}
	var errs []error
	for _, rel := range cgroupCandidates(uid) {
		id, err := cgroups.ID(filepath.Join(root, rel))
		switch {
		case err == nil:
			return cgroupRef{path: rel, id: id}, nil
		case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
		default:
			errs = append(errs, err)
		}
	}
	return cgroupRef{}, errors.Join(errs...)
}

// namedPorts returns the named container ports of pod, sorted and without
// duplicates; the protocol defaults to TCP as in Kubernetes.
func namedPorts(pod *corev1.Pod) []tables.NamedPort {
	var out []tables.NamedPort
	for _, ctr := range pod.Spec.Containers {
		for _, p := range ctr.Ports {
			if p.Name == "" || p.ContainerPort <= 0 || p.ContainerPort > 65535 {
				continue
			}
			proto := strings.ToUpper(string(p.Protocol))
			if proto == "" {
				proto = string(corev1.ProtocolTCP)
			}
			np := tables.NamedPort{Name: p.Name, Port: uint16(p.ContainerPort), Protocol: proto}
			if !slices.Contains(out, np) {
				out = append(out, np)
			}
		}
	}
	slices.SortFunc(out, func(a, b tables.NamedPort) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port))
	})
	return out
}

// mayHaveCgroup says whether the controller looks for the cgroup of the
// local pod s: a terminated pod's cgroup is gone (or going), and a pod
// without a usable UID has none it could find. Host-network pods have one
// too: policy registers it as classified (and not enforced), or the pod
// would be an unclassified one under the kubelet's tree.
func mayHaveCgroup(s *podState) bool {
	phase := s.pod.Status.Phase
	return phase != corev1.PodSucceeded && phase != corev1.PodFailed && validUID(s.uid)
}

// cgroupTracker holds the controller's cgroup state.
type cgroupTracker struct {
	// dir is the cgroup root once it is usable ("" before); rootErr says
	// why it is not, and rootChecked is when it was last looked at.
	dir         string
	rootErr     error
	rootChecked time.Time
	// unresolved and resolved are the local pods whose cgroup is looked
	// for, by whether it was found; unresolvedAt and resolvedAt are when
	// each set is looked at again.
	unresolved, resolved     map[k8s.Key]struct{}
	unresolvedAt, resolvedAt time.Time
}

func newCgroupTracker() cgroupTracker {
	return cgroupTracker{unresolved: map[k8s.Key]struct{}{}, resolved: map[k8s.Key]struct{}{}}
}

// ensureRoot checks, at most once per recheckUnresolved, whether the cgroup
// root has become usable. The endpoints never mount it: that is for the
// features that attach programs to it (they call Prepare), so that an agent
// using none of them changes nothing on the host.
func (c *controller) ensureRoot(now time.Time) bool {
	t := &c.cg
	if t.dir != "" {
		return true
	}
	if !t.rootChecked.IsZero() && now.Sub(t.rootChecked) < recheckUnresolved {
		return false
	}
	t.rootChecked = now
	err := c.Root.Check()
	if err != nil {
		if t.rootErr == nil || t.rootErr.Error() != err.Error() {
			// Normal for a while at start, until a feature mounts the
			// default root; not a problem unless one needs it, and that
			// one says so.
			c.Log.Info("Pods' cgroups unknown until the cgroup root is usable", "error", err)
		}
		t.rootErr = err
		return false
	}
	t.dir, t.rootErr = c.Root.Path(), nil
	c.Log.Info("Looking up pods' cgroups", "root", t.dir)
	return true
}

// trackCgroup follows the cgroup of the pod key, now s (nil: deleted),
// formerly old. A pod new to the controller (or with a new UID) is looked
// up at once; one whose cgroup is known keeps it until the next recheck.
func (c *controller) trackCgroup(key k8s.Key, old, s *podState, now time.Time) {
	if s == nil || !c.isLocal(s) || !mayHaveCgroup(s) {
		if s != nil {
			s.cgroup = cgroupRef{}
		}
		delete(c.cg.unresolved, key)
		delete(c.cg.resolved, key)
		return
	}
	if old != nil && old.uid == s.uid && old.cgroup.id != 0 {
		s.cgroup = old.cgroup
		c.markResolved(key, true, now)
		return
	}
	_, waiting := c.cg.unresolved[key]
	c.checkCgroup(key, s, now)
	if s.cgroup.id == 0 && !waiting && c.cg.dir != "" {
		// Normal for a moment, and for good for pods of a runtime that
		// puts them elsewhere.
		c.Log.Debug("No cgroup for the pod yet", "pod", key, "uid", s.uid)
	}
}

// checkCgroup looks for the cgroup of the local pod s, marking it dirty
// when it changed.
func (c *controller) checkCgroup(key k8s.Key, s *podState, now time.Time) {
	var ref cgroupRef
	if c.ensureRoot(now) {
		var err error
		ref, err = findCgroup(c.cg.dir, s.uid, s.cgroup)
		if err != nil {
			c.Log.Debug("Looking for the pod's cgroup", "pod", key, "error", err)
		}
	}
	if ref != s.cgroup {
		if ref.id == 0 {
			c.Log.Debug("The pod's cgroup is gone", "pod", key, "cgroup", s.cgroup.path)
		} else {
			c.Log.Debug("Found the pod's cgroup", "pod", key, "cgroup", ref.path, "id", ref.id)
		}
		s.cgroup = ref
		c.dirty[key] = struct{}{}
	}
	c.markResolved(key, ref.id != 0, now)
}

// markResolved puts key in the resolved or the unresolved set. A set that
// was empty starts its recheck period now, so that a pod just looked up is
// not looked up again at once.
func (c *controller) markResolved(key k8s.Key, found bool, now time.Time) {
	t := &c.cg
	from, to, at, period := t.unresolved, t.resolved, &t.resolvedAt, recheckResolved
	if !found {
		from, to, at, period = t.resolved, t.unresolved, &t.unresolvedAt, recheckUnresolved
	}
	delete(from, key)
	if len(to) == 0 {
		*at = now.Add(period)
	}
	to[key] = struct{}{}
}

// recheckCgroups looks again for the cgroups that are due (see the top of
// this file).
func (c *controller) recheckCgroups(now time.Time) {
	t := &c.cg
	unresolvedDue := len(t.unresolved) > 0 && !now.Before(t.unresolvedAt)
	resolvedDue := len(t.resolved) > 0 && !now.Before(t.resolvedAt)
	if t.dir == "" && !unresolvedDue && !now.Before(t.rootChecked.Add(recheckResolved)) {
		c.ensureRoot(now)
	}
	if resolvedDue {
		t.resolvedAt = now.Add(recheckResolved)
		for key := range t.resolved {
			c.checkCgroup(key, c.pods[key], now)
		}
	}
	if unresolvedDue {
		t.unresolvedAt = now.Add(recheckUnresolved)
		for key := range t.unresolved {
			c.checkCgroup(key, c.pods[key], now)
		}
	}
}

// nextRecheck returns when recheckCgroups has something to do, and false
// when nothing is to be looked at again (the timer can stay off).
func (c *controller) nextRecheck() (time.Time, bool) {
	t := &c.cg
	var next []time.Time
	if len(t.unresolved) > 0 {
		next = append(next, t.unresolvedAt)
	}
	if len(t.resolved) > 0 {
		next = append(next, t.resolvedAt)
	}
	if t.dir == "" {
		next = append(next, t.rootChecked.Add(recheckResolved))
	}
	if len(next) == 0 {
		return time.Time{}, false
	}
	return slices.MinFunc(next, time.Time.Compare), true
}

// cgroupHealth completes the health message with the cgroups found, or why
// they are unknown.
func (c *controller) cgroupHealth() string {
	if c.cg.dir == "" && c.cg.rootErr != nil {
		// Not degraded: only policy enforcement needs the cgroups, and it
		// reports an unusable root itself. /healthz stays 200 for agents
		// that do without it.
		return "; pods' cgroups unknown: " + c.cg.rootErr.Error()
	}
	return fmt.Sprintf(", %d in a cgroup", len(c.cg.resolved))
}
