package hubble

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	observerpb "github.com/cilium/cilium/api/v1/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// flowAt is a flow at t0 plus i seconds to port i.
func flowAt(i int) *flowpb.Flow {
	return &flowpb.Flow{Time: timestamppb.New(t0.Add(time.Duration(i) * time.Second)),
		L4: &flowpb.Layer4{Protocol: &flowpb.Layer4_TCP{TCP: &flowpb.TCP{DestinationPort: uint32(i)}}}}
}

func portOf(f *flowpb.Flow) int { return int(f.GetL4().GetTCP().GetDestinationPort()) }

func TestRing(t *testing.T) {
	r := newRing(4)
	for i := range 6 {
		r.write(flowAt(i))
	}
	past, next := r.snapshot()
	if len(past) != 4 || portOf(past[0]) != 2 || portOf(past[3]) != 5 || next != 6 {
		t.Fatalf("snapshot: %v next %d", past, next)
	}
	flows, lost, n, _ := r.readFrom(0, 3)
	if lost != 2 || len(flows) != 3 || portOf(flows[0]) != 2 || n != 5 {
		t.Fatalf("readFrom(0, 3): %v lost %d next %d", flows, lost, n)
	}
	if stored, seen := r.stats(); stored != 4 || seen != 6 {
		t.Fatalf("stats: %d %d", stored, seen)
	}
}

// serve runs the observer over r on a Unix socket and returns a client.
func serve(t *testing.T, r *ring) observerpb.ObserverClient {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "hubble.sock")
	ln, err := listenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	observerpb.RegisterObserverServer(srv, &observer{ring: r, nodeName: "n", started: time.Now()})
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return observerpb.NewObserverClient(conn)
}

func recvAll(t *testing.T, s grpc.ServerStreamingClient[observerpb.GetFlowsResponse]) ([]int, error) {
	var ports []int
	for {
		resp, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return ports, nil
		}
		if err != nil {
			return ports, err
		}
		ports = append(ports, portOf(resp.GetFlow()))
	}
}

func TestGetFlows(t *testing.T) {
	r := newRing(100)
	for i := 1; i <= 10; i++ {
		r.write(flowAt(i))
	}
	c := serve(t, r)
	ts := func(i int) *timestamppb.Timestamp { return timestamppb.New(t0.Add(time.Duration(i) * time.Second)) }
	for _, tc := range []struct {
		name string
		req  *observerpb.GetFlowsRequest
		want []int
		code codes.Code
	}{
		{"all", &observerpb.GetFlowsRequest{}, []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, codes.OK},
		{"last 3", &observerpb.GetFlowsRequest{Number: 3}, []int{8, 9, 10}, codes.OK},
		{"first 2", &observerpb.GetFlowsRequest{Number: 2, First: true}, []int{1, 2}, codes.OK},
		{"since until", &observerpb.GetFlowsRequest{Since: ts(4), Until: ts(6)}, []int{4, 5, 6}, codes.OK},
		{"last 2 of a filter", &observerpb.GetFlowsRequest{Number: 2,
			Whitelist: []*flowpb.FlowFilter{{DestinationPort: []string{"3", "5", "7"}}}}, []int{5, 7}, codes.OK},
		{"deny list", &observerpb.GetFlowsRequest{Number: 3,
			Blacklist: []*flowpb.FlowFilter{{DestinationPort: []string{"10"}}}}, []int{7, 8, 9}, codes.OK},
		{"bad filter", &observerpb.GetFlowsRequest{Whitelist: []*flowpb.FlowFilter{{DestinationIp: []string{"x"}}}}, nil, codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := c.GetFlows(t.Context(), tc.req)
			if err != nil {
				t.Fatal(err)
			}
			got, err := recvAll(t, s)
			if status.Code(err) != tc.code {
				t.Fatalf("error %v, want %v", err, tc.code)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("got %v, want %v", got, tc.want)
				}
			}
		})
	}

	t.Run("follow", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		s, err := c.GetFlows(ctx, &observerpb.GetFlowsRequest{Number: 1, Follow: true})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := s.Recv()
		if err != nil || portOf(resp.GetFlow()) != 10 {
			t.Fatalf("first: %v %v", resp, err)
		}
		r.write(flowAt(11))
		resp, err = s.Recv()
		if err != nil || portOf(resp.GetFlow()) != 11 {
			t.Fatalf("followed: %v %v", resp, err)
		}
	})

	t.Run("status", func(t *testing.T) {
		st, err := c.ServerStatus(t.Context(), &observerpb.ServerStatusRequest{})
		if err != nil || st.GetMaxFlows() != 100 || st.GetNumFlows() != 11 || st.GetSeenFlows() != 11 {
			t.Fatalf("%v %v", st, err)
		}
	})

	t.Run("unimplemented", func(t *testing.T) {
		_, err := c.GetNodes(t.Context(), &observerpb.GetNodesRequest{})
		if status.Code(err) != codes.Unimplemented {
			t.Fatalf("GetNodes: %v", err)
		}
	})
}

func TestListenUnix(t *testing.T) {
	path := filepath.Join(t.TempDir(), "file")
	first, err := listenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	// A live socket is not taken away...
	if _, err := listenUnix(path); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("a live socket: %v", err)
	}
	// ...a stale one (its listener gone, the file left) is replaced...
	first.(*net.UnixListener).SetUnlinkOnClose(false)
	first.Close()
	ln, err := listenUnix(path)
	if err != nil {
		t.Fatalf("stale socket: %v", err)
	}
	ln.Close()
	// ...a regular file is not.
	regular := filepath.Join(t.TempDir(), "regular")
	if err := writeRegular(regular); err != nil {
		t.Fatal(err)
	}
	if _, err := listenUnix(regular); err == nil {
		t.Fatal("listenUnix replaced a regular file")
	}
}

func writeRegular(path string) error { return os.WriteFile(path, []byte("x"), 0o600) }
