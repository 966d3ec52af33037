package identity

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"

	"github.com/apiary-net/apiary/tables"
)

// CheckpointFile is the name of the allocator's checkpoint in --state-dir.
const CheckpointFile = "identities.json"

// checkpointVersion changes when the format does; a checkpoint of another
// version is ignored.
const checkpointVersion = 1

type checkpoint struct {
	Version    int               `json:"version"`
	Identities []checkpointEntry `json:"identities"`
}

type checkpointEntry struct {
	ID     uint32   `json:"id"`
	Labels []string `json:"labels"`
}

// encodeCheckpoint returns the checkpoint of the allocated identities
// (reserved ones are fixed and not saved), sorted by number.
func encodeCheckpoint(ids []*tables.Identity) ([]byte, error) {
	c := checkpoint{Version: checkpointVersion, Identities: []checkpointEntry{}}
	for _, id := range ids {
		if id.Scope == tables.ScopeReserved {
			continue
		}
		c.Identities = append(c.Identities, checkpointEntry{ID: id.ID, Labels: id.Labels})
	}
	slices.SortFunc(c.Identities, func(a, b checkpointEntry) int { return int(int64(a.ID) - int64(b.ID)) })
	return json.MarshalIndent(c, "", " ")
}

// ReadCheckpoint reads the checkpoint at path. A missing file returns an
// error matching fs.ErrNotExist; a file that doesn't parse, an error saying
// so.
func ReadCheckpoint(path string) ([]*tables.Identity, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var c checkpoint
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("identity checkpoint %s: %w", path, err)
	}
	if c.Version != checkpointVersion {
		return nil, fmt.Errorf("identity checkpoint %s: version %d, want %d", path, c.Version, checkpointVersion)
	}
	out := make([]*tables.Identity, 0, len(c.Identities))
	for _, e := range c.Identities {
		if len(e.Labels) == 0 {
			return nil, fmt.Errorf("identity checkpoint %s: identity %d has no labels", path, e.ID)
		}
		out = append(out, &tables.Identity{ID: e.ID, Labels: tables.NewLabels(e.Labels...)})
	}
	return out, nil
}
