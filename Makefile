# apiary — see README.md. Every target works on a fresh Debian machine with Go.

GO       ?= go
BIN      := bin/apiary
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

.PHONY: all build test test-race bench run lint deps clean bpf demo

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./daemon

## deps: install what the tests need (Debian packages, Go modules); a no-op when present.
deps:
	scripts/install-deps.sh

## test: the whole suite (as root, so BPF tests run; APIARY_STRICT=1 turns skips into failures).
test: deps
	$(GO) test -count=1 -timeout 15m $(TESTFLAGS) $(PKGS)

## test-race: RACE_PKGS under the race detector (as root, like test; CI runs it after test).
test-race: deps
	$(GO) test -race -count=1 -timeout 15m $(TESTFLAGS) $(RACE_PKGS)

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

## run: build and start the agent with docs/examples as its config dir.
run: build
	@echo "apiary: API on http://$(API_ADDR) — try: curl http://$(API_ADDR)/healthz; $(BIN) db show health"
	$(if $(filter 0,$(shell id -u)),,sudo) $(BIN) agent --config-dir docs/examples \
		--api-addr $(API_ADDR) --state-dir $(STATE_DIR) $(RUN_FLAGS)

## bpf: regenerate the committed BPF objects and bindings (needs clang, llvm, libbpf-dev); reproducible.
bpf:
	cd bpf/socklb && $(GO) generate ./
	cd bpf/policyprog && $(GO) generate ./

## demo: socket load balancing end to end — curl a Service VIP from a cgroup (root).
demo:
	scripts/demo-socketlb.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

clean:
	rm -rf bin
