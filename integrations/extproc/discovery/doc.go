// Package discovery keeps kvroute-epp's endpoints in line with DNS: a Watcher resolves the
// endpoint_picker.discovery.dns_name of kvroute's configuration every interval and turns the
// addresses it finds into backends named "ip:port" (the Endpoint Picker Protocol's endpoint
// format, and the <pod> of llm-d's kv@<pod>@<model> KV-event topics), which it adds to and
// removes from a Membership. Members is the Membership of a kvroute deployment: the Router, the
// health Monitor, the KV index, the engine-metrics scraper and each pod's KV-event consumer.
//
// The name is typically a Kubernetes headless Service (clusterIP: None), whose A and AAAA records
// list the addresses of its ready pods: Kubernetes DNS ("DNS for Services and Pods", kubernetes.io
// /docs/concepts/services-networking/dns-pod-service, and the Kubernetes DNS-Based Service
// Discovery specification, github.com/kubernetes/dns/blob/master/docs/specification.md) answers
// one record per ready endpoint, and NXDOMAIN (or no record) when none is ready.
//
// # What a resolve does
//
//   - A resolver error (a timeout, SERVFAIL, an unreachable server) keeps the endpoints of the last
//     good resolve: it is logged, counted and retried at the next interval. A DNS outage never
//     empties the pool.
//   - NXDOMAIN or an answer without addresses means that no pod is ready, and removes every
//     endpoint, but only once two consecutive resolves have said so (see Watcher).
//   - Otherwise the addresses, deduplicated and sorted, are the endpoints: new ones are added
//     (Membership.AddBackend), vanished ones removed (Membership.RemoveBackend). A Membership error
//     is logged and counted, and the change is tried again at the next resolve.
//   - More than Options.MaxEndpoints addresses (DefaultMaxEndpoints, 1024) is an error, and the
//     endpoints stay as they were.
//
// # Use
//
//	members := &discovery.Members{Config: cfg, Router: router, Health: monitor, Index: index,
//		Metrics: scraper.SetTargets, Events: startConsumer}
//	w, err := discovery.New(cfg, members, discovery.Options{Logger: logger})
//	if err != nil {
//		return err
//	}
//	if err := w.Sync(ctx); err != nil { // the first resolve, before serving
//		logger.Warn("no endpoints yet", "err", err)
//	}
//	w.Start(ctx) // then every discovery.interval
//	defer w.Close()
package discovery
