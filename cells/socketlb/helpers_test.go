package socketlb_test

import (
	"bufio"
	"flag"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/bpf/socklb"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/cells/socketlb"
	"github.com/apiary-net/apiary/internal/testenv"
)

// childEnv, when set, makes the test binary a client (see clientMain)
// instead of running tests: the tests re-execute themselves as clients
// placed in (or kept out of) the test cgroup.
const childEnv = "SOCKETLB_TEST_CLIENT"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(clientMain(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// clientMain connects (TCP) or sends (UDP) n times to a service address and
// prints, sorted, one line per distinct outcome with its count:
//
//	reply <what the server said> <count>
//	peer <getpeername or recvfrom source> <count>
//	error <error> <count>
func clientMain(args []string) int {
	fs := flag.NewFlagSet("client", flag.ContinueOnError)
	n := fs.Int("n", 1, "connections")
	timeout := fs.Duration("timeout", time.Second, "per connection")
	every := fs.Duration("every", 0, "pause between connections")
	if err := fs.Parse(args); err != nil || fs.NArg() != 2 {
		fmt.Fprintln(os.Stderr, "usage: client [-n N] [-timeout D] tcp|udp ADDR", err)
		return 2
	}
	proto, addr := fs.Arg(0), fs.Arg(1)
	counts := map[string]int{}
	for range *n {
		reply, peer, err := exchange(proto, addr, *timeout)
		if err != nil {
			// Errors differ in their port numbers; keep the gist.
			msg := err.Error()
			if i := strings.LastIndex(msg, ": "); i >= 0 {
				msg = msg[i+2:]
			}
			counts["error "+strings.ReplaceAll(msg, " ", "_")]++
		} else {
			counts["reply "+reply]++
			counts["peer "+peer]++
		}
		time.Sleep(*every)
	}
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		fmt.Println(k, counts[k])
	}
	return 0
}

func exchange(proto, addr string, timeout time.Duration) (reply, peer string, err error) {
	switch proto {
	case "tcp":
		c, err := net.DialTimeout("tcp", addr, timeout)
		if err != nil {
			return "", "", err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(timeout))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			return "", "", err
		}
		// RemoteAddr is what getpeername returned at connect time.
		return strings.TrimSpace(line), c.RemoteAddr().String(), nil
	case "udp":
		raddr, err := net.ResolveUDPAddr("udp", addr)
		if err != nil {
			return "", "", err
		}
		// Unconnected, so that sendmsg and recvmsg do the translation.
		laddr := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}
		if raddr.IP.To4() == nil {
			laddr = &net.UDPAddr{IP: net.IPv6loopback}
		}
		c, err := net.ListenUDP("udp", laddr)
		if err != nil {
			return "", "", err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(timeout))
		if _, err := c.WriteToUDP([]byte("hello"), raddr); err != nil {
			return "", "", err
		}
		buf := make([]byte, 512)
		n, from, err := c.ReadFromUDP(buf)
		if err != nil {
			return "", "", err
		}
		return string(buf[:n]), from.String(), nil
	}
	return "", "", fmt.Errorf("unknown protocol %q", proto)
}

// runScripts runs the script files matching pattern against hives with the
// load balancer and the socket load balancer attached to a cgroup of the
// test's own, with these extra commands:
//
//	serve tcp|udp ADDR       listen on ADDR (IPv4 or IPv6); TCP answers
//	                         every connection with ADDR, UDP every datagram
//	client [-outside] [-n N] [-timeout D] [-every D] tcp|udp ADDR
//	                         run a client process in the cgroup (or, with
//	                         -outside, out of it); see clientMain
//	agent-env KEY=VALUE      set an environment variable of the agent,
//	                         read by the next hive (e.g. after restart)
//	cgroup/progs             print how many programs each hook has on the
//	                         cgroup
//	bpf/pins                 print the names of the maps pinned in
//	                         --bpf-pin-dir, sorted
//
// The hive's flags come from the environment (APIARY_ENABLE_SOCKET_LB,
// APIARY_CGROUP_ROOT), so that agent-env and restart can change them.
func runScripts(t *testing.T, pattern string) {
	testenv.RequireRoot(t)
	cg := testenv.Cgroup(t)
	t.Setenv("APIARY_CGROUP_ROOT", cg)
	t.Setenv("APIARY_ENABLE_SOCKET_LB", "true")

	var mu sync.Mutex
	var closers []func()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range closers {
			c()
		}
	})
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}

	cmd := func(c script.Cmd) func(func() (string, error)) script.Cmd {
		return func(func() (string, error)) script.Cmd { return c }
	}
	serve := script.Command(
		script.CmdUsage{Summary: "Serve ADDR", Args: "tcp|udp addr"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 2 {
				return nil, script.ErrUsage
			}
			c, err := startServer(args[0], args[1])
			if err != nil {
				return nil, err
			}
			mu.Lock()
			closers = append(closers, c)
			mu.Unlock()
			return nil, nil
		})
	client := script.Command(
		script.CmdUsage{Async: true, Summary: "Run a client process in the cgroup", Args: "[-outside] [-n N] [-timeout D] [-every D] tcp|udp addr"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			outside := len(args) > 0 && args[0] == "-outside"
			if outside {
				args = args[1:]
			}
			c := exec.CommandContext(s.Context(), self, args...)
			c.Env = append(os.Environ(), childEnv+"=1")
			var stdout, stderr strings.Builder
			c.Stdout, c.Stderr = &stdout, &stderr
			if !outside {
				f, err := os.Open(cg)
				if err != nil {
					return nil, err
				}
				defer f.Close()
				// The child starts in the cgroup: no connection is
				// made before it is there.
				c.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
			}
			if err := c.Start(); err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) {
				err := c.Wait()
				return stdout.String(), stderr.String(), err
			}, nil
		})
	agentEnv := script.Command(
		script.CmdUsage{Summary: "Set an environment variable for the next hive", Args: "key=value"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 1 {
				return nil, script.ErrUsage
			}
			k, v, ok := strings.Cut(args[0], "=")
			if !ok {
				return nil, script.ErrUsage
			}
			return nil, os.Setenv(k, v) // restored by t.Setenv's cleanup
		})
	progs := script.Command(
		script.CmdUsage{Summary: "Count the programs on each hook of the cgroup"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			f, err := os.Open(cg)
			if err != nil {
				return nil, err
			}
			defer f.Close()
			var b strings.Builder
			for _, h := range socklb.Hooks {
				res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: h.Attach})
				if err != nil {
					return nil, fmt.Errorf("query %s: %w", h.Name, err)
				}
				fmt.Fprintf(&b, "%s %d\n", h.Name, len(res.Programs))
			}
			return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
		})

	pins := cell.Provide(func(dir bpffs.PinDir) hive.ScriptCmdsOut {
		return hive.NewScriptCmds(map[string]script.Cmd{"bpf/pins": script.Command(
			script.CmdUsage{Summary: "List the maps pinned in --bpf-pin-dir"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				entries, err := os.ReadDir(string(dir))
				if err != nil {
					return nil, err
				}
				var b strings.Builder
				for _, e := range entries {
					if !e.IsDir() {
						fmt.Fprintln(&b, e.Name())
					}
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			})})
	})

	apiarytest.Run(t, pattern, func(fakeClient cell.Cell) []cell.Cell {
		return []cell.Cell{infra.Cell, fakeClient, lb.Cell, socketlb.Cell, pins}
	},
		apiarytest.WithCommand("serve", cmd(serve)),
		apiarytest.WithCommand("client", cmd(client)),
		apiarytest.WithCommand("agent-env", cmd(agentEnv)),
		apiarytest.WithCommand("cgroup/progs", cmd(progs)),
	)
}

// startServer listens on addr (IPv4 or IPv6) and answers with addr, until
// the returned function is called.
func startServer(proto, addr string) (func(), error) {
	switch proto {
	case "tcp":
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, err
		}
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				fmt.Fprintln(c, addr)
				c.Close()
			}
		}()
		return func() { l.Close() }, nil
	case "udp":
		ua, err := net.ResolveUDPAddr("udp", addr)
		if err != nil {
			return nil, err
		}
		c, err := net.ListenUDP("udp", ua)
		if err != nil {
			return nil, err
		}
		go func() {
			buf := make([]byte, 512)
			for {
				_, from, err := c.ReadFromUDP(buf)
				if err != nil {
					return
				}
				c.WriteToUDP([]byte(addr), from)
			}
		}()
		return func() { c.Close() }, nil
	}
	return nil, fmt.Errorf("unknown protocol %q", proto)
}

// addLoopback adds the IPv6 addresses addrs to lo for the test, for
// backends to listen on: ::1 is the only IPv6 loopback address.
func addLoopback(t *testing.T, addrs ...string) {
	ip := testenv.RequireProgram(t, "ip", "/sbin", "/usr/sbin")
	for _, a := range addrs {
		out, err := exec.Command(ip, "-6", "addr", "add", a+"/128", "dev", "lo", "nodad").CombinedOutput()
		if err != nil {
			t.Fatalf("add %s to lo: %s: %s", a, err, out)
		}
		t.Cleanup(func() {
			if out, err := exec.Command(ip, "-6", "addr", "del", a+"/128", "dev", "lo").CombinedOutput(); err != nil {
				t.Errorf("remove %s from lo: %s: %s", a, err, out)
			}
		})
	}
}
