// Package zmqevents is the ZeroMQ transport of package events: a Consumer that subscribes to the
// KV events vLLM and SGLang publish over ZMQ, decodes them (events.DecodeMsgpackBatch) and
// applies them to an events.Sink, such as a kvindex index. It is the only kvroute package that
// imports a ZMQ library (github.com/go-zeromq/zmq4, for the ZMTP 3 handshake and framing); the
// event model, the decoders, the Sink contract and the SSE transport stay in package events,
// which imports none.
//
// # Wire format
//
// Engines publish on a PUB socket messages of three frames, [topic, seq, payload]: the topic
// (vLLM's is configurable and "" by default; llm-d's kv@<pod>@<model> names the pod and the
// model, see ParseTopic), the batch's sequence number as 8 bytes big-endian, and the msgpack
// batch (vLLM's vllm/distributed/kv_events.py, SGLang's
// sglang/srt/disaggregation/kv_events.py). An engine with a replay endpoint (a ROUTER socket)
// answers a request ["", start] with every batch it still keeps from start on, each as
// ["", seq, payload], then ["", ReplayEndSeq, ""]. The transport is ZMTP 3.0 (rfc.zeromq.org
// 23/ZMTP) with the NULL mechanism.
//
// # Modes
//
//   - Connect (pod discovery): a SUB socket connects to each engine's PUB endpoint
//     (tcp://host:5557, one port per data-parallel rank), Config.Endpoints.
//   - Bind (centralized): the consumer binds one or more addresses that engines connect to (one
//     per engine or per data-parallel rank, each with its own placement rules, Config.Listeners);
//     one consumer owns them all, so a backend reached through several addresses is still applied
//     in order by one goroutine.
//
// # Sequences, replay and catch-up
//
// A jump in seq means lost batches: the consumer asks the engine's replay endpoint for the
// missing ones when it has one, and otherwise calls Sink.ClearBackend so that the index forgets
// that backend's possibly stale state instead of over-reporting it. On each new connection it
// also catches up: before the first batch it asks the replay endpoint for the batches the engine
// still keeps from before (Config.CatchUpBatches; vLLM keeps 10,000), so that the index learns
// what the engine cached before the subscription. A batch over Config.MaxFrameBytes
// (DefaultMaxFrameBytes, 16 MiB) is dropped undecoded and handled as a lost one. A Sink that can
// lose what it was given without being told (a Redis index whose server restarted empty)
// implements events.LossReporter: each backend's worker asks it every Config.LossCheckInterval
// (1 s) whether the backend was lost, and heals a lost one at once, as it answers a failed Apply
// but without waiting for the engine's next batch: it clears the backend and catches each of its
// chains up on the batches through the last one applied.
//
// # Trust
//
// ZMTP's NULL mechanism authenticates no one, and a consumer believes every message it receives.
// Whoever can reach a bound address (bind mode) can therefore feed the index false blocks of any
// backend that address's rules can name, and break a sequence to reset a backend (a random
// sequence number at every message, or connections opened and closed). Three bounds:
//
//   - A bound address without a host ("tcp://:5557") binds loopback; every interface takes an
//     explicit "tcp://*:5557" or "tcp://0.0.0.0:5557", which Start logs at Warn. Bind the pod's
//     own address (Kubernetes' downward API: status.podIP) and let only the engines reach the
//     port (a NetworkPolicy, a firewall).
//   - Each backend has a reset budget, Config.MaxResetsPerMinute (10): the resets beyond it are
//     not made, and are counted (events.SequenceStats.ResetsLimited,
//     telemetry.MetricConsumerResetsLimited).
//   - Messages whose topic names no backend the address accepts are dropped and counted on the
//     address (Consumer.Listeners, telemetry.MetricConsumerListenerMessages), as are new topics
//     beyond Config.MaxTopics and open connections beyond 4 × MaxTopics.
//
// In connect mode the consumer dials the engines it is given; the same holds of whoever can
// impersonate them on the network.
//
// The consumer keeps its sources' status and metrics with events.SourceSet and writes to the
// sink through events.BackendWriter, as any transport built on package events does: Status
// reports events.SourceStatus values, and the metrics carry the names and scope of package
// events ("github.com/kvroute/kvroute/events").
//
// # Use
//
//	index, _ := kvindex.NewMemory(kvindex.MemoryConfig{})
//	c, err := zmqevents.New(zmqevents.Config{Sink: index, Endpoints: []zmqevents.Endpoint{
//		{Backend: "vllm-0", Endpoint: "tcp://vllm-0:5557", ReplayEndpoint: "tcp://vllm-0:5558"},
//	}})
//	if err != nil {
//		return err // errors.Is(err, events.ErrInvalidConfig)
//	}
//	if err := c.Start(ctx); err != nil { // engines that are down are retried in the background
//		return err
//	}
//	defer c.Close()
//	log.Printf("%+v", c.Status()) // one events.SourceStatus per endpoint
package zmqevents
