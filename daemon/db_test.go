package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

func TestServerFromEnv(t *testing.T) {
	for _, tc := range []struct {
		name      string
		args      []string // the command line
		apiServer string   // APIARY_SERVER; "" when unset
		apiAddr   string   // APIARY_API_ADDR; "" when unset
		want      string
	}{
		{name: "nothing set", want: defaultServer},
		{name: "agent's variable", apiAddr: "127.0.0.1:9876", want: "http://127.0.0.1:9876"},
		{name: "agent on every address", apiAddr: "0.0.0.0:9876", want: "http://127.0.0.1:9876"},
		{name: "agent on every IPv6 address", apiAddr: "[::]:9876", want: "http://127.0.0.1:9876"},
		{name: "IPv6 loopback", apiAddr: "[::1]:9876", want: "http://[::1]:9876"},
		{name: "flag wins", args: []string{"--server=http://10.0.0.1:1"}, apiAddr: "127.0.0.1:9876", want: "http://10.0.0.1:1"},
		{name: "flag wins even at its default", args: []string{"--server=" + defaultServer}, apiAddr: "127.0.0.1:9876", want: defaultServer},
		{name: "APIARY_SERVER wins", apiServer: "http://10.0.0.2:2", apiAddr: "127.0.0.1:9876", want: "http://10.0.0.2:2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setenv(t, "APIARY_SERVER", tc.apiServer)
			setenv(t, "APIARY_API_ADDR", tc.apiAddr)
			var server string
			fs := pflag.NewFlagSet("db", pflag.ContinueOnError)
			fs.StringVar(&server, "server", defaultServer, "")
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			applyEnv(fs, "server")
			if got := serverFromEnv(fs.Lookup("server"), server); got != tc.want {
				t.Errorf("server = %q, want %q", got, tc.want)
			}
		})
	}
}

// setenv sets an environment variable for the test, or unsets it for v == "".
func setenv(t *testing.T, name, v string) {
	t.Setenv(name, v) // restores the old value after the test
	if v == "" {
		os.Unsetenv(name)
	}
}

// TestNoTestFakes keeps the fakes of tests out of the shipped binary: they
// belong in packages only tests import.
func TestNoTestFakes(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %s\n%s", err, out)
	}
	for pkg := range strings.Lines(string(out)) {
		pkg = strings.TrimSpace(pkg)
		if strings.HasSuffix(pkg, "/fake") || strings.Contains(pkg, "/fake/") || strings.HasSuffix(pkg, "k8sfake") {
			t.Errorf("the agent binary links %s, a test fake", pkg)
		}
	}
}
