package policy_test

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestScript runs testdata/*.txtar, each against hives of the cells policy
// enforcement stands on (identities, ipcache, policies and selectors, the
// endpoints of this node) and the policy cell, with a cgroup v2 directory
// of its own as --cgroup-root, where the programs attach and the pods'
// kubelet cgroups are looked for. Besides apiarytest's commands, a script
// has:
//
//	cgroup/mkdir DIR...      make cgroups (with their parents) below the
//	                         cgroup root, e.g. kubepods/pod<UID>
//	policy/maps [-e ID]      the pinned policy and policy_endpoints maps as
//	                         `apiary bpf policy list` prints them, with each
//	                         cgroup ID replaced by its path below the root
//
// --cgroup-root comes from the environment (APIARY_CGROUP_ROOT), as a `#!`
// line cannot know the directory; so the files run one after another, each
// with its own. Lines that need the programs loaded (and attached) are
// marked [kernel]: TestScriptInMemory runs the same files without them.
func TestScript(t *testing.T) {
	testenv.RequireRoot(t)
	files, err := filepath.Glob("testdata/*.txtar")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	t.Setenv("APIARY_CGROUP_ROOT", "") // restored when the test ends
	for _, file := range files {
		root := testenv.Cgroup(t)
		// Before the root itself goes (cleanups run last first).
		t.Cleanup(func() { removeCgroupsBelow(t, root) })
		os.Setenv("APIARY_CGROUP_ROOT", root)
		apiarytest.Run(t, file, scriptCells, apiarytest.Sequential())
	}
}

// TestScriptInMemory runs the same scripts without root: on maps in
// memory (bpf/memmap), with a plain directory as --cgroup-root whose
// subdirectories stand for the pods' cgroups. Nothing is loaded or
// attached; the policy maps' entries are the same.
func TestScriptInMemory(t *testing.T) {
	files, err := filepath.Glob("testdata/*.txtar")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	t.Setenv("APIARY_CGROUP_ROOT", "") // restored when the test ends
	for _, file := range files {
		os.Setenv("APIARY_CGROUP_ROOT", t.TempDir())
		apiarytest.Run(t, file, scriptCells, apiarytest.Sequential(), apiarytest.MemoryMaps(), apiarytest.AnyCgroupRoot())
	}
}

// scriptCells is the hive of a script: the infrastructure, the fake
// clientset, what policy needs, the policy cell and the test's commands.
func scriptCells(fakeClient cell.Cell) []cell.Cell {
	return []cell.Cell{
		infra.Cell, fakeClient,
		identity.Cell, ipcache.Cell, selectors.Cell, endpoints.Cell, policy.Cell,
		cell.Provide(scriptTestCommands),
	}
}

func scriptTestCommands(root cgroups.Root, pinDir bpffs.PinDir, maps bpffs.Maps) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"cgroup/mkdir": cgroupMkdirCmd(root),
		"policy/maps":  policyMapsCmd(root, pinDir, maps),
	})
}

// cgroupPath returns rel below the root, refusing anything that leaves it.
func cgroupPath(root cgroups.Root, rel string) (string, error) {
	if !filepath.IsLocal(rel) {
		return "", fmt.Errorf("%q is not a path below the cgroup root", rel)
	}
	return filepath.Join(root.Path(), rel), nil
}

func cgroupMkdirCmd(root cgroups.Root) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "Make cgroups below --cgroup-root", Args: "dir..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			for _, rel := range args {
				dir, err := cgroupPath(root, rel)
				if err != nil {
					return nil, err
				}
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})
}

var cgroupIDRE = regexp.MustCompile(`^((?:endpoint \d+|pod tree) cgroup )(\d+)( .*)$`)

func policyMapsCmd(root cgroups.Root, pinDir bpffs.PinDir, maps bpffs.Maps) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Print the pinned policy maps as `apiary bpf policy list` does, cgroup IDs as paths below --cgroup-root",
			Flags: func(fs *pflag.FlagSet) {
				fs.Uint32P("endpoint", "e", 0, "only the endpoint with this ID")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 0 {
				return nil, script.ErrUsage
			}
			id, err := s.Flags.GetUint32("endpoint")
			if err != nil {
				return nil, err
			}
			eps, entries, err := policy.ReadMaps(maps, string(pinDir))
			if err != nil {
				return nil, err
			}
			var b strings.Builder
			if err := policy.WriteEntries(&b, eps, entries, id); err != nil {
				return nil, err
			}
			names := cgroupNames(root.Path())
			lines := strings.SplitAfter(b.String(), "\n")
			for i, line := range lines {
				m := cgroupIDRE.FindStringSubmatch(strings.TrimSuffix(line, "\n"))
				if m == nil {
					continue
				}
				cg, _ := strconv.ParseUint(m[2], 10, 64)
				name, ok := names[cg]
				if !ok {
					name = "(not below the root)"
				}
				lines[i] = m[1] + name + m[3] + "\n"
			}
			out := strings.Join(lines, "")
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		})
}

// cgroupNames returns the paths below root of the cgroups there, by ID.
func cgroupNames(root string) map[uint64]string {
	names := map[uint64]string{}
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() || path == root {
			return nil
		}
		var st syscall.Stat_t
		if syscall.Stat(path, &st) == nil {
			rel, _ := filepath.Rel(root, path)
			names[st.Ino] = rel
		}
		return nil
	})
	return names
}

// removeCgroupsBelow removes the cgroups below root, the deepest first (a
// cgroup goes with rmdir only, once it has no children).
func removeCgroupsBelow(t testing.TB, root string) {
	var dirs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root {
			dirs = append(dirs, path)
		}
		return nil
	})
	for _, d := range slices.Backward(dirs) {
		if err == nil {
			err = os.Remove(d)
		}
	}
	if err != nil && !os.IsNotExist(err) {
		t.Errorf("remove the cgroups below %s: %v", root, err)
	}
}
