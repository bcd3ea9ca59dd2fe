// Package config is the YAML configuration of kvroute's reference gateway (examples/proxy) and
// its mapping onto the library's types. The schema is kvroute's (server, selection_strategy,
// prefix_routing, response_cache, kv_cache_index, backends, health_checks, circuit_breaker,
// disaggregated_serving) with a few additions of the reference gateway's own; a gateway that embeds kvroute
// can read the same files.
//
// Parse and Load decode strictly: every key must name a field (an unknown one is an error that
// suggests the closest name), ${NAME} and ${NAME:-default} are expanded from a lookup function,
// durations take days ("7d"), secrets never print, and every error names the field path and line
// ("response_cache.ttl: invalid duration "5x" (line 7)"). They then apply the defaults
// (ApplyDefaults) and validate (Validate), joining one error per problem.
//
// The builders turn a valid Config into library values and hand them to the caller to close:
// RouterConfig (kvroute.Config), DisaggConfig (disagg.Config), NewResponseCache
// (respcache.Cache over a memory, Redis or tiered store), NewKVIndex (kvindex.MemoryIndex or
// redisindex.Index), NewStores (both, with one Redis client per server), KVConfig
// (kvroute.KVConfig) and NewEventConsumers (events' SSE and ZMQ consumers). PlanReload says which
// changes of a new configuration apply to a running gateway and which need a restart. What is
// gateway plumbing stays out: the HTTP server, the engines' /tokenize
// client, health probes and the circuit breaker read their sections as plain data.
//
//	cfg, err := config.Load("kvroute.yaml")
//	if err != nil { return err }
//	o := config.Options{MeterProvider: mp, Logger: log}
//	rcfg, err := cfg.RouterConfig(o)
//	index, closeIndex, err := cfg.NewKVIndex()
//	defer closeIndex()
//	rcfg.KV = cfg.KVConfig(index, tokenizer)
//	router, err := kvroute.New(rcfg)
//	consumers, err := cfg.NewEventConsumers(index, o) // Start each; Close each before closeIndex
//	cache, closeCache, err := cfg.NewResponseCache(o)  // nil when disabled; wrap the handler with cache.Middleware
//
// Only Load reads the environment (os.LookupEnv, as its doc says); Parse takes the lookup as an
// argument, and the package keeps no state of its own.
package config
