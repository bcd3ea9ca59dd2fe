package config

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute"
)

const replicasBase = `
backends:
  - {name: vllm-0, url: "http://127.0.0.1:8000"}
  - {name: vllm-1, url: "http://127.0.0.1:8001", metrics_url: "http://127.0.0.1:9001/metrics"}
kv_cache_index:
  enabled: true
  event_sources:
    - {endpoint: "tcp://127.0.0.1:5557", backend_name: vllm-0}
`

func TestReplicasDefaults(t *testing.T) {
	c := mustParse(t, replicasBase+`
engine_metrics: {enabled: true}
replicas:
  enabled: true
  nats_url: nats://user:pw@127.0.0.1:4222
  event_log: {enabled: true}
`, nil)
	assert.Equal(t, "/metrics", c.EngineMetrics.Path)
	assert.Equal(t, 2*time.Second, time.Duration(c.EngineMetrics.Interval))
	assert.Equal(t, time.Second, time.Duration(c.EngineMetrics.Timeout))
	assert.Equal(t, 10*time.Second, time.Duration(c.EngineMetrics.MaxAge))
	assert.Equal(t, "default", c.Replicas.Group)
	assert.Equal(t, 3*time.Second, time.Duration(c.Replicas.PeerTimeout))
	assert.Equal(t, DefaultEventStream, c.Replicas.EventLog.Stream)
	assert.Equal(t, DefaultSnapshotBucket, c.Replicas.EventLog.Bucket)
	assert.Equal(t, time.Minute, time.Duration(c.Replicas.EventLog.SnapshotInterval))

	rc, err := c.RouterConfig(Options{})
	require.NoError(t, err)
	assert.Equal(t, kvroute.DefaultPeerMaxAge, rc.PeerMaxAge)
	assert.Equal(t, kvroute.DefaultPeerDelay, rc.PeerDelay)
	assert.Equal(t, 10*time.Second, rc.EngineLoadMaxAge)
}

// replicas.peer_delay reaches the Router.
func TestReplicasPeerDelay(t *testing.T) {
	for _, d := range []time.Duration{20 * time.Millisecond, time.Minute} {
		c := mustParse(t, replicasBase+"replicas: {enabled: true, peer_delay: "+d.String()+"}\n", nil)
		rc, err := c.RouterConfig(Options{})
		require.NoError(t, err)
		assert.Equal(t, d, rc.PeerDelay)
	}
}

func TestReplicasValidation(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"replicas: {enabled: true, nats_url: \"http://x:4222\"}", "replicas.nats_url"},
		{"replicas: {enabled: true, nats_url: \"nats://u:secretpw@:4222x/\"}", "replicas.nats_url"},
		{"replicas: {enabled: true, group: \"a.b\"}", "replicas.group"},
		{"replicas: {enabled: true, group: \"*\"}", "replicas.group"},
		{"replicas: {enabled: true, replica_id: \"a b\"}", "replicas.replica_id"},
		{"replicas: {enabled: true, heartbeat: 10ms}", "replicas.heartbeat"},
		{"replicas: {enabled: true, heartbeat: 1s, peer_timeout: 1s}", "replicas.peer_timeout"},
		{"replicas: {enabled: true, peer_delay: 2m}", "replicas.peer_delay"},
		{"replicas: {event_log: {enabled: true}}", "needs replicas.enabled"},
		{"replicas: {enabled: true, event_log: {enabled: true, stream: \"a>b\"}}", "replicas.event_log.stream"},
		{"replicas: {enabled: true, event_log: {enabled: true, snapshot_interval: 10ms}}", "replicas.event_log.snapshot_interval"},
		{"engine_metrics: {enabled: true, path: metrics}", "engine_metrics.path"},
		{"engine_metrics: {enabled: true, interval: 1s, timeout: 1s}", "engine_metrics.timeout"},
		{"engine_metrics: {enabled: true, interval: 10ms}", "engine_metrics.interval"},
		{"engine_metrics: {enabled: true, interval: 2s, max_age: 1s}", "engine_metrics.max_age"},
	} {
		_, err := Parse([]byte(replicasBase+tc.yaml), env(nil))
		if assert.Error(t, err, tc.yaml) {
			assert.Contains(t, err.Error(), tc.want, tc.yaml)
			assert.NotContains(t, err.Error(), "secretpw", "a NATS password in an error message")
		}
	}
	// The event log feeds the KV index.
	_, err := Parse([]byte(strings.Replace(replicasBase, "enabled: true", "enabled: false", 1)+
		"replicas: {enabled: true, event_log: {enabled: true}}"), env(nil))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "needs kv_cache_index.enabled")
}

func TestReplicasLogAttrsRedacted(t *testing.T) {
	c := mustParse(t, replicasBase+`
replicas: {enabled: true, nats_url: "nats://u:topsecret@10.0.0.1:4222,nats://10.0.0.2:4222"}
`, nil)
	var b strings.Builder
	for _, a := range c.LogAttrs() {
		b.WriteString(a.String() + " ")
	}
	assert.Contains(t, b.String(), "replicas.nats_url=nats://u:xxxxx@10.0.0.1:4222,nats://10.0.0.2:4222")
	assert.NotContains(t, b.String(), "topsecret")
}
