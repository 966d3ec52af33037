package fqdn

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/apiary-net/apiary/tables"
)

// CheckpointFile is the name of the DNS cache checkpoint in --state-dir.
const CheckpointFile = "fqdn-names.json"

// checkpointVersion is the version of the checkpoint format.
const checkpointVersion = 1

type checkpoint struct {
	Version int                `json:"version"`
	Names   []*tables.FQDNName `json:"names"`
}

func encodeCheckpoint(rows []*tables.FQDNName) ([]byte, error) {
	if rows == nil {
		rows = []*tables.FQDNName{}
	}
	return json.Marshal(checkpoint{Version: checkpointVersion, Names: rows})
}

// readCheckpoint reads the DNS cache checkpoint at path. Rows that make no
// sense (no name, an invalid address) are skipped.
func readCheckpoint(path string) ([]*tables.FQDNName, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var c checkpoint
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("decode %s: %w", path, err)
	}
	if c.Version != checkpointVersion {
		return nil, fmt.Errorf("%s: version %d, want %d", path, c.Version, checkpointVersion)
	}
	var rows []*tables.FQDNName
	for _, n := range c.Names {
		if n == nil || n.Name == "" {
			continue
		}
		ok := true
		for _, ip := range n.IPs {
			ok = ok && ip.IP.IsValid()
		}
		if ok {
			n.Selectors = tables.NewLabels(n.Selectors...)
			rows = append(rows, n)
		}
	}
	return rows, nil
}
