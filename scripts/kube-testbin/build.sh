#!/usr/bin/env bash
# Builds the kube-apiserver and etcd that apiary's real-API-server integration
# test (test/integration) runs, from the Go module proxy alone (CGO_ENABLED=0),
# and prints the directory holding them.
#
# The binaries go to a cache directory keyed on this module's go.sum and this
# script, so a second run (or another checkout of the same versions) is a
# no-op: ${XDG_CACHE_HOME:-$HOME/.cache}/apiary/kube-testbin/<key>/, where
# <key> is the first 16 hex digits of the SHA-256 of go.sum followed by this
# file (the test computes the same path). Set APIARY_KUBE_TESTBIN to use
# another directory, for this script and the test alike. A cold build takes
# ~7.5 min on 2 cores (about 0.6 GB of module cache, 2.2 GB of build cache).
set -euo pipefail
cd "$(dirname "$0")"

key=$(cat go.sum build.sh | sha256sum | cut -c1-16)
out=${APIARY_KUBE_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/apiary/kube-testbin/$key}

if [ -x "$out/kube-apiserver" ] && [ -x "$out/etcd" ]; then
	echo "$out"
	exit 0
fi

echo "kube-testbin: building kube-apiserver v1.36.4 and etcd v3.6.8 into $out (about 7.5 min on 2 cores when the Go caches are cold)" >&2
mkdir -p "$out"
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOWORK=off
v=k8s.io/component-base/version
go build -trimpath \
	-ldflags "-s -w -X $v.gitVersion=v1.36.4 -X $v.gitMajor=1 -X $v.gitMinor=36 -X $v.gitTreeState=clean" \
	-o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3

# Rename into place last, etcd before kube-apiserver, so an interrupted build
# never leaves a pair that the check above takes for complete.
mv -f "$tmp/etcd" "$out/etcd"
mv -f "$tmp/kube-apiserver" "$out/kube-apiserver"
echo "$out"
