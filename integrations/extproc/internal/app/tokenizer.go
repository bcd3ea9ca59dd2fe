package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

// prefixTokenizer is the Router's tokenizer (kvroute.KVConfig.Tokenizer).
type prefixTokenizer = prefixkey.Tokenizer

// errNoTokenizer is returned when no engine in rotation serves the request's model.
var errNoTokenizer = errors.New("no engine in rotation to tokenize with")

// engineTokenizer tokenizes through the engines' own /tokenize (vLLM's), so that block keys match
// the engines' KV events exactly. It asks the first engine in rotation, in the order they joined,
// that serves the request's model: a stable choice keeps that engine's tokenizer cache warm. The
// pool's engines come and go (discovery): add and remove change the set. Safe for concurrent use.
type engineTokenizer struct {
	client     *http.Client
	timeout    time.Duration
	cacheBytes int64
	rotation   interface{ InRotation(string) bool }

	mu      sync.RWMutex
	order   []string
	engines map[string]tokenizerEngine
}

// tokenizerEngine is one engine's tokenizer and what it serves.
type tokenizerEngine struct {
	backend config.BackendConfig
	tok     *prefixkey.EngineTokenizer
}

func newEngineTokenizer(cfg *config.Config, client *http.Client, rotation interface{ InRotation(string) bool }) (*engineTokenizer, error) {
	t := &engineTokenizer{client: client, timeout: time.Duration(cfg.KVCacheIndex.TokenizeTimeout),
		cacheBytes: cfg.KVCacheIndex.TokenizeCacheBytes, rotation: rotation, engines: map[string]tokenizerEngine{}}
	for _, b := range cfg.Backends {
		if err := t.add(b); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// add makes b's /tokenize one the tokenizer may ask.
func (t *engineTokenizer) add(b config.BackendConfig) error {
	et, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: b.URL, Timeout: t.timeout,
		Client: t.client, CacheBytes: t.cacheBytes})
	if err != nil {
		return fmt.Errorf("tokenizer for backend %s: %w", b.Name, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.engines[b.Name]; !ok {
		t.order = append(t.order, b.Name)
	}
	t.engines[b.Name] = tokenizerEngine{backend: b, tok: et}
	return nil
}

// remove forgets backend's tokenizer.
func (t *engineTokenizer) remove(backend string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.engines, backend)
	t.order = slices.DeleteFunc(t.order, func(n string) bool { return n == backend })
}

// Tokenize implements prefixkey.Tokenizer.
func (t *engineTokenizer) Tokenize(ctx context.Context, r *prefixkey.Request) ([]uint32, error) {
	t.mu.RLock()
	var pick *prefixkey.EngineTokenizer
	for _, name := range t.order {
		e := t.engines[name]
		if e.backend.Serves(r.Model) && t.rotation.InRotation(name) {
			pick = e.tok
			break
		}
	}
	t.mu.RUnlock()
	if pick == nil {
		return nil, errNoTokenizer
	}
	return pick.Tokenize(ctx, r)
}
