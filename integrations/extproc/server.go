package extproc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/kvroute/kvroute"
	"github.com/kvroute/kvroute/kvhttp"
)

// The names the Endpoint Picker Protocol gives its header and metadata keys, and the default
// namespaces of its metadata.
const (
	// HeaderDestination is the request header that carries the picked endpoints to Envoy
	// ("ip:port", then the fallbacks, comma-separated); also the key of the picked endpoints in
	// the dynamic metadata.
	HeaderDestination = "x-gateway-destination-endpoint"
	// KeySubset is the key of the proxy's subset hint, the endpoints the picker must choose from,
	// in the request's filter metadata.
	KeySubset = "x-gateway-destination-endpoint-subset"
	// KeyServed is the key of the endpoint that served the request, in the response's metadata.
	KeyServed = "x-gateway-destination-endpoint-served"
	// DefaultDestinationNamespace is the dynamic-metadata namespace of the picked endpoints and
	// of the served endpoint.
	DefaultDestinationNamespace = "envoy.lb"
	// DefaultSubsetNamespace is the filter-metadata namespace of the subset hint.
	DefaultSubsetNamespace = "envoy.lb.subset_hint"
	// MaxFallbacks bounds Config.Fallbacks.
	MaxFallbacks = 8
)

// FailureMode is what the picker does when the Router fails to decide for a reason other than
// having no eligible endpoint (which is always a 503, as the protocol prescribes).
type FailureMode uint8

const (
	// FailClosed answers the request 503 itself (the default).
	FailClosed FailureMode = iota
	// FailOpen sends the request to an eligible endpoint in turn, without kvroute's choice.
	FailOpen
)

// BodyMode is how Envoy sends a request or response body to the picker: the ext_proc filter's
// processing_mode. Envoy names its mode in the first message of each stream (protocol_config);
// Config.BodyMode is used only when it does not (Envoy before 1.35).
type BodyMode uint8

const (
	// BodyFullDuplex is FULL_DUPLEX_STREAMED, the mode the Endpoint Picker Protocol requires:
	// Envoy streams the body and waits for the picker's headers response, which the picker sends
	// once it has read the whole body, with the body after it.
	BodyFullDuplex BodyMode = iota
	// BodyBuffered is BUFFERED (or BUFFERED_PARTIAL): Envoy sends the body in one message after
	// the picker answered the headers, and holds the headers until the body's answer, which
	// carries the picked endpoint.
	BodyBuffered
	// BodyStreamed is STREAMED: Envoy sends the body in chunks after the headers were answered, so
	// the picker chooses from the headers alone (as for NONE).
	BodyStreamed
	// BodyNone is NONE: Envoy does not send the body; the picker chooses from the headers alone.
	BodyNone
)

// DefaultMaxBodyBytes is Config.MaxBodyBytes's default: the reference proxy's.
const DefaultMaxBodyBytes = kvhttp.DefaultMaxBodyBytes

// DefaultBodyIdleTimeout is Config.BodyIdleTimeout's default and DefaultReadTimeout
// Config.ReadTimeout's: the reference proxy's.
const (
	DefaultBodyIdleTimeout = kvhttp.DefaultBodyIdleTimeout
	DefaultReadTimeout     = kvhttp.DefaultReadTimeout
)

// Config configures a Server. Router and Endpoints are required; every other field's zero value
// is a documented default.
type Config struct {
	// Router routes each request. Each backend it names must be in Endpoints; a decision on a
	// backend that is not (or outside the subset hint) is released, and the request goes to an
	// eligible endpoint in turn, counted in Stats.FailedOpen (503 when there is none). The default Router honours the subset
	// hint through kvroute.WithAvoid; a Router of your own should read kvroute.Avoided too, or the
	// Server sends the request to the first endpoint of the subset it may use.
	Router kvroute.Router
	// Endpoints maps the Router's backends to the endpoints Envoy connects to.
	Endpoints *Endpoints
	// InRotation, when set, reports whether a backend may take requests (health.Monitor's
	// InRotation): fallback endpoints and FailOpen's picks skip those out of it. nil means all do.
	InRotation func(backend string) bool
	// FailureMode is what happens when the Router fails to decide (default FailClosed).
	FailureMode FailureMode
	// Fallbacks is how many endpoints follow the picked one in the destination header, for Envoy
	// to try in order when it retries (0..MaxFallbacks; default 0: the picked endpoint alone).
	// They are the other backends holding the most of the request's KV cache, then the rest in a
	// turn that depends on the request's prefix key, so that the retries of one conversation go to
	// the same place.
	Fallbacks int
	// MaxBodyBytes caps a request body; a longer one is answered 413 (default DefaultMaxBodyBytes).
	MaxBodyBytes int64
	// BodyBudget, when set, bounds the request-body bytes all streams hold at once (share one with
	// the rest of the process), as kvhttp.Handler does: a body past 64 KiB may not take its last
	// quarter (kvhttp.Budget.AcquireBody), and a body that finds no room within a second is
	// answered 503.
	BodyBudget *kvhttp.Budget
	// BodyIdleTimeout bounds the wait for a request's headers, and then between two chunks of
	// its body that carry bytes (but in buffered mode, where Envoy gathers the body first): a
	// request whose body stops coming is answered 408 and its stream ended (default
	// DefaultBodyIdleTimeout; negative: no bound). ReadTimeout bounds the whole request phase,
	// from the stream's start to the body's end, the same way, whatever the body mode (default
	// DefaultReadTimeout; negative: no bound). The wait for the engine's answer is not bounded.
	BodyIdleTimeout time.Duration
	ReadTimeout     time.Duration
	// BodyMode is the request and response body mode assumed when Envoy does not name its own
	// (default BodyFullDuplex).
	BodyMode BodyMode
	// DestinationNamespace is the metadata namespace of the picked and served endpoints (default
	// DefaultDestinationNamespace); SubsetNamespace that of the subset hint (default
	// DefaultSubsetNamespace).
	DestinationNamespace string
	SubsetNamespace      string
	// Logger receives the Server's logs; nil discards them.
	Logger *slog.Logger
	// MeterProvider receives the Server's metrics (kvroute.epp.*); nil means none.
	MeterProvider metric.MeterProvider
}

// Server is kvroute's endpoint picker: an Envoy external processor (ext_proc.v3) that routes each
// request with a kvroute Router. Register it on a grpc.Server with
// extprocv3.RegisterExternalProcessorServer. Each ext_proc stream is one HTTP request; the
// Server ends the request's Decision exactly once whatever ends the stream: the response's end,
// Envoy's reset, the client leaving, the grpc.Server's Stop. Safe for concurrent use.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg   Config
	log   *slog.Logger
	turn  atomic.Uint64 // FailOpen's and the fallbacks' rotation
	stats counters
	inst  *instruments // nil without a MeterProvider
}

// New returns a Server for cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Router == nil {
		return nil, errors.New("extproc: Config.Router is required")
	}
	if cfg.Endpoints == nil {
		return nil, errors.New("extproc: Config.Endpoints is required")
	}
	if cfg.Fallbacks < 0 || cfg.Fallbacks > MaxFallbacks {
		return nil, fmt.Errorf("extproc: Config.Fallbacks %d is outside 0..%d", cfg.Fallbacks, MaxFallbacks)
	}
	if cfg.FailureMode > FailOpen {
		return nil, fmt.Errorf("extproc: unknown FailureMode %d", cfg.FailureMode)
	}
	if cfg.BodyMode > BodyNone {
		return nil, fmt.Errorf("extproc: unknown BodyMode %d", cfg.BodyMode)
	}
	if cfg.MaxBodyBytes < 0 {
		return nil, fmt.Errorf("extproc: Config.MaxBodyBytes %d is negative", cfg.MaxBodyBytes)
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.BodyIdleTimeout == 0 {
		cfg.BodyIdleTimeout = DefaultBodyIdleTimeout
	}
	if cfg.ReadTimeout == 0 {
		cfg.ReadTimeout = DefaultReadTimeout
	}
	if cfg.DestinationNamespace == "" {
		cfg.DestinationNamespace = DefaultDestinationNamespace
	}
	if cfg.SubsetNamespace == "" {
		cfg.SubsetNamespace = DefaultSubsetNamespace
	}
	s := &Server{cfg: cfg, log: cfg.Logger}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if cfg.MeterProvider != nil {
		inst, err := newInstruments(cfg.MeterProvider, s)
		if err != nil {
			return nil, err
		}
		s.inst = inst
	}
	return s, nil
}

// Close releases the Server's metric callbacks. The streams in progress go on; stop them with the
// grpc.Server.
func (s *Server) Close() error {
	if s.inst != nil {
		return s.inst.reg.Unregister()
	}
	return nil
}

// Process implements extprocv3.ExternalProcessorServer: it serves one HTTP request's stream.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	st := newStream(s, srv)
	s.stats.streams.Add(1)
	defer s.stats.streams.Add(-1)
	defer st.finish()
	return st.run()
}

// Stats are the Server's counts since New.
type Stats struct {
	// Streams is the ext_proc streams open now.
	Streams int64 `json:"streams"`
	// Picked is the requests sent to an endpoint kvroute chose; FailedOpen those sent to an
	// endpoint in turn because the Router failed (FailOpen).
	Picked     uint64 `json:"picked"`
	FailedOpen uint64 `json:"failed_open"`
	// Answered counts the requests the picker answered itself, by status: 400 (a malformed body),
	// 408 (its body stopped coming), 413 (too large), 503 (no eligible endpoint, or the Router failed with FailClosed; a body
	// that found no room in the budget).
	Answered map[int]uint64 `json:"answered"`
	// Outcomes counts the ends reported to the Router: success, failure, refused (the engine's
	// 429 or 503), not_sent (the request never reached the engine, or the client left).
	Outcomes map[string]uint64 `json:"outcomes"`
	// ServedElsewhere is the requests Envoy served on a fallback endpoint.
	ServedElsewhere uint64 `json:"served_elsewhere"`
	// ProtocolErrors is the streams that broke the protocol (a message out of order).
	ProtocolErrors uint64 `json:"protocol_errors"`
	// IdleTimeouts is the streams ended because their request phase ran out of time
	// (Config.BodyIdleTimeout or ReadTimeout); those whose headers had come were answered 408.
	IdleTimeouts uint64 `json:"idle_timeouts"`
}

// counters are the atomics behind Stats.
type counters struct {
	streams                           atomic.Int64
	picked, failedOpen                atomic.Uint64
	answered400, answered408          atomic.Uint64
	answered413, answered503          atomic.Uint64
	success, failure, refused, unsent atomic.Uint64
	servedElsewhere, protocolErrors   atomic.Uint64
	idleTimeouts                      atomic.Uint64
}

// Stats returns the Server's counts.
func (s *Server) Stats() Stats {
	c := &s.stats
	return Stats{
		Streams: c.streams.Load(), Picked: c.picked.Load(), FailedOpen: c.failedOpen.Load(),
		Answered: map[int]uint64{400: c.answered400.Load(), 408: c.answered408.Load(), 413: c.answered413.Load(),
			503: c.answered503.Load()},
		Outcomes: map[string]uint64{"success": c.success.Load(), "failure": c.failure.Load(),
			"refused": c.refused.Load(), "not_sent": c.unsent.Load()},
		ServedElsewhere: c.servedElsewhere.Load(), ProtocolErrors: c.protocolErrors.Load(),
		IdleTimeouts: c.idleTimeouts.Load(),
	}
}

// countAnswer counts an answer the picker gave itself.
func (s *Server) countAnswer(status int) {
	switch status {
	case 400:
		s.stats.answered400.Add(1)
	case 408:
		s.stats.answered408.Add(1)
	case 413:
		s.stats.answered413.Add(1)
	default:
		s.stats.answered503.Add(1)
	}
}

// countOutcome counts an end reported to the Router.
func (s *Server) countOutcome(o kvroute.Outcome) {
	switch {
	case o.NotSent:
		s.stats.unsent.Add(1)
	case o.Refused:
		s.stats.refused.Add(1)
	case o.Err != nil:
		s.stats.failure.Add(1)
	default:
		s.stats.success.Add(1)
	}
}

// instruments are the Server's OpenTelemetry metrics.
type instruments struct {
	reg metric.Registration
}

func newInstruments(mp metric.MeterProvider, s *Server) (*instruments, error) {
	m := mp.Meter("github.com/kvroute/kvroute/integrations/extproc")
	streams, err := m.Int64ObservableGauge("kvroute.epp.streams", metric.WithDescription("ext_proc streams open"))
	if err != nil {
		return nil, err
	}
	picks, err := m.Int64ObservableCounter("kvroute.epp.requests", metric.WithDescription(
		"requests by how the endpoint picker ended their request phase: picked, failed_open, or the status it answered itself"))
	if err != nil {
		return nil, err
	}
	outcomes, err := m.Int64ObservableCounter("kvroute.epp.outcomes", metric.WithDescription(
		"request ends reported to the Router: success, failure, refused, not_sent"))
	if err != nil {
		return nil, err
	}
	reg, err := m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		st := s.Stats()
		o.ObserveInt64(streams, st.Streams)
		o.ObserveInt64(picks, int64(st.Picked), metric.WithAttributes(attrResult("picked")))
		o.ObserveInt64(picks, int64(st.FailedOpen), metric.WithAttributes(attrResult("failed_open")))
		for code, n := range st.Answered {
			o.ObserveInt64(picks, int64(n), metric.WithAttributes(attrResult(fmt.Sprintf("answered_%d", code))))
		}
		for name, n := range st.Outcomes {
			o.ObserveInt64(outcomes, int64(n), metric.WithAttributes(attrOutcome(name)))
		}
		return nil
	}, streams, picks, outcomes)
	if err != nil {
		return nil, err
	}
	return &instruments{reg: reg}, nil
}

// The gRPC health services the Endpoint Picker Protocol names: liveness (the process answers),
// readiness (it has its endpoints and routes), and the ext_proc service itself (as readiness).
// Register them with google.golang.org/grpc/health's server (see the package example).
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
	HealthExtProc   = "envoy.service.ext_proc.v3.ExternalProcessor"
)

// ServerOptions are the grpc.Server options a picker serving bodies of up to maxBodyBytes needs:
// a message size limit above it (Envoy sends a buffered body in one message, so a body above the
// limit still reaches the Server, which answers it 413, instead of failing the stream), and
// keepalives that end the connections of a gateway gone without a word.
func ServerOptions(maxBodyBytes int64) []grpc.ServerOption {
	if maxBodyBytes <= 0 {
		maxBodyBytes = DefaultMaxBodyBytes
	}
	limit := min(max(2*maxBodyBytes, 32<<20), math.MaxInt32)
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(int(limit)),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
}

// budgetWait bounds the wait of a body's growth for room in Config.BodyBudget.
const budgetWait = time.Second
