// Command demo-backend is the HTTP backend of scripts/demo-socketlb.sh: it
// listens on each address given and answers every request with the address
// that served it, so the demo can show which backend a request reached.
package main

import (
	"fmt"
	"log"
	"net/http"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: demo-backend ADDR:PORT...")
		os.Exit(2)
	}
	errs := make(chan error)
	for _, addr := range os.Args[1:] {
		srv := &http.Server{
			Addr: addr,
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "backend %s answered %s %s from %s\n", addr, r.Method, r.URL.Path, r.RemoteAddr)
			}),
		}
		go func() { errs <- srv.ListenAndServe() }()
	}
	log.Fatal(<-errs)
}
