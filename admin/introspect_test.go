package admin_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/admin"
	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

type probeAnswer struct {
	Format string `json:"format"`
	Model  string `json:"model"`
}

func TestProbeHandler(t *testing.T) {
	var deadline bool
	h := admin.ProbeHandler(func(ctx context.Context, req *prefixkey.Request) (probeAnswer, error) {
		_, deadline = ctx.Deadline()
		if req.Model == "fail" {
			return probeAnswer{}, errors.New("boom")
		}
		return probeAnswer{Format: req.Format.String(), Model: req.Model}, nil
	}, 1<<10)
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		name, query, body, header string
		code                      int
		format                    string
	}{
		{"chat inferred", "", chat, "", 200, "openai_chat"},
		{"chat named", "?api=chat", chat, "", 200, "openai_chat"},
		{"completions inferred", "", `{"model":"m","prompt":"hello"}`, "", 200, "openai_completion"},
		{"messages inferred by system", "", `{"model":"m","system":"s","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "", 200, "anthropic_messages"},
		{"messages inferred by header", "", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "2023-06-01", 200, "anthropic_messages"},
		{"messages named", "?api=messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, "", 200, "anthropic_messages"},
		{"bad api", "?api=embeddings", chat, "", 400, ""},
		{"not JSON", "", `nope`, "", 400, ""},
		{"malformed for its api", "?api=completions", chat, "", 400, ""},
		{"too large", "", `{"model":"m","prompt":"` + strings.Repeat("x", 2000) + `"}`, "", 413, ""},
		{"probe fails", "", `{"model":"fail","prompt":"x"}`, "", 500, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest("POST", "/admin/route/probe"+tc.query, strings.NewReader(tc.body))
			if tc.header != "" {
				r.Header.Set("anthropic-version", tc.header)
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != tc.code || w.Header().Get("Content-Type") != "application/json" {
				t.Fatalf("%d %q: %s", w.Code, w.Header().Get("Content-Type"), w.Body)
			}
			if tc.code != 200 {
				var e struct{ Error string }
				if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error == "" {
					t.Fatalf("error body %s: %v", w.Body, err)
				}
				return
			}
			var got probeAnswer
			if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil || got.Format != tc.format || got.Model != "m" {
				t.Fatalf("answer %s (%v), want format %s", w.Body, err, tc.format)
			}
			if !deadline {
				t.Error("the probe ran without a deadline")
			}
		})
	}
}

// dumper lists n entries, or fails after failAfter of them (−1: never).
func dumper(n, failAfter int, gotLimit *int) kvindex.Dumper {
	return kvindex.DumperFunc(func(ctx context.Context, backend string, limit int, fn func(kvindex.DumpEntry) error) error {
		*gotLimit = limit
		if _, ok := ctx.Deadline(); !ok {
			return errors.New("no deadline")
		}
		for i := range min(n, limit) {
			if i == failAfter {
				return errors.New("index down")
			}
			if err := fn(kvindex.DumpEntry{Backend: backend, Key: uint64(i), Tiers: []kvindex.Tier{0}}); err != nil {
				return err
			}
		}
		if failAfter == n {
			return errors.New("index down")
		}
		return nil
	})
}

func TestDumpHandler(t *testing.T) {
	for _, tc := range []struct {
		name, query     string
		n, failAfter    int
		code, lines     int
		limit           int
		lastLineIsError bool
	}{
		{"default limit", "?backend=b", 5000, -1, 200, kvindex.DefaultDumpLimit, kvindex.DefaultDumpLimit, false},
		{"limit", "?backend=b&limit=7", 100, -1, 200, 7, 7, false},
		{"fewer than the limit", "?backend=b&limit=600", 300, -1, 200, 300, 600, false},
		{"largest limit", fmt.Sprintf("?backend=b&limit=%d", admin.MaxDumpLimit), 3, -1, 200, 3, admin.MaxDumpLimit, false},
		{"nothing", "?backend=b", 0, -1, 200, 0, kvindex.DefaultDumpLimit, false},
		{"no backend", "?limit=5", 1, -1, 400, 0, 0, false},
		{"limit 0", "?backend=b&limit=0", 1, -1, 400, 0, 0, false},
		{"limit not a number", "?backend=b&limit=ten", 1, -1, 400, 0, 0, false},
		{"limit too large", fmt.Sprintf("?backend=b&limit=%d", admin.MaxDumpLimit+1), 1, -1, 400, 0, 0, false},
		{"fails at once", "?backend=b", 10, 0, 500, 0, kvindex.DefaultDumpLimit, false},
		{"fails midway", "?backend=b", 10, 4, 200, 5, kvindex.DefaultDumpLimit, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var limit int
			w := httptest.NewRecorder()
			admin.DumpHandler(dumper(tc.n, tc.failAfter, &limit)).ServeHTTP(w, httptest.NewRequest("GET", "/admin/kv-index/dump"+tc.query, nil))
			if w.Code != tc.code {
				t.Fatalf("status %d, want %d: %s", w.Code, tc.code, w.Body)
			}
			if limit != tc.limit {
				t.Errorf("the dumper got limit %d, want %d", limit, tc.limit)
			}
			if tc.code != 200 {
				if ct := w.Header().Get("Content-Type"); ct != "application/json" || !strings.Contains(w.Body.String(), `"error"`) {
					t.Errorf("%s %s, want a JSON error", ct, w.Body)
				}
				return
			}
			if ct := w.Header().Get("Content-Type"); ct != "application/x-ndjson" {
				t.Errorf("Content-Type %q", ct)
			}
			sc := bufio.NewScanner(w.Body)
			lines := 0
			var last string
			for sc.Scan() {
				last = sc.Text()
				var e kvindex.DumpEntry
				if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
					t.Fatalf("line %d %q: %v", lines, last, err)
				}
				lines++
			}
			if lines != tc.lines {
				t.Errorf("%d lines, want %d", lines, tc.lines)
			}
			if strings.Contains(last, `"error"`) != tc.lastLineIsError {
				t.Errorf("last line %s", last)
			}
		})
	}
}

// A dump that outlives its deadline ends with an error line.
func TestDumpHandlerDeadline(t *testing.T) {
	d := kvindex.DumperFunc(func(ctx context.Context, backend string, limit int, fn func(kvindex.DumpEntry) error) error {
		if err := fn(kvindex.DumpEntry{Backend: backend}); err != nil {
			return err
		}
		dl, _ := ctx.Deadline()
		if time.Until(dl) > admin.DumpTimeout {
			return errors.New("deadline beyond DumpTimeout")
		}
		return context.DeadlineExceeded
	})
	w := httptest.NewRecorder()
	admin.DumpHandler(d).ServeHTTP(w, httptest.NewRequest("GET", "/admin/kv-index/dump?backend=x", nil))
	if w.Code != http.StatusOK || !strings.HasSuffix(strings.TrimSpace(w.Body.String()), `{"error":"dump: context deadline exceeded"}`) {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
}

// A client that asks for a long dump and stops reading does not hold the handler past the
// deadline: the writes are bounded too.
func TestDumpHandlerStalledClient(t *testing.T) {
	defer admin.SetDumpTimeout(500 * time.Millisecond)()
	done := make(chan struct{})
	d := kvindex.DumperFunc(func(ctx context.Context, backend string, limit int, fn func(kvindex.DumpEntry) error) error {
		for range limit {
			if err := fn(kvindex.DumpEntry{Backend: backend, Key: 0xfeedfacecafebeef, Tiers: []kvindex.Tier{events.TierGPU}}); err != nil {
				return err
			}
		}
		return nil
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(done)
		admin.DumpHandler(d).ServeHTTP(w, r)
	}))
	defer srv.Close()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetReadBuffer(4096) // keep the kernel from absorbing the whole dump
	}
	if _, err := fmt.Fprintf(conn, "GET /?backend=x&limit=%d HTTP/1.1\r\nHost: x\r\n\r\n", admin.MaxDumpLimit); err != nil {
		t.Fatal(err)
	}
	// Never read. The handler must give up once its deadline passes.
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the dump handler is still writing to a client that stopped reading, 20 s after a 500 ms deadline")
	}
}
