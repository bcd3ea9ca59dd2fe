package eventlog_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync/eventlog"
	"github.com/kvroute/kvroute/natsync/natstest"
	"github.com/kvroute/kvroute/prefixkey"
)

const testModel = "llama-3-8b"

// prompt returns n deterministic tokens of conversation seed.
func prompt(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000 + (seed*7919+i*37)%120000)
	}
	return out
}

// engine is one vLLM engine's event publisher: its blocks of 16 tokens, engine hashes base+i.
type engine struct {
	name string
	base uint64
	seq  uint64
}

// stored is a batch storing blocks [from, to) of toks, chained to block from−1.
func (e *engine) stored(toks []uint32, from, to int) *events.Batch {
	hs := make([]uint64, to-from)
	for i := range hs {
		hs[i] = e.base + uint64(from+i)
	}
	ev := events.Event{Kind: events.KindBlockStored, BlockHashes: hs, TokenIDs: toks[from*16 : to*16], BlockSize: 16}
	if from > 0 {
		ev.Parent, ev.HasParent = e.base+uint64(from-1), true
	}
	e.seq++
	return &events.Batch{Model: testModel, Seq: e.seq, TS: float64(e.seq), Events: []events.Event{ev}}
}

// removed is a batch removing blocks [from, to) from the GPU.
func (e *engine) removed(from, to int) *events.Batch {
	hs := make([]uint64, to-from)
	for i := range hs {
		hs[i] = e.base + uint64(from+i)
	}
	e.seq++
	return &events.Batch{Model: testModel, Seq: e.seq, TS: float64(e.seq), Events: []events.Event{
		{Kind: events.KindBlockRemoved, BlockHashes: hs},
	}}
}

func newIndex(t testing.TB) *kvindex.MemoryIndex {
	t.Helper()
	ix, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, LookupStride: 1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ix.Close() })
	return ix
}

func connect(t testing.TB, srv *natstest.Server) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond),
		nats.ReconnectJitter(0, 0))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

func testConfig(t testing.TB, js jetstream.JetStream) eventlog.Config {
	return eventlog.Config{JetStream: js, Fleet: "test-fleet", Logger: slog.New(slog.NewTextHandler(t.Output(), nil))}
}

func startPublisher(t testing.TB, cfg eventlog.Config, opts eventlog.PublisherOptions) *eventlog.Publisher {
	t.Helper()
	p, err := eventlog.NewPublisher(cfg, opts)
	require.NoError(t, err)
	require.NoError(t, p.Start(context.Background()))
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func startConsumer(t testing.TB, cfg eventlog.Config, sink events.Sink, startSeq uint64) *eventlog.Consumer {
	t.Helper()
	c, err := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{Sink: sink, StartSeq: startSeq, RetryInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func flush(t testing.TB, p *eventlog.Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.Flush(ctx))
}

func waitSeq(t testing.TB, c *eventlog.Consumer, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, c.WaitSeq(ctx, seq), "consumer at %d, want %d: %+v", c.LastSeq(), seq, c.Stats())
}

// requests are what the router would look up: each conversation's whole prompt.
var requests = [][]uint32{prompt(1, 64*16), prompt(2, 32*16), prompt(3, 20*16)}

var backends = []string{"vllm-0", "vllm-1", "10.0.0.7:8000", "vllm-3"}

// answers returns every backend's match for every request, as the router computes them.
func answers(t testing.TB, ix kvindex.Lookuper) []kvindex.Match {
	t.Helper()
	var out []kvindex.Match
	for _, toks := range requests {
		req := &prefixkey.Request{Model: testModel, TokenIDs: toks}
		keys := req.BlockKeys(nil, kvindex.DefaultBlockSize)
		res, err := ix.Lookup(context.Background(), keys, backends, make([]kvindex.Match, len(backends)))
		require.NoError(t, err)
		out = append(out, res...)
	}
	return out
}

// blocksOf returns the matched blocks of answers, by request then backend.
func blocksOf(ms []kvindex.Match) []int {
	out := make([]int, len(ms))
	for i, m := range ms {
		out[i] = m.Blocks
	}
	return out
}

// Batches published by the bridge are applied by two replicas' consumers, which then answer alike;
// a third replica restored from a snapshot and the events after it answers like them too, for
// blocks stored before and after the snapshot, and blocks removed after it stay removed.
func TestPublishConsumeSnapshotRestore(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	pub := startPublisher(t, cfg, eventlog.PublisherOptions{})
	ix1, ix2 := newIndex(t), newIndex(t)
	c1 := startConsumer(t, cfg, ix1, 0)
	c2 := startConsumer(t, cfg, ix2, 0)
	ctx := context.Background()

	e0 := &engine{name: "vllm-0", base: 1000}
	e1 := &engine{name: "vllm-1", base: 5000}
	e1b := &engine{name: "vllm-1", base: 6000} // another conversation on vllm-1
	e2 := &engine{name: "10.0.0.7:8000", base: 9000}
	apply := func(e *engine, b *events.Batch) { require.NoError(t, pub.Apply(ctx, e.name, b)) }

	// Before the snapshot.
	apply(e0, e0.stored(requests[0], 0, 32))
	apply(e0, e0.stored(requests[0], 32, 48))
	apply(e1, e1.stored(requests[0], 0, 16))
	apply(e1b, e1b.stored(requests[1], 0, 32))
	apply(e2, e2.stored(requests[2], 0, 20))
	apply(e1b, e1b.removed(24, 32))
	flush(t, pub)
	seq := pub.Stats().LastSeq
	require.Equal(t, uint64(6), seq)
	waitSeq(t, c1, seq)
	waitSeq(t, c2, seq)
	before := answers(t, ix1)
	assert.Equal(t, before, answers(t, ix2), "two replicas answer alike")
	assert.Equal(t, []int{48, 16, 0, 0, 0, 24, 0, 0, 0, 0, 20, 0}, blocksOf(before))

	snap, err := eventlog.NewSnapshotter(cfg, eventlog.SnapshotterOptions{Exporter: ix1, Seq: c1})
	require.NoError(t, err)
	defer snap.Close()
	info, err := snap.Snapshot(ctx)
	require.NoError(t, err)
	assert.Equal(t, seq, info.Seq)
	assert.Equal(t, 3, info.Backends)
	assert.Equal(t, 48+16+24+20, info.Blocks)
	assert.Equal(t, uint64(1), snap.Stats().Snapshots)

	// After the snapshot: chains continued from blocks stored before it, blocks stored before it
	// removed, a backend cleared.
	apply(e0, e0.stored(requests[0], 48, 64))
	apply(e0, e0.removed(40, 64))
	apply(e1b, e1b.stored(requests[1], 24, 32))
	apply(e2, e2.removed(10, 20))
	require.NoError(t, pub.ClearBackend(ctx, e1.name))
	apply(e1, e1.stored(requests[2], 0, 4))
	flush(t, pub)
	last := pub.Stats().LastSeq

	ix3 := newIndex(t)
	res, err := eventlog.Restore(ctx, cfg, ix3)
	require.NoError(t, err)
	assert.True(t, res.Found)
	assert.True(t, res.Restored)
	assert.Equal(t, seq+1, res.StartSeq)
	assert.False(t, res.Stale)
	assert.Equal(t, info.Blocks, res.Counts.Blocks)
	assert.Equal(t, answers(t, ix3), before, "the restored index answers as the snapshot's")

	c3 := startConsumer(t, cfg, ix3, res.StartSeq)
	for _, c := range []*eventlog.Consumer{c1, c2, c3} {
		waitSeq(t, c, last)
	}
	after := answers(t, ix1)
	assert.Equal(t, []int{40, 0, 0, 0, 0, 0, 0, 0, 0, 4, 10, 0}, blocksOf(after))
	assert.Equal(t, after, answers(t, ix2))
	assert.Equal(t, after, answers(t, ix3), "restored + replayed answers like the replicas that saw everything")

	st3 := c3.Stats()
	assert.Equal(t, last-seq, st3.Messages, "the third replica replayed only what followed the snapshot")
	assert.Zero(t, st3.DecodeErrors+st3.ApplyErrors+st3.Gaps)
	assert.Equal(t, uint64(1), st3.Clears)
	s3, err := ix3.Stats(ctx)
	require.NoError(t, err)
	assert.Zero(t, s3.Dropped[kvindex.DropUnknownParent.String()], "chains continued from restored parents")
	assert.Zero(t, s3.Dropped[kvindex.DropUnknownBlock.String()], "removals found restored blocks")
	ps := pub.Stats()
	assert.Equal(t, last, ps.Published)
	assert.Zero(t, ps.Dropped+ps.Failed)
}

// With the server down, Apply returns at once, what does not fit the queue is dropped and
// counted, and the backend's next message clears it; after the server is back, publishing and
// consuming resume.
func TestOutage(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	pub := startPublisher(t, cfg, eventlog.PublisherOptions{QueueSize: 8, MaxInFlight: 4, AckTimeout: 300 * time.Millisecond})
	ix := newIndex(t)
	c := startConsumer(t, cfg, ix, 0)
	ctx := context.Background()

	e := &engine{name: "vllm-0", base: 1000}
	require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], 0, 16)))
	flush(t, pub)
	waitSeq(t, c, 1)
	assert.Equal(t, 16, blocksOf(answers(t, ix))[0])

	srv.Stop()
	start := time.Now()
	for i := range 200 {
		from := 16 + i%48
		require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], from, from+1)))
	}
	assert.Less(t, time.Since(start), time.Second, "Apply does not wait for the server")
	ps := pub.Stats()
	assert.Greater(t, ps.Dropped, uint64(100), "%+v", ps)

	srv.Restart()
	// Once the server is back, the next batch carries the clear, then the chain starts over.
	e2 := &engine{name: "vllm-0", base: 70000}
	require.Eventually(t, func() bool {
		f := e2.stored(requests[1], 0, 8)
		require.NoError(t, pub.Apply(ctx, e2.name, f))
		fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_ = pub.Flush(fctx)
		s := pub.Stats()
		return s.StreamReady && s.Published > 1 && pub.Stats().Queued == 0 && s.LastSeq > 1 && s.InFlight == 0
	}, 20*time.Second, 100*time.Millisecond)
	require.NoError(t, pub.Apply(ctx, e2.name, e2.stored(requests[1], 0, 32))) // whole: it may carry a clear
	flush(t, pub)
	ps = pub.Stats()
	assert.GreaterOrEqual(t, ps.Clears, uint64(1))
	waitSeq(t, c, ps.LastSeq)
	got := blocksOf(answers(t, ix))
	assert.Equal(t, 0, got[0], "vllm-0 was cleared: the events it lost leave no hole")
	assert.Equal(t, 32, got[4], "vllm-0's events after the outage")
	cs := c.Stats()
	assert.GreaterOrEqual(t, cs.Clears, uint64(1))
	assert.Zero(t, cs.DecodeErrors)
}

// Garbage on the stream's subjects is counted and skipped; the events around it are applied.
func TestGarbageMessages(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	pub := startPublisher(t, cfg, eventlog.PublisherOptions{})
	ix := newIndex(t)
	c := startConsumer(t, cfg, ix, 0)
	ctx := context.Background()

	e := &engine{name: "vllm-0", base: 1000}
	require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], 0, 8)))
	flush(t, pub)
	// Not a message; a message truncated; a valid message on another backend's subject.
	valid, err := eventlog.AppendMessage(nil, &eventlog.Message{Backend: "vllm-1", Batch: *(&engine{base: 5}).stored(requests[1], 0, 4)})
	require.NoError(t, err)
	for subj, data := range map[string][]byte{
		"kvroute.kv.vllm-1": []byte("hello"),
		"kvroute.kv.vllm-2": valid[:len(valid)-3],
		"kvroute.kv.vllm-3": valid,
	} {
		_, err := js.Publish(ctx, subj, data)
		require.NoError(t, err)
	}
	require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], 8, 16)))
	flush(t, pub)
	waitSeq(t, c, 5)
	st := c.Stats()
	assert.Equal(t, uint64(3), st.DecodeErrors)
	assert.Equal(t, uint64(2), st.Applied)
	assert.NotEmpty(t, st.LastError)
	got := blocksOf(answers(t, ix))
	assert.Equal(t, []int{16, 0, 0, 0}, got[:4])
	assert.Equal(t, []int{0, 0, 0, 0}, got[4:8], "nothing of vllm-1 was applied")
}

// Reset empties the stream and deletes the snapshot; a replica started after it restores nothing.
func TestReset(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	pub := startPublisher(t, cfg, eventlog.PublisherOptions{})
	ix := newIndex(t)
	c := startConsumer(t, cfg, ix, 0)
	ctx := context.Background()
	e := &engine{name: "vllm-0", base: 1000}
	for i := range 4 {
		require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], i*8, i*8+8)))
	}
	flush(t, pub)
	waitSeq(t, c, 4)
	snap, err := eventlog.NewSnapshotter(cfg, eventlog.SnapshotterOptions{Exporter: ix, Seq: c})
	require.NoError(t, err)
	defer snap.Close()
	_, err = snap.Snapshot(ctx)
	require.NoError(t, err)

	res, err := eventlog.Reset(ctx, cfg)
	require.NoError(t, err)
	assert.Equal(t, eventlog.ResetResult{PurgedMessages: 4, DeletedSnapshots: 1}, res)
	st, err := js.Stream(ctx, eventlog.DefaultStream)
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	assert.Zero(t, info.State.Msgs)
	obs, err := js.ObjectStore(ctx, eventlog.DefaultBucket)
	require.NoError(t, err)
	_, err = obs.GetInfo(ctx, cfg.Fleet)
	assert.ErrorIs(t, err, jetstream.ErrObjectNotFound)

	fresh := newIndex(t)
	rr, err := eventlog.Restore(ctx, cfg, fresh)
	require.NoError(t, err)
	assert.False(t, rr.Found)
	assert.Equal(t, uint64(1), rr.StartSeq)
	c2 := startConsumer(t, cfg, fresh, rr.StartSeq)
	// The log goes on after the purge, from the next sequence: the running consumer sees no gap.
	require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[1], 0, 4)))
	flush(t, pub)
	waitSeq(t, c2, 5)
	waitSeq(t, c, 5)
	assert.Equal(t, 4, blocksOf(answers(t, fresh))[4])
	assert.Zero(t, c.Stats().Gaps)
	assert.Equal(t, uint64(1), c2.Stats().Gaps, "the new replica started at 1 and found 5")

	// Reset of a log that does not exist is no error.
	other := cfg
	other.Stream, other.Bucket = "NOPE", "NOPE_BUCKET"
	res, err = eventlog.Reset(ctx, other)
	require.NoError(t, err)
	assert.Zero(t, res)
}

// A consumer started before the stream exists waits for it; one running across a server restart
// resumes where it stopped.
func TestConsumerResumes(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	ix := newIndex(t)
	c := startConsumer(t, cfg, ix, 0)
	time.Sleep(100 * time.Millisecond) // the stream does not exist yet
	pub := startPublisher(t, cfg, eventlog.PublisherOptions{})
	ctx := context.Background()
	e := &engine{name: "vllm-0", base: 1000}
	require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], 0, 8)))
	flush(t, pub)
	waitSeq(t, c, 1)

	srv.Restart()
	require.Eventually(t, func() bool {
		require.NoError(t, pub.Apply(ctx, e.name, e.stored(requests[0], 8, 16)))
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_ = pub.Flush(fctx)
		return pub.Stats().LastSeq >= 2
	}, 20*time.Second, 50*time.Millisecond)
	waitSeq(t, c, pub.Stats().LastSeq)
	assert.Equal(t, 16, blocksOf(answers(t, ix))[0])
	assert.Zero(t, c.Stats().DecodeErrors)
}

// Two bridges relaying one engine store each batch once (Nats-Msg-Id); a batch without an engine
// sequence is not deduplicated.
func TestDedup(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	a := startPublisher(t, cfg, eventlog.PublisherOptions{})
	b := startPublisher(t, cfg, eventlog.PublisherOptions{})
	ctx := context.Background()
	e := &engine{name: "vllm-0", base: 1000}
	for i := range 5 {
		batch := e.stored(requests[0], i*4, i*4+4)
		require.NoError(t, a.Apply(ctx, e.name, batch))
		require.NoError(t, b.Apply(ctx, e.name, batch))
	}
	sse := &events.Batch{Events: []events.Event{{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "ab", TokenCount: 64}}}
	require.NoError(t, a.Apply(ctx, "sse-0", sse))
	require.NoError(t, b.Apply(ctx, "sse-0", sse))
	flush(t, a)
	flush(t, b)
	st, err := js.Stream(ctx, eventlog.DefaultStream)
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	assert.Equal(t, uint64(7), info.State.Msgs)
	assert.Equal(t, uint64(5), a.Stats().Duplicates+b.Stats().Duplicates)
}

func TestConfigValidation(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	for name, cfg := range map[string]eventlog.Config{
		"no jetstream":   {},
		"bad stream":     {JetStream: js, Stream: "a.b"},
		"bad bucket":     {JetStream: js, Bucket: "a b"},
		"wildcard":       {JetStream: js, SubjectPrefix: "kv.*"},
		"empty token":    {JetStream: js, SubjectPrefix: "kv..x"},
		"replicas":       {JetStream: js, Replicas: 6},
		"negative age":   {JetStream: js, MaxAge: -1},
		"dups over age":  {JetStream: js, MaxAge: time.Minute, Duplicates: time.Hour},
		"negative bytes": {JetStream: js, MaxBytes: -1},
	} {
		_, err := eventlog.NewPublisher(cfg, eventlog.PublisherOptions{})
		assert.ErrorIs(t, err, eventlog.ErrInvalidConfig, name)
	}
	cfg := testConfig(t, js)
	_, err := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{})
	assert.ErrorIs(t, err, eventlog.ErrInvalidConfig)
	_, err = eventlog.NewSnapshotter(cfg, eventlog.SnapshotterOptions{})
	assert.ErrorIs(t, err, eventlog.ErrInvalidConfig)
	_, err = eventlog.NewPublisher(cfg, eventlog.PublisherOptions{QueueSize: -1})
	assert.ErrorIs(t, err, eventlog.ErrInvalidConfig)

	// Lifecycle errors.
	p, err := eventlog.NewPublisher(cfg, eventlog.PublisherOptions{})
	require.NoError(t, err)
	require.NoError(t, p.Start(context.Background()))
	assert.ErrorIs(t, p.Start(context.Background()), eventlog.ErrStarted)
	require.NoError(t, p.Close())
	require.NoError(t, p.Close())
	assert.ErrorIs(t, p.Apply(context.Background(), "a", &events.Batch{}), eventlog.ErrClosed)
	assert.ErrorIs(t, p.Start(context.Background()), eventlog.ErrClosed)
	c, err := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{Sink: newIndex(t)})
	require.NoError(t, err)
	require.NoError(t, c.Close())
	assert.ErrorIs(t, c.Start(context.Background()), eventlog.ErrClosed)
	assert.ErrorIs(t, c.WaitSeq(context.Background(), 1), eventlog.ErrClosed)
}

// A restore of a damaged snapshot clears what it restored and tells the consumer to replay the
// whole stream.
func TestRestoreDamaged(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	ctx := context.Background()
	obs, err := js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: eventlog.DefaultBucket})
	require.NoError(t, err)

	src := newIndex(t)
	e := &engine{name: "vllm-0", base: 1000}
	require.NoError(t, src.Apply(ctx, e.name, e.stored(requests[0], 0, 64)))
	var buf bytesBuffer
	_, err = eventlog.WriteSnapshot(ctx, &buf, eventlog.SnapshotHeader{Stream: eventlog.DefaultStream, Seq: 9}, src)
	require.NoError(t, err)
	data := buf.Bytes()
	for name, tc := range map[string]struct {
		data []byte
		want error
	}{
		"truncated":    {data[:len(data)-10], eventlog.ErrMalformed},
		"other stream": {rewriteStream(t, src, "OTHER"), eventlog.ErrSnapshotMismatch},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := obs.PutBytes(ctx, cfg.Fleet, tc.data)
			require.NoError(t, err)
			ix := newIndex(t)
			res, err := eventlog.Restore(ctx, cfg, ix)
			assert.ErrorIs(t, err, tc.want)
			assert.True(t, res.Found)
			assert.False(t, res.Restored)
			assert.Equal(t, uint64(1), res.StartSeq)
			assert.Equal(t, 0, blocksOf(answers(t, ix))[0], "nothing restored stays")
		})
	}
}

func rewriteStream(t *testing.T, ex kvindex.Exporter, stream string) []byte {
	var buf bytesBuffer
	_, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: stream}, ex)
	require.NoError(t, err)
	return buf.Bytes()
}

// bytesBuffer is a bytes.Buffer without its ReadFrom, to check that writers stream.
type bytesBuffer struct{ b []byte }

func (w *bytesBuffer) Write(p []byte) (int, error) {
	if len(p) > 64<<10 {
		return 0, errors.New("write larger than the snapshot writer's buffer")
	}
	w.b = append(w.b, p...)
	return len(p), nil
}
func (w *bytesBuffer) Bytes() []byte { return w.b }

func ExampleConsumer() {
	// In each router replica: restore the latest snapshot, then apply the stream from there.
	var js jetstream.JetStream // jetstream.New(nc), nc from nats.Connect(url, nats.MaxReconnects(-1))
	if js == nil {
		return
	}
	ctx := context.Background()
	cfg := eventlog.Config{JetStream: js, Fleet: "llama-fleet"}
	ix, _ := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: "llama-3-8b"})
	res, _ := eventlog.Restore(ctx, cfg, ix) // no snapshot: StartSeq 1
	c, _ := eventlog.NewConsumer(cfg, eventlog.ConsumerOptions{Sink: ix, StartSeq: res.StartSeq})
	_ = c.Start(ctx)
	defer c.Close()
	snap, _ := eventlog.NewSnapshotter(cfg, eventlog.SnapshotterOptions{Exporter: ix, Seq: c})
	_ = snap.Start(ctx) // one replica per fleet is enough
	defer snap.Close()
	fmt.Println(res.StartSeq)
}

// A consumer started before the stream exists reports "stream not found"; once the stream is
// there and it subscribed, its stats say so (Subscribed, SubscribedAt after LastErrorAt), so that
// the start-up error reads as history. A server restart leaves it subscribed again.
func TestConsumerStatsRecovery(t *testing.T) {
	srv := natstest.Start(t)
	js := connect(t, srv)
	cfg := testConfig(t, js)
	c := startConsumer(t, cfg, newIndex(t), 0)
	require.Eventually(t, func() bool { return c.Stats().LastError != "" }, 10*time.Second, 10*time.Millisecond)
	st := c.Stats()
	assert.Contains(t, st.LastError, "stream not found")
	assert.False(t, st.Subscribed)
	assert.True(t, st.SubscribedAt.IsZero())

	pub := startPublisher(t, cfg, eventlog.PublisherOptions{})
	e := &engine{name: "vllm-0", base: 1000}
	require.NoError(t, pub.Apply(context.Background(), e.name, e.stored(requests[0], 0, 8)))
	flush(t, pub)
	waitSeq(t, c, 1)
	st = c.Stats()
	require.True(t, st.Subscribed, "%+v", st)
	assert.True(t, st.SubscribedAt.After(st.LastErrorAt), "subscribed at %v, last error at %v", st.SubscribedAt, st.LastErrorAt)
	assert.Contains(t, st.LastError, "stream not found", "the error stays, as history")
}
