package events

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// FuzzDecodeMsgpackBatch: no panic; every error wraps ErrMalformed; a decoded batch satisfies the
// Event invariants; decoding into a dirty, reused Batch gives the same result as into a fresh
// one; and whatever the decoder accepts is one well-formed msgpack value to vmihailenco/msgpack.
func FuzzDecodeMsgpackBatch(f *testing.F) {
	paths, err := filepath.Glob(filepath.Join("testdata", "*.msgpack"))
	if err != nil {
		f.Fatal(err)
	}
	for _, path := range paths {
		payload, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(payload)
	}
	f.Add(storedBatchPayload(f, 2, false, 1))
	f.Add(storedBatchPayload(f, 2, true, 1))
	// Amplification: minimal events (the small frame decodes within the slack, the large one is
	// over budget), a dense event, and headers that announce 2^31 elements.
	f.Add(ampRepeated(ampRemovedOne, 1<<10))
	f.Add(ampRepeated(ampRemovedEmpty, 160<<10))
	f.Add(ampOneEvent("stored-extra-keys", 1<<10))
	f.Add(binary.BigEndian.AppendUint32(append(bytes.Clone(ampBatchHead[:10]), mpArray32), 1<<31))
	f.Add(append(binary.BigEndian.AppendUint32(append(append(append(bytes.Clone(ampBatchHead[:10]), 0x91, 0x92), ampEventTag[false]...), mpArray32), 1<<31), 1))

	// dirty is shared across iterations on purpose: it carries storage from earlier inputs.
	var dirty Batch
	f.Fuzz(func(t *testing.T, payload []byte) {
		var fresh Batch
		skipped, err := DecodeMsgpackBatch(payload, &fresh)
		skipped2, err2 := DecodeMsgpackBatch(payload, &dirty)
		if (err == nil) != (err2 == nil) || skipped != skipped2 {
			t.Fatalf("fresh and reused batches disagree: %v/%d vs %v/%d", err, skipped, err2, skipped2)
		}
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			if len(fresh.Events) != 0 || skipped != 0 {
				t.Fatalf("error with %d events, %d skipped", len(fresh.Events), skipped)
			}
			return
		}
		checkBatchInvariants(t, &fresh)
		if fresh.TS != dirty.TS && !math.IsNaN(fresh.TS) || fresh.DPRank != dirty.DPRank || fresh.HasDPRank != dirty.HasDPRank {
			t.Fatalf("batch fields differ: %+v vs %+v", fresh, dirty)
		}
		a, b := normEvents(fresh.Events), normEvents(dirty.Events)
		if len(a) != len(b) {
			t.Fatalf("%d events vs %d", len(a), len(b))
		}
		for i := range a {
			if !decodedEventsEqual(a[i], b[i]) {
				t.Fatalf("event %d differs:\n%+v\n%+v", i, a[i], b[i])
			}
		}
		r := bytes.NewReader(payload)
		if err := msgpack.NewDecoder(r).Skip(); err != nil || r.Len() != 0 {
			t.Fatalf("decoder accepted what msgpack/v5 rejects (err %v, %d bytes left)", err, r.Len())
		}
	})
}

// decodedEventsEqual compares two normalised events field by field.
func decodedEventsEqual(a, b Event) bool {
	if a.Kind != b.Kind || a.Parent != b.Parent || a.HasParent != b.HasParent || a.BlockSize != b.BlockSize ||
		a.LoRAName != b.LoRAName || a.Tier != b.Tier || a.CacheSalt != b.CacheSalt || a.GroupIdx != b.GroupIdx ||
		len(a.ExtraKeys) != len(b.ExtraKeys) {
		return false
	}
	for i := range a.ExtraKeys {
		if !slices.Equal(a.ExtraKeys[i], b.ExtraKeys[i]) {
			return false
		}
	}
	return slices.Equal(a.BlockHashes, b.BlockHashes) && slices.Equal(a.TokenIDs, b.TokenIDs)
}

// FuzzDecodeSSEEvent: no panic; every error wraps ErrMalformed and leaves ev unchanged; a decoded
// event is a KindPrefix event with a known op, a lowercase hex hash and a non-negative count; and
// its hash and count agree with encoding/json's reading of the same data.
func FuzzDecodeSSEEvent(f *testing.F) {
	for _, seed := range []struct{ field, data string }{
		{"cache_created", `{"event":"cache_created","prefix_hash":"9f2c","token_count":2048}`},
		{"", `{"event":"cache_evicted","prefix_hash":"ABCDEF0123456789","token_count":16}`},
		{"message", `{"event":"cache_purged","prefix_hash":"00"}`},
		{"cache_offloaded", `{"x":[1,{"y":"}"}],"prefix_hash":"a\u0062","token_count":null}`},
		{"", `{"event":"cache_reloaded","prefix_hash":"ab","token_count":-1}`},
		{"cache_created", `{"prefix_hash":"ab","token_count":1.5e3}`},
		{"cache_exploded", `[]`},
	} {
		f.Add(seed.field, []byte(seed.data))
	}
	f.Fuzz(func(t *testing.T, field string, data []byte) {
		sentinel := Event{Kind: KindBlockStored, PrefixHash: "sentinel", TokenCount: -7}
		ev := sentinel
		err := DecodeSSEEvent(field, data, &ev)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			if ev.Kind != sentinel.Kind || ev.PrefixHash != sentinel.PrefixHash || ev.TokenCount != sentinel.TokenCount {
				t.Fatalf("ev changed on error: %+v", ev)
			}
			return
		}
		if ev.Kind != KindPrefix || ev.PrefixOp.String() == "unknown" || ev.TokenCount < 0 || ev.PrefixHash == "" ||
			strings.Trim(ev.PrefixHash, "0123456789abcdef") != "" {
			t.Fatalf("bad event: %+v", ev)
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatalf("accepted data encoding/json rejects: %v", err)
		}
		var hash string
		if err := json.Unmarshal(m["prefix_hash"], &hash); err != nil || strings.ToLower(hash) != ev.PrefixHash {
			t.Fatalf("prefix_hash %q (%v) decoded as %q", hash, err, ev.PrefixHash)
		}
		var count *int64
		if raw, ok := m["token_count"]; ok {
			if err := json.Unmarshal(raw, &count); err != nil {
				t.Fatalf("token_count %s accepted: %v", raw, err)
			}
		}
		if count == nil && ev.TokenCount != 0 || count != nil && *count != int64(ev.TokenCount) {
			t.Fatalf("token_count %v decoded as %d", count, ev.TokenCount)
		}
	})
}
