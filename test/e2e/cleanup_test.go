package e2e

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestCleanup: `apiary cleanup` is the uninstall path. Programs stay
// attached and enforcing after the agent is killed (by design), cleanup
// refuses while an agent runs, and once it has run nothing is attached to
// the cgroup, the pin directory is gone and what policy denied goes
// through.
func TestCleanup(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	listen(t, "127.0.1.91:8080", "127.0.1.92:8080")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "egress-a.yaml"), `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-one, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.91/32]
`)
	a := startAgent(t, agentOptions{configDir: configDir,
		flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root, "--enable-socket-lb"}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	if got := connectFrom(t, cgA, "127.0.1.92:8080", ""); got != "EPERM" {
		t.Fatalf("to an address policy denies: %s, want EPERM", got)
	}

	// Refused while the agent runs: it holds its links and would pin them
	// again.
	if out, err := runApiary(nil, "cleanup", "--bpf-pin-dir", a.pinDir); err == nil ||
		!strings.Contains(err.Error(), fmt.Sprintf("another apiary agent (pid %d) holds %s", a.pid(), a.pinDir)) {
		t.Fatalf("cleanup with the agent running: %v\n%s", err, out)
	}

	// Killed, the agent leaves its programs attached: still enforced.
	a.proc.stopped = true
	if err := a.proc.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-a.proc.done
	before := testenv.CgroupPrograms(t, root)
	if before[ebpf.AttachCGroupInet4Connect] != 2 || before[ebpf.AttachCGroupInetEgress] != 1 {
		t.Fatalf("programs on the cgroup root after the agent was killed: %v; want the socket LB's and policy's", before)
	}
	if got := connectFrom(t, cgA, "127.0.1.92:8080", ""); got != "EPERM" {
		t.Fatalf("after the agent was killed: %s, want EPERM (pinned links keep enforcing)", got)
	}

	out, err := runApiary(nil, "cleanup", "--bpf-pin-dir", a.pinDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("apiary cleanup:\n%s", out)
	if !strings.Contains(out, "detached links/policy_connect4\n") || !strings.Contains(out, "Removed ") {
		t.Errorf("apiary cleanup said:\n%s", out)
	}
	if after := testenv.CgroupPrograms(t, root); len(after) != 0 {
		t.Errorf("programs still attached to the cgroup root after cleanup: %v", after)
	}
	if _, err := os.Stat(a.pinDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory after cleanup: %v, want it gone", err)
	}
	if got := connectFrom(t, cgA, "127.0.1.92:8080", ""); got != "ok: hello from 127.0.1.92:8080" {
		t.Errorf("after cleanup: %s, want the connection through", got)
	}

	// Again: nothing left to do.
	out, err = runApiary(nil, "cleanup", "--bpf-pin-dir", a.pinDir)
	if err != nil || !strings.HasPrefix(out, "Nothing to clean up") {
		t.Errorf("second cleanup: %v\n%s", err, out)
	}
}

// TestInitNode: `apiary init-node`, the DaemonSet's init step, mounts bpffs
// where it is missing, in the mount namespace of PID 1 under --host-proc,
// and leaves an existing one alone. The "host" is the test's own mount
// namespace (this machine's PID 1 is not ours to enter): a --host-proc
// whose PID 1 is the test process.
func TestInitNode(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	tmp := t.TempDir()
	dir := filepath.Join(tmp, "bpf")
	hostProc := filepath.Join(tmp, "proc")
	if err := os.Mkdir(hostProc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(fmt.Sprintf("/proc/%d", os.Getpid()), filepath.Join(hostProc, "1")); err != nil {
		t.Fatal(err)
	}
	out, err := runApiary(nil, "init-node", "--host-proc", hostProc, "--bpffs", dir)
	if err != nil {
		t.Fatal(err)
	}
	host := dir
	t.Cleanup(func() {
		if err := unix.Unmount(host, 0); err != nil {
			t.Errorf("unmount %s: %v", host, err)
		}
	})
	if out != "Mounted bpffs at "+dir+"\n" {
		t.Errorf("first run said %q", out)
	}
	if ok, err := bpf.IsBPFFS(host); err != nil || !ok {
		t.Fatalf("%s on bpffs after init-node: %v %v", host, ok, err)
	}
	out, err = runApiary(nil, "init-node", "--host-proc", hostProc, "--bpffs", dir)
	if err != nil || out != "bpffs is mounted at "+dir+"\n" {
		t.Errorf("second run: %v, said %q", err, out)
	}
}
