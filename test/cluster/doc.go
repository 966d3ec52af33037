// Package cluster is apiary's real-node test suite: a single-node
// Kubernetes cluster on this machine (etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler and kubelet built by
// scripts/kube-testbin, containerd and runc from Debian, the bridge CNI
// plugin), apiary's own image imported and deploy/ applied with client-go
// as a user would, then checks with real pods.
//
// Its tests carry the build tag `cluster` so that `go test ./...` leaves
// them out: `make test-cluster` runs them (as root; docs/testing.md). Only
// one such cluster runs on a machine at a time.
package cluster
