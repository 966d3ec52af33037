package ipam_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

// agentArgsEnv makes the test binary run as an agent (a hive with the ipam
// cell) with the JSON-encoded flags it holds, until it is signalled.
const agentArgsEnv = "IPAMTEST_AGENT_FLAGS"

// runAsAgent runs the test binary as an agent process when agentArgsEnv is
// set, and reports whether it did.
func runAsAgent() bool {
	raw := os.Getenv(agentArgsEnv)
	if raw == "" {
		return false
	}
	var flags []string
	if err := json.Unmarshal([]byte(raw), &flags); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h, err := newHive(log, flags)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if err := h.Run(log); err != nil {
		os.Exit(1)
	}
	os.Exit(0)
	return true
}

// TestKillNoLeak kills agent processes with SIGKILL at random moments of
// their start, over and over, with the ingress IP sometimes enabled and
// sometimes not. Whatever moment each kill hit (between an ADD and its
// record, in the middle of a plugin call, during a release), the next agent
// ends up with exactly one host-local lease per enabled kind.
func TestKillNoLeak(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.30.0.0/16"))
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	run := func(ingressOn bool) (*exec.Cmd, *bytes.Buffer) {
		flags, _ := json.Marshal(e.flags(true, ingressOn))
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), agentArgsEnv+"="+string(flags))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd, &stderr
	}

	// How long an agent process takes from exec to both IPs recorded, so
	// that the kills spread over the whole start.
	start := time.Now()
	cmd, stderr := run(true)
	for !(e.record(t, "health").IsValid() && e.record(t, "ingress").IsValid()) {
		if time.Since(start) > 20*time.Second {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("the agent process never recorded its IPs:\n%s", stderr)
		}
		time.Sleep(time.Millisecond)
	}
	full := time.Since(start)
	cmd.Process.Kill()
	cmd.Wait()
	t.Logf("an agent process records both IPs %s after exec", full)

	const kills = 40
	var recordsMissing int
	for range kills {
		ingressOn := rng.IntN(4) != 0
		// Also remove the records now and then, as if the state dir were
		// lost with the node's tmpfs: DEL before ADD still cleans up.
		if rng.IntN(8) == 0 {
			for _, k := range []string{"health", "ingress"} {
				os.Remove(filepath.Join(e.stateDir, "ipam", k+".json"))
			}
		}
		delay := time.Duration(rng.Int64N(int64(full) * 3 / 2))
		cmd, _ := run(ingressOn)
		time.Sleep(delay)
		if err := cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		// A kill between an ADD and its record leaves a lease without
		// record: the window this test is about.
		recs := 0
		for _, k := range []string{"health", "ingress"} {
			if e.record(t, k).IsValid() {
				recs++
			}
		}
		if len(e.leases(t)) > recs {
			recordsMissing++
		}
	}
	t.Logf("%d kills; %d of them left more leases than records", kills, recordsMissing)

	// The next agent sorts it all out: one lease per enabled kind.
	a := startAgent(t, e.flags(true, true))
	wantLeases(t, e, a.waitReady(health, ingress))
	a.stop()
	a = startAgent(t, e.flags(true, false))
	wantLeases(t, e, a.waitReady(health))
}

// TestPluginOutlivesAgent: a plugin call still running when its agent is
// killed keeps the IPAM lock (it inherited it), so the next agent waits for
// it to finish instead of racing with it, then releases what it took.
func TestPluginOutlivesAgent(t *testing.T) {
	e := newEnv(t)
	ipamConf := e.hostLocalIPAM("fake-ipam", "10.31.0.0/24")
	ipamConf["mode"] = "slow"
	e.writeConflist(t, "1.0.0", ipamConf)
	flags, _ := json.Marshal(e.flags(true, false))
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), agentArgsEnv+"="+string(flags))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Kill the agent while its ADD is running.
	marker := filepath.Join(e.binDir, "slow-ADD")
	kill := sync.OnceFunc(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	defer kill() // also when the wait below fails the test
	// The fake plugin's ADD takes a second after leaving its marker.
	testenv.Eventually(t, 20*time.Second, "the agent to start its ADD", func() (bool, string) {
		_, err := os.Stat(marker)
		return err == nil, fmt.Sprint(err)
	})
	kill()

	lockPath := filepath.Join(e.stateDir, "ipam", ".lock")
	f, err := os.OpenFile(lockPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err == nil {
		t.Fatal("the IPAM lock is free while the killed agent's plugin still runs")
	}

	// The next agent waits for the orphaned ADD, then DELs its lease
	// (never recorded) and takes one of its own.
	start := time.Now()
	a := startAgent(t, e.flags(true, false))
	rows := a.waitReady(health)
	if waited := time.Since(start); waited < 500*time.Millisecond {
		t.Errorf("the agent was ready after %s, before the orphaned ADD could finish", waited)
	}
	wantLeases(t, e, rows)
}

// holdLock takes the flock another process would hold on path and returns
// the function that releases it.
func holdLock(t *testing.T, path string) func() {
	t.Helper()
	f, err := os.OpenFile(filepath.Clean(path), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			f.Close()
		}
	}
	t.Cleanup(release)
	return release
}
