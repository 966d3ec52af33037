package policy

import (
	"maps"
	"path/filepath"
	"time"

	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/tables"
)

// podTreeDirs are the kubelet's pod cgroup trees under the cgroup root:
// the cgroupfs driver's, then the systemd driver's.
var podTreeDirs = []string{"kubepods", "kubepods.slice"}

// podTreeRecheck is how often the controller looks for the trees: the
// kubelet makes them when it starts, which may be after the agent.
const podTreeRecheck = time.Second

// reasonPodTree is the Reason of a pod tree's row.
const reasonPodTree = "kubelet pod tree: a pod cgroup below it that is in no endpoint is denied both ways (--" + UnclassifiedFlag + "=deny)"

// podTrees keeps one endpoint-policy row per kubelet pod tree that exists,
// with --unclassified-pods=deny: its policy_endpoints entry makes the
// programs deny any process below it that is in no registered endpoint —
// a pod the agent has not classified yet, or one started while the agent
// was not running.
type podTrees struct {
	c     *controller
	known map[string]uint64 // tree (relative to the root) → cgroup ID
}

func newPodTrees(c *controller) *podTrees {
	return &podTrees{c: c, known: map[string]uint64{}}
}

// want returns the trees that exist now and should have rows.
func (t *podTrees) want() map[string]uint64 {
	out := map[string]uint64{}
	cfg := t.c.Config
	if cfg.UnclassifiedPods != UnclassifiedDeny || cfg.EnablePolicy == ModeNever || t.c.Root.Check() != nil {
		return out
	}
	for _, d := range podTreeDirs {
		if id, err := cgroups.ID(filepath.Join(t.c.Root.Path(), d)); err == nil {
			out[d] = id
		}
	}
	return out
}

// sync writes the rows of the trees that appeared, changed or went.
func (t *podTrees) sync() error {
	want := t.want()
	if maps.Equal(want, t.known) {
		return nil
	}
	wtxn := t.c.DB.WriteTxn(t.c.EndpointPolicy)
	defer wtxn.Abort()
	for d, id := range t.known {
		if want[d] != id {
			if _, _, err := t.c.EndpointPolicy.Delete(wtxn, &tables.EndpointPolicy{Name: tables.PodTreeRowPrefix + d}); err != nil {
				return err
			}
		}
	}
	for d, id := range want {
		if t.known[d] == id {
			continue
		}
		row := &tables.EndpointPolicy{
			Name: tables.PodTreeRowPrefix + d, Cgroup: d, CgroupID: id, PodTree: true,
			Ingress: tables.EnforceDefaultDeny, Egress: tables.EnforceDefaultDeny,
			Audit: t.c.Config.PolicyAuditMode, Policies: []string{}, Reason: reasonPodTree,
			Status: reconciler.StatusPending(),
		}
		if _, _, err := t.c.EndpointPolicy.Insert(wtxn, row); err != nil {
			return err
		}
	}
	wtxn.Commit()
	if len(want) > len(t.known) {
		t.c.Log.Info("Denying pods under the kubelet's cgroup trees until they are classified", "trees", len(want))
	}
	t.known = want
	return nil
}
