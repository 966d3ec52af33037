package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// webService is a ClusterIP Service with extra frontends (externalIPs) and
// an EndpointSlice of the given endpoints, each "IP" (ready) or "IP
// terminating" (serving while terminating), all on port targetPort.
func webService(externalIPs []string, targetPort int, endpoints ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  externalIPs: [%s]
  ports:
  - {name: http, port: 80, targetPort: %d, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc12
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: %d, protocol: TCP}
endpoints:
`, strings.Join(externalIPs, ", "), targetPort, targetPort)
	for _, ep := range endpoints {
		ip, state, _ := strings.Cut(ep, " ")
		cond := "{ready: true}"
		if state == "terminating" {
			cond = "{ready: false, serving: true, terminating: true}"
		}
		fmt.Fprintf(&b, "- addresses: [%q]\n  conditions: %s\n", ip, cond)
	}
	return b.String()
}

// lbMaps reads `apiary bpf lb list` and returns what the three maps say,
// one line per frontend, backend and rev-NAT entry, sorted, with backend IDs
// resolved to addresses so that the lines do not depend on how IDs were
// allocated:
//
//	FE 10.96.0.10:80/TCP count=2 qcount=0 flags=ClusterIP backends=10.244.0.1:8080/TCP,10.244.0.2:8080/TCP
//	BE 10.244.0.1:8080/TCP active
//	REV 10.96.0.10:80
//	WILDCARD 10.96.0.10
//
// It checks that slots 1..count+qcount (the active backends, then the
// terminating ones) and no others name known backends, and that every
// frontend's rev-NAT entry names it.
func (a *agent) lbMaps() ([]string, error) {
	out, err := a.bpf("lb", "list")
	if err != nil {
		return nil, err
	}
	type frontend struct {
		slot0 map[string]string
		slots map[int]string // slot → backend ID
	}
	frontends := map[string]*frontend{}
	backends := map[string]string{} // ID → address
	revNAT := map[string]string{}   // ID → address
	var lines []string
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) < 2 {
			return nil, fmt.Errorf("apiary bpf lb list: unexpected line %q", line)
		}
		kv := map[string]string{}
		for _, field := range f[1:] {
			if k, v, ok := strings.Cut(field, "="); ok {
				kv[k] = v
			}
		}
		switch f[0] {
		case "SVC":
			fe := frontends[f[1]]
			if fe == nil {
				fe = &frontend{slots: map[int]string{}}
				frontends[f[1]] = fe
			}
			if kv["SLOT"] == "0" {
				fe.slot0 = kv
			} else {
				slot, err := strconv.Atoi(kv["SLOT"])
				if err != nil {
					return nil, fmt.Errorf("apiary bpf lb list: %q: %w", line, err)
				}
				fe.slots[slot] = kv["BEID"]
			}
		case "BE":
			backends[kv["ID"]] = kv["ADDR"]
			lines = append(lines, fmt.Sprintf("BE %s %s", kv["ADDR"], kv["STATE"]))
		case "REV":
			revNAT[kv["ID"]] = kv["ADDR"]
			lines = append(lines, "REV "+kv["ADDR"])
		default:
			return nil, fmt.Errorf("apiary bpf lb list: unexpected line %q", line)
		}
	}
	for addr, fe := range frontends {
		if fe.slot0 == nil {
			return nil, fmt.Errorf("apiary bpf lb list: %s has backend slots but no slot 0:\n%s", addr, out)
		}
		if strings.HasSuffix(addr, ":0/ANY") {
			// A cluster IP's wildcard: no ID, no backends.
			if fe.slot0["ID"] != "0" || fe.slot0["COUNT"] != "0" || fe.slot0["QCOUNT"] != "0" || len(fe.slots) > 0 {
				return nil, fmt.Errorf("apiary bpf lb list: wildcard %s has an ID or backends:\n%s", addr, out)
			}
			lines = append(lines, "WILDCARD "+strings.TrimSuffix(addr, ":0/ANY"))
			continue
		}
		count, _ := strconv.Atoi(fe.slot0["COUNT"])
		qcount, _ := strconv.Atoi(fe.slot0["QCOUNT"])
		var bes []string
		for slot := 1; slot <= count+qcount; slot++ {
			be, ok := backends[fe.slots[slot]]
			if !ok {
				return nil, fmt.Errorf("apiary bpf lb list: slot %d of %s names no backend:\n%s", slot, addr, out)
			}
			bes = append(bes, be)
		}
		if len(fe.slots) != len(bes) {
			return nil, fmt.Errorf("apiary bpf lb list: %s has %d slots beyond slot 0, count=%d qcount=%d:\n%s", addr, len(fe.slots), count, qcount, out)
		}
		if rev := revNAT[fe.slot0["ID"]]; !strings.HasPrefix(addr, rev+"/") {
			return nil, fmt.Errorf("apiary bpf lb list: rev-NAT %s of %s is %q:\n%s", fe.slot0["ID"], addr, rev, out)
		}
		slices.Sort(bes)
		lines = append(lines, fmt.Sprintf("FE %s count=%d qcount=%d flags=%s backends=%s",
			addr, count, qcount, fe.slot0["FLAGS"], strings.Join(bes, ",")))
	}
	slices.Sort(lines)
	return lines, nil
}

type frontendRow struct {
	Address  string `json:"address"`
	Service  string `json:"service"`
	Backends []struct {
		Address string `json:"address"`
		State   string `json:"state"`
	} `json:"backends"`
	Status struct {
		Kind string `json:"kind"`
	} `json:"status"`
}

// frontends returns the frontends table, one line per frontend, sorted:
// "ADDRESS SERVICE BACKEND/STATE,... STATUS".
func (a *agent) frontends() ([]string, error) {
	var rows []frontendRow
	if err := a.dump("frontends", &rows); err != nil {
		return nil, err
	}
	var lines []string
	for _, r := range rows {
		var bes []string
		for _, be := range r.Backends {
			bes = append(bes, be.Address+"/"+be.State)
		}
		slices.Sort(bes)
		lines = append(lines, fmt.Sprintf("%s %s %s %s", r.Address, r.Service, strings.Join(bes, ","), r.Status.Kind))
	}
	slices.Sort(lines)
	return lines, nil
}

// waitLB waits until the frontends table and the LB maps read back as
// wanted.
func (a *agent) waitLB(t *testing.T, what string, wantFrontends, wantMaps []string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, "frontends table: "+what, func() (bool, string) {
		got, err := a.frontends()
		if err != nil {
			return false, err.Error()
		}
		return slices.Equal(got, wantFrontends), fmt.Sprintf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(wantFrontends, "\n"))
	})
	testenv.Eventually(t, waitTimeout, "apiary bpf lb list: "+what, func() (bool, string) {
		got, err := a.lbMaps()
		if err != nil {
			return false, err.Error()
		}
		return slices.Equal(got, wantMaps), fmt.Sprintf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(wantMaps, "\n"))
	})
}

// TestLoadBalancing: a Service and its EndpointSlice in --config-dir become
// frontends and the lb4 maps; editing the file converges them, removing it
// empties them.
func TestLoadBalancing(t *testing.T) {
	t.Parallel()
	configDir := t.TempDir()
	file := filepath.Join(configDir, "web.yaml")
	writeFile(t, file, webService(nil, 8080, "10.244.0.1", "10.244.0.2"))
	a := startAgent(t, agentOptions{configDir: configDir})

	a.waitLB(t, "two backends", []string{
		"10.96.0.10:80/TCP default/web 10.244.0.1:8080/TCP/active,10.244.0.2:8080/TCP/active Done",
	}, []string{
		"BE 10.244.0.1:8080/TCP active",
		"BE 10.244.0.2:8080/TCP active",
		"FE 10.96.0.10:80/TCP count=2 qcount=0 flags=ClusterIP backends=10.244.0.1:8080/TCP,10.244.0.2:8080/TCP",
		"REV 10.96.0.10:80",
		"WILDCARD 10.96.0.10",
	})

	// One backend leaves, two come, one of them terminating; an external
	// IP adds a frontend.
	writeFile(t, file, webService([]string{"192.0.2.100"}, 8080, "10.244.0.2", "10.244.0.3", "10.244.0.4 terminating"))
	a.waitLB(t, "after the edit", []string{
		"10.96.0.10:80/TCP default/web 10.244.0.2:8080/TCP/active,10.244.0.3:8080/TCP/active,10.244.0.4:8080/TCP/terminating Done",
		"192.0.2.100:80/TCP default/web 10.244.0.2:8080/TCP/active,10.244.0.3:8080/TCP/active,10.244.0.4:8080/TCP/terminating Done",
	}, []string{
		"BE 10.244.0.2:8080/TCP active",
		"BE 10.244.0.3:8080/TCP active",
		"BE 10.244.0.4:8080/TCP terminating",
		// Terminating backends sit after the active ones (qcount).
		"FE 10.96.0.10:80/TCP count=2 qcount=1 flags=ClusterIP backends=10.244.0.2:8080/TCP,10.244.0.3:8080/TCP,10.244.0.4:8080/TCP",
		"FE 192.0.2.100:80/TCP count=2 qcount=1 flags=ExternalIP+routable backends=10.244.0.2:8080/TCP,10.244.0.3:8080/TCP,10.244.0.4:8080/TCP",
		"REV 10.96.0.10:80",
		"REV 192.0.2.100:80",
		// The cluster IP's other ports are refused; the external IP's
		// are not (it may be a real address).
		"WILDCARD 10.96.0.10",
	})

	// The file goes: so do the frontends and every map entry.
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	a.waitLB(t, "after the removal", nil, nil)
}

// TestSocketLB: with --enable-socket-lb, curl run inside the agent's cgroup
// reaches both HTTP backends of a Service through its VIP.
// TestSocketLBRetry: a --cgroup-root that is no cgroup yet leaves the
// socket LB degraded, naming the reason, and the job retries until the
// directory appears; then the programs attach there.
func TestSocketLBRetry(t *testing.T) {
	t.Parallel()
	cgroup := testenv.Cgroup(t)
	late := filepath.Join(cgroup, "late")
	t.Cleanup(func() { os.Remove(late) }) // before the parent's cleanup
	a := startAgent(t, agentOptions{configDir: t.TempDir(), flags: []string{"--enable-socket-lb", "--cgroup-root=" + late}, startsDegraded: true})

	type row struct{ Scope, Level, Message, Error string }
	attach := func() (row, error) {
		var health []row
		if err := a.dump("health", &health); err != nil {
			return row{}, err
		}
		for _, h := range health {
			if h.Scope == "socketlb.job-attach" {
				return h, nil
			}
		}
		return row{}, fmt.Errorf("no socketlb.job-attach scope in %v", health)
	}
	testenv.Eventually(t, waitTimeout, "the socket LB degraded for want of its cgroup", func() (bool, string) {
		h, err := attach()
		if err != nil {
			return false, err.Error()
		}
		return h.Level == "Degraded" && strings.Contains(h.Error, late+" is not a cgroup v2 directory"), fmt.Sprint(h)
	})
	if err := os.Mkdir(late, 0o755); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "the socket LB attached once the cgroup exists", func() (bool, string) {
		h, err := attach()
		if err != nil {
			return false, err.Error()
		}
		return h.Level == "OK" && strings.HasPrefix(h.Message, "Attached to cgroup "+late+":"), fmt.Sprint(h)
	})
	// Policy's programs, retried alike, attach too: the agent is healthy.
	a.waitHealthy(t)
}

func TestSocketLB(t *testing.T) {
	t.Parallel()
	curl := testenv.RequireProgram(t, "curl")
	cgroup := testenv.Cgroup(t)

	// Two HTTP backends on loopback addresses, on one port, each answering
	// with its own address.
	ln1, err := net.Listen("tcp4", "127.0.0.11:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln1.Addr().(*net.TCPAddr).Port
	ln2, err := net.Listen("tcp4", net.JoinHostPort("127.0.0.12", strconv.Itoa(port)))
	if err != nil {
		ln1.Close()
		t.Fatal(err)
	}
	for _, ln := range []net.Listener{ln1, ln2} {
		srv := &http.Server{
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "backend %s\n", ln.Addr())
			}),
			ReadHeaderTimeout: 5 * time.Second,
		}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
	}

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "web.yaml"), webService(nil, port, "127.0.0.11", "127.0.0.12"))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--enable-socket-lb", "--cgroup-root=" + cgroup}})

	backends := []string{fmt.Sprintf("backend 127.0.0.11:%d", port), fmt.Sprintf("backend 127.0.0.12:%d", port)}
	get := func() (string, error) {
		out, err := runInCgroup(cgroup, curl, "-sS", "--max-time", "2", "http://10.96.0.10/")
		return strings.TrimSpace(out), err
	}
	// No connection is made before the programs are attached and the maps
	// hold the Service: until then it would leave the machine for the VIP.
	testenv.Eventually(t, waitTimeout, "the socket LB attached and the frontend written", func() (bool, string) {
		var health []struct{ Scope, Message string }
		if err := a.dump("health", &health); err != nil {
			return false, err.Error()
		}
		attached := slices.ContainsFunc(health, func(h struct{ Scope, Message string }) bool {
			return h.Scope == "socketlb.job-attach" && strings.HasPrefix(h.Message, "Attached to cgroup")
		})
		fes, err := a.frontends()
		if err != nil {
			return false, err.Error()
		}
		done := len(fes) > 0 && strings.HasSuffix(fes[0], " Done")
		return attached && done, fmt.Sprintf("attached %t, frontends %v", attached, fes)
	})
	seen := map[string]int{}
	// Every connection reaches a backend, and both are used.
	for i := 0; len(seen) < 2; i++ {
		if i == 100 {
			t.Fatalf("100 connections through the VIP all reached the same backend: %v", seen)
		}
		out, err := get()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(backends, out) {
			t.Fatalf("curl http://10.96.0.10/ got %q, no backend's answer (so far: %v)", out, seen)
		}
		seen[out]++
	}
	t.Logf("answers: %v", seen)
}
