// Package e2e runs the shipped apiary binary as a user would: TestMain
// builds it once, and every test starts `apiary agent` as a process with
// its own flags, a temporary --state-dir and --config-dir, a fresh
// --bpf-pin-dir on bpffs and the API on a free loopback port, drives it with
// real outside programs (dnsmasq and dig, curl, the host-local CNI plugin,
// the apiary CLI) and reads back what a user reads: /healthz, /metrics,
// /statedb/dump/{table}, `apiary db show` and `apiary bpf ... list`.
//
// harness_test.go is the harness; each feature has its own file. Tests need
// root and skip without it (or without an outside program) unless
// APIARY_STRICT=1, which turns the skip into a failure. See docs/testing.md.
package e2e
