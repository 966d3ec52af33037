package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

const cniInstall4 = "10.236.0.21"

// TestCNIInstallAndChain: an agent run with --cni-chaining-mode=chain
// copies apiary-cni into the CNI plugin directory and chains it at the end
// of the node's primary configuration (the lowest name) once its
// interface programs are pinned, leaving the other configurations alone;
// the runtime's chain, read from that file by libcni and run with the
// real ptp and host-local, then puts the agent's programs on a new pod's
// veth while the agent is down. A restarted agent writes nothing; a
// malformed configuration that becomes the primary is an error in the
// cni-chain table and /healthz, left untouched, the agent serving; `apiary
// cni uninstall` puts the original back byte for byte; a bad mode stops
// the agent naming the flag.
func TestCNIInstallAndChain(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	ptp := testenv.RequireProgram(t, "ptp", "/usr/lib/cni", "/opt/cni/bin")
	hostLocal := testenv.RequireProgram(t, "host-local", filepath.Dir(ptp))
	root := testenv.Cgroup(t)

	confDir, binDir := t.TempDir(), t.TempDir()
	for _, p := range []string{ptp, hostLocal} {
		if err := os.Symlink(p, filepath.Join(binDir, filepath.Base(p))); err != nil {
			t.Fatal(err)
		}
	}
	primary := filepath.Join(confDir, "10-e2e.conflist")
	original := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "e2e-install",
  "plugins": [{"type": "ptp", "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q, "rangeStart": %q, "rangeEnd": %q}]], "dataDir": %q}}]
}
`, cniSubnet, cniGw4, cniInstall4, cniInstall4, filepath.Join(t.TempDir(), "ipam"))
	other := strings.Replace(original, "e2e-install", "e2e-other", 1)
	writeFile(t, primary, original)
	writeFile(t, filepath.Join(confDir, "20-other.conflist"), other)

	a := startAgent(t, agentOptions{flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + cniGw4,
		"--cni-chaining-mode=chain", "--cni-conf-dir=" + confDir, "--cni-bin-dir=" + binDir, "--cni-plugin-source=" + cniBin,
	}})
	installed := filepath.Join(binDir, "apiary-cni")
	waitChain := func(want map[string]string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, "the cni-chain table", func() (bool, string) {
			var rows []*tables.CNIChain
			if err := a.dump(tables.CNIChainTableName, &rows); err != nil {
				return false, err.Error()
			}
			got := map[string]string{}
			for _, r := range rows {
				got[r.File] = r.State
				if r.Error != "" {
					got[r.File] += ": " + r.Error
				}
			}
			return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprint(got)
		})
	}
	waitChain(map[string]string{installed: "installed", primary: "chained"})
	a.waitHealthy(t)

	data, err := os.ReadFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	var conf struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(data, &conf); err != nil {
		t.Fatal(err)
	}
	if n := len(conf.Plugins); n != 2 || conf.Plugins[0]["type"] != "ptp" || conf.Plugins[1]["type"] != "apiary-cni" || conf.Plugins[1]["bpfPinDir"] != a.pinDir {
		t.Fatalf("%s after chaining:\n%s\nwant ptp, then apiary-cni on %s", primary, data, a.pinDir)
	}
	if got, _ := os.ReadFile(filepath.Join(confDir, "20-other.conflist")); string(got) != other {
		t.Errorf("the configuration that is not the primary changed:\n%s", got)
	}
	want, _ := os.ReadFile(cniBin)
	if got, _ := os.ReadFile(installed); !bytes.Equal(got, want) {
		t.Errorf("%s is not the built apiary-cni (%d bytes, want %d)", installed, len(got), len(want))
	}
	chainedAt, _ := os.Stat(primary)

	t.Run("pod made with the agent down", func(t *testing.T) {
		a.stop(t)
		list, err := libcni.ConfListFromFile(primary)
		if err != nil {
			t.Fatal(err)
		}
		cfg := libcni.NewCNIConfigWithCacheDir([]string{binDir}, t.TempDir(), nil)
		pod := makeCNIPod(t, root, "2a2a2a2a-0000-4000-8000-00000000002a", "cninst")
		rt := &libcni.RuntimeConf{ContainerID: pod.id, NetNS: "/run/netns/" + pod.netns, IfName: "eth0"}
		res, err := cfg.AddNetworkList(context.Background(), list, rt)
		if err != nil {
			t.Fatalf("ADD through the chained configuration: %v", err)
		}
		defer func() {
			if err := cfg.DelNetworkList(context.Background(), list, rt); err != nil {
				t.Errorf("DEL: %v", err)
			}
		}()
		r, err := current.NewResultFromResult(res)
		if err != nil {
			t.Fatal(err)
		}
		host := ""
		for _, i := range r.Interfaces {
			if i.Sandbox == "" {
				host = i.Name
			}
		}
		ifc, err := net.InterfaceByName(host)
		if err != nil {
			t.Fatalf("the pod's host interface %q: %v", host, err)
		}
		// Both programs linked on the new veth, at the agent's pins.
		if ids := linkIDs(t, a.pinDir, ifc.Index); len(ids) != 2 {
			t.Errorf("links on %s: %v", host, ids)
		}
	})

	// Restarted (on the test, not a subtest, which would stop it when
	// it ends): nothing to write.
	a.start(t)
	waitChain(map[string]string{installed: "up to date", primary: "already chained"})
	if st, _ := os.Stat(primary); !st.ModTime().Equal(chainedAt.ModTime()) {
		t.Errorf("%s rewritten by a restarted agent", primary)
	}

	t.Run("malformed primary", func(t *testing.T) {
		bad := filepath.Join(confDir, "05-bad.conflist")
		writeFile(t, bad, `{"cniVersion": "1.0.0", "plugins": [`)
		testenv.Eventually(t, waitTimeout, "/healthz names the malformed file", func() (bool, string) {
			code, body, err := httpGet(a.url("/healthz"))
			if err != nil {
				return false, err.Error()
			}
			return code != 200 && strings.Contains(body, "05-bad.conflist"), fmt.Sprintf("%d %s", code, body)
		})
		var rows []*tables.CNIChain
		if err := a.dump(tables.CNIChainTableName, &rows); err != nil {
			t.Fatal(err)
		}
		found := false
		for _, r := range rows {
			found = found || (r.File == bad && r.State == "error" && strings.Contains(r.Error, "parse "))
		}
		if !found {
			t.Errorf("cni-chain rows %+v, want %s in error", rows, bad)
		}
		if got, _ := os.ReadFile(bad); string(got) != `{"cniVersion": "1.0.0", "plugins": [` {
			t.Errorf("the malformed file was changed: %s", got)
		}
		if err := os.Remove(bad); err != nil {
			t.Fatal(err)
		}
		waitChain(map[string]string{installed: "up to date", primary: "already chained"})
		a.waitHealthy(t)
	})

	t.Run("apiary cni uninstall", func(t *testing.T) {
		a.stop(t)
		out, err := runApiary(nil, "cni", "uninstall", "--cni-conf-dir", confDir)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, primary+": unchained") {
			t.Errorf("apiary cni uninstall said %q", out)
		}
		if got, _ := os.ReadFile(primary); string(got) != original {
			t.Errorf("%s after uninstall:\n%s\nwant the original:\n%s", primary, got, original)
		}
		if _, err := os.Stat(primary + ".apiary-orig"); !os.IsNotExist(err) {
			t.Errorf("the copy of the original is left: %v", err)
		}
		// And install by hand, as the agent does.
		out, err = runApiary(nil, "cni", "install", "--cni-conf-dir", confDir, "--cni-bin-dir", binDir,
			"--cni-plugin-source", cniBin, "--bpf-pin-dir", a.pinDir)
		if err != nil || !strings.Contains(out, primary+": chained") {
			t.Errorf("apiary cni install: %q %v", out, err)
		}
	})

	t.Run("bad mode", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, apiaryBin, "agent", "--cni-chaining-mode=sometimes", "--api-addr=127.0.0.1:0",
			"--state-dir="+t.TempDir(), "--bpf-pin-dir="+testenv.BPFPinDir(t))
		cmd.Env = cleanEnv()
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--cni-chaining-mode") {
			t.Errorf("agent with --cni-chaining-mode=sometimes: %v\n%s", err, out)
		}
	})
}
