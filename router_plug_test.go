package kvroute_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// A Router of a third party's, written with exported API alone: it pins one model to a backend
// and delegates the rest to the default Router, wrapping its decisions so that Done still
// releases what the inner Router holds.
func TestRouterWrapperWithExportedAPI(t *testing.T) {
	inner, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}, {Name: "b"}}})
	require.NoError(t, err)
	defer inner.Close()
	var pinnedDone, wrappedDone, firstTokens atomic.Int32
	var rt kvroute.Router = routerFunc(func(ctx context.Context, req *prefixkey.Request) (*kvroute.Decision, error) {
		if req.Model == "pinned" {
			return kvroute.NewDecision("b", kvroute.ReasonFallback, &kvroute.DecisionHooks{
				Done: func(kvroute.Outcome) { pinnedDone.Add(1) }}), nil
		}
		d, err := inner.Route(ctx, req)
		if err != nil {
			return nil, err
		}
		return kvroute.NewDecision(d.Backend, d.Reason, &kvroute.DecisionHooks{
			Done:       func(o kvroute.Outcome) { wrappedDone.Add(1); d.Done(o) },
			FirstToken: func() { firstTokens.Add(1); d.FirstToken() },
		}), nil
	})
	inFlight := func() int {
		n := 0
		for _, l := range backendStats(t, inner) {
			n += l.InFlight
		}
		return n
	}

	req, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}`))
	require.NoError(t, err)
	d, err := rt.Route(context.Background(), req)
	require.NoError(t, err)
	assert.Equal(t, kvroute.ReasonPrefixHash, d.Reason)
	assert.Equal(t, 1, inFlight())
	d.FirstToken()
	d.Done(kvroute.Outcome{Err: errors.New("upstream 500")})
	d.Done(kvroute.Outcome{})
	d.FirstToken()
	assert.Equal(t, 0, inFlight(), "the wrapper's Done released the inner decision")
	assert.Equal(t, int32(1), wrappedDone.Load(), "Done runs once")
	assert.Equal(t, int32(1), firstTokens.Load(), "FirstToken after Done does nothing")

	p, err := rt.Route(context.Background(), &prefixkey.Request{Model: "pinned"})
	require.NoError(t, err)
	assert.Equal(t, "b", p.Backend)
	p.Done(kvroute.Outcome{})
	assert.Equal(t, int32(1), pinnedDone.Load())
	assert.Equal(t, 0, inFlight())

	var nilHooks *kvroute.Decision = kvroute.NewDecision("a", kvroute.ReasonFallback, nil)
	nilHooks.FirstToken()
	nilHooks.Done(kvroute.Outcome{}) // no hooks: nothing to do, no panic
}

// lookupOnly is a KV index of a third party's that answers lookups and nothing else: backend
// "b" holds every block asked about.
type lookupOnly struct{}

func (lookupOnly) Lookup(_ context.Context, keys []uint64, cands []string, out []kvindex.Match) ([]kvindex.Match, error) {
	out = out[:len(cands)]
	for i, c := range cands {
		out[i] = kvindex.Match{Backend: c}
		if c == "b" {
			out[i] = kvindex.Match{Backend: c, Blocks: len(keys), Tokens: 16 * len(keys), WeightedBlocks: float64(len(keys))}
		}
	}
	return out, nil
}

// Tier 4 runs on an index that only answers lookups; what it lacks is refused at New or left
// out of Stats, never a panic.
func TestLookupOnlyIndex(t *testing.T) {
	backends := []kvroute.Backend{{Name: "a"}, {Name: "b"}, {Name: "c"}}
	_, err := kvroute.New(kvroute.Config{Backends: backends, KV: &kvroute.KVConfig{Index: lookupOnly{}, Speculation: kvroute.SpeculationOn}})
	require.ErrorIs(t, err, kvroute.ErrInvalidConfig, "speculation needs a kvindex.Speculator")
	auto, err := kvroute.New(kvroute.Config{Backends: backends, KV: &kvroute.KVConfig{Index: lookupOnly{}}})
	require.NoError(t, err, "the zero Speculation turns speculation off for an index that cannot")
	auto.Close()

	r, err := kvroute.New(kvroute.Config{Backends: backends,
		KV: &kvroute.KVConfig{Index: lookupOnly{}, Speculation: kvroute.SpeculationOff, SpeculativeTTL: time.Second}})
	require.NoError(t, err)
	defer r.Close()
	toks := make([]uint32, 8*16)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	d, err := r.Route(context.Background(), &prefixkey.Request{Model: "m", TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, "b", d.Backend)
	assert.Equal(t, kvroute.ReasonKVAware, d.Reason)
	d.Done(kvroute.Outcome{})
	st, err := r.Stats(context.Background())
	require.NoError(t, err, "an index without stats is no error")
	assert.Nil(t, st.Index)
	assert.Equal(t, uint64(1), st.Lookups)
	assert.Equal(t, "expected_ttft", st.Scorer)
}

// WrapDecision carries the inner decision's fields and runs the wrapper's hooks, then the inner
// decision's; FirstToken's hook runs once and never after Done has begun.
func TestWrapDecision(t *testing.T) {
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{})
	require.NoError(t, err)
	defer ix.Close()
	inner, err := kvroute.New(kvroute.Config{Backends: []kvroute.Backend{{Name: "a"}, {Name: "b"}},
		KV: &kvroute.KVConfig{Index: ix}})
	require.NoError(t, err)
	defer inner.Close()
	req, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}`))
	require.NoError(t, err)
	req.TokenIDs = make([]uint32, 64)
	in, err := inner.Route(context.Background(), req)
	require.NoError(t, err)
	var order []string
	d := kvroute.WrapDecision(in, &kvroute.DecisionHooks{
		Done:       func(kvroute.Outcome) { order = append(order, "done") },
		FirstToken: func() { order = append(order, "first") },
	})
	assert.Equal(t, in.Backend, d.Backend)
	assert.Equal(t, in.Reason, d.Reason)
	assert.Equal(t, in.PrefixKey, d.PrefixKey)
	assert.Equal(t, in.HasPrefixKey, d.HasPrefixKey)
	assert.Equal(t, in.ExpectedCachedTokens, d.ExpectedCachedTokens)
	d.FirstToken()
	d.FirstToken()
	d.Done(kvroute.Outcome{})
	d.FirstToken()
	d.Done(kvroute.Outcome{})
	assert.Equal(t, []string{"first", "done"}, order, "each hook once, FirstToken's before Done's")
	for _, l := range backendStats(t, inner) {
		assert.Zero(t, l.InFlight, "the inner decision was released")
	}

	// A FirstToken racing Done: its hook runs wholly before the Done hook, or not at all.
	for range 200 {
		var firstRan, doneRan atomic.Bool
		var bad atomic.Bool
		d := kvroute.NewDecision("a", kvroute.ReasonCustom, &kvroute.DecisionHooks{
			FirstToken: func() {
				if doneRan.Load() {
					bad.Store(true)
				}
				firstRan.Store(true)
			},
			Done: func(kvroute.Outcome) { doneRan.Store(true) },
		})
		go d.FirstToken()
		d.Done(kvroute.Outcome{})
		d.FirstToken()
		assert.False(t, bad.Load(), "FirstToken's hook ran after Done's")
	}
	assert.Equal(t, "custom", kvroute.ReasonCustom.String())
}
