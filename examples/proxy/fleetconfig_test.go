package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// The demo fleets' configurations are valid, and each mode gets its tiers: the unified fleet the
// response cache, the disaggregated one disaggregation over the fleet's storage instead.
func TestFleetProxyConfig(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	pd, err := enginesim.StartDemo(ctx, enginesim.DemoConfig{Mode: enginesim.DemoDisagg, Engines: 4})
	require.NoError(t, err)
	defer pd.Close()
	cfg, err := fleetProxyConfig(pd, config.ServerConfig{Port: new(int)})
	require.NoError(t, err)
	assert.True(t, cfg.DisaggregatedServing.Enabled)
	assert.False(t, cfg.ResponseCache.Enabled)
	assert.Equal(t, pd.Storage().Endpoint, cfg.DisaggregatedServing.DefaultExternalStorage.Endpoint)
	assert.Equal(t, enginesim.DefaultKVNamespace, cfg.DisaggregatedServing.DefaultExternalStorage.KVNamespace)
	assert.Len(t, cfg.KVCacheIndex.EventSources, 4)
	cfg.Backends[0].Name = "changed"
	again, err := fleetProxyConfig(pd, config.ServerConfig{})
	require.NoError(t, err)
	assert.Equal(t, "prefill-0", again.Backends[0].Name, "each call builds a configuration of its own")

	uni, err := enginesim.StartDemo(ctx, enginesim.DemoConfig{Engines: 2})
	require.NoError(t, err)
	defer uni.Close()
	cfg, err = fleetProxyConfig(uni, config.ServerConfig{})
	require.NoError(t, err)
	assert.True(t, cfg.ResponseCache.Enabled)
	assert.False(t, cfg.DisaggregatedServing.Enabled)
	assert.Equal(t, []string{"enginesim-0", "enginesim-1"}, []string{cfg.Backends[0].Name, cfg.Backends[1].Name})
}
