// Package stack builds, from kvroute's configuration, the parts of a gateway around the Router
// that every kvroute front end shares: the replicas section (the Router's decisions shared with
// the other replicas over NATS by natsync, the engines' KV events through a JetStream stream with
// index snapshots by natsync/eventlog), the scrapes of engine_metrics (enginemetrics), the probes
// and circuit breakers of health_checks and circuit_breaker (health), and the engines' own
// tokenizer of kv_cache_index.tokenizer engine. The reference proxy (examples/proxy) and the
// Envoy endpoint picker (integrations/extproc) build them here, from the same config.Config, so
// that one YAML file means the same thing to both.
//
// A front end composes them around its Router in this order:
//
//	cache, index, closeStores, _ := cfg.NewStores(opts) // package config
//	fleet, _ := stack.NewFleet(cfg, opts, stack.FleetOptions{Index: index})
//	consumers, _ := cfg.NewEventConsumers(fleet.EventsSink(), opts)
//	var mon *health.Monitor // built after the Router, which needs the tokenizer
//	tok, _ := stack.NewEngineTokenizer(cfg, client, func(b string) bool { return mon == nil || mon.InRotation(b) })
//	rcfg, _ := cfg.RouterConfig(opts)
//	rcfg.KV, rcfg.Peers = cfg.KVConfig(index, tok), fleet.Peers()
//	router, _ := kvroute.New(rcfg)
//	mon, _ = stack.NewHealth(cfg, router, transport, logger)
//	fleet.SetRouter(router) // the peers' decisions and the engines' load go to it
//	_ = fleet.Start(ctx)    // then each consumer's Start, and mon.Start()
//
// and closes them in the reverse order. The tokenizer is only built when
// kv_cache_index.tokenizer is engine and tier 4 is on. On a reload, the Fleet outlives the
// Router: the new Router gets the Fleet's Peers, SetRouter hands it the peers' decisions and
// SetMetricsTargets the new backends' metrics URLs.
package stack
