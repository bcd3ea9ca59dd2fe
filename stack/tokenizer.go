package stack

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

// ErrNoTokenizer is EngineTokenizer.Tokenize's error when no backend in rotation serves the
// request's model: nothing can tokenize it.
var ErrNoTokenizer = errors.New("no healthy backend to tokenize with")

// EngineTokenizer is kv_cache_index.tokenizer engine: it tokenizes through the backends' own
// /tokenize endpoint (vLLM's, with prefixkey.EngineTokenizer), so that block keys match the
// engines' KV events exactly. It asks the first backend in rotation, in the order they were
// added (configuration order first), that serves the request's model: a stable choice keeps that
// backend's tokenizer cache warm. All backends serving one model must share its tokenizer, as
// replicas do. A pool whose engines come and go (kvroute-epp's DNS discovery) adds and removes
// them with AddBackend and RemoveBackend. Safe for concurrent use; Tokenize takes no lock; it
// starts no goroutine.
type EngineTokenizer struct {
	client     *http.Client
	timeout    time.Duration
	cacheBytes int64
	inRotation func(backend string) bool

	mu      sync.Mutex // serialises AddBackend and RemoveBackend
	engines atomic.Pointer[[]tokenizerEngine]
}

// tokenizerEngine is one backend's tokenizer and what the backend serves.
type tokenizerEngine struct {
	backend config.BackendConfig
	tok     *prefixkey.EngineTokenizer
}

var _ prefixkey.Tokenizer = (*EngineTokenizer)(nil)

// NewEngineTokenizer builds the tokenizer of cfg's backends: one prefixkey.EngineTokenizer per
// backend, at its url, with kv_cache_index.tokenize_timeout and tokenize_cache_bytes, sending
// through client (nil: http.DefaultClient). inRotation says whether a backend may be asked (the
// health Monitor's InRotation; nil: every backend); it is called at each Tokenize, so it may
// read a Monitor built after the tokenizer, as the Router that the Monitor drives needs the
// tokenizer first. cfg must be validated with its defaults applied. The error names the backend
// whose URL prefixkey refuses.
func NewEngineTokenizer(cfg *config.Config, client *http.Client, inRotation func(backend string) bool) (*EngineTokenizer, error) {
	if cfg == nil {
		return nil, errors.New("stack: NewEngineTokenizer needs a configuration")
	}
	t := &EngineTokenizer{client: client, timeout: time.Duration(cfg.KVCacheIndex.TokenizeTimeout),
		cacheBytes: cfg.KVCacheIndex.TokenizeCacheBytes, inRotation: inRotation}
	t.engines.Store(&[]tokenizerEngine{})
	for _, b := range cfg.Backends {
		if err := t.AddBackend(b); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// AddBackend makes b's /tokenize one the tokenizer may ask, after those already there; adding a
// backend of the same name replaces it in place. The error names the backend whose URL prefixkey
// refuses.
func (t *EngineTokenizer) AddBackend(b config.BackendConfig) error {
	et, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: b.URL,
		Timeout: t.timeout, Client: t.client, CacheBytes: t.cacheBytes})
	if err != nil {
		return fmt.Errorf("tokenizer for backend %s: %w", b.Name, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	next := slices.Clone(*t.engines.Load())
	e := tokenizerEngine{backend: b, tok: et}
	if i := slices.IndexFunc(next, func(e tokenizerEngine) bool { return e.backend.Name == b.Name }); i >= 0 {
		next[i] = e
	} else {
		next = append(next, e)
	}
	t.engines.Store(&next)
	return nil
}

// RemoveBackend forgets the backend's tokenizer; it reports whether the backend was there.
func (t *EngineTokenizer) RemoveBackend(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	cur := *t.engines.Load()
	next := slices.DeleteFunc(slices.Clone(cur), func(e tokenizerEngine) bool { return e.backend.Name == name })
	t.engines.Store(&next)
	return len(next) != len(cur)
}

// Tokenize implements prefixkey.Tokenizer: the tokens of the first backend in rotation that
// serves r.Model, or ErrNoTokenizer when there is none. Its other errors are the backend's
// (prefixkey.EngineTokenizer.Tokenize's); ctx bounds the call.
func (t *EngineTokenizer) Tokenize(ctx context.Context, r *prefixkey.Request) ([]uint32, error) {
	for _, e := range *t.engines.Load() {
		if !e.backend.Serves(r.Model) || (t.inRotation != nil && !t.inRotation(e.backend.Name)) {
			continue
		}
		return e.tok.Tokenize(ctx, r)
	}
	return nil, ErrNoTokenizer
}

// Stats sums the backends' tokenizer counters (of the backends there now).
func (t *EngineTokenizer) Stats() prefixkey.TokenizerStats {
	var sum prefixkey.TokenizerStats
	for _, e := range *t.engines.Load() {
		st := e.tok.Stats()
		sum.Calls += st.Calls
		sum.CacheHits += st.CacheHits
		sum.Errors += st.Errors
		sum.Timeouts += st.Timeouts
	}
	return sum
}
