package identity

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/internal/atomicfile"
	"github.com/apiary-net/apiary/tables"
)

func newTestAllocator(t *testing.T) *Allocator {
	t.Helper()
	db := statedb.New()
	table, err := tables.NewIdentitiesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	a, err := NewAllocator(hivetest.Logger(t), db, table, NewAgentClusterNumbers())
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// acquire takes a reference in its own transaction.
func acquire(t *testing.T, a *Allocator, hint uint32, labels ...string) (uint32, error) {
	t.Helper()
	wtxn := a.db.WriteTxn(a.table)
	defer wtxn.Abort()
	id, err := a.Acquire(wtxn, tables.NewLabels(labels...), hint)
	if err != nil {
		return 0, err
	}
	wtxn.Commit()
	return id.ID, nil
}

func release(t *testing.T, a *Allocator, id uint32) {
	t.Helper()
	wtxn := a.db.WriteTxn(a.table)
	defer wtxn.Abort()
	if err := a.Release(wtxn, id); err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
}

func row(a *Allocator, id uint32) (*tables.Identity, bool) {
	obj, _, ok := a.table.Get(a.db.ReadTxn(), tables.IdentityIDIndex.Query(id))
	return obj, ok
}

func TestAcquire(t *testing.T) {
	for _, tc := range []struct {
		name   string
		labels []string
		want   uint32
	}{
		{"host whatever else", []string{"reserved:host", "k8s:app=x"}, IDHost},
		{"world alone", []string{"reserved:world"}, IDWorld},
		{"world-ipv6 alone", []string{"reserved:world-ipv6"}, IDWorldIPv6},
		{"health", []string{"reserved:health"}, IDHealth},
		{"ingress", []string{"reserved:ingress"}, IDIngress},
		{"kube-apiserver", []string{"reserved:kube-apiserver", "reserved:remote-node"}, IDKubeAPIServer},
		{"cidr is local", []string{"cidr:10.0.0.0/8", "reserved:world"}, MinLocal},
		{"fqdn is local", []string{"fqdn:*.example.com", "reserved:world"}, MinLocal},
		{"workload is cluster", []string{"k8s:app=web"}, MinCluster},
		{"remote-node alone", []string{"reserved:remote-node"}, IDRemoteNode},
		{"remote-node a nodes peer selects is local", []string{"nodes:{role=db}", "reserved:remote-node"}, MinLocal},
		{"host a nodes peer selects stays 1", []string{"nodes:{role=db}", "reserved:host"}, IDHost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newTestAllocator(t)
			id, err := acquire(t, a, 0, tc.labels...)
			if err != nil || id != tc.want {
				t.Fatalf("got %d, %v; want %d", id, err, tc.want)
			}
			if r, _ := row(a, id); r.RefCount != 1 {
				t.Errorf("refcount %d, want 1", r.RefCount)
			}
		})
	}
}

func TestRefCountAndNextAfterLast(t *testing.T) {
	a := newTestAllocator(t)
	x, _ := acquire(t, a, 0, "cidr:10.0.0.0/8")
	x2, _ := acquire(t, a, 0, "cidr:10.0.0.0/8")
	if x != x2 {
		t.Fatalf("same labels got %d and %d", x, x2)
	}
	y, _ := acquire(t, a, 0, "cidr:10.1.0.0/16")
	release(t, a, x)
	if r, ok := row(a, x); !ok || r.RefCount != 1 {
		t.Fatalf("after one release: %+v, %v", r, ok)
	}
	release(t, a, x)
	if _, ok := row(a, x); ok {
		t.Fatal("identity with no reference left is still there")
	}
	// The freed number is not handed out again at once.
	z, _ := acquire(t, a, 0, "cidr:10.2.0.0/16")
	if z == x || z != y+1 {
		t.Errorf("got %d after freeing %d (last %d), want %d", z, x, y, y+1)
	}
	// A hint is honoured when free and in range; ignored otherwise.
	h, _ := acquire(t, a, MinLocal+100, "cidr:10.3.0.0/16")
	if h != MinLocal+100 {
		t.Errorf("hint: got %d", h)
	}
	h2, _ := acquire(t, a, 300, "cidr:10.4.0.0/16")
	if h2 == 300 {
		t.Error("a cluster number was handed to a CIDR label set")
	}
	// Reserved identities never go away.
	acquire(t, a, 0, "reserved:world")
	release(t, a, IDWorld)
	if _, ok := row(a, IDWorld); !ok {
		t.Error("reserved identity deleted")
	}
}

func TestExhaustion(t *testing.T) {
	a := newTestAllocator(t)
	a.local = NewNumberRange(tables.ScopeLocal, MinLocal, MinLocal+1)
	a1, _ := acquire(t, a, 0, "cidr:10.0.0.1/32")
	if _, err := acquire(t, a, 0, "cidr:10.0.0.2/32"); err != nil {
		t.Fatal(err)
	}
	_, err := acquire(t, a, 0, "cidr:10.0.0.3/32")
	var ex *ExhaustedError
	if !errors.As(err, &ex) || ex.Scope != tables.ScopeLocal {
		t.Fatalf("got %v, want an ExhaustedError", err)
	}
	release(t, a, a1)
	if id, err := acquire(t, a, 0, "cidr:10.0.0.3/32"); err != nil || id != a1 {
		t.Errorf("after a release: %d, %v; want %d", id, err, a1)
	}
}

func TestRestore(t *testing.T) {
	dir := t.TempDir()
	a := newTestAllocator(t)
	web, _ := acquire(t, a, 0, "k8s:app=web")
	acquire(t, a, 0, "k8s:app=db")
	cidr, _ := acquire(t, a, 0, "cidr:192.0.2.0/24", "reserved:world")
	var rows []*tables.Identity
	for obj := range a.table.All(a.db.ReadTxn()) {
		rows = append(rows, obj)
	}
	data, err := encodeCheckpoint(rows)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, CheckpointFile)
	if err := atomicfile.Write(path, data, 0o600); err != nil {
		t.Fatal(err)
	}

	b := newTestAllocator(t)
	restored, err := ReadCheckpoint(path)
	if err != nil || len(restored) != 3 {
		t.Fatalf("read: %d identities, %v", len(restored), err)
	}
	if err := b.Restore(restored); err != nil {
		t.Fatal(err)
	}
	// New label sets never take a restored number.
	other, _ := acquire(t, b, 0, "k8s:app=new")
	if other == web {
		t.Fatalf("new label set took restored number %d", web)
	}
	if id, _ := acquire(t, b, 0, "reserved:world", "cidr:192.0.2.0/24"); id != cidr {
		t.Errorf("CIDR label set got %d after restore, want %d", id, cidr)
	}
	if id, _ := acquire(t, b, 0, "k8s:app=web"); id != web {
		t.Errorf("web got %d after restore, want %d", id, web)
	}
	n, err := b.ReleaseRestored()
	if err != nil || n != 1 {
		t.Errorf("released %d, %v; want the 1 unclaimed", n, err)
	}
	if r, ok := row(b, web); !ok || r.Restored || r.RefCount != 1 {
		t.Errorf("claimed identity after the grace period: %+v", r)
	}
}

func TestReadCheckpointErrors(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"truncated": `{"version":1,"identities":[{"id":`,
		"version":   `{"version":7,"identities":[]}`,
		"no labels": `{"version":1,"identities":[{"id":300}]}`,
		"not json":  `garbage`,
	} {
		path := filepath.Join(dir, "c")
		os.WriteFile(path, []byte(content), 0o600)
		if _, err := ReadCheckpoint(path); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := ReadCheckpoint(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}
