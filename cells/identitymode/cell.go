// Package identitymode is the agent's --identity-management-mode: in
// "agent" mode (the default) the agent hands out cluster identity numbers
// itself; in "operator" mode it never creates Identities but watches the
// apiary.io Identities the operator creates, and a label set that has none
// yet gets a temporary number from 0x01010000–0x010103FF at once, replaced
// by the Identity's number as soon as it appears. See docs/operator.md.
package identitymode

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// Modes of --identity-management-mode.
const (
	ModeAgent    = "agent"
	ModeOperator = "operator"
)

// Cell provides the identity cell's numbers for the configured mode.
var Cell = cell.Module(
	"identity-mode",
	"Identity management mode - agent or operator",

	cell.Config(Config{IdentityManagementMode: ModeAgent}),
	cell.Provide(newModeNumbers),
)

// Config is the mode's configuration.
type Config struct {
	// IdentityManagementMode is "agent" or "operator".
	IdentityManagementMode string
	// TemporaryIdentities caps the temporary range (tests exhaust it);
	// 0: the whole range.
	TemporaryIdentities uint32
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String("identity-management-mode", def.IdentityManagementMode,
		"Who creates cluster identities: agent (this agent numbers them itself) or operator (the apiary operator creates Identity objects; until one appears a label set gets a temporary number)")
	fs.Uint32("temporary-identities", def.TemporaryIdentities,
		"In operator mode, how many temporary numbers from 0x1010000 may be in use at once; 0: all 1024")
	fs.MarkHidden("temporary-identities")
}

type params struct {
	cell.In

	Log       *slog.Logger
	Config    Config
	Jobs      job.Group
	Resources k8s.ResourceParams
}

func newModeNumbers(p params) (*identity.ModeNumbers, error) {
	switch p.Config.IdentityManagementMode {
	case ModeAgent:
		return &identity.ModeNumbers{}, nil
	case ModeOperator:
	default:
		return nil, fmt.Errorf("--identity-management-mode=%q: must be %s or %s", p.Config.IdentityManagementMode, ModeAgent, ModeOperator)
	}
	size := p.Config.TemporaryIdentities
	if size == 0 || size > identity.MaxTemporary-identity.MinTemporary+1 {
		size = identity.MaxTemporary - identity.MinTemporary + 1
	}
	n := NewOperatorNumbers(size)
	// Identities only matter in this mode: the agent mode does not watch
	// them, so its RBAC need not allow it.
	ids := k8s.NewResource(p.Resources, v1alpha1.IdentityKind)
	p.Jobs.Add(job.OneShot("identities", func(ctx context.Context, h cell.Health) error {
		return n.watch(ctx, h, ids, p.Log)
	}))
	return &identity.ModeNumbers{ClusterNumbers: n}, nil
}

// watch feeds the Identities into n.
func (n *OperatorNumbers) watch(ctx context.Context, h cell.Health, ids k8s.Resource[*v1alpha1.Identity], log *slog.Logger) error {
	h.OK("Waiting for Identities")
	for ev := range ids.Events(ctx) {
		switch ev.Kind {
		case k8s.Sync:
			n.Synced()
		case k8s.Upsert:
			num, err := ev.Object.Number()
			if err != nil || num < identity.MinCluster || num > identity.MaxCluster {
				log.Warn("Ignoring Identity whose name is not a cluster identity number", "name", ev.Key.Name)
				continue
			}
			n.Set(num, tables.NewLabels(ev.Object.SecurityLabels...))
		case k8s.Delete:
			if num, err := ev.Object.Number(); err == nil {
				n.Remove(num)
			}
		}
		if n.IsSynced() {
			h.OK(fmt.Sprintf("%d Identities", n.Len()))
		}
	}
	return nil
}
