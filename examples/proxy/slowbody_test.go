package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/testenv"
)

// stalledConns keeps n connections to addr that announce an 8 MiB body, send one byte and stall,
// each one cut replaced by another, until the returned stop is called; stop returns how long the
// cut ones waited for their answer and the answers that were not a 408 with the connection closed.
func stalledConns(addr string, n int) (stop func() ([]time.Duration, []string)) {
	var (
		mu    sync.Mutex
		waits []time.Duration
		bad   []string
		wg    sync.WaitGroup
	)
	ctx, cancel := context.WithCancel(context.Background())
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				c, err := net.Dial("tcp", addr)
				if err != nil {
					mu.Lock()
					bad = append(bad, err.Error())
					mu.Unlock()
					return
				}
				start := time.Now()
				_ = c.SetDeadline(start.Add(10 * time.Second))
				_, _ = io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
					"Content-Length: 8388608\r\n\r\n{")
				unhook := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				unhook()
				c.Close()
				mu.Lock()
				switch {
				case err != nil && ctx.Err() != nil: // stopped
				case err != nil:
					bad = append(bad, err.Error())
				case resp.StatusCode != http.StatusRequestTimeout || !resp.Close:
					bad = append(bad, fmt.Sprintf("%d close=%v", resp.StatusCode, resp.Close))
				default:
					waits = append(waits, time.Since(start))
				}
				mu.Unlock()
			}
		})
	}
	return func() ([]time.Duration, []string) {
		cancel()
		wg.Wait()
		return waits, bad
	}
}

// Through the proxy with its default body budget (128 MiB) and read_timeout (60 s): 16, then 64,
// connections that announce 8 MiB, send a byte and stall (replaced as they are cut) refuse none
// of a client's 10 small requests a second, and each is cut with 408 and a closed connection
// after server.body_idle_timeout (300 ms here), long before read_timeout. Before, 16 of them
// held the whole budget and the client got 503 for 60 s.
func TestProxyStalledBodiesDenyNobody(t *testing.T) {
	for _, n := range []int{16, 64} {
		t.Run(fmt.Sprintf("connections=%d", n), func(t *testing.T) {
			up := newFakeUpstream(t, "a")
			p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
				c.Server.BodyIdleTimeout = config.Duration(300 * time.Millisecond)
			}))
			stop := stalledConns(strings.TrimPrefix(p.URL, "http://"), n)
			time.Sleep(200 * time.Millisecond) // the attack under way first (not a wait for an event)
			refused := 0
			tick := time.NewTicker(100 * time.Millisecond)
			for i := range 20 {
				<-tick.C
				r, b := post(t, p.URL+"/v1/chat/completions", chatBody("s", fmt.Sprint("question ", i), ""))
				if r.StatusCode != http.StatusOK {
					refused++
					t.Logf("request %d: %d %s", i, r.StatusCode, b)
				}
			}
			tick.Stop()
			waits, bad := stop()
			if refused != 0 {
				t.Errorf("%d of 20 small requests refused during the attack", refused)
			}
			if len(bad) > 0 {
				t.Errorf("%d stalled connections not answered 408 with the connection closed, e.g. %q", len(bad), bad[:min(len(bad), 3)])
			}
			if len(waits) < n {
				t.Errorf("%d stalled bodies cut, want at least %d", len(waits), n)
			}
			for _, w := range waits {
				if w > 5*time.Second {
					t.Errorf("a stalled body was cut after %v (body_idle_timeout 300ms, read_timeout 60s)", w)
					break
				}
			}
		})
	}
}

// clientFrom returns an HTTP client whose connections come from the local address ip.
func clientFrom(t *testing.T, ip string) *http.Client {
	tr := &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}).DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// One client address holds at most server.max_client_body_bytes of the bodies in flight: its
// next large body gets 503 while another address's goes through. (Linux: 127.0.0.2 is a second
// loopback address.)
func TestProxyClientBodyBound(t *testing.T) {
	if c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}).Dial("tcp", "127.0.0.1:1"); err != nil && strings.Contains(err.Error(), "assign requested address") {
		testenv.SkipOrFail(t, "no second loopback address here: "+err.Error())
	} else if c != nil {
		c.Close()
	}
	const mib = 1 << 20
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, func(c *config.Config) {
		c.Server.MaxBodyBytes = 2 * mib
		c.Server.MaxInflightBodyBytes = 8 * mib
		c.Server.MaxClientBodyBytes = 3 * mib
	}))
	addr := strings.TrimPrefix(p.URL, "http://")
	// 127.0.0.1 sends most of two bodies of 1.5 MiB and stalls: it holds its 3 MiB.
	for range 2 {
		c, _ := dialRaw(t, addr)
		_ = c.SetDeadline(time.Time{})
		fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", 3*mib/2, strings.Repeat(" ", 3*mib/2-10))
	}
	waitFor(t, 5*time.Second, "3 MiB held", func() bool {
		if p.server.bodies.TryAcquire(5*mib + 1) {
			p.server.bodies.Release(5*mib + 1)
			return false
		}
		return true
	})
	body := chatBody("s", strings.Repeat("x", mib), "")
	send := func(c *http.Client) (int, string) {
		r, err := c.Post(p.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		b, _ := io.ReadAll(r.Body)
		return r.StatusCode, string(b)
	}
	if code, b := send(clientFrom(t, "127.0.0.1")); code != http.StatusServiceUnavailable || !strings.Contains(b, "from this client") {
		t.Errorf("the holder's third body: %d %s; want 503 for its address", code, b)
	}
	if code, b := send(clientFrom(t, "127.0.0.2")); code != http.StatusOK {
		t.Errorf("another address's body: %d %s", code, b)
	}
}

// The pass-through (/v1/ beyond the LLM endpoints) forwards no path with dot or empty segments,
// encoded or not, nor one whose decoded form leaves /v1/: each gets 400 invalid_path in the
// OpenAI style, and the backend sees none of them.
func TestPassThroughDotSegments(t *testing.T) {
	up := newFakeUpstream(t, "a")
	p := startProxy(t, fakeConfig(t, []config.BackendConfig{{Name: "a", URL: up.URL}}, nil))
	addr := strings.TrimPrefix(p.URL, "http://")
	for _, path := range []string{"/v1/%2e%2e/reset_prefix_cache", "/v1/..%2fx", "/v1/%2E%2E", "/v1/.%2e", "/v1/%2e%2E%2fadmin",
		"/v1/%2e%2e/%2e%2e/admin/kv-index/clear", "/v1/embeddings%2f..%2f..%2f..%2fadmin", "/v1/../reset_prefix_cache",
		"/v1/./embeddings", "/v1//embeddings", "/v1/%2fembeddings", "/v1/%00", "/v1/embeddings%0aX-Injected:%201", "/v1/a%7f"} {
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			c, br := dialRaw(t, addr)
			fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"model\":\"m\"}", method, path)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("%s %s: %v", method, path, err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"code":"invalid_path"`) || !strings.Contains(string(b), `{"error":{`) {
				t.Errorf("%s %s: %d %s; want 400 invalid_path in the OpenAI style", method, path, resp.StatusCode, b)
			}
		}
	}
	if n := up.requests.Load(); n != 0 {
		t.Errorf("the backend got %d of those requests", n)
	}
	if r, b := post(t, p.URL+"/v1/embeddings", `{"model":"m","input":"x"}`); r.StatusCode != http.StatusOK {
		t.Errorf("a plain pass-through path: %d %s", r.StatusCode, b)
	}
}
