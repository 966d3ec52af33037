package ct

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// WriteEntries writes every entry of the conntrack map m to w, one line
// each, sorted by tuple, with the remaining lifetime computed from now (in
// seconds of the CT clock, see bpf.CTClockNow):
//
//	TCP OUT 10.0.0.1:41234 -> 10.0.0.2:80 remaining=3599s flags=seen_non_syn rev_nat=0 src_identity=0 ifindex=0 rx_packets=1 rx_bytes=60 tx_packets=2 tx_bytes=120 rx_flags_seen=0x12 tx_flags_seen=0x02
//
// Addresses and ports are printed as the key stores them. Sorting needs the
// whole map in memory, about 120 bytes per entry.
//
// `apiary bpf ct list` and the ct/dump script command print with it.
func WriteEntries(w io.Writer, m bpf.Map, now uint32) error {
	switch m.KeySize() {
	case bpf.CTKey4Size:
		return writeEntries[bpf.CTKey4](w, m, now)
	case bpf.CTKey6Size:
		return writeEntries[bpf.CTKey6](w, m, now)
	}
	return fmt.Errorf("key size %d is no conntrack key", m.KeySize())
}

// WritePinned writes the entries of the conntrack maps pinned in pinDir to
// w, as WriteEntries does, opening the pins read-only: this is `apiary bpf
// ct list`, which works whether the agent runs or not. names selects maps;
// without names every conntrack map that is pinned is written.
func WritePinned(w io.Writer, pinDir string, names ...string) error {
	all := len(names) == 0
	if all {
		names = bpf.CTMapNames(true)
	}
	now, err := bpf.CTClockNow()
	if err != nil {
		return err
	}
	found := 0
	for _, name := range names {
		if _, err := bpf.CTMapIsIPv6(name); err != nil {
			return err
		}
		path := filepath.Join(pinDir, name)
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if all && errors.Is(err, fs.ErrNotExist) {
			// IPv6 maps exist only with --enable-ipv6.
			continue
		}
		if err != nil {
			return fmt.Errorf("open %s: %w", path, err)
		}
		err = WriteEntries(w, m, now)
		m.Close()
		if err != nil {
			return fmt.Errorf("read %s: %w", path, err)
		}
		found++
	}
	if found == 0 {
		return fmt.Errorf("no conntrack map is pinned in %s (has the agent run with --bpf-pin-dir=%s?)", pinDir, pinDir)
	}
	return nil
}

type tupleEntry struct {
	tuple bpf.CTTuple
	entry bpf.CTEntry
}

func writeEntries[K bpf.CTKey](w io.Writer, m bpf.Map, now uint32) error {
	var entries []tupleEntry
	err := bpf.WalkCT(m, gcBatch, func(keys []K, values []bpf.CTEntry) error {
		for i := range keys {
			entries = append(entries, tupleEntry{keys[i].Tuple(), values[i]})
		}
		return nil
	})
	if err != nil {
		return err
	}
	slices.SortFunc(entries, func(a, b tupleEntry) int { return a.tuple.Compare(b.tuple) })

	bw := bufio.NewWriter(w)
	var line []byte
	for _, e := range entries {
		line = appendEntry(line[:0], e.tuple, &e.entry, now)
		bw.Write(line)
	}
	return bw.Flush()
}

// appendEntry appends the line WriteEntries prints for one entry.
func appendEntry(b []byte, t bpf.CTTuple, e *bpf.CTEntry, now uint32) []byte {
	b = append(b, protoName(t.NextHdr)...)
	b = append(b, ' ')
	b = append(b, t.Flags.String()...)
	b = append(b, ' ')
	b = netip.AddrPortFrom(t.SAddr, t.SPort).AppendTo(b)
	b = append(b, " -> "...)
	b = netip.AddrPortFrom(t.DAddr, t.DPort).AppendTo(b)
	if e.Expired(now) {
		b = append(b, " remaining=expired"...)
	} else {
		b = fmt.Appendf(b, " remaining=%ds", e.Lifetime-now)
	}
	b = fmt.Appendf(b, " flags=%s rev_nat=%d src_identity=%d ifindex=%d", e.Flags, e.RevNAT.Uint16(), e.SourceIdentity, e.IfIndex)
	b = fmt.Appendf(b, " rx_packets=%d rx_bytes=%d tx_packets=%d tx_bytes=%d rx_flags_seen=0x%02x tx_flags_seen=0x%02x\n",
		e.RxPackets, e.RxBytes, e.TxPackets, e.TxBytes, e.RxFlagsSeen, e.TxFlagsSeen)
	return b
}

// protoName returns the name of an IP protocol number.
func protoName(p uint8) string {
	switch p {
	case 1:
		return "ICMP"
	case 6:
		return "TCP"
	case 17:
		return "UDP"
	case 58:
		return "ICMPv6"
	case 132:
		return "SCTP"
	}
	return "proto-" + strconv.Itoa(int(p))
}
