package policy

import (
	"bufio"
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/tables"
)

// reasonAgent is the Reason of the agent's own row.
const reasonAgent = "the agent's own container: never denied, so that it reaches the API server to register its pod"

// writeAgentRow writes the row of the agent's own container cgroup when
// the agent runs in a kubelet pod (the DaemonSet's): the pod trees' entries
// an earlier agent pinned deny a pod cgroup no endpoint registers, and the
// agent learns of its own pod only from the API server, which it could
// then not reach (a rollout of the DaemonSet would never end). The row is
// written before anything waits for the inputs; the pod's own endpoint
// (a host-network pod), once registered, is the shallower cgroup and wins.
func (c *controller) writeAgentRow() error {
	if c.Config.UnclassifiedPods != UnclassifiedDeny || c.Config.EnablePolicy == ModeNever || c.Root.Check() != nil {
		return nil
	}
	self, _ := os.ReadFile("/proc/self/cgroup")
	rel, ok := agentCgroup(c.Root.Path(), self, os.Getpid())
	if !ok {
		return nil
	}
	id, err := cgroups.ID(filepath.Join(c.Root.Path(), rel))
	if err != nil {
		return nil
	}
	wtxn := c.DB.WriteTxn(c.EndpointPolicy)
	defer wtxn.Abort()
	row := &tables.EndpointPolicy{
		Name: tables.AgentRowPrefix + rel, Cgroup: rel, CgroupID: id, Agent: true,
		Ingress: tables.EnforceOff, Egress: tables.EnforceOff, Policies: []string{}, Reason: reasonAgent,
		Status: reconciler.StatusPending(),
	}
	if _, _, err := c.EndpointPolicy.Insert(wtxn, row); err != nil {
		return err
	}
	wtxn.Commit()
	c.Log.Info("Registered the agent's own container, never denied", "cgroup", rel)
	return nil
}

// agentCgroup returns the cgroup of the process pid, relative to the cgroup
// v2 root, when it lies below a kubelet pod tree: the "0::" line of its
// /proc/self/cgroup (self), or, in a cgroup namespace of its own (which
// shows "/"), the cgroup below the pod trees whose cgroup.procs lists pid.
func agentCgroup(root string, self []byte, pid int) (string, bool) {
	sc := bufio.NewScanner(bytes.NewReader(self))
	for sc.Scan() {
		if path, ok := strings.CutPrefix(sc.Text(), "0::/"); ok && path != "" && inPodTree(path) {
			if _, err := os.Stat(filepath.Join(root, path)); err == nil {
				return path, true
			}
		}
	}
	want := []byte(strconv.Itoa(pid))
	for _, tree := range podTreeDirs {
		var found string
		filepath.WalkDir(filepath.Join(root, tree), func(p string, d fs.DirEntry, err error) error {
			if err != nil || found != "" {
				return filepath.SkipDir
			}
			if !d.IsDir() {
				return nil
			}
			procs, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			if err == nil && bytes.Contains(append(append([]byte("\n"), procs...), '\n'), append(append([]byte("\n"), want...), '\n')) {
				found, _ = filepath.Rel(root, p)
				return filepath.SkipAll
			}
			return nil
		})
		if found != "" {
			return found, true
		}
	}
	return "", false
}

// inPodTree says whether the relative cgroup path lies below a kubelet pod
// tree.
func inPodTree(path string) bool {
	for _, tree := range podTreeDirs {
		if strings.HasPrefix(path, tree+"/") {
			return true
		}
	}
	return false
}
