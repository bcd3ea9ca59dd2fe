package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// requestTimeout bounds one request; maxRequestsPerRun bounds a closed-loop run's count.
const (
	requestTimeout    = 10 * time.Second
	maxRequestsPerRun = 10_000_000
)

// target is one path to the engine, with its own clients (one per connection).
type target struct {
	id      string // "a" … "e"
	name    string
	url     string // POST url
	body    func() []byte
	xcache  string // expected X-Cache header; "" when not checked
	front   int    // the index of the process serving it in the run's cpuMeter
	clients []*http.Client
}

// newClients returns n clients, each with a Transport of its own that keeps one connection, so
// that n clients are n connections.
func newClients(n int) []*http.Client {
	cs := make([]*http.Client, n)
	for i := range cs {
		cs[i] = &http.Client{
			Timeout: requestTimeout,
			Transport: &http.Transport{
				Proxy:               nil,
				DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
				MaxIdleConns:        1,
				MaxIdleConnsPerHost: 1,
				MaxConnsPerHost:     1,
				IdleConnTimeout:     5 * time.Minute,
				DisableCompression:  true,
			},
		}
	}
	return cs
}

// closeClients closes the idle connections of ts' clients.
func closeClients(ts []*target) {
	for _, t := range ts {
		for _, c := range t.clients {
			c.CloseIdleConnections()
		}
	}
}

// systemPrompt is a system prompt of about 1 KiB, the same in every request.
var systemPrompt = func() string {
	sentences := []string{
		"You are a careful assistant for the support desk of an online bookshop.",
		"Answer in plain English, in at most three sentences, and never invent an order number.",
		"When a customer asks about delivery, give the usual times: two to four working days at home, five to eight abroad.",
		"When a customer asks for a refund, explain that unopened books can be returned within thirty days.",
		"Be polite, be brief, and do not repeat the question back to the customer.",
		"If you do not know the answer, say so and offer to pass the question to a human colleague.",
	}
	var b strings.Builder
	for i := 0; b.Len() < 1024; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(sentences[i%len(sentences)])
	}
	return b.String()
}()

// chatBody returns a function giving request bodies: the system prompt and a user message that
// is "tag #N" with N counting up when vary is set (each body new), or fixed otherwise.
func chatBody(model, tag string, maxTokens int, vary bool) func() []byte {
	quote := func(s string) string { b, _ := json.Marshal(s); return string(b) } // a string always marshals
	head := []byte(`{"model":` + quote(model) + `,"temperature":0,"max_tokens":` + strconv.Itoa(maxTokens) +
		`,"messages":[{"role":"system","content":` + quote(systemPrompt) + `},{"role":"user","content":"` +
		`Question ` + tag + ` #`)
	tail := []byte(`: where is my order?"}]}`)
	if !vary {
		b := slices.Concat(head, []byte("0"), tail)
		return func() []byte { return b }
	}
	var n atomic.Uint64
	return func() []byte {
		b := make([]byte, 0, len(head)+20+len(tail))
		b = append(b, head...)
		b = strconv.AppendUint(b, n.Add(1), 10)
		return append(b, tail...)
	}
}

// do sends one request over c and reads the whole answer. It fails on a transport error, a
// status other than 200 and an X-Cache other than t.xcache.
func (t *target) do(ctx context.Context, c *http.Client) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url, bytes.NewReader(t.body()))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		return err
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("status %d", resp.StatusCode)
	case t.xcache != "" && resp.Header.Get("X-Cache") != t.xcache:
		return fmt.Errorf("X-Cache %q, want %q", resp.Header.Get("X-Cache"), t.xcache)
	}
	return nil
}

// load is a way of sending requests: closed loop on one connection (rate 0) or open loop at
// rate requests per second over conns connections.
type load struct {
	name  string
	conns int
	rate  float64
}

// sample is what one run of one target under one load measured.
type sample struct {
	lat      []time.Duration // sorted
	errors   int
	firstErr error
	elapsed  time.Duration
	cpu      []time.Duration // CPU time of each measured process during the run; nil if unknown
}

// percentile returns the nearest-rank p-th percentile (0 < p ≤ 100) of s.lat; 0 when empty.
func (s *sample) percentile(p float64) time.Duration {
	if len(s.lat) == 0 {
		return 0
	}
	i := int(float64(len(s.lat))*p/100+0.999999) - 1
	return s.lat[min(max(i, 0), len(s.lat)-1)]
}

// throughput returns the completed requests per second.
func (s *sample) throughput() float64 {
	if s.elapsed <= 0 {
		return 0
	}
	return float64(len(s.lat)) / s.elapsed.Seconds()
}

// run sends t requests under l for d (bounded by ctx) and returns what it measured.
func (l load) run(ctx context.Context, t *target, d time.Duration) *sample {
	if l.rate == 0 {
		return closedLoop(ctx, t, t.clients[0], d)
	}
	return openLoop(ctx, t, t.clients[:l.conns], l.rate, d)
}

// closedLoop sends one request at a time over c for d.
func closedLoop(ctx context.Context, t *target, c *http.Client, d time.Duration) *sample {
	s := &sample{lat: make([]time.Duration, 0, 1<<14)}
	start := time.Now()
	end := start.Add(d)
	for i := 0; i < maxRequestsPerRun && ctx.Err() == nil; i++ {
		t0 := time.Now()
		if !t0.Before(end) {
			break
		}
		if err := t.do(ctx, c); err != nil {
			s.fail(err)
			continue
		}
		s.lat = append(s.lat, time.Since(t0))
	}
	s.elapsed = time.Since(start)
	slices.Sort(s.lat)
	return s
}

func (s *sample) fail(err error) {
	if s.errors == 0 {
		s.firstErr = err
	}
	s.errors++
}

// openLoop sends requests at rate per second in total over clients for d: client k sends
// requests k, k+n, k+2n, … (n clients) at t₀ + i/rate. A request sent late because its client
// was still busy is timed from its scheduled time; one sent on time from its send.
func openLoop(ctx context.Context, t *target, clients []*http.Client, rate float64, d time.Duration) *sample {
	n := len(clients)
	interval := float64(time.Second) / rate
	total := int(d.Seconds() * rate)
	t0 := time.Now().Add(time.Millisecond)
	parts := make([]*sample, n)
	var wg sync.WaitGroup
	for k := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := &sample{lat: make([]time.Duration, 0, total/n+1)}
			parts[k] = s
			for i := k; i < total && ctx.Err() == nil; i += n {
				sched := t0.Add(time.Duration(float64(i) * interval))
				start := time.Now()
				if start.Before(sched) {
					if !sleepUntil(ctx, sched) {
						return
					}
					start = time.Now()
				} else {
					start = sched // behind schedule: the wait counts
				}
				if err := t.do(ctx, clients[k]); err != nil {
					s.fail(err)
					continue
				}
				s.lat = append(s.lat, time.Since(start))
			}
		}()
	}
	wg.Wait()
	out := &sample{elapsed: time.Since(t0)}
	for _, p := range parts {
		out.lat = append(out.lat, p.lat...)
		if p.errors > 0 && out.errors == 0 {
			out.firstErr = p.firstErr
		}
		out.errors += p.errors
	}
	slices.Sort(out.lat)
	return out
}

// sleepUntil sleeps until when or until ctx ends; it reports whether it reached when.
func sleepUntil(ctx context.Context, when time.Time) bool {
	tm := time.NewTimer(time.Until(when))
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}
