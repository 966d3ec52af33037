package testenv

import (
	"os"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// cgroupHooks are the cgroup attach types of the agent's programs (the
// socket load balancer's and policy's; bpf/socklb and bpf/policyprog list
// them with their programs, but their own tests use this package).
var cgroupHooks = []ebpf.AttachType{
	ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
	ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
	ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg,
	ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername,
	ebpf.AttachCGroupSockOps, ebpf.AttachCGroupInetIngress, ebpf.AttachCGroupInetEgress,
}

// CgroupPrograms returns the number of programs attached directly to the
// cgroup dir, per hook of the agent's that has any.
func CgroupPrograms(t testing.TB, dir string) map[ebpf.AttachType]int {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := map[ebpf.AttachType]int{}
	for _, hook := range cgroupHooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: hook})
		if err != nil {
			t.Fatalf("query %s of %s: %v", hook, dir, err)
		}
		if n := len(res.Programs); n > 0 {
			got[hook] = n
		}
	}
	return got
}
