package eventlog_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/natsync/eventlog"
)

// fleetIndex is an index holding the scenario's blocks: several backends, tiers, removals and a
// prefix entry.
func fleetIndex(t testing.TB) *kvindex.MemoryIndex {
	t.Helper()
	ix := newIndex(t)
	ctx := context.Background()
	e0 := &engine{name: "vllm-0", base: 1000}
	e1 := &engine{name: "10.0.0.7:8000", base: 5000}
	require.NoError(t, ix.Apply(ctx, e0.name, e0.stored(requests[0], 0, 64)))
	require.NoError(t, ix.Apply(ctx, e1.name, e1.stored(requests[1], 0, 32)))
	require.NoError(t, ix.Apply(ctx, e1.name, &events.Batch{Events: []events.Event{
		{Kind: events.KindBlockStored, BlockHashes: []uint64{5000, 5001}, Tier: events.TierCPU},
		{Kind: events.KindPrefix, PrefixOp: events.PrefixCreated, PrefixHash: "beef", TokenCount: 128},
	}}))
	require.NoError(t, ix.Apply(ctx, e1.name, e1.removed(20, 32)))
	return ix
}

func TestSnapshotRoundTrip(t *testing.T) {
	src := fleetIndex(t)
	var buf bytes.Buffer
	h := eventlog.SnapshotHeader{Stream: "S", Fleet: "f", Seq: 77, Created: time.Unix(1767225600, 5), BlockSize: 16}
	counts, err := eventlog.WriteSnapshot(context.Background(), &buf, h, src)
	require.NoError(t, err)
	assert.Equal(t, eventlog.SnapshotCounts{Backends: 2, Blocks: 64 + 20, EngineHashes: 64 + 20, Prefixes: 1, Bytes: int64(buf.Len())}, counts)

	dst := newIndex(t)
	gotH, gotCounts, err := eventlog.ReadSnapshot(context.Background(), bytes.NewReader(buf.Bytes()), dst)
	require.NoError(t, err)
	assert.True(t, h.Created.Equal(gotH.Created))
	gotH.Created = h.Created
	assert.Equal(t, h, gotH)
	assert.Equal(t, counts, gotCounts)
	assert.Equal(t, answers(t, src), answers(t, dst))
	pm, err := dst.LookupPrefix(context.Background(), "beef", []string{"10.0.0.7:8000"}, make([]kvindex.Match, 1))
	require.NoError(t, err)
	assert.Equal(t, 128, pm[0].Tokens)
}

// Every truncation of a snapshot is an error, and every corrupted byte is an error or (in a
// time field) a snapshot; nothing panics.
func TestSnapshotDamaged(t *testing.T) {
	src := fleetIndex(t)
	var buf bytes.Buffer
	_, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: "S"}, src)
	require.NoError(t, err)
	data := buf.Bytes()
	nop := kvindex.RestorerFunc(func(context.Context, string, []kvindex.StateRecord) error { return nil })
	for n := 0; n < len(data); n += 1 + n/50 {
		_, _, err := eventlog.ReadSnapshot(context.Background(), bytes.NewReader(data[:n]), nop)
		assert.ErrorIs(t, err, eventlog.ErrMalformed, "cut at %d", n)
	}
	for i := 0; i < len(data); i += 7 {
		c := bytes.Clone(data)
		c[i] ^= 0x5a
		_, _, err := eventlog.ReadSnapshot(context.Background(), bytes.NewReader(c), nop)
		assert.ErrorIs(t, err, eventlog.ErrMalformed, "byte %d", i)
	}
	_, _, err = eventlog.ReadSnapshot(context.Background(), bytes.NewReader(append(bytes.Clone(data), 1)), nop)
	assert.ErrorIs(t, err, eventlog.ErrMalformed, "trailing data")
}

// FuzzReadSnapshot reads arbitrary input as a snapshot: no panic, bounded memory.
func FuzzReadSnapshot(f *testing.F) {
	src, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, SweepInterval: -1})
	if err != nil {
		f.Fatal(err)
	}
	e := &engine{name: "a", base: 1}
	_ = src.Apply(context.Background(), "a", e.stored(prompt(1, 64), 0, 4))
	var buf bytes.Buffer
	if _, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: "S"}, src); err != nil {
		f.Fatal(err)
	}
	_ = src.Close()
	f.Add(buf.Bytes())
	f.Add([]byte("KVSNAP\x01"))
	f.Add([]byte("KVSNAP\x02"))
	f.Fuzz(func(t *testing.T, data []byte) {
		n := 0
		_, _, _ = eventlog.ReadSnapshot(context.Background(), bytes.NewReader(data),
			kvindex.RestorerFunc(func(_ context.Context, _ string, recs []kvindex.StateRecord) error {
				n += len(recs)
				return nil
			}))
		if n > len(data) {
			t.Fatalf("%d records from %d bytes", n, len(data))
		}
	})
}

// BenchmarkCodec encodes and decodes a typical vLLM batch (16 blocks stored, 4 removed).
func BenchmarkCodec(b *testing.B) {
	m := eventlog.Message{Backend: "vllm-0", Batch: *typicalBatch()}
	data, err := eventlog.AppendMessage(nil, &m)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		buf := make([]byte, 0, 4096)
		for b.Loop() {
			buf, _ = eventlog.AppendMessage(buf[:0], &m)
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		var out eventlog.Message
		for b.Loop() {
			if err := eventlog.DecodeMessage(data, &out); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSnapshotRestore reads a snapshot of one backend's chain into an empty index.
func BenchmarkSnapshotRestore(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			src, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, SweepInterval: -1})
			if err != nil {
				b.Fatal(err)
			}
			defer src.Close()
			e := &engine{name: "vllm-0", base: 1}
			toks := prompt(5, n*16)
			for from := 0; from < n; from += 512 {
				if err := src.Apply(context.Background(), e.name, e.stored(toks, from, min(from+512, n))); err != nil {
					b.Fatal(err)
				}
			}
			var buf bytes.Buffer
			if _, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: "S"}, src); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(buf.Len()))
			for b.Loop() {
				b.StopTimer()
				dst, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, SweepInterval: -1})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, _, err := eventlog.ReadSnapshot(context.Background(), bytes.NewReader(buf.Bytes()), dst); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				_ = dst.Close()
				b.StartTimer()
			}
		})
	}
}

// BenchmarkSnapshotWrite exports a 100,000-block index into a snapshot.
func BenchmarkSnapshotWrite(b *testing.B) {
	src, err := kvindex.NewMemory(kvindex.MemoryConfig{DefaultModel: testModel, SweepInterval: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	e := &engine{name: "vllm-0", base: 1}
	const n = 100_000
	toks := prompt(5, n*16)
	for from := 0; from < n; from += 512 {
		if err := src.Apply(context.Background(), e.name, e.stored(toks, from, min(from+512, n))); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	var buf bytes.Buffer
	for b.Loop() {
		buf.Reset()
		if _, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: "S"}, src); err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(int64(buf.Len()))
}

// A snapshot of version 1 holds block keys of the first key space: it is refused as a mismatch
// before any record reaches the index, never restored as valid.
func TestSnapshotOfAnotherKeySpace(t *testing.T) {
	src := fleetIndex(t)
	var buf bytes.Buffer
	_, err := eventlog.WriteSnapshot(context.Background(), &buf, eventlog.SnapshotHeader{Stream: "S"}, src)
	require.NoError(t, err)
	old := bytes.Clone(buf.Bytes())
	old[len("KVSNAP")] = 1
	n := 0
	_, _, err = eventlog.ReadSnapshot(context.Background(), bytes.NewReader(old),
		kvindex.RestorerFunc(func(_ context.Context, _ string, recs []kvindex.StateRecord) error {
			n += len(recs)
			return nil
		}))
	require.ErrorIs(t, err, eventlog.ErrSnapshotMismatch)
	assert.Zero(t, n, "records restored from a snapshot of another key space")
}
