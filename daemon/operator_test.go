package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestOperatorCommand runs `apiary operator` in-process: its flags are
// there, a bad flag is one line naming it, and without Kubernetes it says
// so instead of running idle.
func TestOperatorCommand(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // not in a cluster
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		cmd := newRootCmd(&out, &out)
		cmd.SetArgs(args)
		err := cmd.Execute()
		return out.String(), err
	}
	out, err := run("operator", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"--identity-gc-interval duration", "(default 10m0s)",
		"--identity-gc-grace-period duration", "(default 1m0s)",
		"--identity-labels strings", "default identity label filter",
		"--leader-election-namespace string", `(default "kube-system")`,
		"--kubeconfig string", "--api-addr string",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("operator --help lacks %q:\n%s", want, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--identity-gc-interval=0s", "--api-addr=127.0.0.1:0"}, "--identity-gc-interval=0s must be positive"},
		{[]string{"--leader-election-lease-duration=1s", "--api-addr=127.0.0.1:0"}, "must exceed --leader-election-renew-deadline"},
		{[]string{"--api-addr=127.0.0.1:0"}, "the operator needs Kubernetes"},
	} {
		_, err := run(append([]string{"operator", "--log-level=error"}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("operator %v: err = %v, want one line with %q", tc.args, err, tc.want)
		}
	}
}
