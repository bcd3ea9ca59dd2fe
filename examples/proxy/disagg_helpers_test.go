package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/disagg"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// s3Env is the S3 server the tests share KV through: S3_ENDPOINT, S3_BUCKET, S3_ACCESS_KEY and
// S3_SECRET_KEY (the CI's versitygw).
type s3Env struct {
	endpoint, bucket, accessKey, secretKey string
	namespace                              string // a fresh key prefix per test
}

// requireS3 returns the S3 settings, skipping the test without them (failing it under
// KVROUTE_REQUIRE_INTEGRATION=1). Each test gets its own namespace, so that blocks another test
// (or an earlier run) wrote are not found.
func requireS3(t *testing.T) s3Env {
	t.Helper()
	env := testenv.S3(t)
	e := s3Env{endpoint: env.Endpoint, bucket: env.Bucket, accessKey: env.AccessKey, secretKey: env.SecretKey}
	name := regexp.MustCompile(`[^A-Za-z0-9_-]+`).ReplaceAllString(t.Name(), "-")
	e.namespace = "kvroute-proxy-test/" + name + "/" + strconv.FormatInt(time.Now().UnixNano(), 36)
	return e
}

// pdFleet is a prefill/decode fleet: engines 0..P-1 prefill, then D decode, then U unified, all
// sharing one S3 namespace, KV events over ZMQ, no simulated latency unless edit sets one.
type pdFleet struct {
	*enginesim.Fleet
	s3                       s3Env
	prefill, decode, unified []string // engine names by role
}

func startPDFleet(t *testing.T, nPrefill, nDecode, nUnified int, edit func(*enginesim.Config)) *pdFleet {
	t.Helper()
	s3 := requireS3(t)
	var roles []enginesim.Role
	for range nPrefill {
		roles = append(roles, enginesim.RolePrefill)
	}
	for range nDecode {
		roles = append(roles, enginesim.RoleDecode)
	}
	for range nUnified {
		roles = append(roles, enginesim.RoleUnified)
	}
	base := enginesim.Config{BlockSize: 16, CapacityBlocks: 2048, Storage: &enginesim.StorageConfig{
		Endpoint: s3.endpoint, Bucket: s3.bucket, Namespace: s3.namespace, AccessKey: s3.accessKey, SecretKey: s3.secretKey}}
	if edit != nil {
		edit(&base)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	f, err := enginesim.StartFleet(ctx, enginesim.FleetConfig{N: len(roles), ZMQ: true, Roles: roles, Base: base})
	if err != nil {
		t.Fatalf("StartFleet: %v", err)
	}
	t.Cleanup(func() { _ = f.Close() })
	pf := &pdFleet{Fleet: f, s3: s3}
	for _, in := range f.Info() {
		switch in.Role {
		case enginesim.RolePrefill:
			pf.prefill = append(pf.prefill, in.Name)
		case enginesim.RoleDecode:
			pf.decode = append(pf.decode, in.Name)
		default:
			pf.unified = append(pf.unified, in.Name)
		}
	}
	return pf
}

// engine returns the fleet's engine named name.
func (f *pdFleet) engine(t *testing.T, name string) *enginesim.Engine {
	t.Helper()
	for _, e := range f.Engines() {
		if e.Name() == name {
			return e
		}
	}
	t.Fatalf("no engine %s", name)
	return nil
}

// storage is the fleet's S3 location as the proxy's configuration names it.
func (f *pdFleet) storage() *config.ExternalStorageConfig {
	return &config.ExternalStorageConfig{Endpoint: f.s3.endpoint, Bucket: f.s3.bucket, KVNamespace: f.s3.namespace,
		AccessKey: config.Secret(f.s3.accessKey), SecretKey: config.Secret(f.s3.secretKey)}
}

// pdConfig is fleetConfig for a prefill/decode fleet: every engine a backend with its role, KV
// events over ZMQ, tokenization by the engines, no response cache (every request reaches the
// engines), disaggregated serving on with the fleet's S3 as the default storage.
func pdConfig(t *testing.T, f *pdFleet, edit func(*config.Config)) *config.Config {
	t.Helper()
	return fleetConfig(t, f.Fleet, func(c *config.Config) {
		c.ResponseCache.Enabled = false
		for i, in := range f.Info() {
			c.Backends[i].Role = in.Role.String()
		}
		c.DisaggregatedServing = config.DisaggregatedConfig{Enabled: true, DefaultExternalStorage: f.storage()}
		if edit != nil {
			edit(c)
		}
	})
}

// pdResult is what a test reads of one response of the proxy.
type pdResult struct {
	status                 int
	path, prefill, decode  string // the routing-path headers
	backend, route, engine string // X-Kvroute-Backend, X-Kvroute-Route, X-Enginesim-Engine
	storageTokens          int    // X-Enginesim-Storage-Tokens: loaded from S3 for this request
	cachedTokens           int    // usage.prompt_tokens_details.cached_tokens (non-streamed chat)
	body                   []byte
}

func (r pdResult) String() string {
	return fmt.Sprintf("%d path=%s prefill=%s decode=%s backend=%s route=%s engine=%s storage=%d cached=%d",
		r.status, r.path, r.prefill, r.decode, r.backend, r.route, r.engine, r.storageTokens, r.cachedTokens)
}

func readPD(resp *http.Response, body []byte) pdResult {
	h := resp.Header
	r := pdResult{status: resp.StatusCode, path: h.Get(disagg.HeaderRoutingPath), prefill: h.Get(disagg.HeaderPrefillBackend),
		decode: h.Get(disagg.HeaderDecodeBackend), backend: h.Get(HeaderBackend), route: h.Get(HeaderRoute),
		engine: h.Get(enginesim.HeaderEngine), body: body}
	r.storageTokens, _ = strconv.Atoi(h.Get(enginesim.HeaderStorageTokens))
	var u struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &u) == nil {
		r.cachedTokens = u.Usage.Details.Cached
	}
	return r
}

// postPD sends a chat body to the proxy.
func postPD(t *testing.T, p *testProxy, body string) pdResult {
	t.Helper()
	return readPD(post(t, p.URL+"/v1/chat/completions", body))
}

// match returns backend's cached prefix of a chat body in the proxy's KV index, with the block
// keys the Router computes (the engines' tokens).
func (p *testProxy) match(t *testing.T, body, backend string) kvindex.Match {
	t.Helper()
	req, err := prefixkey.Parse(prefixkey.FormatOpenAIChat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tokens, err := p.tok.Tokenize(ctx, req)
	if err != nil {
		t.Fatalf("tokenize: %v", err)
	}
	keys := prefixkey.AppendBlockKeys(nil, prefixkey.BlockRoot(req.ModelOrAdapter(), req.CacheSalt), tokens,
		p.cfg.KVCacheIndex.BlockSize, req.MultiModal)
	m, err := p.index.Lookup(ctx, keys, []string{backend}, make([]kvindex.Match, 1))
	if err != nil {
		t.Fatalf("index lookup: %v", err)
	}
	return m[0]
}

// disaggStats reads GET /admin/disaggregation/stats.
func disaggStats(t *testing.T, p *testProxy) disaggStatsBody {
	t.Helper()
	var st disaggStatsBody
	if code := getJSON(t, p.URL+"/admin/disaggregation/stats", &st); code != http.StatusOK {
		t.Fatalf("disaggregation stats: %d", code)
	}
	return st
}

// disaggStatsBody is the part of the stats the tests read.
type disaggStatsBody struct {
	Enabled  bool         `json:"enabled"`
	Requests disagg.Stats `json:"requests"`
	Config   struct {
		PrefillTimeout    string                     `json:"prefill_timeout"`
		KVTransferTimeout string                     `json:"kv_transfer_timeout"`
		FallbackToUnified bool                       `json:"fallback_to_unified"`
		DefaultStorage    map[string]json.RawMessage `json:"default_external_storage"`
	} `json:"config"`
	PrefillBackends int `json:"prefill_backends"`
	DecodeBackends  int `json:"decode_backends"`
	UnifiedBackends int `json:"unified_backends"`
	Backends        []struct {
		Backend string `json:"backend"`
		Role    string `json:"role"`
		Healthy bool   `json:"healthy"`
	} `json:"backends"`
}
