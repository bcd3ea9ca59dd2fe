// Package storeutil holds what kvroute's own response-cache stores (respcache/redisstore and
// respcache/s3store) share and a store written elsewhere does not need: keeping secrets out of
// errors and descriptions (Redact, Secrets, Presence, RedactURL), the glue between a client
// library's errors and respcache's error types (ErrorType, Unavailable), the latency histogram
// and error counter every store reports (Instruments), and a nil-safe logger (Logger). What a
// third-party store needs is exported by package respcache itself: ErrorTypeOf, ErrorCounts and
// the ErrorType* constants.
//
// Everything here is safe for concurrent use. A store uses it as redisstore does:
//
//	secrets := storeutil.Secrets(opt.Password)
//	m, err := storeutil.NewInstruments(storeutil.Meter(cfg.MeterProvider, scopeName),
//		"redisstore", "redis", telemetry.MetricCacheRedisLatency, telemetry.MetricCacheRedisErrors)
//	...
//	start := time.Now()
//	err = client.Do(ctx, cmd).Error()
//	m.Latency(ctx, storeutil.OpGet, start)
//	if err = storeutil.Redact(err, secrets); err != nil {
//		typ := storeutil.ErrorType(err, rueidisErrorType) // "" for the caller's cancellation
//		m.CountError(typ)
//		if storeutil.Unavailable(typ) {
//			// fall back
//		}
//	}
package storeutil
