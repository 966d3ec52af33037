package policy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// waitFor bounds every wait of these tests.
const waitFor = 10 * time.Second

// newMonitorServer serves m's verdicts the way the API does (the route's
// pattern in a ServeMux). interval replaces the once-a-second checks when
// non-zero; smallBuffers shrinks the server's socket send buffers so that a
// client that does not read blocks the stream soon. The server is closed,
// and m checked to have no subscriber left, when the test ends.
func newMonitorServer(t *testing.T, m *Monitor, interval time.Duration, smallBuffers bool) *httptest.Server {
	t.Helper()
	out := newMonitorHandler(m)
	if interval != 0 {
		out.Handler.Handler.(*monitorHandler).interval = interval
	}
	mux := http.NewServeMux()
	mux.Handle(out.Handler.Path, out.Handler.Handler)
	srv := httptest.NewUnstartedServer(mux)
	if smallBuffers {
		srv.Listener = smallBufferListener{srv.Listener}
	}
	srv.Start()
	// Cleanups run last to first: the streams a test opened after this
	// are closed by then, so Close does not wait for them.
	t.Cleanup(func() {
		srv.Close()
		requireNoSubscribers(t, m)
	})
	return srv
}

// smallBufferListener gives accepted connections a small send buffer.
type smallBufferListener struct{ net.Listener }

func (l smallBufferListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		if err := tc.SetWriteBuffer(4096); err != nil {
			c.Close()
			return nil, fmt.Errorf("set send buffer: %w", err)
		}
	}
	return c, err
}

// smallBufferClient is an HTTP client whose connections have a receive
// buffer of a fixed size (64 KiB, no autotuning), so that when it does not
// read, few verdicts are in flight besides the stream's own buffer.
func smallBufferClient(t *testing.T) *http.Client {
	t.Helper()
	transport := &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			if err := c.(*net.TCPConn).SetReadBuffer(64 << 10); err != nil {
				c.Close()
				return nil, fmt.Errorf("set receive buffer: %w", err)
			}
			return c, nil
		},
	}
	t.Cleanup(transport.CloseIdleConnections)
	return &http.Client{Transport: transport}
}

func requireNoSubscribers(t *testing.T, m *Monitor) {
	t.Helper()
	require.Eventually(t, func() bool { return m.Subscribers() == 0 }, waitFor, 5*time.Millisecond,
		"the streams' subscriptions were not cancelled")
}

// stream is an open GET /policy/verdicts.
type stream struct {
	resp *http.Response
	body io.ReadCloser
	// close ends the request and waits for the reader, if any.
	close func()
}

// openStream requests the verdicts with query and checks the answer is a
// stream; the request ends when the test does.
func openStream(t *testing.T, client *http.Client, srv *httptest.Server, query string) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+VerdictsPath+"?"+query, nil)
	require.NoError(t, err)
	resp, err := client.Do(req)
	if err != nil {
		cancel()
		require.NoError(t, err)
	}
	s := &stream{resp: resp, body: resp.Body}
	s.close = func() {
		cancel()
		resp.Body.Close()
	}
	t.Cleanup(func() { s.close() })
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "application/x-ndjson", resp.Header.Get("Content-Type"))
	return s
}

// lines reads the stream's lines in a goroutine, which close stops.
func (s *stream) lines(t *testing.T, buffer int) <-chan string {
	t.Helper()
	ch := make(chan string, buffer)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(ch)
		sc := bufio.NewScanner(s.body)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}()
	closeBody := s.close
	s.close = func() {
		closeBody()
		// Unblock the reader if the test stopped taking lines.
		for range ch {
		}
		<-done
	}
	return ch
}

// next returns the next line, failing the test after waitFor.
func next(t *testing.T, lines <-chan string) string {
	t.Helper()
	select {
	case line, ok := <-lines:
		require.True(t, ok, "stream ended")
		return line
	case <-time.After(waitFor):
		t.Fatalf("no line within %s", waitFor)
		return ""
	}
}

// line is any line of the stream.
type line struct {
	Verdict
	Dropped *uint64 `json:"dropped"`
	Lost    *uint64 `json:"lost"`
}

func decodeLine(t *testing.T, s string) line {
	t.Helper()
	var l line
	require.NoError(t, json.Unmarshal([]byte(s), &l), "line %q", s)
	return l
}

// verdict returns a verdict with i as its remote identity, to tell them
// apart.
func verdict(i int, endpoint, v, policy string) Verdict {
	reason := ReasonPolicy
	if policy == "" {
		reason = ReasonDefaultDeny
	}
	return Verdict{
		Time:           time.Date(2026, 11, 24, 21, 3, 4, 123e6, time.UTC).Add(time.Duration(i) * time.Millisecond),
		Endpoint:       endpoint,
		Direction:      "egress",
		Src:            "10.0.0.5:43210",
		Dst:            "192.0.2.10:443",
		Proto:          "TCP",
		RemoteIdentity: uint32(i),
		RemoteLabels:   []string{"reserved:world"},
		Verdict:        v,
		Policy:         policy,
		Reason:         reason,
	}
}

func TestMonitorHandlerStream(t *testing.T) {
	const web, db = "default/web", "default/db"
	const allowWeb, denyWeb = "cnp/default/allow-web", "cnp/default/deny-web"
	published := []Verdict{
		verdict(1, web, VerdictAllowed, allowWeb),
		verdict(2, web, VerdictDenied, denyWeb),
		verdict(3, db, VerdictDenied, ""),
		verdict(4, db, VerdictAudited, denyWeb),
		verdict(5, web, VerdictDenied, ""),
		verdict(6, db, VerdictAllowed, allowWeb),
		verdict(7, web, VerdictDenied, denyWeb),
	}
	tests := []struct {
		name  string
		query string
		want  []int // the identities of the verdicts streamed, in order
	}{
		{"everything", "", []int{1, 2, 3, 4, 5, 6, 7}},
		{"verdict", "verdict=denied", []int{2, 3, 5, 7}},
		{"verdicts comma-separated", "verdict=audited,denied", []int{2, 3, 4, 5, 7}},
		{"verdict repeated", "verdict=allowed&verdict=DENIED", []int{1, 2, 3, 5, 6, 7}},
		{"endpoint", "endpoint=default/web", []int{1, 2, 5, 7}},
		{"policy", "policy=cnp/default/deny-web", []int{2, 4, 7}},
		{"policies", "policy=cnp/default/deny-web&policy=cnp/default/allow-web", []int{1, 2, 4, 6, 7}},
		{"all of them", "verdict=denied&endpoint=default/web&policy=cnp/default/deny-web", []int{2, 7}},
	}
	m := NewMonitor()
	srv := newMonitorServer(t, m, 0, false)
	m.Publish(verdict(0, web, VerdictDenied, denyWeb)) // before any stream: nobody sees it
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openStream(t, srv.Client(), srv, tt.query)
			defer s.close()
			lines := s.lines(t, len(published))
			// The answer comes once the stream is subscribed: everything
			// published now is streamed (or filtered out).
			require.Equal(t, 1, m.Subscribers())
			for _, v := range published {
				m.Publish(v)
			}
			// Every case wants the last verdict, so a verdict the filter
			// should have dropped would come before it.
			var got []int
			for range tt.want {
				l := decodeLine(t, next(t, lines))
				require.Nil(t, l.Dropped)
				require.Nil(t, l.Lost)
				require.Equal(t, published[l.RemoteIdentity-1], l.Verdict, "the verdict as published")
				got = append(got, int(l.RemoteIdentity))
			}
			assert.Equal(t, tt.want, got)
		})
		requireNoSubscribers(t, m)
	}
}

func TestMonitorHandlerBadRequest(t *testing.T) {
	tests := []struct {
		name, method, query string
		code                int
		want                string
	}{
		{"unknown verdict", "", "verdict=refused", 400, `invalid ?verdict="refused": want allowed, denied or audited`},
		{"one bad of a list", "", "verdict=denied,nope", 400, `invalid ?verdict="denied,nope"`},
		{"bad repeated", "", "verdict=denied&verdict=nope", 400, `invalid ?verdict="nope"`},
		{"empty verdict", "", "verdict=", 400, `invalid ?verdict=""`},
		{"empty endpoint", "", "endpoint=", 400, `invalid ?endpoint=: empty`},
		{"empty policy", "", "policy=&policy=x", 400, `invalid ?policy=: empty`},
		{"unknown parameter", "", "verdicts=denied", 400, `unknown parameter ?verdicts: want verdict, endpoint, policy or type`},
		{"HEAD", http.MethodHead, "", 405, ""},
	}
	m := NewMonitor()
	srv := newMonitorServer(t, m, 0, false)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), cmpOr(tt.method, http.MethodGet), srv.URL+VerdictsPath+"?"+tt.query, nil)
			require.NoError(t, err)
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.Equal(t, tt.code, resp.StatusCode, "body: %s", body)
			require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			if tt.method == http.MethodHead {
				assert.Equal(t, http.MethodGet, resp.Header.Get("Allow"))
				return
			}
			var e map[string]string
			require.NoError(t, json.Unmarshal(body, &e), "body: %s", body)
			assert.Len(t, e, 1, "only an error: %s", body)
			assert.Contains(t, e["error"], tt.want)
			assert.Zero(t, m.Subscribers(), "subscribed although refused")
		})
	}
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// TestMonitorHandlerSlowClient publishes many verdicts while one client
// does not read: it is told how many it lost, and a client that reads
// gets every verdict.
func TestMonitorHandlerSlowClient(t *testing.T) {
	const batch, batches = monitorBuffer / 2, 20
	const total = batch * batches
	m := NewMonitor()
	srv := newMonitorServer(t, m, 0, true)
	slow := openStream(t, smallBufferClient(t), srv, "")
	reader := openStream(t, srv.Client(), srv, "")
	read := reader.lines(t, batch)
	require.Equal(t, 2, m.Subscribers())

	// Batches no larger than a stream's buffer, each read before the
	// next: the reader keeps up, the slow stream fills and drops.
	for b := range batches {
		for i := range batch {
			m.Publish(verdict(b*batch+i+1, "default/web", VerdictDenied, ""))
		}
		for i := range batch {
			l := decodeLine(t, next(t, read))
			require.Nil(t, l.Dropped, "the reading client dropped verdicts")
			require.Equal(t, uint32(b*batch+i+1), l.RemoteIdentity, "the reading client's verdicts in order")
		}
	}

	// The slow client now reads what it has: verdicts, in order, and a
	// drop count that accounts for every other one.
	lines := slow.lines(t, 0)
	var verdicts, dropped uint64
	last := uint32(0)
	for verdicts+dropped < total {
		l := decodeLine(t, next(t, lines))
		switch {
		case l.Dropped != nil:
			require.Greater(t, *l.Dropped, dropped, "drop counts are totals")
			dropped = *l.Dropped
		case l.Lost != nil:
			t.Fatalf("unexpected lost line: %+v", l)
		default:
			require.Greater(t, l.RemoteIdentity, last, "the slow client's verdicts in order")
			last = l.RemoteIdentity
			verdicts++
		}
	}
	t.Logf("slow client: %d verdicts, %d dropped", verdicts, dropped)
	assert.Positive(t, dropped)
	assert.Equal(t, uint64(total), verdicts+dropped)
}

// TestMonitorHandlerLost reports the datapath's lost events that happen
// while a stream is open, as totals since the stream started.
func TestMonitorHandlerLost(t *testing.T) {
	m := NewMonitor()
	m.lost.Store(5) // before the stream: not its business
	srv := newMonitorServer(t, m, 5*time.Millisecond, false)
	lines := openStream(t, srv.Client(), srv, "").lines(t, 0)

	steps := []struct {
		name string
		do   func()
		want uint64
	}{
		{"grows", func() { m.lost.Add(3) }, 3},
		{"grows again", func() { m.lost.Add(2) }, 5},
		{"counters reset", func() { m.lost.Store(1) }, 6},
	}
	for _, step := range steps {
		step.do()
		l := decodeLine(t, next(t, lines))
		require.NotNil(t, l.Lost, "%s: line %+v", step.name, l)
		require.Equal(t, step.want, *l.Lost, step.name)
	}
}

// TestMonitorHandlerUnsubscribes ends streams in the ways a client goes
// away: each ends its subscription.
func TestMonitorHandlerUnsubscribes(t *testing.T) {
	tests := []struct {
		name string
		// publish is how many verdicts are published before the client
		// goes away without reading them.
		publish int
		read    bool
	}{
		{name: "idle stream"},
		{name: "while reading", read: true, publish: 10},
		{name: "with a full buffer", publish: 4 * monitorBuffer},
	}
	m := NewMonitor()
	srv := newMonitorServer(t, m, 0, true)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openStream(t, smallBufferClient(t), srv, "")
			require.Equal(t, 1, m.Subscribers())
			var lines <-chan string
			if tt.read {
				lines = s.lines(t, tt.publish)
			}
			for i := range tt.publish {
				m.Publish(verdict(i+1, "default/web", VerdictAllowed, "cnp/default/web"))
			}
			if tt.read {
				for range tt.publish {
					next(t, lines)
				}
			}
			s.close()
			requireNoSubscribers(t, m)
		})
	}
}

// TestMonitorHandlerRoute checks the route's pattern: GET, listed with its
// method like the API's own routes.
func TestMonitorHandlerRoute(t *testing.T) {
	out := newMonitorHandler(NewMonitor())
	assert.Equal(t, "GET "+VerdictsPath, out.Handler.Path)
}
