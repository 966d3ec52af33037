// Package integration holds tests that run apiary against real outside
// programs rather than fakes. identities_test.go runs the operator and two
// agents, as processes of the real apiary binary, against a real
// kube-apiserver and etcd built by scripts/kube-testbin/build.sh, with
// deploy/'s CRDs and RBAC installed: RBAC, CRD schemas, resource versions
// and watches are the API server's own. policies_test.go checks that an
// agent copes with Cilium's policy CRDs being absent, installed later and
// deleted. See docs/testing.md.
package integration
