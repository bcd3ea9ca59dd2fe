package events

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// storedBatchPayload encodes a batch of n BlockStored events of 16 blocks of 16 tokens each, the
// shape of a long prompt's prefill on vLLM with the default block size: 64-bit hashes (vLLM folds
// its sha256 digests to their last 8 bytes) and token ids drawn uniformly from a 152k vocabulary
// (so uint16 and uint32 encodings alternate unpredictably), in the array form or the map form.
// seed varies the content.
func storedBatchPayload(tb testing.TB, n int, mapForm bool, seed uint64) []byte {
	tb.Helper()
	const blocks, blockSize = 16, 16
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	events := make([]any, n)
	parent := any(nil)
	for i := range events {
		hashes := make([]any, blocks)
		for j := range hashes {
			hashes[j] = rng.Uint64()
		}
		tokens := make([]any, blocks*blockSize)
		for j := range tokens {
			tokens[j] = rng.IntN(152064)
		}
		if mapForm {
			events[i] = mpMap{{"type", "BlockStored"}, {"block_hashes", hashes}, {"parent_block_hash", parent},
				{"token_ids", tokens}, {"block_size", blockSize}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}}
		} else {
			events[i] = mpArr("BlockStored", hashes, parent, tokens, blockSize, nil, "GPU", nil)
		}
		parent = hashes[blocks-1]
	}
	if mapForm {
		return mpEncode(tb, mpMap{{"ts", 1718000000.123}, {"events", events}, {"data_parallel_rank", 0}})
	}
	return mpEncode(tb, mpArr(1718000000.123, events, 0))
}

// BenchmarkDecodeMsgpackBatch decodes batches of 16-block BlockStored events into a reused Batch.
func BenchmarkDecodeMsgpackBatch(b *testing.B) {
	for _, form := range []string{"array", "map"} {
		for _, n := range []int{1, 16, 64} {
			b.Run(fmt.Sprintf("form=%s/events=%d", form, n), func(b *testing.B) {
				// Rotate through distinct payloads holding 256 events in all, so that the branch
				// predictor cannot learn one payload's token widths by heart (it does for a
				// single small payload, which flatters the result).
				payloads := make([][]byte, max(1, 256/n))
				size := 0
				for i := range payloads {
					payloads[i] = storedBatchPayload(b, n, form == "map", uint64(i))
					size += len(payloads[i])
				}
				var batch Batch
				if _, err := DecodeMsgpackBatch(payloads[0], &batch); err != nil { // grow batch's storage
					b.Fatal(err)
				}
				b.SetBytes(int64(size / len(payloads)))
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := DecodeMsgpackBatch(payloads[i], &batch); err != nil {
						b.Fatal(err)
					}
					if i++; i == len(payloads) {
						i = 0
					}
				}
				b.ReportMetric(float64(b.N*n)/b.Elapsed().Seconds(), "events/s")
			})
		}
	}
}

// BenchmarkDecodeSSEEvent decodes one SSE cache event into a reused Event.
func BenchmarkDecodeSSEEvent(b *testing.B) {
	data := []byte(`{"event":"cache_created","prefix_hash":"9F2C4A7B1E0D3C5A9F2C4A7B1E0D3C5A","token_count":2048}`)
	var ev Event
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if err := DecodeSSEEvent("cache_created", data, &ev); err != nil {
			b.Fatal(err)
		}
	}
}
