package main

import (
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
)

// demoProxyConfig returns the proxy's configuration for the simulated engines (defaults not
// applied): every engine a backend with its role; a KV index in memory fed by one ZMQ subscription
// per engine (with replay) and tokenization by the engines' /tokenize; health checks every 2 s and
// a circuit breaker after 3 failures. Without storage it adds the in-memory response cache (for a
// fleet of unified engines). With storage it adds disaggregated serving instead, with storage as
// the default external storage (its endpoint, bucket and namespace: the proxy only compares
// locations, the engines hold the credentials), and the storage tier of the index.
func demoProxyConfig(engines []enginesim.EngineInfo, storage *enginesim.StorageConfig) *config.Config {
	cfg := &config.Config{
		KVCacheIndex: config.KVCacheIndexConfig{Enabled: true, Backend: "memory", Tokenizer: config.TokenizerEngine,
			BlockSize: 16},
		HealthChecks:   config.HealthCheckConfig{Interval: config.Duration(2 * time.Second), Timeout: config.Duration(time.Second)},
		CircuitBreaker: config.CircuitBreakerConfig{FailureThreshold: 3, RecoveryTimeout: config.Duration(10 * time.Second)},
	}
	for _, e := range engines {
		cfg.Backends = append(cfg.Backends, config.BackendConfig{Name: e.Name, URL: e.URL, Model: e.Model, Role: e.Role.String()})
		cfg.KVCacheIndex.EventSources = append(cfg.KVCacheIndex.EventSources, config.EventSourceConfig{
			BackendName: e.Name, Endpoint: e.ZMQEndpoint, ReplayEndpoint: e.ReplayEndpoint, Model: e.Model})
	}
	if storage == nil {
		cfg.ResponseCache = config.ResponseCacheConfig{Enabled: true, Backend: "memory", Capacity: 1000, TTL: config.Duration(5 * time.Minute)}
		return cfg
	}
	ns := storage.Namespace
	if ns == "" {
		ns = enginesim.DefaultKVNamespace
	}
	cfg.KVCacheIndex.StorageOffloading.Enabled = true
	cfg.DisaggregatedServing = config.DisaggregatedConfig{Enabled: true, DefaultExternalStorage: &config.ExternalStorageConfig{
		Endpoint: storage.Endpoint, Bucket: storage.Bucket, KVNamespace: ns}}
	return cfg
}

// fleetProxyConfig returns the proxy's configuration for a demo fleet (demoProxyConfig's) with
// server as its server section, defaults applied and validated (the error is Validate's).
func fleetProxyConfig(fleet *enginesim.Demo, server config.ServerConfig) (*config.Config, error) {
	c := demoProxyConfig(fleet.Info(), fleet.Storage())
	c.Server = server
	c.ApplyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}
