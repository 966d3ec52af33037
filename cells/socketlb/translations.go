package socketlb

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf/socklb"
)

// Translation is a translation the socket LB made: a socket of the cgroup
// CgroupID asked for Frontend and was sent to Backend.
type Translation struct {
	Time       time.Time
	CgroupID   uint64
	SockCookie uint64
	Proto      string // "TCP" or "UDP"
	Frontend   netip.AddrPort
	Backend    netip.AddrPort
}

// Translations hands the socket LB's translations to one consumer (the
// Hubble server, for its trace-sock flows). The programs report them only
// when the consumer subscribed before they were loaded: without one they
// cost nothing.
type Translations struct {
	mu      sync.Mutex
	ch      chan Translation
	dropped atomic.Uint64
	// lost is the programs' count of events the ring had no room for,
	// while they are loaded.
	lost *ebpf.Map
}

func newTranslations() *Translations { return &Translations{} }

// Subscribe enables the reports and returns them, queue of them waiting
// at most (beyond, new ones are dropped and counted in Lost). Call it
// before the agent starts; a second call returns the same channel.
func (t *Translations) Subscribe(queue int) <-chan Translation {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ch == nil {
		t.ch = make(chan Translation, queue)
	}
	return t.ch
}

func (t *Translations) wanted() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ch != nil
}

// Lost returns how many translations were not reported: the programs'
// ring was full, or the consumer's queue.
func (t *Translations) Lost() uint64 {
	n := t.dropped.Load()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lost == nil {
		return n
	}
	var perCPU []uint64
	if err := t.lost.Lookup(uint32(0), &perCPU); err == nil {
		for _, v := range perCPU {
			n += v
		}
	}
	return n
}

// xlatePoll is how often the reader looks for translations the programs
// did not wake it for.
const xlatePoll = 250 * time.Millisecond

// xlateReader reads the programs' ring into the consumer's queue.
type xlateReader struct {
	rd         *ringbuf.Reader
	maps       [2]*ebpf.Map
	done       chan struct{}
	monoToWall time.Duration
}

// start creates the ring and the lost count for the programs to load
// with, and reads the ring until close.
func (t *Translations) start(log *slog.Logger) (*xlateReader, error) {
	evSpec, lostSpec, err := socklb.XlateMapSpecs()
	if err != nil {
		return nil, err
	}
	events, err := ebpf.NewMap(evSpec)
	if err != nil {
		return nil, fmt.Errorf("create the translation events' ring: %w", err)
	}
	lost, err := ebpf.NewMap(lostSpec)
	if err != nil {
		events.Close()
		return nil, fmt.Errorf("create the translation events' lost count: %w", err)
	}
	rd, err := ringbuf.NewReader(events)
	if err != nil {
		events.Close()
		lost.Close()
		return nil, fmt.Errorf("read the translation events: %w", err)
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		rd.Close()
		events.Close()
		lost.Close()
		return nil, fmt.Errorf("read the monotonic clock: %w", err)
	}
	x := &xlateReader{rd: rd, maps: [2]*ebpf.Map{events, lost}, done: make(chan struct{}),
		monoToWall: time.Duration(time.Now().UnixNano() - ts.Nano())}
	t.mu.Lock()
	t.lost = lost
	ch := t.ch
	t.mu.Unlock()
	go func() {
		defer close(x.done)
		for {
			// The programs wake the reader only once the ring is an
			// eighth full: below that, it polls.
			rd.SetDeadline(time.Now().Add(xlatePoll))
			rec, err := rd.Read()
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			if errors.Is(err, ringbuf.ErrClosed) || errors.Is(err, os.ErrClosed) {
				return
			}
			if err != nil {
				log.Warn("Reading the socket LB's translation events failed", "error", err)
				return
			}
			ev, err := socklb.DecodeXlateEvent(rec.RawSample)
			if err != nil {
				log.Warn("Skipping a socket LB translation event", "error", err)
				continue
			}
			tr := Translation{
				Time:     time.Unix(0, int64(ev.TimeNs)+int64(x.monoToWall)).UTC(),
				CgroupID: ev.CgroupID, SockCookie: ev.SockCookie, Proto: protoName(ev.Protocol),
				Frontend: ev.FrontendAddr(), Backend: ev.BackendAddr(),
			}
			select {
			case ch <- tr:
			default:
				t.dropped.Add(1)
			}
		}
	}()
	return x, nil
}

// stop stops the reader and frees the maps (the programs that write
// them keep theirs until they go).
func (t *Translations) stop(x *xlateReader) {
	if t == nil || x == nil {
		return
	}
	x.rd.Close()
	<-x.done
	t.mu.Lock()
	if t.lost == x.maps[1] {
		t.lost = nil
	}
	t.mu.Unlock()
	for _, m := range x.maps {
		m.Close()
	}
}

func protoName(p uint8) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "TCP"
	case unix.IPPROTO_UDP:
		return "UDP"
	}
	return fmt.Sprintf("proto-%d", p)
}
