package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

// errNoTokenizer is returned when no healthy backend serving the request's model can tokenize.
var errNoTokenizer = errors.New("no healthy backend to tokenize with")

// engineTokenizer tokenizes through the backends' own /tokenize endpoint (vLLM's), so that block
// keys match the engines' KV events exactly. It asks the first healthy backend, in configuration
// order, that serves the request's model: a stable choice keeps that backend's tokenizer cache
// warm. All backends serving one model must share its tokenizer, as replicas do. Safe for
// concurrent use.
type engineTokenizer struct {
	names  []string
	byName map[string]*prefixkey.EngineTokenizer
	cfg    *config.Config
	health interface{ InRotation(string) bool }
}

func newEngineTokenizer(cfg *config.Config, s *server, timeout time.Duration) (*engineTokenizer, error) {
	t := &engineTokenizer{byName: map[string]*prefixkey.EngineTokenizer{}, cfg: cfg}
	for _, b := range cfg.Backends {
		et, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: b.URL, Timeout: timeout,
			Client: s.httpClient(), CacheBytes: cfg.KVCacheIndex.TokenizeCacheBytes})
		if err != nil {
			return nil, fmt.Errorf("tokenizer for backend %s: %w", b.Name, err)
		}
		t.names = append(t.names, b.Name)
		t.byName[b.Name] = et
	}
	t.health = healthLate{s}
	return t, nil
}

// healthLate reads the server's health manager when asked: the tokenizer is built before it.
type healthLate struct{ s *server }

func (h healthLate) InRotation(name string) bool {
	return h.s.health == nil || h.s.health.InRotation(name)
}

// Tokenize implements prefixkey.Tokenizer.
func (t *engineTokenizer) Tokenize(ctx context.Context, r *prefixkey.Request) ([]uint32, error) {
	for _, name := range t.names {
		if !t.cfg.Backend(name).Serves(r.Model) || !t.health.InRotation(name) {
			continue
		}
		return t.byName[name].Tokenize(ctx, r)
	}
	return nil, errNoTokenizer
}

// stats sums the backends' tokenizer counters.
func (t *engineTokenizer) stats() prefixkey.TokenizerStats {
	var sum prefixkey.TokenizerStats
	for _, et := range t.byName {
		st := et.Stats()
		sum.Calls += st.Calls
		sum.CacheHits += st.CacheHits
		sum.Errors += st.Errors
		sum.Timeouts += st.Timeouts
	}
	return sum
}
