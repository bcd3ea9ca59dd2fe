package stack

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/prefixkey"
)

// ErrNoTokenizer is EngineTokenizer.Tokenize's error when no backend in rotation serves the
// request's model: nothing can tokenize it.
var ErrNoTokenizer = errors.New("no healthy backend to tokenize with")

// EngineTokenizer is kv_cache_index.tokenizer engine: it tokenizes through the backends' own
// /tokenize endpoint (vLLM's, with prefixkey.EngineTokenizer), so that block keys match the
// engines' KV events exactly. It asks the first backend in rotation, in configuration order,
// that serves the request's model: a stable choice keeps that backend's tokenizer cache warm.
// All backends serving one model must share its tokenizer, as replicas do. Safe for concurrent
// use; it starts no goroutine.
type EngineTokenizer struct {
	names      []string
	byName     map[string]*prefixkey.EngineTokenizer
	cfg        *config.Config
	inRotation func(backend string) bool
}

var _ prefixkey.Tokenizer = (*EngineTokenizer)(nil)

// NewEngineTokenizer builds the tokenizer of cfg's backends: one prefixkey.EngineTokenizer per
// backend, at its url, with kv_cache_index.tokenize_timeout and tokenize_cache_bytes, sending
// through client (nil: http.DefaultClient). inRotation says whether a backend may be asked (the
// health Monitor's InRotation; nil: every backend); it is called at each Tokenize, so it may
// read a Monitor built after the tokenizer, as the Router that the Monitor drives needs the
// tokenizer first. cfg must be validated with its defaults applied; the tokenizer keeps it. The
// error names the backend whose URL prefixkey refuses.
func NewEngineTokenizer(cfg *config.Config, client *http.Client, inRotation func(backend string) bool) (*EngineTokenizer, error) {
	if cfg == nil {
		return nil, errors.New("stack: NewEngineTokenizer needs a configuration")
	}
	t := &EngineTokenizer{byName: map[string]*prefixkey.EngineTokenizer{}, cfg: cfg, inRotation: inRotation}
	for _, b := range cfg.Backends {
		et, err := prefixkey.NewEngineTokenizer(prefixkey.EngineTokenizerConfig{BaseURL: b.URL,
			Timeout: time.Duration(cfg.KVCacheIndex.TokenizeTimeout), Client: client, CacheBytes: cfg.KVCacheIndex.TokenizeCacheBytes})
		if err != nil {
			return nil, fmt.Errorf("tokenizer for backend %s: %w", b.Name, err)
		}
		t.names = append(t.names, b.Name)
		t.byName[b.Name] = et
	}
	return t, nil
}

// Tokenize implements prefixkey.Tokenizer: the tokens of the first backend in rotation that
// serves r.Model, or ErrNoTokenizer when there is none. Its other errors are the backend's
// (prefixkey.EngineTokenizer.Tokenize's); ctx bounds the call.
func (t *EngineTokenizer) Tokenize(ctx context.Context, r *prefixkey.Request) ([]uint32, error) {
	for _, name := range t.names {
		if !t.cfg.Backend(name).Serves(r.Model) || (t.inRotation != nil && !t.inRotation(name)) {
			continue
		}
		return t.byName[name].Tokenize(ctx, r)
	}
	return nil, ErrNoTokenizer
}

// Stats sums the backends' tokenizer counters.
func (t *EngineTokenizer) Stats() prefixkey.TokenizerStats {
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
