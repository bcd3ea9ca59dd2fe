package disagg

import (
	"encoding/json"
	"sync"
	"testing"
)

func TestCounters(t *testing.T) {
	var c Counters
	plans := []Plan{
		{Path: PathFastDecode, Reason: ReasonLocalHit},
		{Path: PathFastDecode, Reason: ReasonStorageHit},
		{Path: PathPrefillThenDecode, Reason: ReasonCacheMiss},
		{Path: PathFallback, Reason: ReasonPrefillFailed},
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				for _, p := range plans {
					c.Record(p)
				}
				c.RecordNoBackend()
				c.RecordPrefillFailure()
			}
		})
	}
	wg.Wait()
	s := c.Snapshot()
	if s.FastDecode != 1600 || s.PrefillThenDecode != 800 || s.Fallback != 800 || s.Unified != 0 || s.Total != 3200 {
		t.Errorf("paths = %+v", s)
	}
	if s.Reasons.LocalHit != 800 || s.Reasons.StorageHit != 800 || s.Reasons.CacheMiss != 800 || s.Reasons.PrefillFailed != 800 {
		t.Errorf("reasons = %+v", s.Reasons)
	}
	if s.NoBackend != 800 || s.PrefillFailures != 800 || s.Path(PathFastDecode) != 1600 || s.Path(0) != 0 {
		t.Errorf("stats = %+v", s)
	}
	b, _ := json.Marshal(s)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"total", "fast_decode", "prefill_then_decode", "unified", "fallback", "reasons", "no_backend", "prefill_failures"} {
		if _, ok := m[k]; !ok {
			t.Errorf("JSON lacks %q: %s", k, b)
		}
	}
	c.Reset()
	if c.Snapshot() != (Stats{}) {
		t.Errorf("after Reset: %+v", c.Snapshot())
	}
}
