package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"
)

// loadResult is what testpod load prints, one JSON line.
type loadResult struct {
	Conns    int     `json:"conns"`
	Errors   int     `json:"errors"`
	FirstErr string  `json:"first_error,omitempty"`
	Seconds  float64 `json:"seconds"`
	P50us    float64 `json:"p50_us"`
	P90us    float64 `json:"p90_us"`
	P99us    float64 `json:"p99_us"`
}

// load runs workers loops of one connection, one request, one answer
// against addr for the duration given, and prints a loadResult.
func load(addr, duration, workers string) error {
	d, err := time.ParseDuration(duration)
	if err != nil {
		return fmt.Errorf("duration: %w", err)
	}
	w, err := strconv.Atoi(workers)
	if err != nil || w < 1 {
		return fmt.Errorf("workers %q: want a positive number", workers)
	}
	var (
		mu       sync.Mutex
		lat      []time.Duration
		errs     int
		firstErr string
		wg       sync.WaitGroup
	)
	start := time.Now()
	end := start.Add(d)
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			var myErrs int
			var myFirst string
			for time.Now().Before(end) {
				t0 := time.Now()
				if err := exchange(addr); err != nil {
					myErrs++
					if myFirst == "" {
						myFirst = err.Error()
					}
					continue
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, mine...)
			errs += myErrs
			if firstErr == "" {
				firstErr = myFirst
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	took := time.Since(start)
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds())
	}
	return json.NewEncoder(os.Stdout).Encode(loadResult{
		Conns: len(lat), Errors: errs, FirstErr: firstErr, Seconds: took.Seconds(),
		P50us: pct(0.50), P90us: pct(0.90), P99us: pct(0.99),
	})
}

// exchange makes one connection to addr, sends one HTTP/1.0 request and
// reads the answer until the server closes the connection.
func exchange(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: bench\r\n\r\n"); err != nil {
		return err
	}
	body, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if !bytes.HasPrefix(body, []byte("HTTP/1.0 200")) && !bytes.HasPrefix(body, []byte("HTTP/1.1 200")) {
		return fmt.Errorf("answer %.40q", body)
	}
	return nil
}
