// Command testpod is the program of test/cluster's pods, built into a
// container image by the test:
//
//   - testpod serve: an HTTP server on :8080 that answers "hello from
//     <hostname>" on /, and on /connect?addr=HOST:PORT makes a connection
//     from inside the pod (its cgroup, its network namespace) and answers
//     with the outcome: "ok: <the peer's answer>", "EPERM", "timeout" or
//     the error. With $FIRST_CONNECT set, the very first thing it does,
//     before listening, is such a connection, whose outcome /first
//     answers: a pod's first connection, made as soon as it runs.
//     /lookup?name=NAME resolves NAME with the pod's resolver (its
//     /etc/resolv.conf, as any program does) and answers "ok: <addresses>"
//     or the error. With $DNS_SERVER set, it also answers DNS on port 53
//     (UDP and TCP): *.allowed.test and *.denied.test have an address
//     each, other names none.
//   - testpod pause: the pod sandbox's process (containerd's
//     sandbox_image): it waits for SIGTERM or SIGINT.
//   - testpod load ADDR DURATION WORKERS: a load generator (the kube-proxy
//     benchmark runs it in the outside client's namespace): WORKERS loops,
//     for DURATION, each making a new TCP connection to ADDR, one HTTP/1.0
//     GET on it and reading the answer to its end; prints one JSON line
//     with the count of such exchanges, the failures and the latency
//     percentiles (dial to the answer's end).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

func main() {
	mode := ""
	if len(os.Args) > 1 {
		mode = os.Args[1]
	}
	switch mode {
	case "serve":
		serve()
	case "load":
		if len(os.Args) != 5 {
			fmt.Fprintln(os.Stderr, "usage: testpod load ADDR DURATION WORKERS")
			os.Exit(2)
		}
		if err := load(os.Args[2], os.Args[3], os.Args[4]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	case "pause":
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
	default:
		fmt.Fprintln(os.Stderr, "usage: testpod serve|pause|load")
		os.Exit(2)
	}
}

func serve() {
	first := "none"
	if addr := os.Getenv("FIRST_CONNECT"); addr != "" {
		first = connect(addr)
		fmt.Printf("first connection to %s: %s\n", addr, first)
	}
	host, _ := os.Hostname()
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s", host)
	})
	mux.HandleFunc("/first", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, first)
	})
	mux.HandleFunc("/connect", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, connect(r.URL.Query().Get("addr")))
	})
	mux.HandleFunc("/lookup", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, lookup(r.URL.Query().Get("name")))
	})
	if os.Getenv("DNS_SERVER") != "" {
		for _, network := range []string{"udp", "tcp"} {
			srv := &dns.Server{Addr: ":53", Net: network, Handler: dns.HandlerFunc(answer)}
			go func() {
				if err := srv.ListenAndServe(); err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
			}()
		}
	}
	srv := &http.Server{Addr: ":8080", Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		srv.Close()
	}()
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// connect makes an HTTP request to addr and says how it went.
func connect(addr string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return err.Error()
	}
	resp, err := client.Do(req)
	switch {
	case errors.Is(err, syscall.EPERM):
		return "EPERM"
	case errors.Is(err, context.DeadlineExceeded), isTimeout(err):
		return "timeout"
	case err != nil:
		return strings.TrimSpace(err.Error())
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "read: " + err.Error()
	}
	return "ok: " + string(body)
}

// lookup resolves name's IPv4 addresses as any program of the pod would.
func lookup(name string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupIP(ctx, "ip4", name)
	if err != nil {
		return "error: " + err.Error()
	}
	out := make([]string, len(ips))
	for i, ip := range ips {
		out[i] = ip.String()
	}
	return "ok: " + strings.Join(out, ",")
}

// answer is the DNS server of a pod with $DNS_SERVER.
func answer(w dns.ResponseWriter, req *dns.Msg) {
	resp := new(dns.Msg).SetReply(req)
	for _, q := range req.Question {
		ip := ""
		switch {
		case strings.HasSuffix(q.Name, ".allowed.test."):
			ip = "192.0.2.10"
		case strings.HasSuffix(q.Name, ".denied.test."):
			ip = "192.0.2.20"
		}
		if ip != "" && q.Qtype == dns.TypeA {
			resp.Answer = append(resp.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30},
				A:   net.ParseIP(ip),
			})
		}
	}
	w.WriteMsg(resp)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
