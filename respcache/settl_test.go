package respcache

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// ttlStore records the TTL of each Set.
type ttlStore struct {
	*MemoryStore
	ttls []time.Duration
}

func (s *ttlStore) Set(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	s.ttls = append(s.ttls, ttl)
	return s.MemoryStore.Set(ctx, key, value, ttl)
}

// SetTTL changes the TTL of the responses stored from then on; 0 means DefaultTTL, negative is
// refused.
func TestSetTTL(t *testing.T) {
	m, err := NewMemory(MemoryConfig{})
	if err != nil {
		t.Fatal(err)
	}
	st := &ttlStore{MemoryStore: m}
	c, err := New(Config{Store: st, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	store := func(prompt string) {
		body := `{"model":"m","temperature":0,"messages":[{"role":"user","content":"` + prompt + `"}]}`
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)))
	}
	store("one")
	if err := c.SetTTL(10 * time.Second); err != nil || c.TTL() != 10*time.Second {
		t.Fatalf("SetTTL: %v, TTL %v", err, c.TTL())
	}
	store("two")
	if err := c.SetTTL(0); err != nil || c.TTL() != DefaultTTL {
		t.Fatalf("SetTTL(0): %v, TTL %v", err, c.TTL())
	}
	store("three")
	if err := c.SetTTL(-time.Second); !errors.Is(err, ErrInvalidConfig) || c.TTL() != DefaultTTL {
		t.Errorf("SetTTL(-1s): %v, TTL %v", err, c.TTL())
	}
	want := []time.Duration{time.Minute, 10 * time.Second, DefaultTTL}
	if len(st.ttls) != len(want) || st.ttls[0] != want[0] || st.ttls[1] != want[1] || st.ttls[2] != want[2] {
		t.Errorf("stored with TTLs %v, want %v", st.ttls, want)
	}
	if got := c.Stats(context.Background()).Config.TTL; got != "5m" {
		t.Errorf("stats TTL %q", got)
	}
}
