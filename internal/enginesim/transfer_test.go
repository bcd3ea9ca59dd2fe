package enginesim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/prefixkey"
)

// s3Storage returns a StorageConfig on the S3 server of S3_ENDPOINT, S3_ACCESS_KEY,
// S3_SECRET_KEY and S3_BUCKET, under a namespace of its own (emptied at the end of the test),
// with small simulated sizes: 1,000 bytes per token at 1 MB/s. It skips without S3.
func s3Storage(t *testing.T) *StorageConfig {
	t.Helper()
	env := testenv.S3(t)
	sc := &StorageConfig{Endpoint: env.Endpoint, Bucket: env.Bucket, AccessKey: env.AccessKey, SecretKey: env.SecretKey,
		BytesPerToken: 1000, BandwidthBytesPerSec: 1e6}
	var b [8]byte
	_, _ = rand.Read(b[:])
	sc.Namespace = "kvroute-test/enginesim-" + hex.EncodeToString(b[:])
	c := s3Client(t, sc)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		objs := c.ListObjects(ctx, sc.Bucket, minio.ListObjectsOptions{Prefix: sc.Namespace + "/", Recursive: true})
		for err := range c.RemoveObjects(ctx, sc.Bucket, objs, minio.RemoveObjectsOptions{}) {
			t.Errorf("cleanup: %v", err.Err)
		}
	})
	return sc
}

// s3Client is a client of the test's S3 server, for looking at what the engines stored.
func s3Client(t *testing.T, sc *StorageConfig) *minio.Client {
	t.Helper()
	host, secure, err := splitEndpoint(sc.Endpoint)
	require.NoError(t, err)
	c, err := minio.New(host, &minio.Options{Creds: credentials.NewStaticV4(sc.AccessKey, sc.SecretKey, ""),
		Secure: secure, Region: DefaultStorageRegion})
	require.NoError(t, err)
	return c
}

// storedKeys lists the block keys stored under the namespace for model.
func storedKeys(t *testing.T, sc *StorageConfig, model string) []string {
	t.Helper()
	c := s3Client(t, sc)
	prefix := sc.Namespace + "/" + model + "/"
	var out []string
	for obj := range c.ListObjects(context.Background(), sc.Bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		require.NoError(t, obj.Err)
		out = append(out, strings.TrimPrefix(obj.Key, prefix))
	}
	slices.Sort(out)
	return out
}

// closedEndpoint returns an http:// endpoint on a loopback port nothing listens on.
func closedEndpoint(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return "http://" + addr
}

// pdFormat is one API of the P/D tests: its path and a request body with a long shared prefix.
type pdFormat struct {
	name   string
	path   string
	format prefixkey.Format
	body   func(model string, maxTokens int, stream bool) map[string]any
}

var pdFormats = []pdFormat{
	{"chat", "/v1/chat/completions", prefixkey.FormatOpenAIChat, func(model string, k int, stream bool) map[string]any {
		m := map[string]any{"model": model, "temperature": 0, "max_tokens": k, "stream": stream,
			"messages": []any{map[string]any{"role": "system", "content": longSystem()},
				map[string]any{"role": "user", "content": "which replica holds my cache?"}}}
		if stream {
			m["stream_options"] = map[string]any{"include_usage": true}
		}
		return m
	}},
	{"completions", "/v1/completions", prefixkey.FormatOpenAICompletion, func(model string, k int, stream bool) map[string]any {
		return map[string]any{"model": model, "temperature": 0, "max_tokens": k, "stream": stream,
			"prompt": longSystem() + " which replica holds my cache?"}
	}},
	{"messages", "/v1/messages", prefixkey.FormatAnthropicMessages, func(model string, k int, stream bool) map[string]any {
		return map[string]any{"model": model, "max_tokens": k, "stream": stream, "system": longSystem(),
			"messages": []any{map[string]any{"role": "user", "content": "which replica holds my cache?"}}}
	}},
}

// prefillBody turns a client body into the proxy's prefill request (the protocol's step 1).
func prefillBody(client map[string]any) map[string]any {
	p := make(map[string]any, len(client)+1)
	for k, v := range client {
		p[k] = v
	}
	p["max_tokens"], p["stream"] = 1, false
	delete(p, "stream_options")
	p["kv_transfer_params"] = map[string]any{"do_remote_decode": true, "do_remote_prefill": false}
	return p
}

// withParams is the decode request of the protocol's step 3: the client's body plus the prefill's
// kv_transfer_params as returned.
func withParams(client map[string]any, params json.RawMessage) map[string]any {
	d := make(map[string]any, len(client)+1)
	for k, v := range client {
		d[k] = v
	}
	d["kv_transfer_params"] = params
	return d
}

// pdResponse is what the P/D tests read from a response body.
type pdResponse struct {
	Usage struct {
		PromptTokens         int `json:"prompt_tokens"`
		InputTokens          int `json:"input_tokens"`
		CacheReadInputTokens int `json:"cache_read_input_tokens"`
		PromptTokensDetails  struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// cached returns the prompt length and the cached tokens a response reports.
func (r *pdResponse) cached(f prefixkey.Format) (prompt, cached int) {
	if f == prefixkey.FormatAnthropicMessages {
		return r.Usage.InputTokens + r.Usage.CacheReadInputTokens, r.Usage.CacheReadInputTokens
	}
	return r.Usage.PromptTokens, r.Usage.PromptTokensDetails.CachedTokens
}

func postJSON(t *testing.T, url string, body map[string]any) (*http.Response, []byte) {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	return post(t, url, string(b))
}

// promptTokens returns the tokens an engine processes body with.
func promptTokens(t *testing.T, f prefixkey.Format, body map[string]any) []uint32 {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	r, err := prefixkey.Parse(f, b)
	require.NoError(t, err)
	return PromptTokens(r)
}

// collectUntil reads batches from sub until done says the events seen are enough.
func collectUntil(t *testing.T, sub *rawSub, done func([]evView) bool) []evView {
	t.Helper()
	var evs []evView
	for !done(evs) {
		evs = append(evs, view(decode(t, sub.next(t).payload))...)
	}
	return evs
}

// stored returns the hashes and tokens of the BlockStored events on tier, in order.
func stored(evs []evView, tier events.Tier) (hashes []uint64, tokens []uint32) {
	for _, ev := range evs {
		if ev.Kind == events.KindBlockStored && ev.Tier == tier {
			hashes = append(hashes, ev.Hashes...)
			tokens = append(tokens, ev.Tokens...)
		}
	}
	return hashes, tokens
}

// TestPrefillThenDecode runs the two-phase flow on a prefill/decode fleet for each API: the
// prefill writes every full block to S3 and announces them on the storage tier, the decode loads
// them, reports them as cached and announces them on its GPU, and a repeated decode reads nothing.
func TestPrefillThenDecode(t *testing.T) {
	sc := s3Storage(t)
	for _, f := range pdFormats {
		t.Run(f.name, func(t *testing.T) {
			const bs = 8
			sc := *sc
			sc.Namespace += "/" + f.name
			fl, err := StartFleet(context.Background(), FleetConfig{N: 2, ZMQ: true, Roles: []Role{RolePrefill, RoleDecode},
				Base: Config{BlockSize: bs, CapacityBlocks: 256, HashSeed: 5, Storage: &sc}})
			require.NoError(t, err)
			defer fl.Close()
			pe, de := fl.Engines()[0], fl.Engines()[1]
			info := fl.Info()
			assert.Equal(t, RolePrefill, info[0].Role)
			assert.Equal(t, RoleDecode, info[1].Role)
			psub, dsub := subscribeRaw(t, pe, ""), subscribeRaw(t, de, "")

			client := f.body(DefaultModel, 5, false)
			tokens := promptTokens(t, f.format, client)
			keys := storageKeys(nil, DefaultModel, bs, tokens)
			require.Greater(t, len(keys), 4)
			var wantKeys []string
			for _, k := range keys {
				wantKeys = append(wantKeys, formatKey(k))
			}

			// Phase 1: prefill.
			resp, b := postJSON(t, info[0].URL+f.path, prefillBody(client))
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			var pr pdResponse
			require.NoError(t, json.Unmarshal(b, &pr))
			var params KVTransferParams
			require.NoError(t, json.Unmarshal(pr.KVTransferParams, &params), string(b))
			assert.Equal(t, KVTransferParams{DoRemotePrefill: true, DoRemoteDecode: false, RemoteEngineID: info[0].Name,
				RemoteStorage:   &RemoteStorage{Endpoint: sc.Endpoint, Bucket: sc.Bucket, Namespace: sc.Namespace},
				RemoteBlockKeys: wantKeys, NumPromptTokens: len(tokens)}, params)
			var raw map[string]any
			require.NoError(t, json.Unmarshal(pr.KVTransferParams, &raw))
			assert.ElementsMatch(t, []string{"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_storage",
				"remote_block_keys", "num_prompt_tokens"}, keysOf(raw))

			got := storedKeys(t, &sc, DefaultModel)
			assert.Equal(t, slices.Sorted(slices.Values(wantKeys)), got, "every full block is in the bucket")
			ps := pe.Stats()
			assert.Equal(t, uint64(len(keys)), ps.StorageBlocksWritten)
			assert.Equal(t, uint64(len(keys)*bs*1000), ps.StorageBytesWritten)
			assert.Equal(t, uint64(1), ps.PrefillHandoffs)
			assert.Zero(t, ps.StorageErrors)

			// The prefill's events: its blocks on the GPU, then the same blocks on the storage tier.
			pevs := collectUntil(t, psub, func(evs []evView) bool {
				h, _ := stored(evs, events.TierStorage)
				return len(h) >= len(keys)
			})
			gpuH, gpuT := stored(pevs, events.TierGPU)
			stH, stT := stored(pevs, events.TierStorage)
			assert.Equal(t, pe.cache.hashes(nil, tokens), stH, "storage events carry the engine's own hashes")
			assert.Equal(t, gpuH, stH)
			assert.Equal(t, tokens[:len(keys)*bs], stT)
			assert.Equal(t, gpuT, stT)

			// Phase 2: decode with the prefill's parameters.
			decode := withParams(client, pr.KVTransferParams)
			resp, b = postJSON(t, info[1].URL+f.path, decode)
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			var dr pdResponse
			require.NoError(t, json.Unmarshal(b, &dr))
			assert.Empty(t, dr.KVTransferParams, "a decode answers without kv_transfer_params")
			loaded := min(len(keys), (len(tokens)-1)/bs)
			prompt, cached := dr.cached(f.format)
			assert.Equal(t, len(tokens), prompt)
			assert.Equal(t, loaded*bs, cached)
			assert.Equal(t, itoa(loaded*bs), resp.Header.Get(HeaderStorageTokens))
			wantLoad := transferTime(int64(loaded*bs*1000), 1e6)
			assert.Equal(t, itoa(int(wantLoad.Microseconds())), resp.Header.Get(HeaderStorageLoad))
			ds := de.Stats()
			assert.Equal(t, uint64(loaded), ds.StorageBlocksRead)
			assert.Equal(t, uint64(loaded*bs*1000), ds.StorageBytesRead)
			assert.Equal(t, wantLoad, ds.StorageReadTime)
			assert.Equal(t, uint64(loaded*bs), ds.ExternalCacheHits)
			assert.Zero(t, ds.PrefixCacheHits)
			assert.Zero(t, ds.StorageMissingBlocks)
			assert.Equal(t, uint64(1), ds.DecodeHandoffs)

			devs := collectUntil(t, dsub, func(evs []evView) bool {
				h, _ := stored(evs, events.TierGPU)
				return len(h) >= len(keys)
			})
			dH, dT := stored(devs, events.TierGPU)
			assert.Equal(t, de.cache.hashes(nil, tokens), dH, "loaded and computed blocks, with the decode engine's hashes")
			assert.Equal(t, tokens[:len(keys)*bs], dT)
			assert.NotEqual(t, stH, dH, "engines of a fleet hash with their own seeds")

			// Again: the decode engine holds the prefix and reads nothing.
			resp, b = postJSON(t, info[1].URL+f.path, decode)
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			require.NoError(t, json.Unmarshal(b, &dr))
			_, cached = dr.cached(f.format)
			assert.Equal(t, loaded*bs, cached)
			assert.Equal(t, "0", resp.Header.Get(HeaderStorageTokens))
			ds2 := de.Stats()
			assert.Equal(t, ds.StorageBlocksRead, ds2.StorageBlocksRead)
			assert.Equal(t, uint64(loaded*bs), ds2.PrefixCacheHits)

			// A second prefill of the same prompt writes nothing.
			resp, b = postJSON(t, info[0].URL+f.path, prefillBody(client))
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			assert.Equal(t, ps.StorageBlocksWritten, pe.Stats().StorageBlocksWritten)

			// The decode engine's metrics.
			r, err := http.Get(info[1].URL + "/metrics")
			require.NoError(t, err)
			mb := new(bytes.Buffer)
			_, _ = mb.ReadFrom(r.Body)
			r.Body.Close()
			lbl := `{engine="0",model_name="` + DefaultModel + `"} `
			assert.Contains(t, mb.String(), "vllm:kv_storage_blocks_read_total"+lbl+itoa(loaded))
			assert.Contains(t, mb.String(), "vllm:kv_transfer_decode_handoffs_total"+lbl+"2", "both decode requests")
			assert.Contains(t, mb.String(), "# TYPE vllm:kv_storage_errors_total counter")
		})
	}
}

func keysOf(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestPrefillSkipsBlocksAlreadyStored: a second prefill engine finds the blocks another one wrote
// (HEAD) and does not rewrite them, but announces them on its storage tier.
func TestPrefillSkipsBlocksAlreadyStored(t *testing.T) {
	sc := s3Storage(t)
	cfg := Config{Model: "m", BlockSize: 4, Role: RolePrefill, Storage: sc}
	a, b := newTestEngine(t, cfg), newTestEngine(t, cfg)
	tokens := seqTokens(7, 30)
	in := Input{Tokens: tokens, OutputTokens: 1, KVTransfer: &KVTransferParams{DoRemoteDecode: true}}
	ra, err := a.Generate(context.Background(), in)
	require.NoError(t, err)
	require.NotNil(t, ra.KVTransfer)
	assert.Len(t, ra.KVTransfer.RemoteBlockKeys, 7)
	assert.Equal(t, transferTime(7*4*1000, 1e6), ra.StorageStore)

	// Extend the prompt: b finds the 7 blocks stored and writes the 3 new ones only.
	in.Tokens = seqTokens(7, 42)
	rb, err := b.Generate(context.Background(), in)
	require.NoError(t, err)
	assert.Len(t, rb.KVTransfer.RemoteBlockKeys, 10)
	assert.Equal(t, transferTime(3*4*1000, 1e6), rb.StorageStore)
	s := b.Stats()
	assert.Equal(t, uint64(3), s.StorageBlocksWritten)
	assert.Equal(t, uint64(7), s.StorageBlocksSkipped)
	assert.Len(t, storedKeys(t, sc, "m"), 10)
}

// TestStoragePath: with no kv_transfer_params a decode engine looks the prompt's blocks up in
// storage itself (the router's storage path), as far as they are stored; Lookup and the role
// decide whether it does.
func TestStoragePath(t *testing.T) {
	sc := s3Storage(t)
	const bs = 4
	stored := seqTokens(100, 26) // 6 full blocks written by a prefill
	p := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: RolePrefill, Storage: sc})
	_, err := p.Generate(context.Background(), Input{Tokens: stored, OutputTokens: 1, KVTransfer: &KVTransferParams{DoRemoteDecode: true}})
	require.NoError(t, err)
	require.Len(t, storedKeys(t, sc, "m"), 6)

	longer := append(append([]uint32(nil), stored[:24]...), seqTokens(900, 20)...) // 6 stored blocks, then new ones
	tests := []struct {
		name   string
		role   Role
		lookup StorageLookup
		tokens []uint32
		want   int // blocks loaded
	}{
		{"decode auto", RoleDecode, StorageLookupAuto, stored, 6},
		{"decode auto, prompt goes on past the stored blocks", RoleDecode, StorageLookupAuto, longer, 6},
		{"decode auto, last block not loadable", RoleDecode, StorageLookupAuto, stored[:24], 5},
		{"decode off", RoleDecode, StorageLookupOff, stored, 0},
		{"unified auto", RoleUnified, StorageLookupAuto, stored, 0},
		{"unified on", RoleUnified, StorageLookupOn, stored, 6},
		{"prefill on", RolePrefill, StorageLookupOn, stored, 0},
		{"nothing stored", RoleDecode, StorageLookupAuto, seqTokens(5000, 40), 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dsc := *sc
			dsc.Lookup = tt.lookup
			d := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: tt.role, Storage: &dsc, HashSeed: 99})
			res, err := d.Generate(context.Background(), Input{Tokens: tt.tokens, OutputTokens: 2})
			require.NoError(t, err)
			assert.Equal(t, tt.want*bs, res.CachedTokens)
			assert.Equal(t, tt.want*bs, res.StorageTokens)
			assert.Equal(t, transferTime(int64(tt.want*bs*1000), 1e6), res.StorageLoad)
			s := d.Stats()
			assert.Equal(t, uint64(tt.want), s.StorageBlocksRead)
			assert.Zero(t, s.StorageErrors)
			assert.Zero(t, s.StorageMissingBlocks, "the storage path has no list to miss")
			gpu, _ := d.Lookup(tt.tokens)
			assert.Equal(t, len(tt.tokens)/bs, gpu, "loaded and computed blocks are cached")
		})
	}
}

// TestDecodeStopsAtFirstUnusableBlock: blocks listed but deleted or corrupt end the load there;
// the rest is computed locally and counted missing.
func TestDecodeStopsAtFirstUnusableBlock(t *testing.T) {
	sc := s3Storage(t)
	const bs = 4
	tests := []struct {
		name    string
		block   int
		corrupt bool
	}{
		{"deleted", 2, false},
		{"corrupt", 1, true},
		{"first deleted", 0, false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := seqTokens(1000*(i+1), 33) // 8 full blocks; the hit covers all 8
			p := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: RolePrefill, Storage: sc})
			pr, err := p.Generate(context.Background(), Input{Tokens: tokens, OutputTokens: 1, KVTransfer: &KVTransferParams{DoRemoteDecode: true}})
			require.NoError(t, err)
			c := s3Client(t, sc)
			name := sc.Namespace + "/m/" + pr.KVTransfer.RemoteBlockKeys[tt.block]
			if tt.corrupt {
				junk := []byte("not a block")
				_, err = c.PutObject(context.Background(), sc.Bucket, name, bytes.NewReader(junk), int64(len(junk)), minio.PutObjectOptions{})
			} else {
				err = c.RemoveObject(context.Background(), sc.Bucket, name, minio.RemoveObjectOptions{})
			}
			require.NoError(t, err)

			d := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: RoleDecode, Storage: sc})
			params := *pr.KVTransfer
			params.DoRemotePrefill = true
			res, err := d.Generate(context.Background(), Input{Tokens: tokens, OutputTokens: 3, KVTransfer: &params})
			require.NoError(t, err)
			assert.Equal(t, tt.block*bs, res.CachedTokens)
			s := d.Stats()
			assert.Equal(t, uint64(tt.block), s.StorageBlocksRead)
			assert.Equal(t, uint64(8-tt.block), s.StorageMissingBlocks)
			if tt.corrupt {
				assert.Equal(t, uint64(1), s.StorageErrors)
			} else {
				assert.Zero(t, s.StorageErrors)
			}
		})
	}
}

// TestStreamingDecode: a streamed decode request with kv_transfer_params loads the blocks and
// reports them in the streamed usage.
func TestStreamingDecode(t *testing.T) {
	sc := s3Storage(t)
	const bs = 8
	p := newTestEngine(t, Config{BlockSize: bs, Role: RolePrefill, Storage: sc})
	d := newTestEngine(t, Config{BlockSize: bs, Role: RoleDecode, Storage: sc, HashSeed: 77})
	psrv, dsrv := httptest.NewServer(p.Handler()), httptest.NewServer(d.Handler())
	defer psrv.Close()
	defer dsrv.Close()
	for _, f := range []pdFormat{pdFormats[0], pdFormats[2]} {
		t.Run(f.name, func(t *testing.T) {
			client := f.body(DefaultModel, 3, true)
			tokens := promptTokens(t, f.format, client)
			resp, b := postJSON(t, psrv.URL+f.path, prefillBody(client))
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			var pr pdResponse
			require.NoError(t, json.Unmarshal(b, &pr))
			require.NotEmpty(t, pr.KVTransferParams)

			resp, b = postJSON(t, dsrv.URL+f.path, withParams(client, pr.KVTransferParams))
			require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
			assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
			want := min(len(tokens)/bs, (len(tokens)-1)/bs) * bs
			require.Positive(t, want)
			names, datas := sseLines(t, b)
			if f.format == prefixkey.FormatAnthropicMessages {
				require.Equal(t, "message_start", names[0])
				var start struct {
					Message pdResponse `json:"message"`
				}
				require.NoError(t, json.Unmarshal([]byte(datas[0]), &start))
				assert.Equal(t, want, start.Message.Usage.CacheReadInputTokens)
				assert.Equal(t, "message_stop", names[len(names)-1])
				return
			}
			assert.Equal(t, "[DONE]", datas[len(datas)-1])
			var last pdResponse
			require.NoError(t, json.Unmarshal([]byte(datas[len(datas)-2]), &last))
			assert.Equal(t, want, last.Usage.PromptTokensDetails.CachedTokens)
		})
	}
}

// TestStorageUnreachable: with the storage endpoint down, a prefill answers 503 with an
// OpenAI-style error (the proxy falls back), and a decode computes locally and succeeds.
func TestStorageUnreachable(t *testing.T) {
	sc := &StorageConfig{Endpoint: closedEndpoint(t), Bucket: "b", AccessKey: "AKIA-closed-port", SecretKey: "never-shown-secret",
		OpTimeout: 2 * time.Second}
	const bs = 4
	p := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: RolePrefill, Storage: sc})
	d := newTestEngine(t, Config{Model: "m", BlockSize: bs, Role: RoleDecode, Storage: sc})
	psrv, dsrv := httptest.NewServer(p.Handler()), httptest.NewServer(d.Handler())
	defer psrv.Close()
	defer dsrv.Close()
	client := map[string]any{"model": "m", "max_tokens": 4, "prompt": longSystem()}
	tokens := promptTokens(t, prefixkey.FormatOpenAICompletion, client)

	resp, b := postJSON(t, psrv.URL+"/v1/completions", prefillBody(client))
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, string(b))
	var oe openAIError
	require.NoError(t, json.Unmarshal(b, &oe), string(b))
	assert.Equal(t, "ServiceUnavailableError", oe.Error.Type)
	assert.Equal(t, http.StatusServiceUnavailable, oe.Error.Code)
	assert.Contains(t, oe.Error.Message, "external KV storage unavailable")
	assert.NotContains(t, string(b), "never-shown-secret")
	assert.NotContains(t, string(b), "AKIA-closed-port")
	assert.Equal(t, uint64(1), p.Stats().StorageErrors)
	assert.Zero(t, p.Stats().PrefillHandoffs)
	// The cooldown makes the next prefill fail fast, the same way.
	resp, _ = postJSON(t, psrv.URL+"/v1/completions", prefillBody(client))
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)

	// A decode given parameters (as a prefill on a reachable storage would have returned).
	var keys []string
	for _, k := range storageKeys(nil, "m", bs, tokens) {
		keys = append(keys, formatKey(k))
	}
	params, err := json.Marshal(KVTransferParams{DoRemotePrefill: true, RemoteEngineID: "p",
		RemoteStorage: &RemoteStorage{Endpoint: sc.Endpoint, Bucket: "b", Namespace: DefaultKVNamespace}, RemoteBlockKeys: keys,
		NumPromptTokens: len(tokens)})
	require.NoError(t, err)
	resp, b = postJSON(t, dsrv.URL+"/v1/completions", withParams(client, params))
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var dr pdResponse
	require.NoError(t, json.Unmarshal(b, &dr))
	assert.Zero(t, dr.Usage.PromptTokensDetails.CachedTokens)
	s := d.Stats()
	assert.Equal(t, uint64(1), s.StorageErrors)
	assert.Equal(t, uint64((len(tokens)-1)/bs), s.StorageMissingBlocks)
	assert.Zero(t, s.StorageBlocksRead)

	// The storage path too: no params, storage down, computed locally.
	other := map[string]any{"model": "m", "max_tokens": 2, "prompt": "another prompt " + longSystem()}
	resp, b = postJSON(t, dsrv.URL+"/v1/completions", other)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
}

// TestRoleEnforcement: requests that do not match an engine's role are served normally. The
// storage endpoint is a closed port, so that any storage request would show as an error.
func TestRoleEnforcement(t *testing.T) {
	const bs = 4
	down := &StorageConfig{Endpoint: closedEndpoint(t), Bucket: "b"}
	client := map[string]any{"model": "m", "max_tokens": 3, "prompt": longSystem()}
	tokens := promptTokens(t, prefixkey.FormatOpenAICompletion, client)
	var keys []string
	for _, k := range storageKeys(nil, "m", bs, tokens) {
		keys = append(keys, formatKey(k))
	}
	wanted := (len(tokens) - 1) / bs
	remote := func(edit func(p *KVTransferParams)) map[string]any {
		p := KVTransferParams{DoRemotePrefill: true, RemoteEngineID: "p", NumPromptTokens: len(tokens),
			RemoteStorage:   &RemoteStorage{Endpoint: "http://elsewhere:9000", Bucket: "b", Namespace: DefaultKVNamespace},
			RemoteBlockKeys: slices.Clone(keys)}
		if edit != nil {
			edit(&p)
		}
		raw, err := json.Marshal(p)
		require.NoError(t, err)
		return withParams(client, raw)
	}
	tests := []struct {
		name    string
		role    Role
		storage *StorageConfig
		body    map[string]any
		status  int
		missing int
	}{
		{"prefill without do_remote_decode", RolePrefill, down, client, http.StatusOK, 0},
		{"decode given do_remote_decode", RoleDecode, down, prefillBody(client), http.StatusOK, 0},
		{"prefill given do_remote_prefill", RolePrefill, down, remote(nil), http.StatusOK, 0},
		{"no storage, do_remote_decode", RoleUnified, nil, prefillBody(client), http.StatusOK, 0},
		{"no storage, do_remote_prefill", RoleDecode, nil, remote(nil), http.StatusOK, wanted},
		{"another bucket", RoleDecode, down, remote(func(p *KVTransferParams) { p.RemoteStorage.Bucket = "other" }), http.StatusOK, wanted},
		{"another namespace", RoleDecode, down, remote(func(p *KVTransferParams) { p.RemoteStorage.Namespace = "x/y" }), http.StatusOK, wanted},
		{"keys of another prompt", RoleDecode, down, remote(func(p *KVTransferParams) { p.RemoteBlockKeys[0] = "0123456789abcdef" }), http.StatusOK, wanted},
		{"malformed keys", RoleDecode, down, remote(func(p *KVTransferParams) { p.RemoteBlockKeys[0] = "xyz" }), http.StatusOK, wanted},
		{"no keys", RoleDecode, down, remote(func(p *KVTransferParams) { p.RemoteBlockKeys = nil }), http.StatusOK, 0},
		{"null params", RoleDecode, nil, withParams(client, json.RawMessage("null")), http.StatusOK, 0},
		{"stream with do_remote_decode", RolePrefill, down, func() map[string]any {
			b := prefillBody(client)
			b["stream"] = true
			return b
		}(), http.StatusBadRequest, 0},
		{"params not an object", RoleDecode, down, withParams(client, json.RawMessage("5")), http.StatusBadRequest, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{Model: "m", BlockSize: bs, Role: tt.role, Storage: tt.storage}
			if tt.storage != nil && tt.role == RoleDecode {
				sc := *tt.storage
				sc.Lookup = StorageLookupOff // the storage path would query the closed port
				cfg.Storage = &sc
			}
			e := newTestEngine(t, cfg)
			srv := httptest.NewServer(e.Handler())
			defer srv.Close()
			resp, b := postJSON(t, srv.URL+"/v1/completions", tt.body)
			require.Equal(t, tt.status, resp.StatusCode, string(b))
			s := e.Stats()
			assert.Zero(t, s.StorageErrors, "no storage request was made")
			assert.Zero(t, s.StorageBlocksWritten)
			assert.Equal(t, uint64(tt.missing), s.StorageMissingBlocks)
			if tt.status != http.StatusOK {
				return
			}
			var r pdResponse
			require.NoError(t, json.Unmarshal(b, &r))
			assert.Empty(t, r.KVTransferParams, "no handoff: the response has no kv_transfer_params")
			assert.Zero(t, r.Usage.PromptTokensDetails.CachedTokens)
		})
	}
}

func TestFleetRoles(t *testing.T) {
	f, err := StartFleet(context.Background(), FleetConfig{N: 3, Roles: []Role{RolePrefill, RoleDecode}, Base: Config{Role: RoleUnified}})
	require.NoError(t, err)
	defer f.Close()
	var roles []Role
	for i, in := range f.Info() {
		roles = append(roles, in.Role)
		assert.Equal(t, in.Role, f.Engines()[i].Config().Role)
	}
	assert.Equal(t, []Role{RolePrefill, RoleDecode, RoleUnified}, roles)
	_, err = StartFleet(context.Background(), FleetConfig{N: 1, Roles: []Role{RolePrefill, RoleDecode}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
}
