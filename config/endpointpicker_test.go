package config

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// eppFull is the endpoint_picker section of the example, with discovery and no static
// backends.
const eppFull = `
kv_cache_index: {enabled: true}
endpoint_picker:
  grpc_address: 0.0.0.0:9002
  health_address: 0.0.0.0:9003
  metrics_address: ""
  failure_mode: fail_open
  fallback_endpoints: 2
  destination_namespace: my.lb
  subset_namespace: my.lb.subset
  discovery:
    dns_name: vllm-llama.default.svc.cluster.local
    port: 8000
    scheme: https
    interval: 30s
    model: meta-llama/Llama-3.1-8B-Instruct
    zmq_endpoint: tcp://{ip}:5557
    zmq_replay_endpoint: tcp://{ip}:5558
`

func TestEndpointPickerParse(t *testing.T) {
	c := mustParse(t, eppFull, nil)
	e := c.EndpointPicker
	assert.Empty(t, c.Backends, "discovery lets backends be empty")
	assert.Equal(t, "0.0.0.0:9002", e.GRPCAddress)
	assert.Equal(t, "0.0.0.0:9003", e.HealthAddress)
	require.NotNil(t, e.MetricsAddress)
	assert.Equal(t, "", *e.MetricsAddress, `an explicit "" turns the metrics listener off`)
	assert.Equal(t, FailureModeOpen, e.FailureMode)
	assert.True(t, e.FailOpen())
	assert.Equal(t, 2, e.FallbackEndpoints)
	assert.Equal(t, "my.lb", e.DestinationNamespace)
	assert.Equal(t, "my.lb.subset", e.SubsetNamespace)
	d := e.Discovery
	assert.True(t, d.Enabled())
	assert.Equal(t, "vllm-llama.default.svc.cluster.local", d.DNSName)
	assert.Equal(t, 8000, d.Port)
	assert.Equal(t, "https", d.Scheme)
	assert.Equal(t, 30*time.Second, time.Duration(d.Interval))
	assert.Equal(t, "meta-llama/Llama-3.1-8B-Instruct", d.Model)
	assert.Equal(t, "tcp://{ip}:5557", d.ZMQEndpoint)
	assert.Equal(t, "tcp://{ip}:5558", d.ZMQReplayEndpoint)

	var b strings.Builder
	for _, a := range c.LogAttrs() {
		b.WriteString(a.String() + " ")
	}
	assert.Contains(t, b.String(), "endpoint_picker.discovery.dns_name=vllm-llama.default.svc.cluster.local")
	assert.Contains(t, b.String(), "backends=0 ")
}

func TestEndpointPickerDefaults(t *testing.T) {
	c := mustParse(t, minimalBackends, nil)
	e := c.EndpointPicker
	assert.Equal(t, DefaultEPPGRPCAddress, e.GRPCAddress)
	assert.Equal(t, "127.0.0.1:9002", e.GRPCAddress)
	assert.Equal(t, "127.0.0.1:9003", e.HealthAddress)
	require.NotNil(t, e.MetricsAddress)
	assert.Equal(t, "127.0.0.1:9090", *e.MetricsAddress)
	assert.Equal(t, FailureModeClosed, e.FailureMode)
	assert.False(t, e.FailOpen())
	assert.Equal(t, 0, e.FallbackEndpoints)
	assert.Equal(t, "envoy.lb", e.DestinationNamespace)
	assert.Equal(t, "envoy.lb.subset_hint", e.SubsetNamespace)
	assert.False(t, e.Discovery.Enabled())
	assert.Equal(t, "http", e.Discovery.Scheme)
	assert.Equal(t, 10*time.Second, time.Duration(e.Discovery.Interval))

	// ApplyDefaults is idempotent and keeps what was set.
	before := *c
	c.ApplyDefaults()
	assert.Equal(t, *before.EndpointPicker.MetricsAddress, *c.EndpointPicker.MetricsAddress)
	assert.Equal(t, before.EndpointPicker.FailureMode, c.EndpointPicker.FailureMode)

	// The InferencePool's spellings of the failure mode are accepted and rewritten.
	for in, want := range map[string]string{"FailOpen": FailureModeOpen, "FailClose": FailureModeClosed, "fail_closed": FailureModeClosed} {
		c := mustParse(t, minimalBackends+"endpoint_picker: {failure_mode: "+in+"}\n", nil)
		assert.Equal(t, want, c.EndpointPicker.FailureMode, in)
		assert.Equal(t, want == FailureModeOpen, c.EndpointPicker.FailOpen(), in)
	}

	// A Config built in Go without ApplyDefaults is refused by Validate, naming the field.
	raw := &Config{}
	raw.ApplyDefaults()
	raw.EndpointPicker.MetricsAddress = nil
	err := raw.Validate()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "endpoint_picker.metrics_address")
}

func TestEndpointPickerValidation(t *testing.T) {
	disc := func(extra string) string {
		return "kv_cache_index: {enabled: true}\nendpoint_picker:\n  discovery: {dns_name: pool.ns.svc.cluster.local, port: 8000" + extra + "}\n"
	}
	for _, tc := range []struct{ name, yaml, want string }{
		{"grpc address", minimalBackends + "endpoint_picker: {grpc_address: localhost}", "endpoint_picker.grpc_address: \"localhost\" is not host:port"},
		{"grpc port", minimalBackends + "endpoint_picker: {grpc_address: \"localhost:99999\"}", "endpoint_picker.grpc_address: \"localhost:99999\": port"},
		{"health address", minimalBackends + "endpoint_picker: {health_address: \"127.0.0.1:x\"}", "endpoint_picker.health_address: \"127.0.0.1:x\": port \"x\""},
		{"metrics address", minimalBackends + "endpoint_picker: {metrics_address: \"9090\"}", "endpoint_picker.metrics_address: \"9090\" is not host:port"},
		{"failure mode", minimalBackends + "endpoint_picker: {failure_mode: open}", "endpoint_picker.failure_mode: \"open\" is not one of fail_closed, fail_open"},
		{"fallbacks negative", minimalBackends + "endpoint_picker: {fallback_endpoints: -1}", "endpoint_picker.fallback_endpoints: -1 is not in [0, 8]"},
		{"fallbacks above 8", minimalBackends + "endpoint_picker: {fallback_endpoints: 9}", "endpoint_picker.fallback_endpoints: 9 is not in [0, 8]"},
		{"destination namespace", minimalBackends + "endpoint_picker: {destination_namespace: \"envoy lb\"}", "endpoint_picker.destination_namespace"},
		{"subset namespace", minimalBackends + "endpoint_picker: {subset_namespace: \"a\\tb\"}", "endpoint_picker.subset_namespace"},
		{"discovery without name", minimalBackends + "endpoint_picker: {discovery: {port: 8000}}", "endpoint_picker.discovery.dns_name: is required"},
		{"name with a space", "endpoint_picker: {discovery: {dns_name: \"a b\", port: 8000}}", "endpoint_picker.discovery.dns_name: \"a b\" is not a DNS name"},
		{"name with an empty label", "endpoint_picker: {discovery: {dns_name: a..b, port: 8000}}", "endpoint_picker.discovery.dns_name: \"a..b\" is not a DNS name"},
		{"label of 64", "endpoint_picker: {discovery: {dns_name: " + strings.Repeat("a", 64) + ".svc, port: 8000}}", "each label has 1 to 63"},
		{"name too long", "endpoint_picker: {discovery: {dns_name: " + strings.Repeat("abcdefg.", 32) + "x, port: 8000}}", "1 to 253 characters"},
		{"label with a hyphen", "endpoint_picker: {discovery: {dns_name: -pool.svc, port: 8000}}", "starts or ends with '-'"},
		{"IP literal", "endpoint_picker: {discovery: {dns_name: 10.0.0.7, port: 8000}}", "endpoint_picker.discovery.dns_name: \"10.0.0.7\" is an IP address"},
		{"port missing", "endpoint_picker: {discovery: {dns_name: pool.svc}}", "endpoint_picker.discovery.port: 0 is not in [1, 65535]"},
		{"port too big", "endpoint_picker: {discovery: {dns_name: pool.svc, port: 65536}}", "endpoint_picker.discovery.port: 65536 is not in [1, 65535]"},
		{"scheme", disc(", scheme: grpc"), "endpoint_picker.discovery.scheme: \"grpc\" is not one of http, https"},
		{"interval", disc(", interval: 500ms"), "endpoint_picker.discovery.interval: 500ms is below 1s"},
		{"zmq without ip", disc(", zmq_endpoint: \"tcp://10.0.0.1:5557\""), "endpoint_picker.discovery.zmq_endpoint: \"tcp://10.0.0.1:5557\" does not contain {ip}"},
		{"zmq not tcp", disc(", zmq_endpoint: \"ipc://{ip}\""), "endpoint_picker.discovery.zmq_endpoint: \"ipc://{ip}\" is not a tcp:// endpoint"},
		{"zmq no port", disc(", zmq_endpoint: \"tcp://{ip}\""), "endpoint_picker.discovery.zmq_endpoint: \"tcp://{ip}\" is not tcp://{ip}:port"},
		{"zmq ip not the host", disc(", zmq_endpoint: \"tcp://x{ip}:5557\""), "endpoint_picker.discovery.zmq_endpoint: \"tcp://x{ip}:5557\" is not tcp://{ip}:port"},
		{"zmq port 0", disc(", zmq_endpoint: \"tcp://{ip}:0\""), "endpoint_picker.discovery.zmq_endpoint: \"tcp://{ip}:0\": port \"0\""},
		{"replay without ip", disc(", zmq_endpoint: \"tcp://{ip}:5557\", zmq_replay_endpoint: \"tcp://h:5558\""), "endpoint_picker.discovery.zmq_replay_endpoint: \"tcp://h:5558\" does not contain {ip}"},
		{"replay without endpoint", disc(", zmq_replay_endpoint: \"tcp://{ip}:5558\""), "endpoint_picker.discovery.zmq_replay_endpoint: needs zmq_endpoint"},
		{"zmq without the index", "endpoint_picker: {discovery: {dns_name: pool.svc, port: 8000, zmq_endpoint: \"tcp://{ip}:5557\"}}",
			"endpoint_picker.discovery.zmq_endpoint: needs kv_cache_index.enabled"},
		{"no backends without discovery", "endpoint_picker: {grpc_address: \"0.0.0.0:9002\"}", "backends: at least one backend is required (or endpoint_picker.discovery.dns_name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml), env(nil))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			// Each problem is one error of the join, naming its field first.
			var joined interface{ Unwrap() []error }
			require.True(t, errors.As(err, &joined))
			assert.Len(t, joined.Unwrap(), 1, "%v", err)
		})
	}

	// Valid forms: an empty host (every interface), a trailing dot, an underscore, bracketed {ip}.
	for _, y := range []string{
		minimalBackends + "endpoint_picker: {grpc_address: \":9002\", metrics_address: \"[::1]:9090\", failure_mode: FailOpen, fallback_endpoints: 8}",
		disc(", interval: 1s, scheme: https"),
		"endpoint_picker: {discovery: {dns_name: pool.ns.svc.cluster.local., port: 1}}",
		"endpoint_picker: {discovery: {dns_name: _vllm._tcp.pool, port: 65535}}",
		disc(", zmq_endpoint: \"tcp://[{ip}]:5557\", zmq_replay_endpoint: \"tcp://{ip}:5558\""),
	} {
		_, err := Parse([]byte(y), env(nil))
		assert.NoError(t, err, y)
	}
}

func TestDiscoveredBackend(t *testing.T) {
	c := mustParse(t, eppFull, nil)
	b, es := c.DiscoveredBackend("10.0.0.7")
	assert.Equal(t, BackendConfig{Name: "10.0.0.7:8000", URL: "https://10.0.0.7:8000", Weight: 1, Model: "meta-llama/Llama-3.1-8B-Instruct"}, b)
	assert.Equal(t, []EventSourceConfig{{BackendName: "10.0.0.7:8000", Endpoint: "tcp://10.0.0.7:5557",
		ReplayEndpoint: "tcp://10.0.0.7:5558", Model: "meta-llama/Llama-3.1-8B-Instruct"}}, es)

	// IPv6: brackets in the name, the URL and the endpoints; a mapped IPv4 address is IPv4.
	b, es = c.DiscoveredBackend("fd00::7")
	assert.Equal(t, "[fd00::7]:8000", b.Name)
	assert.Equal(t, "https://[fd00::7]:8000", b.URL)
	require.Len(t, es, 1)
	assert.Equal(t, "tcp://[fd00::7]:5557", es[0].Endpoint)
	assert.Equal(t, "tcp://[fd00::7]:5558", es[0].ReplayEndpoint)
	b, _ = c.DiscoveredBackend("::ffff:10.0.0.8")
	assert.Equal(t, "10.0.0.8:8000", b.Name)

	// A template with [{ip}] is not bracketed twice.
	c.EndpointPicker.Discovery.ZMQEndpoint = "tcp://[{ip}]:6000"
	_, es = c.DiscoveredBackend("fd00::7")
	assert.Equal(t, "tcp://[fd00::7]:6000", es[0].Endpoint)
	_, es = c.DiscoveredBackend("10.0.0.9")
	assert.Equal(t, "tcp://10.0.0.9:6000", es[0].Endpoint)

	// Without zmq_endpoint, no event source; the default scheme is http.
	c = mustParse(t, "endpoint_picker: {discovery: {dns_name: pool.svc, port: 8001}}", nil)
	b, es = c.DiscoveredBackend("10.0.0.7")
	assert.Equal(t, BackendConfig{Name: "10.0.0.7:8001", URL: "http://10.0.0.7:8001", Weight: 1}, b)
	assert.Empty(t, es)
	// The result is a valid backend of the configuration.
	c.Backends = append(c.Backends, b)
	assert.NoError(t, c.Validate())
}
