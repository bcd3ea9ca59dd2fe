package events

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDecodeSSEEvent(t *testing.T) {
	tests := []struct {
		name      string
		field     string
		data      string
		want      Event
		wantErrIn string // substring of the error; "" means success
	}{
		{
			name:  "seed example",
			field: "cache_created",
			data:  `{"event":"cache_created","prefix_hash":"9f2c","token_count":2048}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "9f2c", TokenCount: 2048},
		},
		{
			name: "json event used when field absent",
			data: `{"event":"cache_evicted","prefix_hash":"ab","token_count":16}`,
			want: Event{Kind: KindPrefix, PrefixOp: PrefixEvicted, PrefixHash: "ab", TokenCount: 16},
		},
		{
			name:  "field wins over json event",
			field: "cache_offloaded",
			data:  `{"event":"cache_created","prefix_hash":"ab","token_count":1}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixOffloaded, PrefixHash: "ab", TokenCount: 1},
		},
		{
			name:  "field wins even when json event is unknown",
			field: "cache_reloaded",
			data:  `{"event":"whatever","prefix_hash":"ab"}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixReloaded, PrefixHash: "ab"},
		},
		{
			name:  "sse default type message defers to json",
			field: "message",
			data:  `{"event":"cache_purged","prefix_hash":"ab"}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixPurged, PrefixHash: "ab"},
		},
		{
			name:  "hash lowercased, whitespace and unknown keys",
			field: "cache_created",
			data: " {\n\t\"extra\": {\"nested\": [1, \"}\", {\"a\": null}]}, \"prefix_hash\" : \"9F2C4A7B1E0D3C5A9F2C4A7B1E0D3C5A\" ," +
				" \"token_count\" : 0, \"other\": -1.5e3, \"flag\": true } ",
			want: Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "9f2c4a7b1e0d3c5a9f2c4a7b1e0d3c5a"},
		},
		{
			name:  "escaped strings",
			field: "",
			data:  `{"ev\u0065nt":"cache_\u0063reated","prefix_hash":"\u0041b","skip":"a\"b\\"}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "ab"},
		},
		{
			name:  "null token_count and null event with field",
			field: "cache_created",
			data:  `{"event":null,"prefix_hash":"00","token_count":null}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "00"},
		},
		{
			name:  "duplicate keys: last wins",
			field: "cache_created",
			data:  `{"prefix_hash":"aa","prefix_hash":"BB","token_count":1,"token_count":2}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "bb", TokenCount: 2},
		},
		{
			name:  "minus zero token_count",
			field: "cache_created",
			data:  `{"prefix_hash":"aa","token_count":-0}`,
			want:  Event{Kind: KindPrefix, PrefixOp: PrefixCreated, PrefixHash: "aa"},
		},
		{name: "unknown field name", field: "cache_exploded", data: `{"prefix_hash":"ab"}`, wantErrIn: "unknown event name"},
		{name: "unknown json name", data: `{"event":"cache_exploded","prefix_hash":"ab"}`, wantErrIn: "unknown event name"},
		{name: "no event name", data: `{"prefix_hash":"ab"}`, wantErrIn: "no event name"},
		{name: "json event not a string", data: `{"event":5,"prefix_hash":"ab"}`, wantErrIn: "not a string"},
		{name: "missing prefix_hash", field: "cache_created", data: `{"token_count":1}`, wantErrIn: "missing prefix_hash"},
		{name: "null prefix_hash", field: "cache_created", data: `{"prefix_hash":null}`, wantErrIn: "missing prefix_hash"},
		{name: "empty prefix_hash", field: "cache_created", data: `{"prefix_hash":""}`, wantErrIn: "prefix_hash"},
		{name: "non-hex prefix_hash", field: "cache_created", data: `{"prefix_hash":"9f2g"}`, wantErrIn: "prefix_hash"},
		{name: "0x prefix_hash", field: "cache_created", data: `{"prefix_hash":"0x9f"}`, wantErrIn: "prefix_hash"},
		{name: "numeric prefix_hash", field: "cache_created", data: `{"prefix_hash":123}`, wantErrIn: "prefix_hash"},
		{name: "too long prefix_hash", field: "cache_created", data: `{"prefix_hash":"` + strings.Repeat("a", 129) + `"}`, wantErrIn: "prefix_hash"},
		{name: "negative token_count", field: "cache_created", data: `{"prefix_hash":"ab","token_count":-1}`, wantErrIn: "negative"},
		{name: "fractional token_count", field: "cache_created", data: `{"prefix_hash":"ab","token_count":1.5}`, wantErrIn: "not an integer"},
		{name: "exponent token_count", field: "cache_created", data: `{"prefix_hash":"ab","token_count":1e3}`, wantErrIn: "not an integer"},
		{name: "string token_count", field: "cache_created", data: `{"prefix_hash":"ab","token_count":"5"}`, wantErrIn: "not an integer"},
		{name: "overflowing token_count", field: "cache_created", data: `{"prefix_hash":"ab","token_count":9223372036854775808}`, wantErrIn: "not an integer"},
		{name: "not json", field: "cache_created", data: `{"prefix_hash":"ab"`, wantErrIn: "not a JSON object"},
		{name: "json array", field: "cache_created", data: `["ab"]`, wantErrIn: "not a JSON object"},
		{name: "empty data", field: "cache_created", data: ``, wantErrIn: "not a JSON object"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// ev starts dirty: every field must be overwritten on success and kept on error.
			dirty := Event{Kind: KindBlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{2}, BlockSize: 1,
				LoRAName: "l", Tier: TierCPU, CacheSalt: "s", GroupIdx: 3, Parent: 4, HasParent: true,
				PrefixOp: PrefixPurged, PrefixHash: "ff", TokenCount: 9}
			ev := dirty
			err := DecodeSSEEvent(tt.field, []byte(tt.data), &ev)
			if tt.wantErrIn != "" {
				require.ErrorIs(t, err, ErrMalformed)
				require.ErrorContains(t, err, tt.wantErrIn)
				require.Equal(t, dirty, ev)
				return
			}
			require.NoError(t, err)
			require.Equal(t, normEvents([]Event{tt.want}), normEvents([]Event{ev}))
		})
	}
}

// TestDecodeSSEEventAllocs: a repeated event allocates nothing (the lowercased hash string is
// reused when unchanged).
func TestDecodeSSEEventAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	data := []byte(`{"event":"cache_created","prefix_hash":"9F2C4A7B1E0D3C5A","token_count":2048,"x":[1,{"y":"z"}]}`)
	for _, field := range []string{"", "cache_evicted"} {
		t.Run("field="+field, func(t *testing.T) {
			var ev Event
			require.NoError(t, DecodeSSEEvent(field, data, &ev))
			allocs := testing.AllocsPerRun(100, func() {
				if err := DecodeSSEEvent(field, data, &ev); err != nil {
					t.Fatal(err)
				}
			})
			require.Zero(t, allocs)
		})
	}
}
