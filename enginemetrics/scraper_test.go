package enginemetrics_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/enginemetrics"
	"github.com/kvroute/kvroute/telemetry"
)

func TestNewConfig(t *testing.T) {
	ok := map[string]string{"a": "http://127.0.0.1:8000/metrics"}
	for _, tc := range []struct {
		name string
		cfg  enginemetrics.Config
		good bool
	}{
		{"zero", enginemetrics.Config{}, true},
		{"targets", enginemetrics.Config{Targets: ok}, true},
		{"short interval, default timeout below it", enginemetrics.Config{Targets: ok, Interval: 50 * time.Millisecond}, true},
		{"bounds", enginemetrics.Config{Interval: enginemetrics.MaxInterval, Timeout: time.Minute, MaxBodyBytes: enginemetrics.MaxMaxBodyBytes}, true},
		{"interval too short", enginemetrics.Config{Interval: time.Millisecond}, false},
		{"interval too long", enginemetrics.Config{Interval: time.Hour}, false},
		{"timeout not below interval", enginemetrics.Config{Interval: time.Second, Timeout: time.Second}, false},
		{"default timeout not below interval", enginemetrics.Config{Interval: 500 * time.Millisecond, Timeout: enginemetrics.DefaultTimeout}, false},
		{"negative timeout", enginemetrics.Config{Timeout: -time.Second}, false},
		{"negative body limit", enginemetrics.Config{MaxBodyBytes: -1}, false},
		{"body limit too large", enginemetrics.Config{MaxBodyBytes: enginemetrics.MaxMaxBodyBytes + 1}, false},
		{"empty backend name", enginemetrics.Config{Targets: map[string]string{"": "http://h/metrics"}}, false},
		{"relative URL", enginemetrics.Config{Targets: map[string]string{"a": "/metrics"}}, false},
		{"other scheme", enginemetrics.Config{Targets: map[string]string{"a": "ftp://h/metrics"}}, false},
		{"no host", enginemetrics.Config{Targets: map[string]string{"a": "http:///metrics"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := enginemetrics.New(tc.cfg, nopSink)
			if !tc.good {
				require.ErrorIs(t, err, enginemetrics.ErrInvalidConfig)
				return
			}
			require.NoError(t, err)
			require.NoError(t, s.Close())
		})
	}
	_, err := enginemetrics.New(enginemetrics.Config{}, nil)
	require.ErrorIs(t, err, enginemetrics.ErrInvalidConfig, "nil sink")

	// The error names the bad URL without its password.
	_, err = enginemetrics.New(enginemetrics.Config{Targets: map[string]string{"a": "ftp://u:secret@h/metrics"}}, nopSink)
	require.ErrorIs(t, err, enginemetrics.ErrInvalidConfig)
	assert.NotContains(t, err.Error(), "secret")
}

// Each way a scrape can end: what the Sink gets, what Stats and the scrapes counter say.
func TestScrapeResults(t *testing.T) {
	big := fixture(t, "vllm.prom") + strings.Repeat("# padding comment line to grow the body past its limit\n", 2000)
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	for _, tc := range []struct {
		name    string
		h       http.HandlerFunc
		result  string
		engine  enginemetrics.Engine
		load    kvroute.EngineLoad // of ok
		errText string             // in LastError otherwise
	}{
		{"vLLM", body(fixture(t, "vllm.prom")), "ok", enginemetrics.EngineVLLM,
			kvroute.EngineLoad{Running: 7, Waiting: 3, KVCacheUsage: 0.4123}, ""},
		{"SGLang", body(fixture(t, "sglang.prom")), "ok", enginemetrics.EngineSGLang,
			kvroute.EngineLoad{Running: 38, Waiting: 7, KVCacheUsage: 0.3}, ""},
		{"500", func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "boom", http.StatusInternalServerError)
		}, "error", "", kvroute.EngineLoad{}, "status 500"},
		{"404", http.NotFound, "error", "", kvroute.EngineLoad{}, "status 404"},
		{"garbage", body("<html>502 Bad Gateway</html>\n"), "parse_error", "", kvroute.EngineLoad{}, "malformed"},
		{"not an engine", body("# TYPE node_load1 gauge\nnode_load1 0.5\n"), "parse_error", "", kvroute.EngineLoad{}, "no engine load metrics"},
		{"oversized, with its length", body(big), "too_large", "", kvroute.EngineLoad{}, "over the limit"},
		{"oversized, chunked", func(w http.ResponseWriter, _ *http.Request) {
			for i := 0; i < len(big); i += 4096 {
				_, _ = w.Write([]byte(big[i:min(i+4096, len(big))]))
				w.(http.Flusher).Flush()
			}
		}, "too_large", "", kvroute.EngineLoad{}, "over the limit"},
		{"hanging", func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-hang:
			case <-r.Context().Done():
			}
		}, "error", "", kvroute.EngineLoad{}, "deadline exceeded"},
		{"hanging mid-body", func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write([]byte("# HELP vllm:num_requests_running Number of requests\n"))
			w.(http.Flusher).Flush()
			select {
			case <-hang:
			case <-r.Context().Done():
			}
		}, "error", "", kvroute.EngineLoad{}, "deadline exceeded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each has its own target, scraper and meter provider
			srv := serve(t, tc.h)
			mp, rd := metricsReader(t)
			sink := newRecorder()
			s := start(t, enginemetrics.Config{Targets: map[string]string{"b": srv.URL + "/metrics"},
				Interval: 200 * time.Millisecond, Timeout: 100 * time.Millisecond, MaxBodyBytes: 64 << 10, MeterProvider: mp}, sink)
			scrapes := func() int64 {
				return counter(t, rd, telemetry.MetricEngineScrapes, "backend", "b", "result", tc.result)
			}
			// The metric and the stats are updated one after the other: wait for both.
			require.Eventually(t, func() bool {
				for _, st := range s.Stats() {
					if st.Backend == "b" && st.Scrapes >= 2 {
						return scrapes() >= 2
					}
				}
				return false
			}, waitFor, tick)
			st := statsOf(t, s, "b")
			assert.Equal(t, srv.URL+"/metrics", st.URL)
			assert.GreaterOrEqual(t, st.Scrapes, uint64(2))
			if tc.result != "ok" {
				assert.Zero(t, sink.count("b"), "a failed scrape reports nothing")
				assert.Equal(t, st.Scrapes, st.Failures)
				assert.GreaterOrEqual(t, st.ConsecutiveFailures, 2)
				assert.Contains(t, st.LastError, tc.errText)
				assert.Nil(t, st.LastLoad)
				assert.True(t, st.LastSuccess.IsZero())
				assert.False(t, st.LastFailure.IsZero())
				return
			}
			require.GreaterOrEqual(t, sink.count("b"), 2)
			l, _ := sink.last("b")
			assert.False(t, l.At.IsZero())
			assert.WithinDuration(t, time.Now(), l.At, waitFor)
			want := tc.load
			want.At = l.At
			assert.InDelta(t, want.KVCacheUsage, l.KVCacheUsage, 1e-9)
			want.KVCacheUsage = l.KVCacheUsage
			assert.Equal(t, want, l)
			assert.Equal(t, tc.engine, st.Engine)
			assert.Zero(t, st.Failures)
			assert.Zero(t, st.ConsecutiveFailures)
			assert.Empty(t, st.LastError)
			require.NotNil(t, st.LastLoad)
			assert.Equal(t, tc.load.Running, st.LastLoad.Running)
			assert.False(t, st.LastSuccess.IsZero())
		})
	}
}

// A target that hangs until its timeout, every time, does not slow the scrapes of another.
func TestSlowTargetDelaysNoOther(t *testing.T) {
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	slow := serve(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	})
	fast := serve(t, body(fixture(t, "vllm.prom")))
	sink := newRecorder()
	s := start(t, enginemetrics.Config{Targets: map[string]string{"slow": slow.URL, "fast": fast.URL},
		Interval: 50 * time.Millisecond, Timeout: 40 * time.Millisecond}, sink)
	// The fast target is scraped about once per interval while every scrape of the slow one
	// waits 40 ms for its timeout: 20 reports take about 1 s, however long a scrape of the slow
	// one takes.
	require.Eventually(t, func() bool { return sink.count("fast") >= 20 }, waitFor, tick)
	assert.Zero(t, sink.count("slow"))
	st := statsOf(t, s, "slow")
	assert.Positive(t, st.Failures)
	assert.Contains(t, st.LastError, "deadline exceeded")
}

func TestSetTargets(t *testing.T) {
	a := serve(t, body(sglangBody("m", 1, 0, 0.1)))
	b := serve(t, body(sglangBody("m", 2, 0, 0.2)))
	c := serve(t, body(sglangBody("m", 3, 0, 0.3)))
	sink := newRecorder()
	s, err := enginemetrics.New(enginemetrics.Config{Targets: map[string]string{"a": a.URL}, Interval: interval}, sink)
	require.NoError(t, err)
	defer s.Close()

	// Before Start, SetTargets only replaces the targets.
	require.NoError(t, s.SetTargets(map[string]string{"a": a.URL, "b": b.URL}))
	assert.Len(t, s.Stats(), 2)
	require.NoError(t, s.Start(context.Background()))
	require.ErrorIs(t, s.Start(context.Background()), enginemetrics.ErrStarted)
	require.Eventually(t, func() bool { return sink.count("a") >= 2 && sink.count("b") >= 2 }, waitFor, tick)

	// A bad entry changes nothing.
	require.ErrorIs(t, s.SetTargets(map[string]string{"a": a.URL, "c": "not a URL"}), enginemetrics.ErrInvalidConfig)
	assert.Len(t, s.Stats(), 2)

	// Remove a, add c: a gets nothing after SetTargets returns; b's stats go on.
	bScrapes := statsOf(t, s, "b").Scrapes
	require.NoError(t, s.SetTargets(map[string]string{"b": b.URL, "c": c.URL}))
	aReports := sink.count("a")
	require.Eventually(t, func() bool { return sink.count("c") >= 3 }, waitFor, tick)
	assert.Equal(t, aReports, sink.count("a"), "a removed backend was reported")
	stats := s.Stats()
	require.Len(t, stats, 2)
	assert.Equal(t, "b", stats[0].Backend)
	assert.Equal(t, "c", stats[1].Backend)
	assert.Greater(t, stats[0].Scrapes, bScrapes, "b kept its stats")
	l, _ := sink.last("c")
	assert.Equal(t, 3, l.Running)

	// A new URL for b: its stats start again, and its loads come from there.
	require.NoError(t, s.SetTargets(map[string]string{"b": a.URL, "c": c.URL}))
	assert.Equal(t, a.URL, statsOf(t, s, "b").URL)
	require.Eventually(t, func() bool {
		l, _ := sink.last("b")
		return l.Running == 1
	}, waitFor, tick)

	// Empty.
	require.NoError(t, s.SetTargets(nil))
	assert.Empty(t, s.Stats())
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.SetTargets(map[string]string{"a": a.URL}), enginemetrics.ErrClosed)
	require.ErrorIs(t, s.Start(context.Background()), enginemetrics.ErrClosed)
}

// Close ends every goroutine the Scraper started (its targets', its HTTP client's connections),
// even with a scrape hanging, and nothing is reported after it returns.
func TestCloseLeavesNoGoroutine(t *testing.T) {
	hang := make(chan struct{})
	defer close(hang)
	srvs := []string{
		serve(t, body(fixture(t, "vllm.prom"))).URL,
		serve(t, body(fixture(t, "sglang.prom"))).URL,
		serve(t, func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-hang:
			case <-r.Context().Done():
			}
		}).URL,
	}
	base := runtime.NumGoroutine()
	sink := newRecorder()
	s, err := enginemetrics.New(enginemetrics.Config{
		Targets:  map[string]string{"v": srvs[0], "s": srvs[1], "h": srvs[2]},
		Interval: interval, Timeout: interval / 2}, sink)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	require.Eventually(t, func() bool {
		return sink.count("v") >= 3 && sink.count("s") >= 3 && statsOf(t, s, "h").Failures >= 1
	}, waitFor, tick)
	assert.Greater(t, runtime.NumGoroutine(), base)
	require.NoError(t, s.Close())
	reported := sink.count("v") + sink.count("s")
	// Polled here: testify's Eventually runs its condition on a goroutine of its own.
	for deadline := time.Now().Add(waitFor); runtime.NumGoroutine() > base; time.Sleep(tick) {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("goroutines left: %d, want ≤ %d\n%s", runtime.NumGoroutine(), base, buf[:runtime.Stack(buf, true)])
		}
	}
	assert.Equal(t, reported, sink.count("v")+sink.count("s"), "reported after Close")
	require.NoError(t, s.Close(), "Close is idempotent")
}

// The end of Start's context stops the Scraper as Close does.
func TestStartContextStops(t *testing.T) {
	srv := serve(t, body(fixture(t, "vllm.prom")))
	sink := newRecorder()
	s, err := enginemetrics.New(enginemetrics.Config{Targets: map[string]string{"v": srv.URL}, Interval: interval}, sink)
	require.NoError(t, err)
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, s.Start(ctx))
	require.Eventually(t, func() bool { return sink.count("v") >= 2 }, waitFor, tick)
	cancel()
	// Once the goroutine has seen the cancellation, the count stays put.
	var last atomic.Int64
	require.Eventually(t, func() bool {
		n := int64(sink.count("v"))
		return last.Swap(n) == n && statsOf(t, s, "v").Scrapes == uint64(n)
	}, waitFor, 5*interval)
	require.NoError(t, s.Close())
}

// Redirects are followed within the target's host only.
func TestRedirects(t *testing.T) {
	other := serve(t, body(fixture(t, "vllm.prom")))
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			http.Redirect(w, r, "/metrics/", http.StatusMovedPermanently)
		case "/metrics/":
			body(fixture(t, "sglang.prom"))(w, r)
		case "/away":
			http.Redirect(w, r, other.URL+"/metrics", http.StatusFound)
		}
	})
	sink := newRecorder()
	s := start(t, enginemetrics.Config{Targets: map[string]string{"same": srv.URL + "/metrics", "away": srv.URL + "/away"}}, sink)
	require.Eventually(t, func() bool { return sink.count("same") >= 1 && statsOf(t, s, "away").Failures >= 1 }, waitFor, tick)
	assert.Equal(t, enginemetrics.EngineSGLang, statsOf(t, s, "same").Engine)
	assert.Contains(t, statsOf(t, s, "away").LastError, "another host")
	assert.Zero(t, sink.count("away"))
}

// The Sink's refusal is counted and shown, and the scrapes go on.
func TestSinkError(t *testing.T) {
	srv := serve(t, body(fixture(t, "vllm.prom")))
	mp, rd := metricsReader(t)
	sink := newRecorder()
	sink.err = errors.New("unknown backend")
	s := start(t, enginemetrics.Config{Targets: map[string]string{"v": srv.URL}, MeterProvider: mp}, sink)
	require.Eventually(t, func() bool { return counter(t, rd, telemetry.MetricEngineReportErrors, "backend", "v") >= 2 }, waitFor, tick)
	st := statsOf(t, s, "v")
	assert.Equal(t, "unknown backend", st.LastReportError)
	assert.Zero(t, st.Failures, "the scrape itself succeeded")
	assert.NotNil(t, st.LastLoad)
	assert.Positive(t, counter(t, rd, telemetry.MetricEngineScrapes, "backend", "v", "result", "ok"))
}

// logRecords is a slog handler that keeps the records.
type logRecords struct {
	mu  sync.Mutex
	got []slog.Record
}

func (h *logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecords) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.got = append(h.got, r.Clone())
	h.mu.Unlock()
	return nil
}
func (h *logRecords) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecords) WithGroup(string) slog.Handler      { return h }

func (h *logRecords) at(level slog.Level) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []slog.Record
	for _, r := range h.got {
		if r.Level == level {
			out = append(out, r)
		}
	}
	return out
}

func attrOf(r slog.Record, key string) slog.Value {
	var v slog.Value
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value
			return false
		}
		return true
	})
	return v
}

// A failing target warns once per LogEvery, counting the failures it did not log, and notes its
// recovery.
func TestWarningsRateLimited(t *testing.T) {
	var now atomic.Int64
	now.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	clock := func() time.Time { return time.Unix(0, now.Load()) }
	engine := &switchable{}
	engine.set("", true)
	srv := serve(t, engine.ServeHTTP)
	logs := &logRecords{}
	s := start(t, enginemetrics.Config{Targets: map[string]string{"v": srv.URL}, Logger: slog.New(logs), Now: clock},
		nopSink)
	require.Eventually(t, func() bool { return statsOf(t, s, "v").Failures >= 5 }, waitFor, tick)
	require.Len(t, logs.at(slog.LevelWarn), 1, "one warning within LogEvery")

	failures := statsOf(t, s, "v").Failures // all but the first unlogged
	now.Add(int64(enginemetrics.LogEvery))
	require.Eventually(t, func() bool { return len(logs.at(slog.LevelWarn)) == 2 }, waitFor, tick)
	second := logs.at(slog.LevelWarn)[1]
	assert.GreaterOrEqual(t, attrOf(second, "not_logged").Int64(), int64(failures-1))
	assert.Contains(t, attrOf(second, "error").String(), "status 500")

	engine.set(fixture(t, "vllm.prom"), false)
	require.Eventually(t, func() bool { return len(logs.at(slog.LevelInfo)) == 1 }, waitFor, tick)
	assert.Contains(t, logs.at(slog.LevelInfo)[0].Message, "recovered")
	// After a recovery, the next failure warns at once.
	engine.set("", true)
	require.Eventually(t, func() bool { return len(logs.at(slog.LevelWarn)) == 3 }, waitFor, tick)
}

func TestStatsJSON(t *testing.T) {
	srv := serve(t, body(fixture(t, "vllm.prom")))
	u := strings.Replace(srv.URL, "http://", "http://scraper:s3cret@", 1)
	s := start(t, enginemetrics.Config{Targets: map[string]string{"v": u + "/metrics", "down": "http://127.0.0.1:1/metrics"}},
		nopSink)
	require.Eventually(t, func() bool { return statsOf(t, s, "v").LastLoad != nil && statsOf(t, s, "down").Failures > 0 }, waitFor, tick)
	b, err := json.Marshal(s.Stats())
	require.NoError(t, err)
	assert.NotContains(t, string(b), "s3cret")
	var got []map[string]any
	require.NoError(t, json.Unmarshal(b, &got))
	require.Len(t, got, 2)
	down, v := got[0], got[1]
	assert.Equal(t, "down", down["backend"])
	assert.Contains(t, down, "last_error")
	assert.Contains(t, down, "last_failure")
	assert.NotContains(t, down, "last_success")
	assert.NotContains(t, down, "last_load")
	assert.Equal(t, "vllm", v["engine"])
	assert.Contains(t, v["url"], "scraper:xxxxx@")
	load, _ := v["last_load"].(map[string]any)
	assert.EqualValues(t, 7, load["running"])
	assert.EqualValues(t, 3, load["waiting"])
	for _, k := range []string{"scrapes", "failures", "consecutive_failures", "last_attempt", "last_success"} {
		assert.Contains(t, v, k)
	}
}

// nopSink discards every load.
var nopSink = enginemetrics.SinkFunc(func(string, kvroute.EngineLoad) error { return nil })
