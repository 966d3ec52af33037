package tables

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// ClusterNetpolStatusTableName is the name of the clusternetpol-status
// table.
const ClusterNetpolStatusTableName = "clusternetpol-status"

// ClusterNetpolStatus is the status condition this node reports on one
// ClusterNetworkPolicy: written to the object's status.conditions when
// the policy came from the API server, and shown here in any case (the
// only place for a policy of --config-dir, which has no API server).
type ClusterNetpolStatus struct {
	// Name is the policy's name in the policies table,
	// "clusternetpol/<name>".
	Name string `json:"name" yaml:"name"`
	// Type is the condition's type, "Ready-On-Node-<node>": each node's
	// agent owns its own condition.
	Type string `json:"type" yaml:"type"`
	// Status is "True" (enforced) or "False" (invalid: see Reason and
	// Message).
	Status string `json:"status" yaml:"status"`
	// Reason is Enforced, Invalid (failing closed) or Ignored
	// (--policy-invalid-mode=ignore).
	Reason string `json:"reason" yaml:"reason"`
	// Message says why, with the policy's error.
	Message string `json:"message" yaml:"message"`
	// Written says what became of the condition in the API server:
	// "yes", "not in the API server" (--config-dir), "no API server", or
	// the error of the last attempt (retried).
	Written string `json:"written" yaml:"written"`
}

// TableHeader implements statedb.TableWritable.
func (*ClusterNetpolStatus) TableHeader() []string {
	return []string{"Name", "Type", "Status", "Reason", "Message", "Written"}
}

// TableRow implements statedb.TableWritable.
func (s *ClusterNetpolStatus) TableRow() []string {
	return []string{s.Name, s.Type, s.Status, s.Reason, s.Message, s.Written}
}

// ClusterNetpolStatusNameIndex is the primary index of the
// clusternetpol-status table.
var ClusterNetpolStatusNameIndex = statedb.Index[*ClusterNetpolStatus, string]{
	Name:       "name",
	FromObject: func(s *ClusterNetpolStatus) index.KeySet { return index.NewKeySet(index.String(s.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewClusterNetpolStatusTable registers the clusternetpol-status table
// with db.
func NewClusterNetpolStatusTable(db *statedb.DB) (statedb.RWTable[*ClusterNetpolStatus], error) {
	return statedb.NewTable(db, ClusterNetpolStatusTableName, ClusterNetpolStatusNameIndex)
}
