# apiary — see README.md. Every target works on a fresh Debian machine with Go.

GO       ?= go
BIN      := bin/apiary
# The chained CNI plugin (docs/policy.md, "The CNI plugin"): a small binary
# without client-go, installed in the node's CNI bin dir.
CNI_BIN  := bin/apiary-cni
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT   ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -X main.version=$(VERSION) -X main.gitCommit=$(COMMIT)

# Flags for `make run`; override e.g. `make run RUN_FLAGS="--log-level=debug"`.
API_ADDR  ?= 127.0.0.1:9234
STATE_DIR ?= /var/run/apiary
RUN_FLAGS ?=

# Test flags; `make test TESTFLAGS=-v PKGS=./cells/lb/...`.
PKGS      ?= ./...
TESTFLAGS ?=
BENCHTIME ?= 1s
# The packages with concurrent state (jobs, reconcilers, informers, timers,
# BPF map users, the Identity client) that `make test-race` runs under the
# race detector. ./daemon is left out: under -race it takes over 4 minutes.
RACE_PKGS ?= ./cells/... ./reconcilers/... ./bpf/... ./internal/... ./apis/...

# `make image`: the image's repository; it is tagged $(VERSION) and latest.
IMAGE     ?= ghcr.io/apiary-net/apiary
IMAGE_TAR ?= bin/apiary-image.tar
# A tag allows letters, digits, '.', '_' and '-': anything else in the
# version (a '+', a '/') becomes '-'.
IMAGE_TAG := $(shell printf '%s' '$(VERSION)' | tr -c 'A-Za-z0-9_.-' '-')

.PHONY: all build image test test-race test-cluster conformance conformance-multinode conformance-services conformance-clusternetpol bench bench-lb-reference bench-kube-proxy run lint deps clean bpf demo

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./daemon
	$(GO) build -ldflags "$(LDFLAGS)" -o $(CNI_BIN) ./cni

## image: a container image of the static binary, as an archive that
## `ctr -n k8s.io images import` and `docker load` accept ($(IMAGE_TAR)),
## built from Go alone (no Docker daemon, no registry).
image:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS) -s -w" -o bin/image/apiary ./daemon
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS) -s -w" -o bin/image/apiary-cni ./cni
	$(GO) run ./scripts/mkimage -o $(IMAGE_TAR) -tag $(IMAGE):$(IMAGE_TAG) -tag $(IMAGE):latest \
		-entrypoint /usr/bin/apiary bin/image/apiary=/usr/bin/apiary bin/image/apiary-cni=/usr/bin/apiary-cni

## deps: install what the tests need (Debian packages, Go modules); a no-op when present.
deps:
	scripts/install-deps.sh

## test: the whole suite (as root, so BPF tests run; APIARY_STRICT=1 turns skips into failures).
test: deps
	$(GO) test -count=1 -timeout 15m $(TESTFLAGS) $(PKGS)

## test-race: RACE_PKGS under the race detector (as root, like test; CI runs it after test).
test-race: deps
	$(GO) test -race -count=1 -timeout 15m $(TESTFLAGS) $(RACE_PKGS)

## test-cluster: test/cluster, a real single-node cluster (kubelet, containerd,
## runc) with apiary installed from deploy/ and its image, and a part of
## Kubernetes' NetworkPolicy e2e suite and of network-policy-api's
## ClusterNetworkPolicy suite against it (as root; one per machine; CI runs
## it after test-race). TestMultiNode brings up NODES
## nodes (default 2) in namespaces of this machine: make test-cluster NODES=3.
NODES ?= 2
test-cluster: deps image
	APIARY_NODES=$(NODES) $(GO) test -tags cluster -count=1 -timeout 30m $(TESTFLAGS) ./test/cluster

## conformance: all of Kubernetes' NetworkPolicy e2e suite against apiary on
## test/cluster's node; writes docs/conformance.md (as root).
conformance: deps image
	APIARY_CONFORMANCE=all APIARY_CONFORMANCE_REPORT=$(CURDIR)/docs/conformance.md \
		$(GO) test -tags cluster -count=1 -timeout 120m -v -run '^TestNetworkPolicyConformance$$' $(TESTFLAGS) ./test/cluster

## conformance-multinode: the multi-node cluster's long proofs
## (TestMultiNodeLifecycle: a rollout, operator mode, a node joining and
## leaving), all of Kubernetes' NetworkPolicy e2e suite and the Services
## specs that need 2 nodes against apiary on NODES nodes (default 2) of
## test/cluster's multi-node cluster; writes the "NODES nodes" section of
## docs/conformance.md and bin/conformance-services-multinode.md (as root).
conformance-multinode: deps image
	APIARY_NODES=$(NODES) APIARY_MULTINODE_LIFECYCLE=1 APIARY_CONFORMANCE_MULTINODE=all APIARY_CONFORMANCE_REPORT=$(CURDIR)/docs/conformance.md \
		APIARY_SERVICES_CONFORMANCE_MULTINODE=1 APIARY_CONFORMANCE_REPORT_SERVICES=$(CURDIR)/bin/conformance-services-multinode.md \
		$(GO) test -tags cluster -count=1 -timeout 120m -v -run '^(TestMultiNodeLifecycle|TestNetworkPolicyConformanceMultiNode|TestServicesConformanceMultiNode)$$' $(TESTFLAGS) ./test/cluster
## conformance-services: Kubernetes' [sig-network] Services e2e suite against
## apiary on test/cluster's node (no kube-proxy); writes
## docs/conformance-services.md (as root).
conformance-services: deps image
	APIARY_SERVICES_CONFORMANCE=all APIARY_CONFORMANCE_REPORT=$(CURDIR)/docs/conformance-services.md \
		$(GO) test -tags cluster -count=1 -timeout 120m -v -run '^TestServicesConformance$$' $(TESTFLAGS) ./test/cluster

## conformance-clusternetpol: network-policy-api v0.3.0's ClusterNetworkPolicy
## conformance suite (profile ClusterNetworkPolicy, both experimental features)
## against apiary on NODES nodes (default 2) of test/cluster's multi-node cluster; writes
## docs/conformance-clusternetpol.md (as root).
conformance-clusternetpol: deps image
	APIARY_CNP_CONFORMANCE=all APIARY_CONFORMANCE_REPORT=$(CURDIR)/docs/conformance-clusternetpol.md APIARY_CNP_CONFORMANCE_LOG=$(CURDIR)/bin/cnp-conformance.json \
		APIARY_NODES=$(NODES) $(GO) test -tags cluster -count=1 -timeout 120m -v -run '^TestClusterNetworkPolicyConformance$$' $(TESTFLAGS) ./test/cluster

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

## bench-lb-reference: the reference's LB control-plane benchmark (cilium
## v1.19.3, built in scripts/lb-reference, a module of its own) and apiary's
## BenchmarkServices, interleaved ROUNDS times, with the ratios (root).
ROUNDS ?= 3
bench-lb-reference:
	ROUNDS=$(ROUNDS) scripts/lb-reference/compare.sh

## bench-kube-proxy: apiary side by side with kube-proxy (nftables and
## iptables modes, in turn) on test/cluster's node: time from a Service
## change to the datapath at 10,000 Services × 10 endpoints, one endpoint
## change, NodePort connections/s from an outside client (as root, 25-45 min;
## not in CI). Writes bin/bench-kube-proxy.md; docs/benchmarks.md has the
## figures. Take the cluster lock: flock /tmp/apiary-cluster.lock make bench-kube-proxy
bench-kube-proxy: deps image
	APIARY_BENCH_KUBE_PROXY=1 APIARY_BENCH_REPORT=$(CURDIR)/bin/bench-kube-proxy.md \
		$(GO) test -tags cluster -count=1 -timeout 90m -v -run '^TestKubeProxyBench$$' $(TESTFLAGS) ./test/cluster

## run: build and start the agent with docs/examples as its config dir.
run: build
	@echo "apiary: API on http://$(API_ADDR) — try: curl http://$(API_ADDR)/healthz; $(BIN) db show health"
	$(if $(filter 0,$(shell id -u)),,sudo) $(BIN) agent --config-dir docs/examples \
		--api-addr $(API_ADDR) --state-dir $(STATE_DIR) $(RUN_FLAGS)

## bpf: regenerate the committed BPF objects and bindings (needs clang, llvm, libbpf-dev); reproducible.
bpf:
	cd bpf/socklb && $(GO) generate ./
	cd bpf/policyprog && $(GO) generate ./
	cd bpf/nodeport && $(GO) generate ./

## demo: socket load balancing end to end — curl a Service VIP from a cgroup (root).
demo:
	scripts/demo-socketlb.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags cluster ./test/cluster

clean:
	rm -rf bin
