package ct

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
)

// Flag names, used in error messages so that a bad value points at the flag
// to fix.
const (
	TCPMaxFlag     = "bpf-ct-global-tcp-max"
	AnyMaxFlag     = "bpf-ct-global-any-max"
	SizeRatioFlag  = "bpf-map-dynamic-size-ratio"
	GCIntervalFlag = "conntrack-gc-interval"
)

// Config is the conntrack cell's configuration.
type Config struct {
	// BPFCTGlobalTCPMax is the size of the TCP maps in entries; 0 sizes
	// them from BPFMapDynamicSizeRatio.
	BPFCTGlobalTCPMax int
	// BPFCTGlobalAnyMax is the size of the maps for other protocols; 0
	// sizes them from BPFMapDynamicSizeRatio.
	BPFCTGlobalAnyMax int
	// BPFMapDynamicSizeRatio is the fraction of total memory the maps sized
	// dynamically may take.
	BPFMapDynamicSizeRatio float64
	// ConntrackGCInterval is the time between garbage collections; 0 adapts
	// it to how much each run deletes.
	ConntrackGCInterval time.Duration
}

var defaultConfig = Config{
	BPFMapDynamicSizeRatio: 0.0025,
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Int(TCPMaxFlag, def.BPFCTGlobalTCPMax,
		fmt.Sprintf("Entries of the TCP conntrack maps, %d to %d; 0 sizes them from --%s", MinEntries, MaxEntries, SizeRatioFlag))
	fs.Int(AnyMaxFlag, def.BPFCTGlobalAnyMax,
		fmt.Sprintf("Entries of the non-TCP conntrack maps, %d to %d; 0 sizes them from --%s", MinEntries, MaxEntries, SizeRatioFlag))
	fs.Float64(SizeRatioFlag, def.BPFMapDynamicSizeRatio,
		"Fraction of total memory for conntrack maps whose size flag is 0 (split 2:1 between TCP and other protocols)")
	fs.Duration(GCIntervalFlag, def.ConntrackGCInterval,
		"Time between conntrack garbage collections; 0 adapts it between 10s and 12h to how much each run deletes")
}

// validate checks the flags on their own; sizes are checked by mapSizes.
func (c Config) validate() error {
	if c.ConntrackGCInterval < 0 || c.ConntrackGCInterval > 0 && c.ConntrackGCInterval < time.Second {
		return fmt.Errorf("--%s=%s is out of range: want 0 (adaptive) or at least 1s", GCIntervalFlag, c.ConntrackGCInterval)
	}
	return nil
}
