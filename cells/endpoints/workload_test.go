package endpoints

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/tables"
)

func TestWorkloadOf(t *testing.T) {
	yes, no := true, false
	pod := func(generateName string, labels map[string]string, owners ...metav1.OwnerReference) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: generateName + "x1", GenerateName: generateName,
			Labels: labels, OwnerReferences: owners}}
	}
	ctrl := func(kind, name string) metav1.OwnerReference {
		return metav1.OwnerReference{Kind: kind, Name: name, Controller: &yes}
	}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want *tables.Workload
	}{
		{"deployment through its replicaset", pod("web-5d4f8c7b9-", map[string]string{"pod-template-hash": "5d4f8c7b9"},
			ctrl("ReplicaSet", "web-5d4f8c7b9")), &tables.Workload{Kind: "Deployment", Name: "web"}},
		{"replicaset of its own", pod("rs-", nil, ctrl("ReplicaSet", "rs")), &tables.Workload{Kind: "ReplicaSet", Name: "rs"}},
		{"replicaset whose name lacks the hash", pod("rs-", map[string]string{"pod-template-hash": "abc"},
			ctrl("ReplicaSet", "rs")), &tables.Workload{Kind: "ReplicaSet", Name: "rs"}},
		{"daemonset", pod("agent-", nil, ctrl("DaemonSet", "agent")), &tables.Workload{Kind: "DaemonSet", Name: "agent"}},
		{"statefulset", pod("db-", nil, ctrl("StatefulSet", "db")), &tables.Workload{Kind: "StatefulSet", Name: "db"}},
		{"job", pod("migrate-", nil, ctrl("Job", "migrate")), &tables.Workload{Kind: "Job", Name: "migrate"}},
		{"cronjob through its job", pod("backup-29012345-", nil, ctrl("Job", "backup-29012345")),
			&tables.Workload{Kind: "CronJob", Name: "backup"}},
		{"job with a short number", pod("run-123-", nil, ctrl("Job", "run-123")), &tables.Workload{Kind: "Job", Name: "run-123"}},
		{"the controller among owners", pod("w-", nil, metav1.OwnerReference{Kind: "Thing", Name: "t", Controller: &no},
			ctrl("DaemonSet", "w")), &tables.Workload{Kind: "DaemonSet", Name: "w"}},
		{"owners but no controller", pod("w-", nil, metav1.OwnerReference{Kind: "Thing", Name: "t"}), nil},
		{"a named pod", &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", OwnerReferences: []metav1.OwnerReference{
			ctrl("DaemonSet", "w")}}}, nil},
		{"no owner", pod("w-", nil), nil},
		{"nil", nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := WorkloadOf(tc.pod)
			if (got == nil) != (tc.want == nil) || (got != nil && *got != *tc.want) {
				t.Errorf("WorkloadOf: %+v, want %+v", got, tc.want)
			}
		})
	}
}
