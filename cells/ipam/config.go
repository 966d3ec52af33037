package ipam

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/tables"
)

// Flag names, used in error messages so that a bad value points at the flag
// to fix.
const (
	IPAMFlag            = "ipam"
	CNIConfFileFlag     = "cni-conf-file"
	CNIBinDirFlag       = "cni-bin-dir"
	EnableHealthIPFlag  = "enable-health-ip"
	EnableIngressIPFlag = "enable-ingress-ip"
)

// ModeDelegatedPlugin is the --ipam value that makes the agent allocate its
// own IPs through the CNI IPAM plugin of --cni-conf-file.
const ModeDelegatedPlugin = "delegated-plugin"

// DefaultCNIBinDir is where CNI plugins live unless --cni-bin-dir says
// otherwise.
const DefaultCNIBinDir = "/opt/cni/bin"

// Config is the IPAM cell's configuration.
type Config struct {
	// IPAM is the IPAM mode: "" or "none" (off) or "delegated-plugin".
	IPAM string
	// CNIConfFile is the CNI network configuration (.conflist or .conf)
	// whose IPAM plugin allocates the agent's IPs.
	CNIConfFile string
	// CNIBinDir is the directory holding the CNI plugin binaries.
	CNIBinDir string
	// EnableHealthIP allocates the health IP.
	EnableHealthIP bool
	// EnableIngressIP allocates the ingress IP.
	EnableIngressIP bool
}

var defaultConfig = Config{CNIBinDir: DefaultCNIBinDir}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(IPAMFlag, def.IPAM,
		`IPAM mode for the agent's own IPs: "delegated-plugin" allocates them through the IPAM plugin of --cni-conf-file; "" or "none" turns this off`)
	fs.String(CNIConfFileFlag, def.CNIConfFile,
		"CNI network configuration (.conflist or .conf) whose first ipam section names the delegated IPAM plugin; it may appear after the agent starts")
	fs.String(CNIBinDirFlag, def.CNIBinDir, "Directory holding the CNI plugin binaries (CNI_PATH)")
	fs.Bool(EnableHealthIPFlag, def.EnableHealthIP, "Allocate the health IP (container ID apiary-health) with --ipam=delegated-plugin")
	fs.Bool(EnableIngressIPFlag, def.EnableIngressIP, "Allocate the ingress IP (container ID apiary-ingress) with --ipam=delegated-plugin")
}

// settings is the validated configuration.
type settings struct {
	enabled   bool
	confFile  string
	binDir    string
	kinds     map[string]bool // kind → enabled
	kindOrder []string
}

// allKinds lists the kinds in the order they are worked on.
var allKinds = []string{tables.AgentIPKindHealth, tables.AgentIPKindIngress}

func (c Config) validate() (settings, error) {
	s := settings{
		binDir:    c.CNIBinDir,
		kinds:     map[string]bool{tables.AgentIPKindHealth: c.EnableHealthIP, tables.AgentIPKindIngress: c.EnableIngressIP},
		kindOrder: allKinds,
	}
	switch c.IPAM {
	case "", "none":
		for flag, on := range map[string]bool{EnableHealthIPFlag: c.EnableHealthIP, EnableIngressIPFlag: c.EnableIngressIP} {
			if on {
				return s, fmt.Errorf("--%s needs --%s=%s: no other IPAM mode can give the agent its own IPs", flag, IPAMFlag, ModeDelegatedPlugin)
			}
		}
	case ModeDelegatedPlugin:
		s.enabled = true
		if c.CNIConfFile == "" {
			return s, fmt.Errorf("--%s=%s needs --%s", IPAMFlag, ModeDelegatedPlugin, CNIConfFileFlag)
		}
		abs, err := filepath.Abs(c.CNIConfFile)
		if err != nil {
			return s, fmt.Errorf("--%s %s: %w", CNIConfFileFlag, c.CNIConfFile, err)
		}
		s.confFile = abs
	default:
		return s, fmt.Errorf("--%s=%q: want %q, \"none\" or empty", IPAMFlag, c.IPAM, ModeDelegatedPlugin)
	}
	// The bin dir is needed even with --ipam off: a recorded IP is released
	// through the plugin that allocated it.
	if c.CNIBinDir == "" {
		return s, errors.New("--" + CNIBinDirFlag + " is empty")
	}
	abs, err := filepath.Abs(c.CNIBinDir)
	if err != nil {
		return s, fmt.Errorf("--%s %s: %w", CNIBinDirFlag, c.CNIBinDir, err)
	}
	s.binDir = abs
	return s, nil
}

// enabledKind reports whether the configuration asks for an IP of kind.
func (s settings) enabledKind(kind string) bool { return s.enabled && s.kinds[kind] }
