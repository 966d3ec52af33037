#!/usr/bin/env bash
# Socket load balancing, end to end, on this machine (as root):
#   1. two HTTP backends listen on 127.0.0.11:8080 and 127.0.0.12:8080;
#   2. the agent runs with docs/examples (Service web, 10.96.0.10:80, whose
#      EndpointSlice lists those two addresses) and --enable-socket-lb,
#      attached to a cgroup of the demo's own;
#   3. curl, started inside that cgroup, asks http://10.96.0.10/ a few times
#      and prints which backend answered;
#   4. 127.0.0.12 is removed from the EndpointSlice: only 127.0.0.11 answers.
# Everything is removed on exit (the agent's pins, which detaches the
# programs, and the cgroup).
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" -eq 0 ] || { echo "demo-socketlb: run as root (BPF, cgroups)" >&2; exit 1; }
command -v curl >/dev/null || { echo "demo-socketlb: needs curl" >&2; exit 1; }

VIP=10.96.0.10
API_ADDR=${API_ADDR:-127.0.0.1:9239}
work=$(mktemp -d /tmp/apiary-demo.XXXXXX)
pins=/sys/fs/bpf/apiary-demo-$$
cgmount=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
if [ -z "$cgmount" ]; then
	cgmount=/run/apiary/cgroupv2
	mkdir -p "$cgmount" && mount -t cgroup2 none "$cgmount"
fi
cg=$cgmount/apiary-demo-$$
mkdir "$cg"

pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$pins" "$work"
	rmdir "$cg" 2>/dev/null || true
}
trap cleanup EXIT

echo "== building"
go build -o "$work/apiary" ./daemon
go build -o "$work/demo-backend" ./scripts/demo-backend

echo "== backends on 127.0.0.11:8080 and 127.0.0.12:8080"
"$work/demo-backend" 127.0.0.11:8080 127.0.0.12:8080 &
pids+=($!)

mkdir "$work/config"
cp docs/examples/*.yaml "$work/config/"
echo "== agent: --config-dir (a copy of docs/examples) --enable-socket-lb --cgroup-root $cg"
"$work/apiary" agent --config-dir "$work/config" --enable-socket-lb --cgroup-root "$cg" \
	--bpf-pin-dir "$pins" --state-dir "$work/state" --api-addr "$API_ADDR" \
	>"$work/agent.log" 2>&1 &
pids+=($!)

# incg CMD...: runs CMD in the demo's cgroup.
incg() { sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" "$@"; }

# Connect only once the programs are attached and the maps hold the Service:
# before that a connection to the VIP would leave the machine.
for _ in $(seq 100); do
	"$work/apiary" db show health --server "http://$API_ADDR" 2>/dev/null | grep -q 'socketlb.job-attach.*Attached to cgroup' \
		&& "$work/apiary" db show frontends --server "http://$API_ADDR" 2>/dev/null | grep -q Done && break
	sleep 0.2
done

echo "== health"
"$work/apiary" db show health --server "http://$API_ADDR" 2>/dev/null | grep -E 'socketlb|^Module' \
	|| curl -s "http://$API_ADDR/healthz"; echo

echo "== curl http://$VIP/ from inside the cgroup, 6 times"
for _ in $(seq 6); do incg curl -s --max-time 2 "http://$VIP/"; done

# Outside the cgroup nothing is translated: a connection to $VIP would go to
# the network as addressed, so the demo does not make one.

echo "== 127.0.0.12 leaves the EndpointSlice"
sed -i '/127.0.0.12/,+1d' "$work/config/web-service.yaml"
for _ in $(seq 50); do
	n=$(for _ in $(seq 10); do incg curl -s --max-time 2 "http://$VIP/"; done | grep -c 127.0.0.12 || true)
	[ "$n" -eq 0 ] && break
	sleep 0.2
done
for _ in $(seq 6); do incg curl -s --max-time 2 "http://$VIP/"; done
echo "== done"
