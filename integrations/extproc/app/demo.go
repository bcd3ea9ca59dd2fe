package app

import (
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// DemoConfig is the configuration of kvroute-epp in front of simulated engines (the -demo mode
// and the tests), defaults applied: every engine a backend with its KV events over ZMQ (with
// replay) into an in-memory index, tokenization by the engines' /tokenize, health checks every
// 2 s, and the picker on its default loopback addresses with two fallback endpoints.
func DemoConfig(engines []enginesim.EngineInfo) *config.Config {
	cfg := &config.Config{
		KVCacheIndex:   config.KVCacheIndexConfig{Enabled: true, Backend: "memory", Tokenizer: config.TokenizerEngine, BlockSize: 16},
		HealthChecks:   config.HealthCheckConfig{Interval: config.Duration(2 * time.Second), Timeout: config.Duration(time.Second)},
		EndpointPicker: config.EndpointPickerConfig{FallbackEndpoints: 2},
	}
	if len(engines) > 0 && engines[0].BlockSize > 0 {
		cfg.KVCacheIndex.BlockSize = engines[0].BlockSize
	}
	for _, e := range engines {
		cfg.Backends = append(cfg.Backends, config.BackendConfig{Name: e.Name, URL: e.URL, Model: e.Model})
		cfg.KVCacheIndex.EventSources = append(cfg.KVCacheIndex.EventSources, config.EventSourceConfig{
			BackendName: e.Name, Endpoint: e.ZMQEndpoint, ReplayEndpoint: e.ReplayEndpoint, Model: e.Model})
	}
	cfg.ApplyDefaults()
	return cfg
}
