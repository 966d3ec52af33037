#!/usr/bin/env bash
# Runs the reference's load-balancer control-plane benchmark (cilium v1.19.3,
# pkg/loadbalancer/benchmark, through this module's main.go) and apiary's
# BenchmarkServices side by side, interleaved, and prints both and the
# ratios (`make bench-lb-reference`; root, so both use real BPF maps).
#
# ROUNDS (default 3) rounds, each: the reference (ITERATIONS insert+delete
# rounds of SERVICES Services on one hive, averaged, as its own command
# does), then apiary's cold and warm runs of the same size. The reference's
# binary is cached like scripts/hubble-testbin's, keyed on go.sum, go.mod,
# main.go and this script: ${XDG_CACHE_HOME:-$HOME/.cache}/apiary/lb-reference/<key>/lb-reference.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
ROUNDS=${ROUNDS:-3}
ITERATIONS=${ITERATIONS:-5}
SERVICES=${SERVICES:-50000}

key=$(cat "$here/go.sum" "$here/go.mod" "$here/main.go" | sha256sum | cut -c1-16)
cache=${APIARY_LB_REFERENCE:-${XDG_CACHE_HOME:-$HOME/.cache}/apiary/lb-reference/$key}
ref=$cache/lb-reference
if [ ! -x "$ref" ]; then
	echo "lb-reference: building the reference's benchmark (cilium v1.19.3) into $cache (several minutes when the Go caches are cold)" >&2
	mkdir -p "$cache"
	tmp=$(mktemp -d "$cache/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	(cd "$here" && GOWORK=off GOFLAGS="-mod=readonly -buildvcs=false" go build -o "$tmp/lb-reference" .)
	mv -f "$tmp/lb-reference" "$ref"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$repo" && go test -c -o "$work/lb.test" ./cells/lb/)

for r in $(seq 1 "$ROUNDS"); do
	echo "== round $r/$ROUNDS (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
	(cd "$work" && "$ref" -services "$SERVICES" -iterations "$ITERATIONS") >"$work/ref.$r" 2>&1 ||
		{ cat "$work/ref.$r" >&2; exit 1; }
	(cd "$repo/cells/lb" && "$work/lb.test" -test.run '^$' -test.benchtime 1x \
		-test.bench "^BenchmarkServices\$/^services=$SERVICES\$/^backends=1\$/^(cold|warm)\$" \
		-test.skip 'BenchmarkServices/services/backends/(cold|warm)/(prealloc|ipv6)' -services "$SERVICES") \
		>"$work/apiary.$r" 2>&1 || { cat "$work/apiary.$r" >&2; exit 1; }
	grep -h '^BenchmarkServices' "$work/apiary.$r" >&2
done

# The reference prints, per run, "Avg: ... (per service: N objs, NB alloc,
# NB in-use)" once, then "Avg: Reconciled ... / X services per second)"
# for insert and then for delete.
awk -v rounds="$ROUNDS" -v iters="$ITERATIONS" '
function metric(line, unit,   n, f, i) {
	n = split(line, f, /[ \t]+/)
	for (i = 2; i <= n; i++) if (f[i] == unit) return f[i-1]
	return ""
}
FILENAME ~ /ref\./ && /^Avg: Allocated/ {
	match($0, /[0-9]+B in-use/); refmem += substr($0, RSTART, RLENGTH - 8); nrefmem++
}
FILENAME ~ /ref\./ && /^Avg: Reconciled/ {
	match($0, /[0-9.]+ services per second/); v = substr($0, RSTART, RLENGTH - 20)
	if (seen[FILENAME]++ == 0) { refins += v; nrefins++ } else { refdel += v; nrefdel++ }
}
FILENAME ~ /apiary\./ && $1 ~ /^BenchmarkServices\/.*\/backends=1\/(cold|warm)(-[0-9]+)?$/ {
	kind = ($1 ~ /warm/) ? "warm" : "cold"
	ins[kind] += metric($0, "insert-services/s"); del[kind] += metric($0, "delete-services/s"); n[kind]++
	if (kind == "cold") { mem += metric($0, "retained-B/service") }
}
END {
	ri = refins / nrefins; rd = refdel / nrefdel; rm = refmem / nrefmem
	printf "\nmeans of %d interleaved rounds (reference: the mean of its %d iterations per round)\n", rounds, iters
	printf "%-22s %14s %14s %16s\n", "", "insert/s", "delete/s", "retained B/svc"
	printf "%-22s %14.0f %14.0f %16.0f\n", "reference (cilium)", ri, rd, rm
	for (k in n) {
		ai = ins[k] / n[k]; ad = del[k] / n[k]
		if (k == "cold") printf "%-22s %14.0f %14.0f %16.0f\n", "apiary " k, ai, ad, mem / n[k]
		else printf "%-22s %14.0f %14.0f %16s\n", "apiary " k, ai, ad, "-"
	}
	for (k in n) printf "ratio apiary %s / reference: insert %.2fx, delete %.2fx%s\n", k, ins[k] / n[k] / ri, del[k] / n[k] / rd, (k == "cold") ? sprintf(", retained %.2fx", mem / n[k] / rm) : ""
}' "$work"/ref.* "$work"/apiary.*
