package endpoints

import (
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/tables"
)

// cronJobName matches the name of a Job a CronJob made: the CronJob's
// name and the scheduled time in minutes since the epoch (8 to 10 digits).
var cronJobName = regexp.MustCompile(`^(.+)-\d{8,10}$`)

// WorkloadOf returns the workload that controls pod, as the reference's
// Hubble derives it (so that flows name the same workloads): the kind and
// name of the pod's controller, except that a ReplicaSet a Deployment made
// (its name is the Deployment's with the pod-template-hash appended) is
// that Deployment, and a Job a CronJob made is that CronJob. Only a pod
// whose name a controller generated has one; nil otherwise. The owners
// are not looked up: the names are what the controllers give them.
func WorkloadOf(pod *corev1.Pod) *tables.Workload {
	if pod == nil || pod.GenerateName == "" {
		return nil
	}
	ref := metav1.GetControllerOf(pod)
	if ref == nil {
		return nil
	}
	w := &tables.Workload{Kind: ref.Kind, Name: ref.Name}
	switch ref.Kind {
	case "ReplicaSet":
		if hash := pod.Labels["pod-template-hash"]; hash != "" && strings.HasSuffix(ref.Name, "-"+hash) {
			w.Kind, w.Name = "Deployment", strings.TrimSuffix(ref.Name, "-"+hash)
		}
	case "Job":
		if m := cronJobName.FindStringSubmatch(ref.Name); m != nil {
			w.Kind, w.Name = "CronJob", m[1]
		}
	}
	return w
}
