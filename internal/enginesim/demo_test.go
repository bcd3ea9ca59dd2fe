package enginesim

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The disaggregation demo: a prefill, decode and unified fleet exchanging KV through the
// in-process S3, whose configuration the proxy accepts; the prefill's blocks reach the decode
// engine through MemoryS3 (minio's client against it: PUT, HEAD, GET, NoSuchKey).
func TestStartDemoDisagg(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := StartDemo(ctx, DemoConfig{Mode: DemoDisagg, Engines: 4})
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Close()); require.NoError(t, d.Close()) }()
	var names []string
	for _, in := range d.Info() {
		names = append(names, in.Name+"/"+in.Role.String())
	}
	assert.Equal(t, []string{"prefill-0/prefill", "decode-0/decode", "decode-1/decode", "unified-0/unified"}, names)
	assert.Len(t, d.Engines(), 4)

	require.NotNil(t, d.Storage())
	assert.Equal(t, d.s3.Endpoint(), d.Storage().Endpoint)

	info := d.Info()
	client := pdFormats[0].body(DefaultModel, 4, false)
	resp, b := postJSON(t, info[0].URL+"/v1/chat/completions", prefillBody(client))
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var pr pdResponse
	require.NoError(t, json.Unmarshal(b, &pr))
	require.Contains(t, string(pr.KVTransferParams), `"remote_block_keys"`)
	blocks := d.s3.Len()
	require.Positive(t, blocks, "the prefill wrote its blocks to the in-process S3")

	// Again: every block is found stored (HEAD) and none is rewritten.
	resp, b = postJSON(t, info[0].URL+"/v1/chat/completions", prefillBody(client))
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	assert.Equal(t, blocks, d.s3.Len())

	resp, b = postJSON(t, info[1].URL+"/v1/chat/completions", withParams(client, pr.KVTransferParams))
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	loaded, _ := strconv.Atoi(resp.Header.Get(HeaderStorageTokens))
	assert.Equal(t, blocks*16, loaded, "the decode engine loaded every block from the in-process S3")
	assert.Zero(t, d.Engines()[1].Stats().StorageErrors)
}

func TestStartDemoUnified(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := StartDemo(ctx, DemoConfig{Engines: 2})
	require.NoError(t, err)
	defer d.Close()
	info := d.Info()
	assert.Equal(t, []string{"enginesim-0", "enginesim-1"}, []string{info[0].Name, info[1].Name})
	assert.Nil(t, d.s3)
	assert.Nil(t, d.Storage())
}

func TestStartDemoRejects(t *testing.T) {
	for _, c := range []DemoConfig{{Mode: "pd"}, {Engines: 65}, {Engines: -1}, {Mode: DemoDisagg, Engines: 2}} {
		_, err := StartDemo(context.Background(), c)
		assert.ErrorIs(t, err, ErrInvalidConfig, "%+v", c)
	}
}

// MemoryS3 answers what the engines do not use with S3's errors, and holds objects of at most
// 1 MiB.
func TestMemoryS3Errors(t *testing.T) {
	s, err := StartMemoryS3(context.Background(), "")
	require.NoError(t, err)
	defer s.Close()
	for _, tc := range []struct {
		method, path, body string
		status             int
		code               string
	}{
		{"GET", "/b/missing", "", 404, "NoSuchKey"},
		{"HEAD", "/b/missing", "", 404, ""},
		{"HEAD", "/b", "", 200, ""},
		{"GET", "/", "", 405, "MethodNotAllowed"},
		{"GET", "/b", "", 501, "NotImplemented"},
		{"DELETE", "/b/k", "", 501, "NotImplemented"},
		{"PUT", "/b/big", strings.Repeat("x", maxMemObject+1), 400, "EntityTooLarge"},
		{"PUT", "/b/k", "v", 200, ""},
		{"GET", "/b/k", "", 200, ""},
	} {
		req, err := http.NewRequest(tc.method, s.Endpoint()+tc.path, strings.NewReader(tc.body))
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		var e struct{ Code string }
		_ = xmlDecode(resp, &e)
		assert.Equal(t, tc.status, resp.StatusCode, "%s %s", tc.method, tc.path)
		assert.Equal(t, tc.code, e.Code, "%s %s", tc.method, tc.path)
	}
	assert.Equal(t, 1, s.Len())
	require.NoError(t, s.Close())
	assert.Zero(t, s.Len())
}

// xmlDecode reads resp's S3 error document into v (nothing for another body).
func xmlDecode(resp *http.Response, v any) error {
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "application/xml" {
		return nil
	}
	return xml.NewDecoder(resp.Body).Decode(v)
}
