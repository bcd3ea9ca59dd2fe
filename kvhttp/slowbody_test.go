package kvhttp_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvhttp"
)

// stallAttack keeps n connections to addr that announce an 8 MiB body, send one byte of it and
// stall; each one cut is replaced by another. It returns stop, which ends the attack and returns
// how long each cut connection waited for its answer and the answers that were not a 408 with
// the connection closed.
func stallAttack(t *testing.T, addr string, n int) (stop func() (waits []time.Duration, bad []string)) {
	t.Helper()
	var (
		mu    sync.Mutex
		waits []time.Duration
		bad   []string
		wg    sync.WaitGroup
	)
	done := make(chan struct{})
	for range n {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
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
				stopped := context.AfterFunc(closedCtx(done), func() { _ = c.SetDeadline(time.Unix(1, 0)) })
				res, err := http.ReadResponse(bufio.NewReader(c), nil)
				stopped()
				c.Close()
				mu.Lock()
				switch {
				case err != nil && isClosed(done):
				case err != nil:
					bad = append(bad, err.Error())
				case res.StatusCode != http.StatusRequestTimeout || !res.Close:
					bad = append(bad, fmt.Sprintf("%d close=%v", res.StatusCode, res.Close))
				default:
					waits = append(waits, time.Since(start))
				}
				mu.Unlock()
			}
		})
	}
	return func() ([]time.Duration, []string) {
		close(done)
		wg.Wait()
		return waits, bad
	}
}

// closedCtx is a context that ends when done is closed.
func closedCtx(done chan struct{}) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-done; cancel() }()
	return ctx
}

func isClosed(done chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// Connections that announce 8 MiB, send one byte and stall (16 of them, then 64, replaced as
// they are cut) hold almost nothing of the body budget: a client sending 10 small requests a
// second meanwhile is never refused, and each stalled body is cut with 408 and a closed
// connection after BodyIdleTimeout, long before ReadTimeout. (Before the budget was charged for
// bytes received, 16 such connections held the whole 128 MiB and every other request got 503.)
func TestStalledBodiesDenyNobody(t *testing.T) {
	for _, n := range []int{16, 64} {
		t.Run(fmt.Sprintf("connections=%d", n), func(t *testing.T) {
			backend := upstream(t, func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				_, _ = io.WriteString(w, `{}`)
			})
			router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}}})
			require.NoError(t, err)
			defer router.Close()
			budget := kvhttp.NewBudget(128 << 20)
			gw := gateway(t, &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"a": backend},
				BodyBudget: budget, BodyIdleTimeout: 300 * time.Millisecond, ReadTimeout: time.Minute})
			stop := stallAttack(t, strings.TrimPrefix(gw, "http://"), n)
			time.Sleep(200 * time.Millisecond) // the attack under way before the first request (not a wait for an event)
			refused := 0
			tick := time.NewTicker(100 * time.Millisecond)
			for i := range 20 { // 10 requests a second for 2 s
				<-tick.C
				body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"question %d"}]}`, i)
				res, err := http.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(body))
				require.NoError(t, err)
				b, _ := io.ReadAll(res.Body)
				res.Body.Close()
				if res.StatusCode != http.StatusOK {
					refused++
					t.Logf("request %d: %d %s", i, res.StatusCode, b)
				}
			}
			tick.Stop()
			waits, bad := stop()
			assert.Zero(t, refused, "small requests refused during the attack")
			if len(bad) > 0 {
				t.Errorf("%d stalled connections not answered 408 with the connection closed, e.g. %q", len(bad), bad[:min(len(bad), 3)])
			}
			assert.GreaterOrEqual(t, len(waits), n, "stalled bodies cut")
			for _, w := range waits {
				if w > 5*time.Second {
					t.Errorf("a stalled body was cut after %v: the idle timeout is 300ms, the read timeout 1m", w)
					break
				}
			}
			waitBudgetFree(t, budget, 128<<20)
		})
	}
}

// waitBudgetFree waits until the whole of budget, of size bytes, is free again.
func waitBudgetFree(t *testing.T, budget *kvhttp.Budget, size int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !budget.TryAcquire(size) {
		if time.Now().After(deadline) {
			t.Fatal("the budget was not given back")
		}
		time.Sleep(10 * time.Millisecond)
	}
	budget.Release(size)
}

// partialBody sends, from client, the headers of a body of size bytes and sent of its bytes, and
// keeps the connection open (the body unfinished) until the test ends.
func partialBody(t *testing.T, gw, client string, size, sent int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(gw, "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	_, err = fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Client: %s\r\nContent-Length: %d\r\n\r\n%s",
		client, size, strings.Repeat(" ", sent))
	require.NoError(t, err)
	return c
}

// postAs posts body as client and returns the status and the answer.
func postAs(t *testing.T, gw, client, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, gw+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("X-Client", client)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// largeChat is a chat body of about size bytes.
func largeChat(size int) string {
	return `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a", size) + `"}]}`
}

// The bodies of one client hold at most MaxClientBodyBytes: its next large body is refused with
// 503 while another client's goes through; and large bodies may not take the budget's last
// quarter, which small ones still get.
func TestBodyBudgetBounds(t *testing.T) {
	backend := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, `{}`)
	})
	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}}})
	require.NoError(t, err)
	defer router.Close()
	const mib = 1 << 20
	budget := kvhttp.NewBudget(8 * mib)
	gw := gateway(t, &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"a": backend},
		BodyBudget: budget, MaxBodyBytes: 2 * mib, MaxClientBodyBytes: 3 * mib,
		ClientKey: func(r *http.Request) string { return r.Header.Get("X-Client") }})
	// held reports whether at least n bytes of the budget are held (probing it).
	held := func(n int64) bool {
		if budget.TryAcquire(8*mib - n + 1) {
			budget.Release(8*mib - n + 1)
			return false
		}
		return true
	}

	// The attacker sends most of three bodies of 1.5 MiB and stalls: it holds 3 MiB, its bound
	// (the third body is refused: a 503 and a closed connection).
	a1 := partialBody(t, gw, "attacker", 3*mib/2, 3*mib/2-10)
	a2 := partialBody(t, gw, "attacker", 3*mib/2, 3*mib/2-10)
	waitHeld(t, held, 3*mib-20)
	code, b := postAs(t, gw, "attacker", largeChat(mib))
	assert.Equal(t, http.StatusServiceUnavailable, code, b)
	assert.Contains(t, b, "from this client")
	// Another client's large body goes through.
	code, b = postAs(t, gw, "other", largeChat(mib))
	assert.Equal(t, http.StatusOK, code, b)

	// Two more clients fill the large bodies' 6 MiB (three quarters of 8): a large body waits,
	// then is refused; small ones use the reserve.
	partialBody(t, gw, "b", 3*mib/2, 3*mib/2-10)
	partialBody(t, gw, "c", 3*mib/2, 3*mib/2-10)
	waitHeld(t, held, 6*mib-40)
	code, b = postAs(t, gw, "other", largeChat(mib))
	assert.Equal(t, http.StatusServiceUnavailable, code, b)
	assert.NotContains(t, b, "from this client")
	for i := range 20 {
		code, b = postAs(t, gw, fmt.Sprint("small", i), largeChat(10<<10))
		require.Equal(t, http.StatusOK, code, b)
	}
	a1.Close()
	a2.Close()
}

// waitHeld waits until held reports at least n bytes held.
func waitHeld(t *testing.T, held func(int64) bool, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !held(n) {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes never held", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// idleGateway serves a Handler in front of backend with a 300 ms body idle timeout and a long
// ReadTimeout; it returns the gateway's URL.
func idleGateway(t *testing.T, backend *url.URL) string {
	t.Helper()
	router, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = router.Close() })
	return gateway(t, &kvhttp.Handler{Router: router, Backends: map[string]*url.URL{"a": backend},
		BodyIdleTimeout: 300 * time.Millisecond, ReadTimeout: time.Minute})
}

// idleBody is the request body of the idle-timeout tests.
const idleBody = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`

// sendSlowly posts idleBody to the gateway gw on a connection of its own: its first 10 bytes and
// then nothing when stall, else a byte at a time with a 100 ms pause every pauseEvery bytes (never
// idle for the 300 ms timeout). It returns the response and its body.
func sendSlowly(t *testing.T, gw string, stall bool, pauseEvery int) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(gw, "http://"))
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(idleBody))
	if stall {
		_, _ = io.WriteString(c, idleBody[:10])
	} else {
		for i := range len(idleBody) {
			_, _ = io.WriteString(c, idleBody[i:i+1])
			if i%pauseEvery == 0 {
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	return res, string(b)
}

// A body that trickles, a byte more often than the idle timeout, is not cut by it; one that
// stops is, whatever is left of ReadTimeout.
func TestBodyIdleTimeout(t *testing.T) {
	checkNoLeak(t)
	var got atomic.Int64
	gw := idleGateway(t, upstream(t, func(w http.ResponseWriter, r *http.Request) {
		got.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, `{}`)
	}))
	// Slower than the idle timeout in all, never idle for it.
	res, _ := sendSlowly(t, gw, false, 8)
	assert.Equal(t, http.StatusOK, res.StatusCode)

	res, b := sendSlowly(t, gw, true, 0)
	assert.Equal(t, http.StatusRequestTimeout, res.StatusCode, "%s", b)
	assert.True(t, res.Close)
	assert.Contains(t, b, "stalled")
	assert.EqualValues(t, 1, got.Load())
}

// A Handler reuses the idle watch of a body read in time for the next body: after many bodies
// read whole, a body that stops is still cut by the idle timeout, and one that trickles is not.
func TestBodyIdleTimeoutAfterReuse(t *testing.T) {
	checkNoLeak(t)
	gw := idleGateway(t, upstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, `{}`)
	}))
	client := &http.Client{}
	for range 50 {
		res, err := client.Post(gw+"/v1/chat/completions", "application/json", strings.NewReader(idleBody))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		require.Equal(t, http.StatusOK, res.StatusCode)
	}
	client.CloseIdleConnections()

	for _, stall := range []bool{true, false, true} {
		res, b := sendSlowly(t, gw, stall, 16)
		if stall {
			assert.Equal(t, http.StatusRequestTimeout, res.StatusCode, "%s", b)
			assert.Contains(t, b, "stalled")
		} else {
			assert.Equal(t, http.StatusOK, res.StatusCode, "%s", b)
		}
	}
}
