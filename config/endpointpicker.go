package config

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"
)

// EndpointPickerConfig is the endpoint_picker section: the settings of kvroute-epp, kvroute's
// endpoint picker for the Gateway API Inference Extension (Envoy's external processing, ext_proc).
// The reference proxy ignores it. Every field is optional.
type EndpointPickerConfig struct {
	// GRPCAddress is the host:port of the ext_proc gRPC listener Envoy calls (default
	// 127.0.0.1:9002; in Kubernetes, 0.0.0.0:9002).
	GRPCAddress string `yaml:"grpc_address"`
	// HealthAddress is the host:port of the gRPC health service, which answers for the services
	// "liveness", "readiness" and "envoy.service.ext_proc.v3.ExternalProcessor" (default
	// 127.0.0.1:9003).
	HealthAddress string `yaml:"health_address"`
	// MetricsAddress is the host:port of the HTTP listener serving /metrics in the Prometheus
	// format (default 127.0.0.1:9090); an explicit "" turns the listener off. ApplyDefaults sets
	// it, so that after it the pointer is never nil.
	MetricsAddress *string `yaml:"metrics_address"`
	// FailureMode is what the picker does when kvroute cannot decide (an internal error, not the
	// absence of an eligible endpoint, which is always answered 503): fail_closed (default)
	// answers 503, fail_open picks any eligible endpoint. The InferencePool's spellings FailClose
	// and FailOpen are accepted; ApplyDefaults rewrites them to fail_closed and fail_open.
	FailureMode string `yaml:"failure_mode"`
	// FallbackEndpoints is how many endpoints follow the primary one in the
	// x-gateway-destination-endpoint header, for the proxy to try when the primary fails (default
	// 0, at most 8).
	FallbackEndpoints int `yaml:"fallback_endpoints"`
	// DestinationNamespace is the dynamic metadata namespace that carries the picked endpoint(s)
	// (default envoy.lb, the protocol's).
	DestinationNamespace string `yaml:"destination_namespace"`
	// SubsetNamespace is the filter metadata namespace of the proxy's subset hint, the endpoints
	// the pick is restricted to (default envoy.lb.subset_hint, the protocol's).
	SubsetNamespace string `yaml:"subset_namespace"`
	// Discovery finds the pool's endpoints in DNS. Without it, the endpoints are the static
	// backends.
	Discovery DiscoveryConfig `yaml:"discovery"`
}

// DiscoveryConfig is endpoint_picker.discovery: the pool's endpoints are the addresses a DNS name
// resolves to (the A and AAAA records of a Kubernetes headless Service list its ready pods), each
// a backend named "ip:port", resolved again every Interval. Discovery is on when DNSName is set.
type DiscoveryConfig struct {
	// DNSName is the name resolved, e.g. vllm-llama.default.svc.cluster.local (default "": no
	// discovery).
	DNSName string `yaml:"dns_name"`
	// Port is the engines' HTTP port on every address (required with dns_name; 1 to 65535).
	Port int `yaml:"port"`
	// Scheme is the engines' URL scheme: http (default) or https.
	Scheme string `yaml:"scheme"`
	// Interval is the time between two resolutions (default 10s, at least 1s).
	Interval Duration `yaml:"interval"`
	// Model is the model every discovered engine serves: its backends' model and the default model
	// of its KV events (default "": none declared).
	Model string `yaml:"model"`
	// ZMQEndpoint is the template of each engine's KV-event ZMQ endpoint, connected to (not
	// bound), e.g. tcp://{ip}:5557: {ip} is replaced by the engine's address (in brackets for
	// IPv6). Default "": no KV events from discovered engines. Needs kv_cache_index.enabled.
	ZMQEndpoint string `yaml:"zmq_endpoint"`
	// ZMQReplayEndpoint is the template of each engine's ZMQ replay endpoint, e.g.
	// tcp://{ip}:5558 (default "": none). Needs zmq_endpoint.
	ZMQReplayEndpoint string `yaml:"zmq_replay_endpoint"`
}

// Defaults of the endpoint_picker section.
const (
	DefaultEPPGRPCAddress          = "127.0.0.1:9002"
	DefaultEPPHealthAddress        = "127.0.0.1:9003"
	DefaultEPPMetricsAddress       = "127.0.0.1:9090"
	DefaultEPPDestinationNamespace = "envoy.lb"
	DefaultEPPSubsetNamespace      = "envoy.lb.subset_hint"
	DefaultDiscoveryScheme         = "http"
	DefaultDiscoveryInterval       = 10 * time.Second
	// MaxFallbackEndpoints is the most endpoint_picker.fallback_endpoints.
	MaxFallbackEndpoints = 8
	// MinDiscoveryInterval is the shortest endpoint_picker.discovery.interval.
	MinDiscoveryInterval = time.Second
	// DiscoveryIPPlaceholder is the placeholder of the discovery's ZMQ endpoint templates.
	DiscoveryIPPlaceholder = "{ip}"
)

// Failure modes of endpoint_picker.failure_mode.
const (
	// FailureModeClosed answers 503 when kvroute cannot decide.
	FailureModeClosed = "fail_closed"
	// FailureModeOpen picks any eligible endpoint when kvroute cannot decide.
	FailureModeOpen = "fail_open"
)

// FailOpen reports whether failure_mode is fail_open (or the InferencePool's FailOpen).
func (e *EndpointPickerConfig) FailOpen() bool {
	return canonicalFailureMode(e.FailureMode) == FailureModeOpen
}

// Enabled reports whether discovery is on: dns_name is set.
func (d *DiscoveryConfig) Enabled() bool { return d.DNSName != "" }

// canonicalFailureMode maps the accepted spellings of a failure mode to kvroute's; anything else,
// "" included, is returned as is.
func canonicalFailureMode(s string) string {
	switch s {
	case FailureModeClosed, "FailClose":
		return FailureModeClosed
	case FailureModeOpen, "FailOpen":
		return FailureModeOpen
	}
	return s
}

// applyDefaults fills the endpoint_picker section's unset fields. Idempotent.
func (e *EndpointPickerConfig) applyDefaults() {
	if e.GRPCAddress == "" {
		e.GRPCAddress = DefaultEPPGRPCAddress
	}
	if e.HealthAddress == "" {
		e.HealthAddress = DefaultEPPHealthAddress
	}
	if e.MetricsAddress == nil {
		e.MetricsAddress = ptr(DefaultEPPMetricsAddress)
	}
	if e.FailureMode == "" {
		e.FailureMode = FailureModeClosed
	}
	e.FailureMode = canonicalFailureMode(e.FailureMode)
	if e.DestinationNamespace == "" {
		e.DestinationNamespace = DefaultEPPDestinationNamespace
	}
	if e.SubsetNamespace == "" {
		e.SubsetNamespace = DefaultEPPSubsetNamespace
	}
	d := &e.Discovery
	if d.Scheme == "" {
		d.Scheme = DefaultDiscoveryScheme
	}
	if d.Interval == 0 {
		d.Interval = Duration(DefaultDiscoveryInterval)
	}
}

// validateEndpointPicker checks the endpoint_picker section.
func (c *Config) validateEndpointPicker(fe *fieldErrors) {
	e := &c.EndpointPicker
	const p = "endpoint_picker"
	if err := checkListenAddr(e.GRPCAddress); err != nil {
		fe.add(p+".grpc_address", "%v", err)
	}
	if err := checkListenAddr(e.HealthAddress); err != nil {
		fe.add(p+".health_address", "%v", err)
	}
	if a := *e.MetricsAddress; a != "" {
		if err := checkListenAddr(a); err != nil {
			fe.add(p+".metrics_address", "%v (or \"\" to turn the listener off)", err)
		}
	}
	if canonicalFailureMode(e.FailureMode) != FailureModeClosed && canonicalFailureMode(e.FailureMode) != FailureModeOpen {
		fe.add(p+".failure_mode", "%q is not one of %s, %s (or FailClose, FailOpen)", e.FailureMode, FailureModeClosed, FailureModeOpen)
	}
	if n := e.FallbackEndpoints; n < 0 || n > MaxFallbackEndpoints {
		fe.add(p+".fallback_endpoints", "%d is not in [0, %d]", n, MaxFallbackEndpoints)
	}
	for path, ns := range map[string]string{p + ".destination_namespace": e.DestinationNamespace, p + ".subset_namespace": e.SubsetNamespace} {
		if ns == "" || strings.ContainsFunc(ns, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
			fe.add(path, "%q must be a non-empty name without spaces or control characters", ns)
		}
	}

	d := &e.Discovery
	const dp = p + ".discovery"
	if !d.Enabled() {
		// The other fields do nothing without a name: say so rather than ignore them.
		if d.Port != 0 || d.Model != "" || d.ZMQEndpoint != "" || d.ZMQReplayEndpoint != "" {
			fe.add(dp+".dns_name", "is required when other discovery settings are set")
		}
		return
	}
	if err := checkDNSName(d.DNSName); err != nil {
		fe.add(dp+".dns_name", "%v", err)
	}
	if d.Port < 1 || d.Port > 65535 {
		fe.add(dp+".port", "%d is not in [1, 65535] (the engines' HTTP port is required)", d.Port)
	}
	if d.Scheme != "http" && d.Scheme != "https" {
		fe.add(dp+".scheme", "%q is not one of http, https", d.Scheme)
	}
	if iv := time.Duration(d.Interval); iv < MinDiscoveryInterval {
		fe.add(dp+".interval", "%v is below %v", iv, MinDiscoveryInterval)
	}
	for _, t := range []struct{ path, tmpl string }{{dp + ".zmq_endpoint", d.ZMQEndpoint}, {dp + ".zmq_replay_endpoint", d.ZMQReplayEndpoint}} {
		if t.tmpl != "" {
			if err := checkZMQTemplate(t.tmpl); err != nil {
				fe.add(t.path, "%v", err)
			}
		}
	}
	if d.ZMQReplayEndpoint != "" && d.ZMQEndpoint == "" {
		fe.add(dp+".zmq_replay_endpoint", "needs zmq_endpoint")
	}
	if d.ZMQEndpoint != "" && !c.KVCacheIndex.Enabled {
		fe.add(dp+".zmq_endpoint", "needs kv_cache_index.enabled: the events feed the KV index")
	}
}

// checkListenAddr checks that s is host:port with a numeric port (the host may be empty: every
// interface).
func checkListenAddr(s string) error {
	_, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("%q is not host:port", s)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || port == "" {
		return fmt.Errorf("%q: port %q is not a number in [0, 65535]", s, port)
	} else if n > 65535 {
		return fmt.Errorf("%q: port %d is not in [0, 65535]", s, n)
	}
	return nil
}

// checkDNSName checks that s is a DNS name (RFC 1035 as relaxed by RFC 1123, with the underscore
// some service names use): at most 253 characters, dot-separated labels of 1 to 63 letters,
// digits, '-' and '_' that neither start nor end with '-', an optional final dot. An IP address
// is refused: it is no pool to discover.
func checkDNSName(s string) error {
	if _, err := netip.ParseAddr(s); err == nil {
		return fmt.Errorf("%q is an IP address, not a DNS name (list a fixed endpoint in backends)", s)
	}
	name := strings.TrimSuffix(s, ".")
	if name == "" || len(name) > 253 {
		return fmt.Errorf("%q is not a DNS name (1 to 253 characters)", s)
	}
	for label := range strings.SplitSeq(name, ".") {
		if len(label) == 0 || len(label) > 63 {
			return fmt.Errorf("%q is not a DNS name: each label has 1 to 63 characters", s)
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("%q is not a DNS name: label %q starts or ends with '-'", s, label)
		}
		for i := 0; i < len(label); i++ {
			ch := label[i]
			if !('a' <= ch && ch <= 'z' || 'A' <= ch && ch <= 'Z' || '0' <= ch && ch <= '9' || ch == '-' || ch == '_') {
				return fmt.Errorf("%q is not a DNS name: %q is not a letter, digit, '-' or '_'", s, ch)
			}
		}
	}
	return nil
}

// checkZMQTemplate checks an endpoint template of the discovery: tcp://, with {ip} as the host (or
// in brackets), a port in [1, 65535].
func checkZMQTemplate(t string) error {
	if !strings.Contains(t, DiscoveryIPPlaceholder) {
		return fmt.Errorf("%q does not contain %s, the place of each engine's address", t, DiscoveryIPPlaceholder)
	}
	if !strings.HasPrefix(t, "tcp://") {
		return fmt.Errorf("%q is not a tcp:// endpoint", t)
	}
	host, port, err := net.SplitHostPort(strings.TrimPrefix(expandIP(t, "10.0.0.1"), "tcp://"))
	if err != nil || host != "10.0.0.1" {
		return fmt.Errorf("%q is not tcp://%s:port", t, DiscoveryIPPlaceholder)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("%q: port %q is not in [1, 65535]", t, port)
	}
	return nil
}

// expandIP replaces {ip} in template t with ip, in brackets when ip is an IPv6 address ("[{ip}]"
// in the template is accepted as well, and not bracketed twice).
func expandIP(t, ip string) string {
	t = strings.ReplaceAll(t, "["+DiscoveryIPPlaceholder+"]", DiscoveryIPPlaceholder)
	host := ip
	if strings.Contains(ip, ":") {
		host = "[" + ip + "]"
	}
	return strings.ReplaceAll(t, DiscoveryIPPlaceholder, host)
}

// DiscoveredBackend returns the backend of one address ip discovered by endpoint_picker.discovery
// and the connect-mode ZMQ event sources of its engine (none without discovery.zmq_endpoint). The
// backend's name is ip:port (the endpoint picker protocol's endpoint, and the <pod> of llm-d's
// kv@<pod>@<model> topics), its URL scheme://ip:port, its weight 1 and its model discovery.model;
// an IPv6 address is in brackets in the name, the URL and the ZMQ endpoints ([fd00::7]:8000). An
// IPv6 zone is dropped. ip is not checked: the watcher passes addresses from the resolver. It only
// reads c; c should have its defaults applied.
func (c *Config) DiscoveredBackend(ip string) (BackendConfig, []EventSourceConfig) {
	d := &c.EndpointPicker.Discovery
	if a, err := netip.ParseAddr(ip); err == nil {
		ip = a.Unmap().WithZone("").String()
	}
	hostPort := net.JoinHostPort(ip, strconv.Itoa(d.Port))
	scheme := d.Scheme
	if scheme == "" {
		scheme = DefaultDiscoveryScheme
	}
	b := BackendConfig{Name: hostPort, URL: scheme + "://" + hostPort, Weight: 1, Model: d.Model}
	if d.ZMQEndpoint == "" {
		return b, nil
	}
	es := EventSourceConfig{BackendName: b.Name, Endpoint: expandIP(d.ZMQEndpoint, ip), Model: d.Model}
	if d.ZMQReplayEndpoint != "" {
		es.ReplayEndpoint = expandIP(d.ZMQReplayEndpoint, ip)
	}
	return b, []EventSourceConfig{es}
}
