#!/usr/bin/env bash
# Builds the real `hubble` CLI of the reference (github.com/cilium/cilium
# v1.19.3, package github.com/cilium/cilium/hubble) that test/e2e's
# TestHubble runs against the agent, from the Go module proxy alone
# (CGO_ENABLED=0), and prints the directory holding it.
#
# The binary goes to a cache directory keyed on this module's go.sum and this
# script, so a second run is a no-op:
# ${XDG_CACHE_HOME:-$HOME/.cache}/apiary/hubble-testbin/<key>/hubble, where
# <key> is the first 16 hex digits of the SHA-256 of go.sum followed by this
# file (the test computes the same path). Set APIARY_HUBBLE_TESTBIN to use
# another directory, for this script and the test alike. NICE=1 runs the
# compiler under nice.
set -euo pipefail
cd "$(dirname "$0")"

key=$(cat go.sum build.sh | sha256sum | cut -c1-16)
out=${APIARY_HUBBLE_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/apiary/hubble-testbin/$key}
if [ -x "$out/hubble" ]; then
	echo "$out"
	exit 0
fi

echo "hubble-testbin: building hubble (cilium v1.19.3) into $out (a few minutes when the Go caches are cold)" >&2
mkdir -p "$out"
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOWORK=off
nice=()
[ "${NICE:-}" != 1 ] || nice=(nice -n 19)
"${nice[@]}" go build -trimpath -ldflags "-s -w" -o "$tmp/hubble" github.com/cilium/cilium/hubble
# Renamed into place when complete: an interrupted build never leaves a
# binary the check above takes for one.
mv -f "$tmp/hubble" "$out/hubble"
echo "$out"
