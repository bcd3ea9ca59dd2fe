package kvroute

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// backendSet.lookup finds what byName finds, for the ring's own names (found by their bytes'
// address), for copies of them and for names sharing a backend's bytes without being its name
// (found, or not, by the map); and Route's decisions find their backend's state through it.
func TestBackendSetLookup(t *testing.T) {
	joined := "vllm-10vllm-1"
	long, short := joined[:7], joined[:6] // "vllm-10" and "vllm-1", at the same address
	names := []string{long, short}
	for i := range 100 {
		names = append(names, fmt.Sprintf("b-%d", i))
	}
	r := newRouter(t, Config{})
	assert.Nil(t, r.set.Load().lookup(long), "an empty set")
	for _, n := range names {
		require.NoError(t, r.AddBackend(Backend{Name: n}))
	}
	set := r.set.Load()
	for _, n := range names {
		want := set.byName[n]
		require.NotNil(t, want, n)
		assert.Same(t, want, set.lookup(n), n)
		assert.Same(t, want, set.lookup(strings.Clone(n)), "a copy of %s", n)
	}
	assert.Nil(t, set.lookup(joined[:5]), "shares vllm-10's bytes, names no backend")
	assert.Nil(t, set.lookup("b-100"))
	assert.Nil(t, set.lookup(""))

	require.NoError(t, r.RemoveBackend(short))
	set = r.set.Load()
	assert.Nil(t, set.lookup(short))
	assert.Same(t, set.byName[long], set.lookup(long))
	assert.Len(t, set.byName, len(names)-1)

	ctx := context.Background()
	for i := range 300 {
		d, err := r.Route(ctx, chatReq(fmt.Sprint("system ", i), "u"))
		require.NoError(t, err)
		assert.Same(t, set.byName[d.Backend], d.state, d.Backend)
		d.Done(Outcome{})
	}
}
