package deploy_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	headermutationv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_mutation/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvroute/kvroute/config"
)

// The names the files share: the Envoy filters and clusters the bootstraps must hold, and the
// header of the Endpoint Picker Protocol.
const (
	destinationHeader = "x-gateway-destination-endpoint"
	eppCluster        = "kvroute-epp"
	originalDst       = "original_destination"
)

// The typed configs the bootstraps use. Naming each type keeps it linked into the test binary,
// and so in protobuf's global registry, where protojson finds the type of each "@type".
var _ = []proto.Message{
	(*hcmv3.HttpConnectionManager)(nil),
	(*extprocv3.ExternalProcessor)(nil),
	(*headermutationv3.HeaderMutation)(nil),
	(*routerv3.Router)(nil),
	(*upstreamhttpv3.HttpProtocolOptions)(nil),
}

// bodyModes is each bootstrap's expected body mode, for both directions.
var bodyModes = map[string]extprocv3.ProcessingMode_BodySendMode{
	"envoy.yaml":          extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	"envoy-buffered.yaml": extprocv3.ProcessingMode_BUFFERED,
}

// TestEnvoyBootstraps decodes each envoy/envoy*.yaml into Envoy's Bootstrap, strictly, applies
// the validation rules of Envoy's API to it and to every typed config inside it, and checks the
// parts kvroute-epp relies on.
func TestEnvoyBootstraps(t *testing.T) {
	files, err := filepath.Glob("envoy/envoy*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range files {
		names = append(names, filepath.Base(f))
	}
	if want := []string{"envoy-buffered.yaml", "envoy.yaml"}; !slices.Equal(names, want) {
		t.Fatalf("envoy/ holds %v, want %v (add the expected body mode of a new file to bodyModes)", names, want)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			tree, err := decodeYAML(data)
			if err != nil {
				t.Fatal(err)
			}
			b, err := loadBootstrap(tree)
			if err != nil {
				t.Fatal(err)
			}
			for _, err := range checkBootstrap(b, bodyModes[filepath.Base(f)]) {
				t.Error(err)
			}
		})
	}
}

// TestEnvoyChecksCatchMistakes breaks envoy.yaml in ways Envoy would refuse, or that would route
// no request to kvroute-epp's pick, and expects the checks of TestEnvoyBootstraps to say so. It
// shows that those checks can fail: in particular that the validation rules reach into the typed
// configs (a stat_prefix-less HttpConnectionManager is only caught there).
func TestEnvoyChecksCatchMistakes(t *testing.T) {
	data, err := os.ReadFile("envoy/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const hcm = "static_resources.listeners.0.filter_chains.0.filters.0.typed_config"
	const extProc = hcm + ".http_filters.1.typed_config"
	tests := []struct {
		name  string
		path  string
		value any // nil deletes
		want  string
	}{
		{"unknown field", extProc + ".processing_modes", "SEND", "unknown field"},
		{"unknown enum value", extProc + ".processing_mode.request_body_mode", "FULL_DUPLEX", "invalid value"},
		{"typed config without its required field", hcm + ".stat_prefix", nil, "StatPrefix"},
		{"typed config within a typed config", extProc + ".message_timeout", "7200s", "MessageTimeout"},
		{"rule of the bootstrap itself", "static_resources.clusters.0.connect_timeout", "-1s", "ConnectTimeout"},
		{"header mode", extProc + ".processing_mode.response_header_mode", "SKIP", "response_header_mode"},
		{"body mode", extProc + ".processing_mode.request_body_mode", "STREAMED", "request_body_mode"},
		{"trailers with full duplex", extProc + ".processing_mode.response_trailer_mode", "SKIP", "response_trailer_mode"},
		{"fail open", extProc + ".failure_mode_allow", true, "failure_mode_allow"},
		{"mode override", extProc + ".allow_mode_override", true, "allow_mode_override"},
		{"ext_proc cluster", extProc + ".grpc_service.envoy_grpc.cluster_name", "epp", "cluster"},
		{"router not last", hcm + ".http_filters.2.name", "envoy.filters.http.router2", "router"},
		{"client header kept", hcm + ".http_filters.0.typed_config.mutations.request_mutations.0.remove", "x-other", "removes"},
		{"destination header", "static_resources.clusters.1.original_dst_lb_config.http_header_name", "x-envoy-original-dst-host", "http_header_name"},
		{"original destination load balancer", "static_resources.clusters.1.lb_policy", "ROUND_ROBIN", "CLUSTER_PROVIDED"},
		{"route", hcm + ".route_config.virtual_hosts.0.routes.0.route.cluster", "kvroute-epp", "route"},
		{"epp without HTTP/2", "static_resources.clusters.0.typed_extension_protocol_options", nil, "HTTP/2"},
		{"connect timeout", "static_resources.clusters.1.connect_timeout", nil, "connect_timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tree, err := decodeYAML(data)
			if err != nil {
				t.Fatal(err)
			}
			if err := setPath(tree, tt.path, tt.value); err != nil {
				t.Fatal(err)
			}
			errs := bootstrapErrors(tree, extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED)
			if !mentions(errs, tt.want) {
				t.Errorf("errors %v, want one mentioning %q", errs, tt.want)
			}
		})
	}
}

// bootstrapErrors is everything loadBootstrap and checkBootstrap find wrong with tree.
func bootstrapErrors(tree any, mode extprocv3.ProcessingMode_BodySendMode) []error {
	b, err := loadBootstrap(tree)
	if err != nil {
		return []error{err}
	}
	return checkBootstrap(b, mode)
}

// loadBootstrap turns the YAML tree of a bootstrap into Envoy's Bootstrap as Envoy reads it (JSON
// mapping of the protos, unknown fields refused) and applies Envoy's protoc-gen-validate rules to
// it and to the content of every Any inside it, which the Bootstrap's own rules do not open.
func loadBootstrap(tree any) (*bootstrapv3.Bootstrap, error) {
	js, err := json.Marshal(tree)
	if err != nil {
		return nil, err
	}
	b := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(js, b); err != nil {
		return nil, err
	}
	if err := validateDeep(b, "bootstrap"); err != nil {
		return nil, err
	}
	return b, nil
}

// validateDeep applies m's validation rules, then those of every message packed in an Any
// anywhere within m, naming each by where it was found.
func validateDeep(m proto.Message, where string) error {
	var errs []error
	if v, ok := m.(interface{ ValidateAll() error }); ok {
		if err := v.ValidateAll(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
		}
	} else {
		errs = append(errs, fmt.Errorf("%s: %s has no validation rules", where, m.ProtoReflect().Descriptor().FullName()))
	}
	for _, a := range anys(m.ProtoReflect(), where) {
		inner, err := a.any.UnmarshalNew()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a.where, err))
			continue
		}
		if err := validateDeep(inner, a.where+"("+string(inner.ProtoReflect().Descriptor().Name())+")"); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// foundAny is an Any and the field path it was found at.
type foundAny struct {
	any   *anypb.Any
	where string
}

// anys lists the Any messages within m, not looking inside them.
func anys(m protoreflect.Message, where string) []foundAny {
	if a, ok := m.Interface().(*anypb.Any); ok {
		return []foundAny{{a, where}}
	}
	var out []foundAny
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		name := where + "." + string(fd.Name())
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := 0; i < v.List().Len(); i++ {
				out = append(out, anys(v.List().Get(i).Message(), name+"."+strconv.Itoa(i))...)
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				out = append(out, anys(mv.Message(), name+"["+k.String()+"]")...)
				return true
			})
		case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
			out = append(out, anys(v.Message(), name)...)
		}
		return true
	})
	return out
}

// checkBootstrap checks what kvroute-epp needs of a valid bootstrap: every request goes through
// the ext_proc filter, which reaches kvroute-epp over HTTP/2 with the processing mode the
// Endpoint Picker Protocol asks for, after a filter drops the client's own destination header
// and before the router, which sends it to an ORIGINAL_DST cluster reading that header.
func checkBootstrap(b *bootstrapv3.Bootstrap, mode extprocv3.ProcessingMode_BodySendMode) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	clusters := map[string]*clusterv3.Cluster{}
	for _, c := range b.GetStaticResources().GetClusters() {
		clusters[c.GetName()] = c
		if c.GetConnectTimeout() == nil {
			fail("cluster %s: no connect_timeout", c.GetName())
		}
	}

	listeners := b.GetStaticResources().GetListeners()
	if len(listeners) != 1 {
		return append(errs, fmt.Errorf("%d listeners, want 1", len(listeners)))
	}
	l := listeners[0]
	if sa := l.GetAddress().GetSocketAddress(); sa.GetAddress() != "0.0.0.0" || sa.GetPortValue() != 8081 {
		fail("listener on %s:%d, want 0.0.0.0:8081", sa.GetAddress(), sa.GetPortValue())
	}
	chains := l.GetFilterChains()
	if len(chains) != 1 || len(chains[0].GetFilters()) != 1 {
		return append(errs, errors.New("want one filter chain of one network filter"))
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if err := chains[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(hcm); err != nil {
		return append(errs, fmt.Errorf("network filter: %w", err))
	}

	// The HTTP filters, in order: header_mutation, ext_proc, router.
	filters := hcm.GetHttpFilters()
	var kinds []string
	for _, f := range filters {
		kinds = append(kinds, f.GetName())
	}
	want := []string{"envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"}
	if !slices.Equal(kinds, want) {
		return append(errs, fmt.Errorf("http filters %v, want %v (the router last)", kinds, want))
	}
	mutation := &headermutationv3.HeaderMutation{}
	if err := filters[0].GetTypedConfig().UnmarshalTo(mutation); err != nil {
		fail("header_mutation: %v", err)
	} else if rm := mutation.GetMutations().GetRequestMutations(); len(rm) != 1 || rm[0].GetRemove() != destinationHeader {
		fail("header_mutation removes %v, want only %s", rm, destinationHeader)
	}
	if err := filters[2].GetTypedConfig().UnmarshalTo(&routerv3.Router{}); err != nil {
		fail("router: %v", err)
	}

	ep := &extprocv3.ExternalProcessor{}
	if err := filters[1].GetTypedConfig().UnmarshalTo(ep); err != nil {
		return append(errs, fmt.Errorf("ext_proc: %w", err))
	}
	pm := ep.GetProcessingMode()
	send := extprocv3.ProcessingMode_SEND
	for _, hm := range []struct {
		name string
		got  extprocv3.ProcessingMode_HeaderSendMode
	}{
		{"request_header_mode", pm.GetRequestHeaderMode()},
		{"response_header_mode", pm.GetResponseHeaderMode()},
		{"request_trailer_mode", pm.GetRequestTrailerMode()},
		{"response_trailer_mode", pm.GetResponseTrailerMode()},
	} {
		if hm.got != send {
			fail("ext_proc %s %v, want SEND", hm.name, hm.got)
		}
	}
	if got := pm.GetRequestBodyMode(); got != mode {
		fail("ext_proc request_body_mode %v, want %v", got, mode)
	}
	if got := pm.GetResponseBodyMode(); got != mode {
		fail("ext_proc response_body_mode %v, want %v", got, mode)
	}
	if ep.GetFailureModeAllow() {
		fail("ext_proc failure_mode_allow true: requests would bypass kvroute-epp")
	}
	if ep.GetAllowModeOverride() {
		fail("ext_proc allow_mode_override true")
	}
	if ep.GetMessageTimeout() == nil {
		fail("ext_proc has no message_timeout")
	}
	epp := ep.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	if epp != eppCluster {
		fail("ext_proc grpc_service cluster %q, want %q", epp, eppCluster)
	} else if c := clusters[epp]; c == nil {
		fail("ext_proc cluster %q is not defined", epp)
	} else {
		checkEPPCluster(c, fail)
	}

	// The route sends everything to the ORIGINAL_DST cluster.
	vhosts := hcm.GetRouteConfig().GetVirtualHosts()
	if len(vhosts) != 1 || len(vhosts[0].GetRoutes()) != 1 {
		fail("want one virtual host with one route")
	} else if r := vhosts[0].GetRoutes()[0]; r.GetMatch().GetPrefix() != "/" || r.GetRoute().GetCluster() != originalDst {
		fail("route %v to %q, want prefix / to %q", r.GetMatch(), r.GetRoute().GetCluster(), originalDst)
	}
	od := clusters[originalDst]
	switch {
	case od == nil:
		fail("cluster %q is not defined", originalDst)
	case od.GetType() != clusterv3.Cluster_ORIGINAL_DST:
		fail("cluster %s type %v, want ORIGINAL_DST", originalDst, od.GetType())
	case od.GetLbPolicy() != clusterv3.Cluster_CLUSTER_PROVIDED:
		// Envoy refuses an ORIGINAL_DST cluster with any other policy.
		fail("cluster %s lb_policy %v, want CLUSTER_PROVIDED", originalDst, od.GetLbPolicy())
	case od.GetLoadAssignment() != nil:
		fail("cluster %s has a load_assignment, which Envoy refuses for ORIGINAL_DST", originalDst)
	case !od.GetOriginalDstLbConfig().GetUseHttpHeader():
		fail("cluster %s does not read the destination header (use_http_header)", originalDst)
	case od.GetOriginalDstLbConfig().GetHttpHeaderName() != destinationHeader:
		fail("cluster %s http_header_name %q, want %q", originalDst, od.GetOriginalDstLbConfig().GetHttpHeaderName(), destinationHeader)
	}
	return errs
}

// checkEPPCluster checks the cluster of kvroute-epp: one static endpoint on port 9002, spoken to
// in HTTP/2, as gRPC needs.
func checkEPPCluster(c *clusterv3.Cluster, fail func(string, ...any)) {
	eps := c.GetLoadAssignment().GetEndpoints()
	if len(eps) != 1 || len(eps[0].GetLbEndpoints()) != 1 {
		fail("cluster %s: want one endpoint", c.GetName())
	} else if sa := eps[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress(); sa.GetPortValue() != 9002 {
		fail("cluster %s: port %d, want kvroute-epp's 9002", c.GetName(), sa.GetPortValue())
	}
	opts := &upstreamhttpv3.HttpProtocolOptions{}
	a := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	if a == nil || a.UnmarshalTo(opts) != nil || opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
		fail("cluster %s: not HTTP/2 (explicit_http_config.http2_protocol_options)", c.GetName())
	}
}

// decodeYAML decodes one YAML document into maps, lists and scalars that encoding/json can
// marshal.
func decodeYAML(data []byte) (any, error) {
	var tree any
	if err := yaml.Unmarshal(data, &tree); err != nil {
		return nil, err
	}
	return tree, nil
}

// setPath sets the value at a dotted path of maps and list indexes in tree, or deletes it when
// value is nil.
func setPath(tree any, p string, value any) error {
	parts := strings.Split(p, ".")
	node := tree
	for i, part := range parts {
		last := i == len(parts)-1
		switch n := node.(type) {
		case map[string]any:
			if last {
				if value == nil {
					delete(n, part)
				} else {
					n[part] = value
				}
				return nil
			}
			node = n[part]
		case []any:
			idx, err := strconv.Atoi(part)
			if err != nil || idx < 0 || idx >= len(n) {
				return fmt.Errorf("%s: no element %s", p, part)
			}
			if last {
				n[idx] = value
				return nil
			}
			node = n[idx]
		default:
			return fmt.Errorf("%s: %s is not in the tree", p, strings.Join(parts[:i+1], "."))
		}
	}
	return nil
}

// mentions reports whether some error's message contains s.
func mentions(errs []error, s string) bool {
	for _, err := range errs {
		if err != nil && strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}

// TestKubernetesManifests parses the Kubernetes manifests and the kvroute configuration of the
// ConfigMap, and checks that they agree with each other.
func TestKubernetesManifests(t *testing.T) {
	docs, err := loadManifests()
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range checkManifests(docs) {
		t.Error(err)
	}
}

// TestKubernetesChecksCatchMistakes breaks the manifests in ways that would leave kvroute-epp
// unreachable, probed on the wrong port, blind to the pool's pods or unusable by the gateway, and
// expects the checks of TestKubernetesManifests to say so.
func TestKubernetesChecksCatchMistakes(t *testing.T) {
	tests := []struct {
		name  string
		kind  string // the document's kind
		dname string // and name
		path  string
		value any // nil deletes; a [2]string replaces its first string in config.yaml by the second
		want  string
	}{
		{"picker port", "InferencePool", "vllm-llama", "spec.endpointPickerRef.port.number", 9003, "endpointPickerRef port"},
		{"picker name", "InferencePool", "vllm-llama", "spec.endpointPickerRef.name", "epp", "endpointPickerRef names"},
		{"pool port", "InferencePool", "vllm-llama", "spec.targetPorts.0.number", 8001, "discovery.port"},
		{"pool selector", "InferencePool", "vllm-llama", "spec.selector.matchLabels.app", "vllm", "selector"},
		{"field not in the CRD", "InferencePool", "vllm-llama", "spec.targetPort", 8000, "spec.targetPort"},
		{"failure mode", "InferencePool", "vllm-llama", "spec.endpointPickerRef.failureMode", "FailOpenly", "failureMode"},
		{"pool version", "InferencePool", "vllm-llama", "apiVersion", "inference.networking.x-k8s.io/v1alpha2", "apiVersion"},
		{"not headless", "Service", "vllm-llama", "spec.clusterIP", nil, "clusterIP"},
		{"not ready pods", "Service", "vllm-llama", "spec.publishNotReadyAddresses", true, "publishNotReadyAddresses"},
		{"service port", "Service", "kvroute-epp", "spec.ports.0.port", 9000, "endpointPickerRef port"},
		{"service target", "Service", "kvroute-epp", "spec.ports.0.targetPort", "metrics", "targetPort"},
		{"h2c", "Service", "kvroute-epp", "spec.ports.0.appProtocol", "http", "appProtocol"},
		{"liveness port", "Deployment", "kvroute-epp", "spec.template.spec.containers.0.livenessProbe.grpc.port", 9002, "livenessProbe"},
		{"readiness service", "Deployment", "kvroute-epp", "spec.template.spec.containers.0.readinessProbe.grpc.service", "liveness", "readinessProbe"},
		{"config path", "Deployment", "kvroute-epp", "spec.template.spec.containers.0.args.1", "/etc/kvroute.yaml", "-config"},
		{"root", "Deployment", "kvroute-epp", "spec.template.spec.securityContext.runAsNonRoot", false, "runAsNonRoot"},
		{"grace period", "Deployment", "kvroute-epp", "spec.template.spec.terminationGracePeriodSeconds", 60, "terminationGracePeriodSeconds"},
		{"writable root", "Deployment", "kvroute-epp", "spec.template.spec.containers.0.securityContext.readOnlyRootFilesystem", false, "readOnlyRootFilesystem"},
		{"route backend", "HTTPRoute", "vllm-llama", "spec.rules.0.backendRefs.0.kind", "Service", "InferencePool"},
		{"config package refuses", "ConfigMap", "kvroute-epp", "", [2]string{"kv_cache_index:", "kv_cache_indx:"}, "config.Parse"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			docs, err := loadManifests()
			if err != nil {
				t.Fatal(err)
			}
			doc := find(docs, tt.kind, tt.dname)
			if doc == nil {
				t.Fatalf("no %s %s", tt.kind, tt.dname)
			}
			if r, ok := tt.value.([2]string); ok {
				// A change of config.yaml, whose key is no path for setPath: only package config
				// can see it, the ports and names stay.
				data := doc["data"].(map[string]any)
				text := data["config.yaml"].(string)
				if !strings.Contains(text, r[0]) {
					t.Fatalf("config.yaml has no %q", r[0])
				}
				data["config.yaml"] = strings.Replace(text, r[0], r[1], 1)
			} else if err := setPath(doc.tree(), tt.path, tt.value); err != nil {
				t.Fatal(err)
			}
			errs := checkManifests(docs)
			if !mentions(errs, tt.want) {
				t.Errorf("errors %v, want one mentioning %q", errs, tt.want)
			}
		})
	}
}

// object is one Kubernetes object of the manifests.
type object map[string]any

// tree returns o as the any setPath walks.
func (o object) tree() any { return map[string]any(o) }

// kind, name and namespace of the object.
func (o object) kind() string      { return str(o, "kind") }
func (o object) name() string      { return str(o, "metadata.name") }
func (o object) namespace() string { return str(o, "metadata.namespace") }

// loadManifests reads every document of kubernetes/*.yaml.
func loadManifests() ([]object, error) {
	files, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, errors.New("no kubernetes/*.yaml")
	}
	var docs []object
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		for {
			var doc map[string]any
			err := dec.Decode(&doc)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			if doc == nil {
				continue // an empty document
			}
			docs = append(docs, object(doc))
		}
	}
	return docs, nil
}

// find returns the object of that kind and name, or nil.
func find(docs []object, kind, name string) object {
	for _, d := range docs {
		if d.kind() == kind && d.name() == name {
			return d
		}
	}
	return nil
}

// get returns the value at a dotted path of maps and list indexes, or nil.
func get(tree any, p string) any {
	node := tree
	if o, ok := node.(object); ok {
		node = map[string]any(o)
	}
	for part := range strings.SplitSeq(p, ".") {
		switch n := node.(type) {
		case map[string]any:
			node = n[part]
		case []any:
			i, err := strconv.Atoi(part)
			if err != nil || i < 0 || i >= len(n) {
				return nil
			}
			node = n[i]
		default:
			return nil
		}
	}
	return node
}

// str is the string at p, or "".
func str(tree any, p string) string {
	s, _ := get(tree, p).(string)
	return s
}

// num is the integer at p, or -1.
func num(tree any, p string) int {
	n, ok := get(tree, p).(int)
	if !ok {
		return -1
	}
	return n
}

// addrPort is the port of a host:port address of the kvroute configuration, or -1.
func addrPort(addr string) int {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(port)
	if err != nil {
		return -1
	}
	return n
}

// checkManifests checks the manifests: the objects expected are there, the configuration parses
// with package config, and the ports, names and selectors the objects share agree.
func checkManifests(docs []object) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	var have []string
	for _, d := range docs {
		have = append(have, d.kind()+"/"+d.name())
		if d.namespace() != "default" {
			fail("%s %s: namespace %q, want default", d.kind(), d.name(), d.namespace())
		}
	}
	slices.Sort(have)
	want := []string{
		"ConfigMap/kvroute-epp", "Deployment/kvroute-epp", "HTTPRoute/vllm-llama",
		"InferencePool/vllm-llama", "Service/kvroute-epp", "Service/vllm-llama",
	}
	if !slices.Equal(have, want) {
		return append(errs, fmt.Errorf("objects %v, want %v", have, want))
	}
	cm := find(docs, "ConfigMap", "kvroute-epp")
	dep := find(docs, "Deployment", "kvroute-epp")
	eppSvc := find(docs, "Service", "kvroute-epp")
	poolSvc := find(docs, "Service", "vllm-llama")
	pool := find(docs, "InferencePool", "vllm-llama")
	route := find(docs, "HTTPRoute", "vllm-llama")

	// The kvroute configuration: package config must accept it; the ports and names compared
	// below are read from the YAML itself.
	data, _ := get(cm, "data").(map[string]any)
	cfgText, _ := data["config.yaml"].(string) // a key with a dot: not a path for str
	if cfgText == "" {
		fail("ConfigMap kvroute-epp: no config.yaml")
	}
	if _, err := config.Parse([]byte(cfgText), nil); err != nil {
		fail("ConfigMap kvroute-epp config.yaml: config.Parse: %v", err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(cfgText), &cfg); err != nil {
		return append(errs, fmt.Errorf("ConfigMap kvroute-epp config.yaml: %w", err))
	}
	grpcPort := addrPort(str(cfg, "endpoint_picker.grpc_address"))
	healthPort := addrPort(str(cfg, "endpoint_picker.health_address"))
	metricsPort := addrPort(str(cfg, "endpoint_picker.metrics_address"))
	discoveryPort := num(cfg, "endpoint_picker.discovery.port")
	for name, p := range map[string]int{"grpc_address": grpcPort, "health_address": healthPort, "metrics_address": metricsPort, "discovery.port": discoveryPort} {
		if p <= 0 {
			fail("config.yaml: endpoint_picker.%s has no port", name)
		}
	}
	for _, a := range []string{"grpc_address", "health_address", "metrics_address"} {
		if host, _, _ := net.SplitHostPort(str(cfg, "endpoint_picker."+a)); host != "0.0.0.0" {
			fail("config.yaml: endpoint_picker.%s listens on %q: other pods could not reach it (want 0.0.0.0)", a, host)
		}
	}
	if got, want := str(cfg, "endpoint_picker.discovery.dns_name"), poolSvc.name()+"."+poolSvc.namespace()+".svc.cluster.local"; got != want {
		fail("config.yaml: discovery.dns_name %q, want the headless Service's %q", got, want)
	}

	checkDeployment(dep, cm, grpcPort, healthPort, metricsPort, fail)

	// Kubernetes kills the pod terminationGracePeriodSeconds after SIGTERM: kvroute-epp's drain
	// (server.shutdown_timeout) must end before.
	drain := config.DefaultShutdownTimeout
	if s := str(cfg, "server.shutdown_timeout"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			fail("config.yaml: server.shutdown_timeout %q: %v", s, err)
		}
		drain = d
	}
	if grace := num(dep, "spec.template.spec.terminationGracePeriodSeconds"); time.Duration(grace)*time.Second <= drain {
		fail("Deployment kvroute-epp: terminationGracePeriodSeconds %d does not outlast server.shutdown_timeout %v", grace, drain)
	}
	checkEPPService(eppSvc, dep, pool, grpcPort, fail)

	// The headless Service kvroute-epp resolves, and the InferencePool, select the same pods.
	if ip := get(poolSvc, "spec.clusterIP"); ip != "None" {
		fail("Service vllm-llama: clusterIP %v, want None (headless: DNS must answer with the pods' IPs)", ip)
	}
	if p := get(poolSvc, "spec.publishNotReadyAddresses"); p != false {
		fail("Service vllm-llama: publishNotReadyAddresses %v, want false", p)
	}
	if !sameStrings(get(poolSvc, "spec.selector"), get(pool, "spec.selector.matchLabels")) {
		fail("Service vllm-llama selector %v differs from the InferencePool's selector %v",
			get(poolSvc, "spec.selector"), get(pool, "spec.selector.matchLabels"))
	}

	if v := str(pool, "apiVersion"); v != "inference.networking.k8s.io/v1" {
		fail("InferencePool: apiVersion %q, want inference.networking.k8s.io/v1", v)
	}
	for _, err := range checkPoolSchema(get(pool, "spec")) {
		fail("InferencePool: %v", err)
	}
	if p := num(pool, "spec.targetPorts.0.number"); p != discoveryPort {
		fail("InferencePool: targetPorts[0] %d, want config.yaml's discovery.port %d", p, discoveryPort)
	}

	found := false
	for _, rule := range asList(get(route, "spec.rules")) {
		for _, ref := range asList(get(rule, "backendRefs")) {
			if str(ref, "group") == "inference.networking.k8s.io" && str(ref, "kind") == "InferencePool" && str(ref, "name") == pool.name() {
				found = true
			}
		}
	}
	if !found {
		fail("HTTPRoute vllm-llama: no backendRef to InferencePool %s (group inference.networking.k8s.io)", pool.name())
	}
	return errs
}

// checkDeployment checks kvroute-epp's Deployment: it reads the ConfigMap's config.yaml, exposes
// the configuration's ports, is probed on the health port's liveness and readiness services and
// runs without root and with a read-only root file system.
func checkDeployment(dep, cm object, grpcPort, healthPort, metricsPort int, fail func(string, ...any)) {
	pod := get(dep, "spec.template")
	if !subset(get(dep, "spec.selector.matchLabels"), get(pod, "metadata.labels")) {
		fail("Deployment kvroute-epp: selector does not match its pod labels")
	}
	containers := asList(get(pod, "spec.containers"))
	if len(containers) != 1 {
		fail("Deployment kvroute-epp: %d containers, want 1", len(containers))
		return
	}
	c := containers[0]

	// -config names a file of the ConfigMap through its volume.
	args := asList(get(c, "args"))
	i := slices.Index(args, any("-config"))
	if i < 0 || i+1 >= len(args) {
		fail("Deployment kvroute-epp: no -config argument")
	} else {
		file, _ := args[i+1].(string)
		mounted := false
		for _, vm := range asList(get(c, "volumeMounts")) {
			if str(vm, "mountPath") != path.Dir(file) {
				continue
			}
			for _, v := range asList(get(pod, "spec.volumes")) {
				if str(v, "name") == str(vm, "name") && str(v, "configMap.name") == cm.name() {
					_, mounted = get(cm, "data").(map[string]any)[path.Base(file)]
				}
			}
		}
		if !mounted {
			fail("Deployment kvroute-epp: -config %s is no key of ConfigMap %s mounted at %s", file, cm.name(), path.Dir(file))
		}
	}

	ports := map[int]bool{}
	for _, p := range asList(get(c, "ports")) {
		ports[num(p, "containerPort")] = true
	}
	for _, p := range []int{grpcPort, healthPort, metricsPort} {
		if !ports[p] {
			fail("Deployment kvroute-epp: no containerPort %d", p)
		}
	}
	for probe, service := range map[string]string{"livenessProbe": "liveness", "readinessProbe": "readiness"} {
		if p, s := num(c, probe+".grpc.port"), str(c, probe+".grpc.service"); p != healthPort || s != service {
			fail("Deployment kvroute-epp: %s grpc port %d service %q, want health_address's port %d and %q", probe, p, s, healthPort, service)
		}
	}
	if get(pod, "spec.securityContext.runAsNonRoot") != true {
		fail("Deployment kvroute-epp: runAsNonRoot is not true")
	}
	if get(c, "securityContext.readOnlyRootFilesystem") != true {
		fail("Deployment kvroute-epp: readOnlyRootFilesystem is not true")
	}
	if get(c, "securityContext.allowPrivilegeEscalation") != false {
		fail("Deployment kvroute-epp: allowPrivilegeEscalation is not false")
	}
}

// checkEPPService checks the Service the InferencePool's endpointPickerRef names: its port is
// the ref's, reaches the container's gRPC port and says h2c (gRPC without TLS).
func checkEPPService(svc, dep, pool object, grpcPort int, fail func(string, ...any)) {
	if ref := str(pool, "spec.endpointPickerRef.name"); ref != svc.name() {
		fail("InferencePool: endpointPickerRef names %q, want Service %q", ref, svc.name())
	}
	if k := str(pool, "spec.endpointPickerRef.kind"); k != "" && k != "Service" {
		fail("InferencePool: endpointPickerRef kind %q, want Service", k)
	}
	if !subset(get(svc, "spec.selector"), get(dep, "spec.template.metadata.labels")) {
		fail("Service kvroute-epp: selector does not match the Deployment's pods")
	}
	refPort := num(pool, "spec.endpointPickerRef.port.number")
	if refPort != grpcPort {
		fail("InferencePool: endpointPickerRef port %d, want config.yaml's grpc_address port %d", refPort, grpcPort)
	}
	var sp any
	for _, p := range asList(get(svc, "spec.ports")) {
		if num(p, "port") == refPort {
			sp = p
		}
	}
	if sp == nil {
		fail("Service kvroute-epp: no port %d, the endpointPickerRef port", refPort)
		return
	}
	// targetPort is a number or the name of a container port.
	target := num(sp, "targetPort")
	if name := str(sp, "targetPort"); name != "" {
		target = -1
		for _, p := range asList(get(dep, "spec.template.spec.containers.0.ports")) {
			if str(p, "name") == name {
				target = num(p, "containerPort")
			}
		}
	}
	if target != grpcPort {
		fail("Service kvroute-epp: port %d's targetPort %v reaches container port %d, want %d", refPort, get(sp, "targetPort"), target, grpcPort)
	}
	if ap := str(sp, "appProtocol"); ap != "kubernetes.io/h2c" {
		fail("Service kvroute-epp: port %d appProtocol %q, want kubernetes.io/h2c", refPort, ap)
	}
}

// poolFields are the fields of an InferencePool's spec in the v1 CRD of the Gateway API
// Inference Extension (config/crd/bases/inference.networking.k8s.io_inferencepools.yaml,
// openAPIV3Schema), "[]" marking a list's elements; selector.matchLabels is a map of strings.
var poolFields = map[string]bool{
	"appProtocol":                   true,
	"endpointPickerRef":             true,
	"endpointPickerRef.failureMode": true,
	"endpointPickerRef.group":       true,
	"endpointPickerRef.kind":        true,
	"endpointPickerRef.name":        true,
	"endpointPickerRef.port":        true,
	"endpointPickerRef.port.number": true,
	"selector":                      true,
	"selector.matchLabels":          true,
	"targetPorts":                   true,
	"targetPorts[]":                 true,
	"targetPorts[].number":          true,
}

// checkPoolSchema checks an InferencePool spec against the v1 schema: only its fields, the
// required ones present, the enums' values and the port ranges.
func checkPoolSchema(spec any) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	var walk func(node any, p string)
	walk = func(node any, p string) {
		if p != "" && !poolFields[p] {
			fail("spec.%s is not a field of InferencePool v1", p)
			return
		}
		if p == "selector.matchLabels" {
			m, ok := node.(map[string]any)
			if !ok || len(m) == 0 {
				fail("spec.selector.matchLabels must be a non-empty map")
			}
			for k, v := range m {
				if _, ok := v.(string); !ok {
					fail("spec.selector.matchLabels.%s is not a string", k)
				}
			}
			return
		}
		switch n := node.(type) {
		case map[string]any:
			for k, v := range n {
				walk(v, strings.TrimPrefix(p+"."+k, "."))
			}
		case []any:
			for _, v := range n {
				walk(v, p+"[]")
			}
		}
	}
	walk(spec, "")

	for _, req := range []string{"selector.matchLabels", "targetPorts", "endpointPickerRef.name"} {
		if get(spec, req) == nil {
			fail("spec.%s is required", req)
		}
	}
	ports := asList(get(spec, "targetPorts"))
	if len(ports) < 1 || len(ports) > 8 {
		fail("spec.targetPorts has %d ports, want 1 to 8", len(ports))
	}
	for i, p := range ports {
		if n := num(p, "number"); n < 1 || n > 65535 {
			fail("spec.targetPorts[%d].number %v is not a port", i, get(p, "number"))
		}
	}
	// port is required when kind is Service, its default.
	if k := str(spec, "endpointPickerRef.kind"); k == "" || k == "Service" {
		if n := num(spec, "endpointPickerRef.port.number"); n < 1 || n > 65535 {
			fail("spec.endpointPickerRef.port.number %v: a Service reference needs a port", get(spec, "endpointPickerRef.port.number"))
		}
	}
	if fm := get(spec, "endpointPickerRef.failureMode"); fm != nil && fm != "FailOpen" && fm != "FailClose" {
		fail("spec.endpointPickerRef.failureMode %v, want FailOpen or FailClose", fm)
	}
	if ap := get(spec, "appProtocol"); ap != nil && ap != "http" && ap != "kubernetes.io/h2c" {
		fail("spec.appProtocol %v, want http or kubernetes.io/h2c", ap)
	}
	return errs
}

// asList is v as a list, or nil.
func asList(v any) []any {
	l, _ := v.([]any)
	return l
}

// subset reports whether the labels of sel are all in labels (a selector with none selects
// nothing here).
func subset(sel, labels any) bool {
	s, ok := sel.(map[string]any)
	l, ok2 := labels.(map[string]any)
	if !ok || !ok2 || len(s) == 0 {
		return false
	}
	for k, v := range s {
		if l[k] != v {
			return false
		}
	}
	return true
}

// sameStrings reports whether two label maps are equal and non-empty.
func sameStrings(a, b any) bool {
	return subset(a, b) && subset(b, a)
}

// TestREADMEConfigs parses every YAML block of the module's README with package config, so that
// the configuration the README shows is one kvroute-epp accepts.
func TestREADMEConfigs(t *testing.T) {
	data, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := yamlBlocks(string(data))
	if len(blocks) == 0 {
		t.Fatal("the README has no yaml block")
	}
	for i, b := range blocks {
		if _, err := config.Parse([]byte(b), nil); err != nil {
			t.Errorf("README yaml block %d: %v\n%s", i+1, err, b)
		}
	}
}

// yamlBlocks returns the contents of the ```yaml fenced blocks of a Markdown text.
func yamlBlocks(md string) []string {
	var out []string
	for {
		start := strings.Index(md, "```yaml\n")
		if start < 0 {
			return out
		}
		md = md[start+len("```yaml\n"):]
		end := strings.Index(md, "```")
		if end < 0 {
			return out
		}
		out = append(out, md[:end])
		md = md[end:]
	}
}
