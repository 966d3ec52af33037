#!/usr/bin/env bash
# Builds the conformance suite of SIG Network's network-policy-api v0.3.0
# (package sigs.k8s.io/network-policy-api/conformance and its own go test
# entry point, TestConformanceProfiles) as a test binary from the Go module
# proxy alone (CGO_ENABLED=0), and prints the directory holding it. test/
# cluster's TestClusterNetworkPolicyConformance runs it against apiary
# (make conformance-clusternetpol, docs/conformance-clusternetpol.md). The
# directory holds:
#   cnp-conformance.test   the suite
#   crd-experimental.yaml  the module's experimental-channel CRD, which the
#                          suite's experimental features need
#   images                 the images the suite's manifests name, one a line
#
# The suite is the module's, built as its own main module (its go.mod and
# go.sum) from a copy, with one addition: nosctp/nosctp.go goes into its
# package conformance/utils/kubernetes, and apply.go and helper.go there get
# one call each into it. It acts only with APIARY_CNP_NO_SCTP=1 (a kernel
# without SCTP): the base StatefulSets lose their SCTP server containers
# (agnhost porter exits when it cannot open an SCTP socket, so the pods
# would never be Ready and no test could run) and SCTP probes are left out;
# each probe is logged for the report to count.
#
# The directory is a cache keyed on this module's go.sum, this script and
# nosctp/nosctp.go, so a second run is a no-op:
# ${XDG_CACHE_HOME:-$HOME/.cache}/apiary/cnp-testbin/<key>/, where <key> is
# the first 16 hex digits of the SHA-256 of those files in that order (the
# test computes the same path). Set APIARY_CNP_TESTBIN to use another
# directory, for this script and the test alike. NICE=1 runs the compiler
# under nice. Cold, it takes about 2 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"

key=$(cat go.sum build.sh nosctp/nosctp.go | sha256sum | cut -c1-16)
out=${APIARY_CNP_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/apiary/cnp-testbin/$key}
if [ -x "$out/cnp-conformance.test" ]; then
	echo "$out"
	exit 0
fi

echo "cnp-testbin: building network-policy-api v0.3.0's conformance suite into $out (about 2 min when the Go caches are cold)" >&2
mkdir -p "$out"
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOWORK=off
# The module as go.sum pins it (go verifies it), copied: the module cache
# is read-only and go's -overlay refuses files in it.
src=$(go mod download -json sigs.k8s.io/network-policy-api | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -n "$src" ] || { echo "cnp-testbin: go mod download gave no directory" >&2; exit 1; }
cp -r "$src" "$tmp/src"
chmod -R u+w "$tmp/src"
dir=$tmp/src/conformance/utils/kubernetes

# One call into nosctp.go before a line of each file; a file without that
# line (another version of the suite) fails the build rather than the run.
hook() { # file, the line (whole, fixed), the text to put before it
	local f=$dir/$1
	grep -qxF -- "$2" "$f" || { echo "cnp-testbin: $f has no line '$2'" >&2; exit 1; }
	awk -v line="$2" -v text="$3" '$0 == line && !done { print text; done = 1 } { print }' "$f" >"$f.new"
	mv -f "$f.new" "$f"
}
hook apply.go $'\t\tresources = append(resources, uObj)' $'\t\tapiaryDropSCTPServers(t, &uObj)'
hook helper.go $'\ttimeoutArg := fmt.Sprintf("--timeout=%v", timeout)' \
	$'\tif apiaryProbe(t, protocol, clientNamespace, clientPod, targetHost, targetPort, shouldConnect) {\n\t\treturn true\n\t}'
cp nosctp/nosctp.go "$dir/apiary_nosctp.go"

nice=()
[ "${NICE:-}" != 1 ] || nice=(nice -n 19)
(cd "$tmp/src" && "${nice[@]}" go test -c -vet=off -trimpath -ldflags "-s -w" \
	-o "$tmp/cnp-conformance.test" ./conformance)
cp "$src/config/crd/experimental/policy.networking.k8s.io_clusternetworkpolicies.yaml" "$out/crd-experimental.yaml"
grep -rhoE 'image: *[^ ]+' "$src/conformance/base" | sed 's/image: *//' | sort -u >"$out/images"
# Renamed into place last: an interrupted build never leaves a binary the
# check above takes for a complete directory.
mv -f "$tmp/cnp-conformance.test" "$out/cnp-conformance.test"
echo "$out"
