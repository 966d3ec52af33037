package hubble

import (
	"context"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	observerpb "github.com/cilium/cilium/api/v1/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// followBatch is how many flows a follower takes from the ring at once.
const followBatch = 256

// observer serves Hubble's observer API from the ring; what apiary has no
// answer for (agent and debug events, nodes, namespaces) is left to
// UnimplementedObserverServer.
type observer struct {
	observerpb.UnimplementedObserverServer
	ring     *ring
	nodeName string
	started  time.Time
	// onLost, when set, counts the flows a follower lost.
	onLost func(n uint64)
}

// ServerStatus reports the ring's fill and the flows seen since start.
func (o *observer) ServerStatus(context.Context, *observerpb.ServerStatusRequest) (*observerpb.ServerStatusResponse, error) {
	stored, seen := o.ring.stats()
	uptime := time.Since(o.started)
	return &observerpb.ServerStatusResponse{
		NumFlows:  stored,
		MaxFlows:  uint64(len(o.ring.buf)),
		SeenFlows: seen,
		UptimeNs:  uint64(uptime),
		Version:   "apiary",
		FlowsRate: float64(seen) / max(uptime.Seconds(), 1),
	}, nil
}

// GetFlows sends the stored flows the request selects, then, with
// follow, the new ones as they come.
func (o *observer) GetFlows(req *observerpb.GetFlowsRequest, stream grpc.ServerStreamingServer[observerpb.GetFlowsResponse]) error {
	allow, err := compileFilters(req.GetWhitelist())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	deny, err := compileFilters(req.GetBlacklist())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	var since, until time.Time
	if req.GetSince() != nil {
		since = req.GetSince().AsTime()
	}
	if req.GetUntil() != nil {
		until = req.GetUntil().AsTime()
	}
	selected := func(f *flowpb.Flow) bool {
		t := f.GetTime().AsTime()
		if !since.IsZero() && t.Before(since) {
			return false
		}
		if (len(allow) > 0 && !allow.any(f)) || deny.any(f) {
			return false
		}
		return true
	}
	ctx := stream.Context()

	past, next := o.ring.snapshot()
	// Without follow, number or since, Hubble answers with everything it
	// has; with follow alone, only what comes.
	var picked []*flowpb.Flow
	wantPast := !req.GetFollow() || req.GetNumber() > 0 || req.GetSince() != nil
	if wantPast {
		if req.GetFirst() {
			for _, f := range past {
				if req.GetNumber() > 0 && uint64(len(picked)) >= req.GetNumber() {
					break
				}
				if selected(f) && !after(f, until) {
					picked = append(picked, f)
				}
			}
		} else {
			for i := len(past) - 1; i >= 0; i-- {
				if req.GetNumber() > 0 && uint64(len(picked)) >= req.GetNumber() {
					break
				}
				if f := past[i]; selected(f) && !after(f, until) {
					picked = append(picked, f)
				}
			}
			for i, j := 0, len(picked)-1; i < j; i, j = i+1, j-1 {
				picked[i], picked[j] = picked[j], picked[i]
			}
		}
	}
	for _, f := range picked {
		if err := o.send(stream, f); err != nil {
			return err
		}
	}
	if !req.GetFollow() || (req.GetFirst() && req.GetNumber() > 0) {
		return nil
	}
	var deadline <-chan time.Time
	if !until.IsZero() {
		t := time.NewTimer(time.Until(until))
		defer t.Stop()
		deadline = t.C
	}
	for {
		flows, lost, n, written := o.ring.readFrom(next, followBatch)
		next = n
		if lost > 0 {
			if o.onLost != nil {
				o.onLost(lost)
			}
			// Overwritten before this follower could read them: it
			// reads slower than flows come.
			if err := stream.Send(&observerpb.GetFlowsResponse{
				NodeName: o.nodeName, Time: timestamppb.Now(),
				ResponseTypes: &observerpb.GetFlowsResponse_LostEvents{LostEvents: &flowpb.LostEvent{
					Source: flowpb.LostEventSource_HUBBLE_RING_BUFFER, NumEventsLost: lost,
				}},
			}); err != nil {
				return err
			}
		}
		for _, f := range flows {
			if after(f, until) {
				return nil
			}
			if selected(f) {
				if err := o.send(stream, f); err != nil {
					return err
				}
			}
		}
		if len(flows) > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-deadline:
			return nil
		case <-written:
		}
	}
}

func after(f *flowpb.Flow, until time.Time) bool {
	return !until.IsZero() && f.GetTime().AsTime().After(until)
}

func (o *observer) send(stream grpc.ServerStreamingServer[observerpb.GetFlowsResponse], f *flowpb.Flow) error {
	return stream.Send(&observerpb.GetFlowsResponse{
		NodeName: o.nodeName, Time: f.GetTime(),
		ResponseTypes: &observerpb.GetFlowsResponse_Flow{Flow: f},
	})
}
