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
# for insert and then for delete. Each round gives a line of both; the
# summary is the median of the rounds.
for r in $(seq 1 "$ROUNDS"); do
	awk -v round="$r" '
	function metric(line, unit,   n, f, i) {
		n = split(line, f, /[ \t]+/)
		for (i = 2; i <= n; i++) if (f[i] == unit) return f[i-1]
		return ""
	}
	FILENAME ~ /ref\./ && /^Avg: Allocated/ { match($0, /[0-9]+B in-use/); rm = substr($0, RSTART, RLENGTH - 8) }
	FILENAME ~ /ref\./ && /^Avg: Reconciled/ {
		match($0, /[0-9.]+ services per second/); v = substr($0, RSTART, RLENGTH - 20)
		if (seen++ == 0) ri = v; else rd = v
	}
	FILENAME ~ /apiary\./ && $1 ~ /^BenchmarkServices\/.*\/backends=1\/(cold|warm)(-[0-9]+)?$/ {
		k = ($1 ~ /warm/) ? "warm" : "cold"
		ins[k] = metric($0, "insert-services/s"); del[k] = metric($0, "delete-services/s")
		if (k == "cold") mem = metric($0, "retained-B/service")
	}
	END { print round, ri, rd, rm, ins["cold"], del["cold"], mem, ins["warm"], del["warm"] }
	' "$work/ref.$r" "$work/apiary.$r"
done >"$work/rounds"

awk -v iters="$ITERATIONS" '
function median(col,   i, j, t, a) {
	for (i = 1; i <= n; i++) a[i] = v[i, col]
	for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
	return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{ n++; for (c = 1; c <= NF; c++) v[n, c] = $c }
END {
	printf "\n%-6s %12s %12s %10s | %12s %12s %10s | %12s %12s\n", "round", "ref ins/s", "ref del/s", "ref B/svc", "cold ins/s", "cold del/s", "cold B/svc", "warm ins/s", "warm del/s"
	for (i = 1; i <= n; i++)
		printf "%-6d %12.0f %12.0f %10.0f | %12.0f %12.0f %10.0f | %12.0f %12.0f\n", v[i, 1], v[i, 2], v[i, 3], v[i, 4], v[i, 5], v[i, 6], v[i, 7], v[i, 8], v[i, 9]
	ri = median(2); rd = median(3); rm = median(4)
	printf "median %12.0f %12.0f %10.0f | %12.0f %12.0f %10.0f | %12.0f %12.0f\n", ri, rd, rm, median(5), median(6), median(7), median(8), median(9)
	printf "\nreference: the mean of its %d iterations per round, as its command prints it\n", iters
	printf "ratio apiary cold / reference (medians): insert %.2fx, delete %.2fx, retained %.2fx\n", median(5) / ri, median(6) / rd, median(7) / rm
	printf "ratio apiary warm / reference (medians): insert %.2fx, delete %.2fx\n", median(8) / ri, median(9) / rd
	# Within a round both ran under about the same load: on a busy
	# machine these say more than the ratio of the medians.
	for (i = 1; i <= n; i++)
		printf "round %d ratios: cold insert %.2fx, delete %.2fx; warm insert %.2fx, delete %.2fx\n", i, v[i, 5] / v[i, 2], v[i, 6] / v[i, 3], v[i, 8] / v[i, 2], v[i, 9] / v[i, 3]
}' "$work/rounds"
