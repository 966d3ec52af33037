package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/apiary-net/apiary/cells/policy"
)

// fakeVerdicts is an agent's verdict stream: it answers GET
// /policy/verdicts with lines, then ends the stream, and remembers the
// queries it was sent.
type fakeVerdicts struct {
	*httptest.Server
	mu      sync.Mutex
	queries []url.Values
}

func newFakeVerdicts(t *testing.T, lines ...string) *fakeVerdicts {
	t.Helper()
	f := &fakeVerdicts{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.queries = append(f.queries, r.URL.Query())
		f.mu.Unlock()
		if r.URL.Path != policy.VerdictsPath {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/x-ndjson")
		for _, l := range lines {
			w.Write([]byte(l + "\n"))
		}
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeVerdicts) query(t *testing.T) url.Values {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.queries, 1, "requests")
	return f.queries[0]
}

// runMonitor runs `apiary monitor args...` in-process.
func runMonitor(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	var out, errOut bytes.Buffer
	root := newRootCmd(&out, &errOut)
	root.SetArgs(append([]string{"monitor"}, args...))
	err = root.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}

// unsetServerEnv keeps the environment's agent out of a test.
func unsetServerEnv(t *testing.T) {
	setenv(t, "APIARY_SERVER", "")
	setenv(t, "APIARY_API_ADDR", "")
}

func jsonLine(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

var (
	deniedWeb = policy.Verdict{
		Time:     time.Date(2026, 11, 24, 21, 3, 4, 123456789, time.UTC),
		Endpoint: "default/web", Direction: "egress",
		Src: "10.0.0.5:43210", Dst: "192.0.2.10:443", Proto: "TCP",
		RemoteIdentity: 16777217, RemoteLabels: []string{"cidr:192.0.2.0/24", "reserved:world"},
		Verdict: policy.VerdictDenied, Policy: "cnp/default/deny-web", Reason: policy.ReasonPolicy,
	}
	allowedDB = policy.Verdict{
		Time:     time.Date(2026, 11, 24, 21, 3, 5, 0, time.FixedZone("CET", 3600)),
		Endpoint: "default/db", Direction: "ingress",
		Src: "10.0.0.7:51000", Dst: "10.0.0.6:5432", Proto: "TCP",
		RemoteIdentity: 4, RemoteLabels: []string{"reserved:host"},
		Verdict: policy.VerdictAllowed, Reason: policy.ReasonNoPolicy,
	}
	auditedDNS = policy.Verdict{
		Time:     time.Date(2026, 11, 24, 21, 3, 6, 1e6, time.UTC),
		Endpoint: "kube-system/coredns", Direction: "egress",
		Src: "10.0.0.9:0", Dst: "8.8.8.8:53", Proto: "UDP",
		RemoteIdentity: 2,
		Verdict:        policy.VerdictAudited, Reason: policy.ReasonDefaultDeny,
	}
)

func TestMonitorOutput(t *testing.T) {
	unsetServerEnv(t)
	lines := []string{
		jsonLine(t, deniedWeb),
		jsonLine(t, policy.VerdictsDropped{Dropped: 120}),
		jsonLine(t, allowedDB),
		jsonLine(t, policy.VerdictsLost{Lost: 7}),
		`{"someday":"a kind of line this client does not know"}`,
		jsonLine(t, auditedDNS),
	}
	tests := []struct {
		name       string
		args       []string
		wantStdout string
		wantStderr string
	}{
		{
			name: "text",
			wantStdout: "2026-11-24T21:03:04.123Z default/web egress 10.0.0.5:43210 -> 192.0.2.10:443 TCP identity=16777217 [cidr:192.0.2.0/24,reserved:world] DENIED by cnp/default/deny-web\n" +
				"2026-11-24T20:03:05.000Z default/db ingress 10.0.0.7:51000 -> 10.0.0.6:5432 TCP identity=4 [reserved:host] ALLOWED (no policy)\n" +
				"2026-11-24T21:03:06.001Z kube-system/coredns egress 10.0.0.9:0 -> 8.8.8.8:53 UDP identity=2 AUDITED (default deny)\n",
			wantStderr: "monitor: 120 verdicts dropped: this client read too slowly\n" +
				"monitor: 7 verdicts lost by the datapath since monitoring started (its event buffer was full)\n",
		},
		{
			name:       "json",
			args:       []string{"-o", "json"},
			wantStdout: strings.Join(lines, "\n") + "\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newFakeVerdicts(t, lines...)
			stdout, stderr, err := runMonitor(t.Context(), append(tt.args, "--server", srv.URL)...)
			// The fake agent ends the stream after its lines.
			require.ErrorContains(t, err, "verdict stream from "+srv.URL+" ended (agent stopped?)")
			assert.Equal(t, tt.wantStdout, stdout)
			assert.Equal(t, tt.wantStderr, stderr)
		})
	}
}

func TestMonitorQuery(t *testing.T) {
	tests := []struct {
		name string
		args []string
		// apiAddr is APIARY_API_ADDR, "" for none; the server is then
		// found through it, otherwise given with --server.
		apiAddr bool
		want    url.Values
	}{
		{name: "no filter", want: url.Values{}},
		{
			name: "verdicts",
			args: []string{"--verdict", "denied", "--verdict", "audited,Allowed"},
			want: url.Values{"verdict": {"denied", "audited", "allowed"}},
		},
		{
			name: "every filter",
			args: []string{"--verdict=denied", "--endpoint", "default/web", "--policy", "cnp/default/deny-web"},
			want: url.Values{"verdict": {"denied"}, "endpoint": {"default/web"}, "policy": {"cnp/default/deny-web"}},
		},
		{
			name:    "agent found through APIARY_API_ADDR",
			args:    []string{"--endpoint", "default/db"},
			apiAddr: true,
			want:    url.Values{"endpoint": {"default/db"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			unsetServerEnv(t)
			srv := newFakeVerdicts(t)
			args := tt.args
			if tt.apiAddr {
				t.Setenv("APIARY_API_ADDR", srv.Listener.Addr().String())
			} else {
				args = append(args, "--server", srv.URL)
			}
			_, _, err := runMonitor(t.Context(), args...)
			require.ErrorContains(t, err, "ended (agent stopped?)")
			assert.Equal(t, tt.want, srv.query(t))
		})
	}
}

func TestMonitorErrors(t *testing.T) {
	unsetServerEnv(t)
	answer := func(code int, contentType, body string) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", contentType)
			w.WriteHeader(code)
			w.Write([]byte(body))
		}))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	// An address nothing listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := "http://" + ln.Addr().String()
	ln.Close()

	tests := []struct {
		name   string
		server string
		args   []string
		want   string
	}{
		{
			name:   "unreachable",
			server: closed,
			want:   "cannot reach the agent at " + closed + ": dial tcp " + closed[len("http://"):] + ": connect: connection refused (is `apiary agent` running? see --server)",
		},
		{
			name:   "refused",
			server: answer(400, "application/json", `{"error":"invalid ?verdict=\"x\": want allowed, denied or audited"}`),
			want:   `the agent refused the verdict stream: invalid ?verdict="x": want allowed, denied or audited`,
		},
		{
			name:   "agent without the route",
			server: answer(404, "application/json", `{"error":"no such path"}`),
			want:   "does not serve /policy/verdicts",
		},
		{
			name:   "not the API",
			server: answer(502, "text/html", "<html>bad gateway</html>"),
			want:   "GET /policy/verdicts: 502 Bad Gateway",
		},
		{
			name:   "broken stream",
			server: answer(200, "application/x-ndjson", "{not json\n"),
			want:   "broken verdict stream from",
		},
		{name: "bad verdict", server: closed, args: []string{"--verdict", "denied,refused"}, want: `--verdict "refused": want allowed, denied or audited`},
		{name: "bad output", server: closed, args: []string{"-o", "yaml"}, want: `-o "yaml": want text or json`},
		{name: "bad server", server: "127.0.0.1:9234", want: `--server "127.0.0.1:9234": want a URL such as http://127.0.0.1:9234`},
		{name: "arguments", server: closed, args: []string{"default/web"}, want: `unknown command "default/web"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stdout, _, err := runMonitor(t.Context(), append(tt.args, "--server", tt.server)...)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
			assert.NotContains(t, err.Error(), "\n", "one line")
			assert.Empty(t, stdout)
		})
	}
}

// notifyWriter is a writer that tests can read while a command writes to
// it; written is signalled after each write.
type notifyWriter struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	written chan struct{}
}

func newNotifyWriter() *notifyWriter { return &notifyWriter{written: make(chan struct{}, 1)} }

func (w *notifyWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, err := w.buf.Write(p)
	select {
	case w.written <- struct{}{}:
	default:
	}
	return n, err
}

func (w *notifyWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// TestMonitorInterrupt stops a stream with a signal, as Ctrl-C does: no
// error, and the request is ended.
func TestMonitorInterrupt(t *testing.T) {
	unsetServerEnv(t)
	first := jsonLine(t, deniedWeb) + "\n"
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			gone := make(chan struct{})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/x-ndjson")
				w.Write([]byte(first))
				http.NewResponseController(w).Flush()
				<-r.Context().Done()
				close(gone)
			}))
			defer srv.Close()

			stdout, stderr := newNotifyWriter(), newNotifyWriter()
			done := make(chan error, 1)
			go func() {
				root := newRootCmd(stdout, stderr)
				root.SetArgs([]string{"monitor", "--server", srv.URL})
				done <- root.Execute()
			}()
			// A printed verdict: the command is connected, and has listened
			// for signals since before it connected, so the signal stops it
			// rather than the test.
			select {
			case <-stdout.written:
			case err := <-done:
				t.Fatalf("monitor ended before printing a verdict: %v", err)
			case <-time.After(10 * time.Second):
				t.Fatal("monitor printed no verdict")
			}
			require.NoError(t, syscall.Kill(os.Getpid(), sig))
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatalf("monitor still running after %s", sig)
			}
			assert.Contains(t, stdout.String(), "DENIED by cnp/default/deny-web")
			assert.Empty(t, stderr.String())
			select {
			case <-gone:
			case <-time.After(10 * time.Second):
				t.Fatal("the request was not ended")
			}
		})
	}
}

func TestMonitorFormatVerdict(t *testing.T) {
	const prefix = "2026-01-02T03:04:05.000Z ns/pod ingress 10.0.0.1:1 -> 10.0.0.2:80 TCP identity=42"
	long := []string{
		"k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=default",
		"k8s:io.cilium.k8s.policy.serviceaccount=frontend", "k8s:tier=web",
	}
	tests := []struct {
		name                    string
		verdict, policy, reason string
		labels                  []string
		want                    string
	}{
		{name: "by a policy", verdict: "denied", policy: "ccnp/deny-all", reason: "policy", want: prefix + " DENIED by ccnp/deny-all"},
		{name: "default deny", verdict: "denied", reason: "default deny", want: prefix + " DENIED (default deny)"},
		{name: "no policy", verdict: "allowed", reason: "no policy", want: prefix + " ALLOWED (no policy)"},
		{name: "audited", verdict: "audited", policy: "cnp/ns/x", reason: "policy", want: prefix + " AUDITED by cnp/ns/x"},
		{name: "nothing says", verdict: "denied", want: prefix + " DENIED (no policy)"},
		{name: "entry of an unnamed policy", verdict: "denied", reason: "policy", want: prefix + " DENIED (policy)"},
		{name: "policy and another reason", verdict: "denied", policy: "cnp/ns/x", reason: "default deny", want: prefix + " DENIED by cnp/ns/x (default deny)"},
		{name: "short labels", verdict: "denied", reason: "default deny", labels: []string{"reserved:world"},
			want: prefix + " [reserved:world] DENIED (default deny)"},
		{name: "long labels cut short", verdict: "denied", reason: "default deny", labels: long,
			want: prefix + " [k8s:app=frontend,k8s:io.kubernetes.pod.namespace=default,…+2] DENIED (default deny)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := &policy.Verdict{
				Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Endpoint: "ns/pod", Direction: "ingress",
				Src: "10.0.0.1:1", Dst: "10.0.0.2:80", Proto: "TCP", RemoteIdentity: 42, RemoteLabels: tt.labels,
				Verdict: tt.verdict, Policy: tt.policy, Reason: tt.reason,
			}
			got := formatVerdict(v)
			assert.Equal(t, tt.want, got)
			assert.NotContains(t, got, "\n")
		})
	}
	t.Run("empty fields", func(t *testing.T) {
		assert.Equal(t, "- - - - -> - - identity=0 - (no policy)", formatVerdict(&policy.Verdict{}))
	})
}

func TestMonitorHelp(t *testing.T) {
	stdout, _, err := runMonitor(t.Context(), "--help")
	require.NoError(t, err)
	for _, want := range []string{
		"apiary monitor --verdict denied", "apiary db show policy-entries", "Why was this connection refused?",
		"--server string", "APIARY_SERVER", "APIARY_API_ADDR",
		"-o, --output string", `(default "text")`, "--verdict strings", "--endpoint string", "--policy string",
		"default deny", "no policy", "dropped", "lost",
	} {
		assert.Contains(t, stdout, want)
	}
}
