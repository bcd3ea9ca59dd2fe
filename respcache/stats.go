package respcache

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/kvroute/kvroute/telemetry"
)

// scopeName is the instrumentation scope of the package's metrics.
const scopeName = "github.com/kvroute/kvroute/respcache"

// This file holds the Cache's counters, its OpenTelemetry instruments, and the two admin
// operations: GET /admin/response-cache/stats (Stats) and
// POST /admin/response-cache/invalidate (Invalidate).

// lookup results
const (
	dispHit = iota
	dispMiss
	dispSkip
	numDisps
)

var dispNames = [numDisps]string{"hit", "miss", "skip"}

// store operations whose failures are counted
const (
	seGet = iota
	seSet
	seDelete
	seClear
	seCorrupt
	numSE
)

var seNames = [numSE]string{"get", "set", "delete", "clear", "corrupt"}

// cacheCounters are the Cache's own counts, read by Stats and by the metric callbacks: counting
// a request is an atomic add, and the SDK reads the counts when it collects.
type cacheCounters struct {
	results   [numDisps]atomic.Uint64
	coalesced atomic.Uint64
	storeErrs [numSE]atomic.Uint64
}

func (c *cacheCounters) result(which int) { c.results[which].Add(1) }

func (c *cacheCounters) coalesce() { c.coalesced.Add(1) }

func (c *cacheCounters) storeError(op int) { c.storeErrs[op].Add(1) }

// cacheMetrics holds the registrations of the Cache's observable instruments. The counters'
// callback reads only the counters and is never unregistered: they are reported for as long as
// the MeterProvider runs, Close or not, as counters that count as they go would be.
type cacheMetrics struct {
	reg       metric.Registration
	closeOnce sync.Once
}

func newCacheMetrics(mp metric.MeterProvider, c *Cache) (*cacheMetrics, error) {
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	meter := mp.Meter(scopeName)
	m := &cacheMetrics{}
	var err error
	wrap := func(name string, err error) error { return fmt.Errorf("respcache: metric %s: %w", name, err) }
	requests, err := meter.Int64ObservableCounter(telemetry.MetricResponseCacheRequests, metric.WithUnit("{request}"),
		metric.WithDescription("Response cache lookups by result (hit, miss, skip)."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheRequests, err)
	}
	coalesced, err := meter.Int64ObservableCounter(telemetry.MetricResponseCacheCoalesced, metric.WithUnit("{request}"),
		metric.WithDescription("Requests served by a concurrent identical request's call."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheCoalesced, err)
	}
	storeErrors, err := meter.Int64ObservableCounter(telemetry.MetricResponseCacheStoreErrors, metric.WithUnit("{error}"),
		metric.WithDescription("Failed store operations and corrupt entries, by operation."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheStoreErrors, err)
	}
	var byResult [numDisps]metric.ObserveOption
	for i, n := range dispNames {
		byResult[i] = metric.WithAttributeSet(attribute.NewSet(attribute.String("result", n)))
	}
	var byOp [numSE]metric.ObserveOption
	for i, n := range seNames {
		byOp[i] = metric.WithAttributeSet(attribute.NewSet(attribute.String("op", n)))
	}
	// A count is observed once it is not zero: a series appears with its first event.
	cnt := c.counters
	if _, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for i := range cnt.results {
			if n := cnt.results[i].Load(); n > 0 {
				o.ObserveInt64(requests, int64(n), byResult[i])
			}
		}
		if n := cnt.coalesced.Load(); n > 0 {
			o.ObserveInt64(coalesced, int64(n))
		}
		for i := range cnt.storeErrs {
			if n := cnt.storeErrs[i].Load(); n > 0 {
				o.ObserveInt64(storeErrors, int64(n), byOp[i])
			}
		}
		return nil
	}, requests, coalesced, storeErrors); err != nil {
		return nil, fmt.Errorf("respcache: metric callback: %w", err)
	}
	entries, err := meter.Int64ObservableGauge(telemetry.MetricResponseCacheEntries, metric.WithUnit("{entry}"),
		metric.WithDescription("Current number of cached responses."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheEntries, err)
	}
	size, err := meter.Int64ObservableGauge(telemetry.MetricResponseCacheSize, metric.WithUnit("By"),
		metric.WithDescription("Approximate size of the cached responses."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheSize, err)
	}
	evictions, err := meter.Int64ObservableCounter(telemetry.MetricResponseCacheEvictions, metric.WithUnit("{entry}"),
		metric.WithDescription("Entries evicted from the response cache's store."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheEvictions, err)
	}
	hitRate, err := meter.Float64ObservableGauge(telemetry.MetricResponseCacheHitRate, metric.WithUnit("1"),
		metric.WithDescription("Hits / (hits + misses) since the cache was created."))
	if err != nil {
		return nil, wrap(telemetry.MetricResponseCacheHitRate, err)
	}
	m.reg, err = meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		st := c.store.Stats(ctx)
		if st.Entries >= 0 {
			o.ObserveInt64(entries, int64(st.Entries))
		}
		o.ObserveInt64(size, st.SizeBytes)
		o.ObserveInt64(evictions, int64(st.Evictions))
		hits, misses := c.counters.results[dispHit].Load(), c.counters.results[dispMiss].Load()
		o.ObserveFloat64(hitRate, hitRatio(hits, misses))
		return nil
	}, entries, size, evictions, hitRate)
	if err != nil {
		return nil, fmt.Errorf("respcache: metric callback: %w", err)
	}
	return m, nil
}

// Close unregisters the Cache's metric callback. The Cache keeps serving; only the store's
// metrics and the hit rate (entries, size, evictions, hit rate) stop being reported, the counts
// of requests, coalesced requests and store errors go on. It is idempotent, safe for
// concurrent use, and returns the unregistration's error, if any. It does not close the Store.
func (c *Cache) Close() error {
	var err error
	c.metrics.closeOnce.Do(func() {
		if c.metrics.reg != nil {
			err = c.metrics.reg.Unregister()
		}
	})
	return err
}

func hitRatio(hits, misses uint64) float64 {
	if hits+misses == 0 {
		return 0
	}
	return float64(hits) / float64(hits+misses)
}

// Stats is the body of kvroute's GET /admin/response-cache/stats, plus the coalescing and
// store-error counts. Encode it with encoding/json.
type Stats struct {
	Enabled     bool         `json:"enabled"`      // always true: a Cache exists
	BackendType string       `json:"backend_type"` // the store's StoreStats.Backend
	Entries     int          `json:"entries"`      // -1 when the store cannot count
	Capacity    int          `json:"capacity"`
	Requests    RequestStats `json:"requests"`
	HitRate     string       `json:"hit_rate"` // hits / (hits + misses), 4 decimals: "0.7924"
	Evictions   uint64       `json:"evictions"`
	SizeBytes   int64        `json:"size_bytes"`
	Config      StatsConfig  `json:"config"`
	Redis       *RemoteStats `json:"redis,omitempty"`  // when the store (or a tier of it) is Redis
	Remote      *RemoteStats `json:"remote,omitempty"` // when it is another remote store
	// Coalesced counts requests served by a concurrent identical request's call (also counted in
	// Requests.Hit).
	Coalesced uint64 `json:"coalesced"`
	// StoreErrors counts the middleware's failed store operations by kind: get, set, delete,
	// clear, and corrupt (an entry that did not decode; served as a miss).
	StoreErrors map[string]uint64 `json:"store_errors"`
	// BackendErrors are the store's own error counts (StoreStats.Errors), when it keeps them.
	BackendErrors map[string]uint64 `json:"backend_errors,omitempty"`
}

// RequestStats counts requests by disposition: Hit (X-Cache: HIT, from the store or coalesced),
// Miss (MISS: the wrapped handler answered an eligible request; also a coalesced waiter whose
// client left before anything was written), Skip (BYPASS); Total is their sum.
type RequestStats struct {
	Hit   uint64 `json:"hit"`
	Miss  uint64 `json:"miss"`
	Skip  uint64 `json:"skip"`
	Total uint64 `json:"total"`
}

// StatsConfig is the "config" section of the stats endpoint.
type StatsConfig struct {
	Backend             string `json:"backend"`
	TTL                 string `json:"ttl"` // compact: "5m", "30m", "1h30m", "90s" → "1m30s"
	Capacity            int    `json:"capacity"`
	MaxResponseSize     int    `json:"max_response_size"`
	MaxStreamBufferSize int    `json:"max_stream_buffer_size"`
}

// Stats returns the cache's statistics: its own counters and the store's StoreStats. It is safe for
// concurrent use; ctx bounds the store's Stats call. The counters are read one by one, not as one
// atomic snapshot.
func (c *Cache) Stats(ctx context.Context) Stats {
	st := c.store.Stats(ctx)
	var rs RequestStats
	rs.Hit = c.counters.results[dispHit].Load()
	rs.Miss = c.counters.results[dispMiss].Load()
	rs.Skip = c.counters.results[dispSkip].Load()
	rs.Total = rs.Hit + rs.Miss + rs.Skip
	s := Stats{
		Enabled:     true,
		BackendType: st.Backend,
		Entries:     st.Entries,
		Capacity:    st.Capacity,
		Requests:    rs,
		HitRate:     strconv.FormatFloat(hitRatio(rs.Hit, rs.Miss), 'f', 4, 64),
		Evictions:   st.Evictions,
		SizeBytes:   st.SizeBytes,
		Config: StatsConfig{
			Backend:             st.Backend,
			TTL:                 compactDuration(c.TTL()),
			Capacity:            st.Capacity,
			MaxResponseSize:     c.maxResp,
			MaxStreamBufferSize: c.maxStream,
		},
		Coalesced:     c.counters.coalesced.Load(),
		StoreErrors:   make(map[string]uint64, numSE),
		BackendErrors: st.Errors,
	}
	for i, n := range seNames {
		s.StoreErrors[n] = c.counters.storeErrs[i].Load()
	}
	if remote, backend := findRemote(&st); backend == "redis" {
		s.Redis = remote
	} else {
		s.Remote = remote
	}
	return s
}

// findRemote returns the remote section of a store or of one of its tiers, and that store's
// backend name.
func findRemote(st *StoreStats) (*RemoteStats, string) {
	if st == nil {
		return nil, ""
	}
	if st.Remote != nil {
		return st.Remote, st.Backend
	}
	if r, b := findRemote(st.L1); r != nil {
		return r, b
	}
	return findRemote(st.L2)
}

// compactDuration formats d as time.Duration.String does, without zero trailing units: "5m",
// "30m", "1h", "1h30m", "1m30s", "1.5s", "0s".
func compactDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// InvalidateRequest is the body of kvroute's POST /admin/response-cache/invalidate: either
// {"clear_all": true}, or {"key": "<64 hex digits>"} (a key from KeyFor) to drop one entry.
type InvalidateRequest struct {
	ClearAll bool   `json:"clear_all"`
	Key      string `json:"key,omitempty"`
}

// InvalidateResult is the endpoint's response: {"success": true, "action": "clear_all",
// "cleared_entries": 1243}. Action is "clear_all" or "delete_key".
type InvalidateResult struct {
	Success        bool   `json:"success"`
	Action         string `json:"action"`
	ClearedEntries int    `json:"cleared_entries"`
}

// Actions of InvalidateResult.
const (
	ActionClearAll  = "clear_all"
	ActionDeleteKey = "delete_key"
)

// ErrEmptyInvalidate is returned by Invalidate for a request that neither clears all nor names a
// key.
var ErrEmptyInvalidate = errors.New("respcache: invalidate request has neither clear_all nor key")

// ErrBadKey is returned by Invalidate for a key that is not a cache key (64 lowercase hex
// digits, as KeyFor returns it).
var ErrBadKey = errors.New("respcache: not a cache key (want 64 lowercase hex digits)")

// Invalidate drops cached responses: every entry of the store (ClearAll; ClearedEntries is what
// the store's Clear reports, -1 when it cannot count), or the one under Key (ClearedEntries is 1
// when it was present just before, 0 otherwise). Responses being recorded when Invalidate runs are
// not kept. It is safe for concurrent use; ctx bounds the store calls. An error comes from the
// store (wrapped) or is ErrEmptyInvalidate; Success is then false.
func (c *Cache) Invalidate(ctx context.Context, req InvalidateRequest) (InvalidateResult, error) {
	c.gen.Add(1)
	switch {
	case req.ClearAll:
		n, err := c.store.Clear(ctx)
		if err != nil {
			c.counters.storeError(seClear)
			return InvalidateResult{Action: ActionClearAll}, fmt.Errorf("respcache: clear: %w", err)
		}
		return InvalidateResult{Success: true, Action: ActionClearAll, ClearedEntries: n}, nil
	case req.Key != "":
		if len(req.Key) != 64 || strings.ToLower(req.Key) != req.Key {
			return InvalidateResult{Action: ActionDeleteKey}, ErrBadKey
		}
		if _, err := hex.DecodeString(req.Key); err != nil {
			return InvalidateResult{Action: ActionDeleteKey}, ErrBadKey
		}
		_, present, _ := c.store.Get(ctx, req.Key)
		if err := c.store.Delete(ctx, req.Key); err != nil {
			c.counters.storeError(seDelete)
			return InvalidateResult{Action: ActionDeleteKey}, fmt.Errorf("respcache: delete: %w", err)
		}
		res := InvalidateResult{Success: true, Action: ActionDeleteKey}
		if present {
			res.ClearedEntries = 1
		}
		return res, nil
	}
	return InvalidateResult{}, ErrEmptyInvalidate
}
