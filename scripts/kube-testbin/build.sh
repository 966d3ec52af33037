#!/usr/bin/env bash
# Builds the Kubernetes binaries that apiary's tests run, from the Go module
# proxy alone (CGO_ENABLED=0), and prints the directory holding them:
#   kube-apiserver, etcd        test/integration (a real API server)
#   kube-controller-manager,    test/cluster (a real single-node cluster,
#   kube-scheduler, kubelet     with containerd and runc from Debian)
#   e2e.test, agnhost           test/cluster's NetworkPolicy conformance run
#                               (Kubernetes' own e2e suite and its test image)
#   kube-proxy                  test/cluster's side-by-side benchmark
#                               (make bench-kube-proxy, nftables and iptables)
#
# The binaries go to a cache directory keyed on this module's go.sum and this
# script, so a second run (or another checkout of the same versions) is a
# no-op: ${XDG_CACHE_HOME:-$HOME/.cache}/apiary/kube-testbin/<key>/, where
# <key> is the first 16 hex digits of the SHA-256 of go.sum followed by this
# file (the tests compute the same path). Set APIARY_KUBE_TESTBIN to use
# another directory, for this script and the tests alike. Only missing
# binaries are built. Cold, all eight take ~20 min on 2 cores (about 0.8 GB
# of module cache, 4 GB of build cache); NICE=1 runs the compiler under nice.
set -euo pipefail
cd "$(dirname "$0")"

key=$(cat go.sum build.sh | sha256sum | cut -c1-16)
out=${APIARY_KUBE_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/apiary/kube-testbin/$key}

# Built in this order; each is renamed into place when complete, so an
# interrupted build never leaves a binary that the check below takes for one.
kube=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
missing=()
[ -x "$out/etcd" ] || missing+=(etcd)
for b in "${kube[@]}" e2e.test agnhost; do
	[ -x "$out/$b" ] || missing+=("$b")
done
if [ ${#missing[@]} -eq 0 ]; then
	echo "$out"
	exit 0
fi

echo "kube-testbin: building ${missing[*]} (Kubernetes v1.36.4, etcd v3.6.8) into $out (about 20 min on 2 cores when the Go caches are cold)" >&2
mkdir -p "$out"
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOWORK=off
nice=()
[ "${NICE:-}" != 1 ] || nice=(nice -n 19)
v=k8s.io/component-base/version
kflags="-s -w -X $v.gitVersion=v1.36.4 -X $v.gitMajor=1 -X $v.gitMinor=36 -X $v.gitTreeState=clean"
for b in "${missing[@]}"; do
	case "$b" in
	etcd)
		"${nice[@]}" go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3 ;;
	e2e.test)
		"${nice[@]}" go test -c -vet=off -trimpath -ldflags "$kflags" -o "$tmp/e2e.test" k8s.io/kubernetes/test/e2e ;;
	agnhost)
		"${nice[@]}" go build -trimpath -ldflags "-s -w" -o "$tmp/agnhost" k8s.io/kubernetes/test/images/agnhost ;;
	*)
		"${nice[@]}" go build -trimpath -ldflags "$kflags" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b" ;;
	esac
	mv -f "$tmp/$b" "$out/$b"
done
echo "$out"
