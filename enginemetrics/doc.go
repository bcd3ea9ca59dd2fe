// Package enginemetrics reads the load of vLLM and SGLang engines from their Prometheus metrics
// endpoints and reports it to a kvroute Router: the engine-reported load of the Router's "Router
// replicas" documentation (kvroute.DefaultRouter.ReportEngineLoad, kvroute.EngineLoad).
//
// A router replica sees only the requests it routed itself. An engine counts every replica's: a
// Scraper GETs each backend's metrics URL every Config.Interval (2 s), reads the engine's running
// and waiting requests and its KV-cache usage, and hands them to a Sink, which
// *kvroute.DefaultRouter is. The Router takes as the backend's external load the larger of its
// peers' in-flight requests and what the engine reports beyond the Router's own in-flight
// requests at the time of the report (Running + Waiting − own, at least 0), and counts it in the
// backend's bound (tiers 1 and 4) and in tier 4's candidates like its own requests.
//
// # What it reads
//
// The engine is detected on every scrape from the gauges present (a body with both engines' or
// neither's fails the scrape). Series are summed, over the engine's data-parallel ranks (each a
// series of its own) or over the models of a multi-model endpoint; Config.Model keeps only the
// series whose model_name label is that model. The usage gauge is averaged over its series.
//
// vLLM (labels model_name, the served model name, and engine, the engine core's index: one series
// per data-parallel engine behind one API server):
//
//	vllm:num_requests_running  gauge  requests in the engine's model execution batches → Running
//	vllm:num_requests_waiting  gauge  requests queued for scheduling                   → Waiting
//	vllm:kv_cache_usage_perc   gauge  fraction (0–1, despite the name) of KV-cache blocks in use
//	                                  → KVCacheUsage; vLLM's name since 0.9.2 (the v1 engine)
//	vllm:gpu_cache_usage_perc  gauge  the same under its earlier name, read when the newer one is
//	                                  absent; deprecated in 0.9.2 and hidden since 0.11 (unless
//	                                  --show-hidden-metrics-for-version)
//
// SGLang (label model_name, with rank labels such as tp_rank, pp_rank or dp_rank depending on the
// version and the parallelism; each data-parallel scheduler reports series of its own):
//
//	sglang:num_running_reqs  gauge  requests in the running batch                   → Running
//	sglang:num_queue_reqs    gauge  requests in the waiting queue                   → Waiting
//	sglang:token_usage       gauge  fraction (0–1) of the KV pool's token slots used → KVCacheUsage
//
// KVCacheUsage is -1 when the engine reports no usage gauge. NaN and infinite samples are skipped,
// negative counts count as 0, usage is clamped to [0, 1].
//
// These names, types and labels were checked against the engines' sources: vLLM's
// vllm/v1/metrics/loggers.py (PrometheusStatLogger declares the three gauges with labelnames
// model_name and engine, one child per engine index; vllm:gpu_cache_usage_perc carries the
// comment "Deprecated in 0.9.2 - Renamed as vllm:kv_cache_usage_perc" and, from 0.11, is created
// only with show_hidden_metrics) and its "Production Metrics" documentation; SGLang's
// python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector declares
// sglang:num_running_reqs, sglang:num_queue_reqs and sglang:token_usage as gauges over the
// scheduler's labels) and its docs/references/production_metrics.md sample output (model_name
// label). Both serve them through the Python prometheus_client, whose text output
// testdata/*.prom imitate. The simulated engine of kvroute's tests (internal/enginesim) exports
// vLLM's names with the same types and labels.
//
// # Wire format
//
// A scrape asks for the Prometheus text format, version 0.0.4 (Accept: text/plain;version=0.0.4),
// which both engines serve unless OpenMetrics is asked for, and parses the body with expfmt's
// TextParser (package github.com/prometheus/common/expfmt), checking names as UTF-8 so that one
// odd family does not fail the body. The body is parsed as text whatever its Content-Type: an
// OpenMetrics body of plain gauges parses the same, one with exemplars or fractional timestamps
// fails. expfmt's OpenMetrics decoder is not used: in prometheus/common v0.73 it parses each line
// against the OpenMetrics ABNF grammar, which took 3.3 s for a 6 KB body and 7 s for a single
// sample with a 1 KB label on a test machine, so that a hostile endpoint could pin a core. A
// parse of a whole vLLM body (200 series, 25 KB) takes about 1.3 ms on a 2-vCPU machine
// (BenchmarkParse).
//
// # When a scrape fails
//
// A scrape fails on a connection error, a timeout (Config.Timeout, 1 s, bounds the whole
// scrape), a status other than 200, a body over Config.MaxBodyBytes (4 MiB, counted after gzip
// decoding, and never read further), a malformed body, or one without the engine's running and
// waiting gauges. It reports nothing: the backend's previous report goes on counting until it
// is Config.EngineLoadMaxAge (of the Router, 10 s by default: keep it at a few intervals) old, and
// then the Router falls back to its own counts and its peers'. Failures are counted
// (telemetry.MetricEngineScrapes with result error, too_large or parse_error), shown in Stats (last error,
// consecutive failures) and logged as a warning at most once per LogEvery per target; the
// first success after them is logged too.
//
// # Goroutines
//
// New builds an idle Scraper; Start runs one goroutine per target until its context ends or
// Close, which waits for them. Each target's first scrape comes after a random delay within one
// interval, so that a fleet's scrapes spread; targets are scraped concurrently, each bounded by
// its own timeout, so that a slow target delays no other. SetTargets adds and removes targets
// at run time (a configuration reload), and waits for a removed target's goroutine, so that no
// load of a removed backend reaches the Router after it returns.
//
// # Use
//
//	s, err := enginemetrics.New(enginemetrics.Config{
//		Targets: map[string]string{
//			"vllm-0": "http://10.0.0.10:8000/metrics",
//			"vllm-1": "http://10.0.0.11:8000/metrics",
//		},
//		MeterProvider: mp, // optional
//		Logger:        logger,
//	}, router) // router: *kvroute.DefaultRouter
//	if err != nil {
//		return err
//	}
//	if err := s.Start(ctx); err != nil {
//		return err
//	}
//	defer s.Close()
//	// On a configuration reload: s.SetTargets(newTargets), then router.RemoveBackend(gone).
//	// For an admin endpoint: json.NewEncoder(w).Encode(s.Stats())
//
// Importing this package costs prometheus/common and prometheus/client_model (and protobuf);
// the kvroute package itself imports neither.
package enginemetrics
