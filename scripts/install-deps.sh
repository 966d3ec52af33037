#!/usr/bin/env bash
# Installs what apiary's tests need on a Debian machine that has Go: the Debian
# packages below and the Go modules. Idempotent: a no-op when all is present.
set -euo pipefail

# Debian packages the tests use:
#   containernetworking-plugins  host-local and ptp (delegated IPAM tests, the apiary-cni chain of TestCNIPlugin)
#   iproute2                     network namespaces and veth pairs
#   dnsmasq-base, dnsutils       a DNS upstream (dnsmasq) and dig (test/e2e's DNS proxy test)
#   curl                         HTTP through a Service VIP (test/e2e's socket LB test, make demo)
#   gcc, libc6-dev               cgo, which the race detector needs (make test-race)
#   containerd, runc             the container runtime of test/cluster's node (make test-cluster)
#   busybox-static, wget,        /bin/sh, wget, nc … in test/cluster's agnhost image: the e2e suites exec them
#   netcat-openbsd               (curl, above, goes into that image too; wget, nc and curl with their libraries)
#   nftables, iptables           kube-proxy's nftables and iptables modes (make bench-kube-proxy)
#   kubernetes-client            kubectl, which the Services suite execs its pods with (only where none is on PATH)
packages=(containernetworking-plugins iproute2 dnsmasq-base dnsutils curl gcc libc6-dev containerd runc busybox-static wget netcat-openbsd nftables iptables)

missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v kubectl >/dev/null || missing+=(kubernetes-client)

if [ ${#missing[@]} -gt 0 ]; then
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	echo "install-deps: installing ${missing[*]}"
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cd "$(dirname "$0")/.."
go mod download

# kube-apiserver and etcd for test/integration (the real API server test),
# built from the Go module proxy into a cache directory: ~8 min the first
# time, a no-op afterwards. Where they cannot be built the test skips; under
# APIARY_STRICT=1 (CI) that skip would be a failure, so fail here at once.
if ! scripts/kube-testbin/build.sh >/dev/null; then
	[ "${APIARY_STRICT:-}" != 1 ] || exit 1
	echo "install-deps: could not build kube-apiserver and etcd; test/integration will skip" >&2
fi

# The real hubble CLI for test/e2e's TestHubble, built the same way (a
# few minutes the first time, a no-op afterwards).
if ! scripts/hubble-testbin/build.sh >/dev/null; then
	[ "${APIARY_STRICT:-}" != 1 ] || exit 1
	echo "install-deps: could not build the hubble CLI; TestHubble will skip" >&2
fi

# network-policy-api's ClusterNetworkPolicy conformance suite for test/
# cluster, built the same way (about 2 minutes the first time).
if ! scripts/cnp-testbin/build.sh >/dev/null; then
	[ "${APIARY_STRICT:-}" != 1 ] || exit 1
	echo "install-deps: could not build the ClusterNetworkPolicy conformance suite; TestClusterNetworkPolicyConformance will skip" >&2
fi
