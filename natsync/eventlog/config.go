package eventlog

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Defaults of Config.
const (
	DefaultStream        = "KVROUTE_KV_EVENTS"
	DefaultSubjectPrefix = "kvroute.kv"
	DefaultBucket        = "KVROUTE_KV_SNAPSHOTS"
	DefaultFleet         = "default"
	DefaultMaxAge        = time.Hour
	DefaultMaxBytes      = 1 << 30 // 1 GiB
	DefaultReplicas      = 1
	// DefaultDuplicates is the stream's deduplication window (JetStream's default).
	DefaultDuplicates = 2 * time.Minute
	// DefaultRetryInterval is the pause before the Publisher, Consumer and Snapshotter retry an
	// operation that failed on the server (creating the stream, subscribing).
	DefaultRetryInterval = time.Second
)

// Errors callers branch on.
var (
	// ErrInvalidConfig is wrapped by the constructors' errors for a configuration they reject.
	ErrInvalidConfig = errors.New("eventlog: invalid config")
	// ErrClosed is returned by methods called after Close.
	ErrClosed = errors.New("eventlog: closed")
	// ErrStarted is returned by a second Start.
	ErrStarted = errors.New("eventlog: already started")
)

// Config names one fleet's event log: the JetStream stream its KV events go to, the Object Store
// bucket and object of its index snapshots, the stream's limits, and the telemetry of every part
// (Publisher, Consumer, Snapshotter, Restore, Reset). Its zero value, but for JetStream, means
// the Default* constants. Every part of one fleet, in every process, uses the same Stream,
// SubjectPrefix, Bucket and Fleet.
type Config struct {
	// JetStream is the caller's JetStream handle (jetstream.New on a *nats.Conn); required. The
	// caller owns the connection: give it unlimited reconnects (nats.MaxReconnects(-1)) so that
	// the parts resume after a server restart.
	JetStream jetstream.JetStream
	// Stream is the stream's name (DefaultStream when ""); SubjectPrefix its subjects' prefix
	// (DefaultSubjectPrefix): a backend's messages go to <SubjectPrefix>.<SubjectToken(backend)>,
	// and the stream holds <SubjectPrefix>.>.
	Stream        string
	SubjectPrefix string
	// Bucket is the Object Store bucket of snapshots (DefaultBucket), Fleet the name of this
	// fleet's snapshot object in it (DefaultFleet).
	Bucket string
	Fleet  string
	// MaxAge (DefaultMaxAge) and MaxBytes (DefaultMaxBytes) bound the stream: older messages are
	// discarded first. Replicas is the stream's and the bucket's replication factor (1 to 5,
	// DefaultReplicas); Duplicates the stream's deduplication window (DefaultDuplicates). The
	// Publisher creates or updates the stream with them; the bucket is created by the first
	// snapshot. Both use file storage.
	MaxAge     time.Duration
	MaxBytes   int64
	Replicas   int
	Duplicates time.Duration
	// Logger receives warnings and errors (slog.Default() when nil).
	Logger *slog.Logger
	// MeterProvider receives the parts' metrics (none when nil).
	MeterProvider metric.MeterProvider
	// Now is the clock of stats and snapshot times (time.Now when nil).
	Now func() time.Time
}

// withDefaults validates c and fills in its defaults.
func (c Config) withDefaults() (Config, error) {
	invalid := func(format string, args ...any) (Config, error) {
		return c, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if c.JetStream == nil {
		return invalid("JetStream is nil")
	}
	if c.Stream == "" {
		c.Stream = DefaultStream
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = DefaultSubjectPrefix
	}
	if c.Bucket == "" {
		c.Bucket = DefaultBucket
	}
	if c.Fleet == "" {
		c.Fleet = DefaultFleet
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = DefaultMaxBytes
	}
	if c.Replicas == 0 {
		c.Replicas = DefaultReplicas
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = noop.NewMeterProvider()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	switch {
	case !validName(c.Stream):
		return invalid("Stream %q: want letters, digits, '-' and '_'", c.Stream)
	case !validName(c.Bucket):
		return invalid("Bucket %q: want letters, digits, '-' and '_'", c.Bucket)
	case !validPrefix(c.SubjectPrefix):
		return invalid("SubjectPrefix %q: want dot-separated tokens without wildcards", c.SubjectPrefix)
	case c.MaxAge < 0:
		return invalid("MaxAge %v < 0", c.MaxAge)
	case c.MaxBytes < 0:
		return invalid("MaxBytes %d < 0", c.MaxBytes)
	case c.Replicas < 1 || c.Replicas > 5:
		return invalid("Replicas %d not in [1, 5]", c.Replicas)
	case c.Duplicates < 0 || (c.MaxAge > 0 && c.Duplicates > c.MaxAge):
		return invalid("Duplicates %v not in [0, MaxAge]", c.Duplicates)
	}
	return c, nil
}

// validName reports whether s is a stream or bucket name we accept.
func validName(s string) bool {
	if s == "" || len(s) > 255 {
		return false
	}
	for i := range len(s) {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// validPrefix reports whether s is a literal subject of non-empty tokens.
func validPrefix(s string) bool {
	if s == "" || len(s) > 255 {
		return false
	}
	for tok := range strings.SplitSeq(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n*>") {
			return false
		}
	}
	return true
}

// streamConfig is the stream the Publisher creates or updates.
func (c *Config) streamConfig() jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        c.Stream,
		Description: "kvroute KV events (package natsync/eventlog)",
		Subjects:    []string{c.SubjectPrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     jetstream.FileStorage,
		MaxAge:      c.MaxAge,
		MaxBytes:    c.MaxBytes,
		MaxMsgSize:  MaxMessageBytes,
		Replicas:    c.Replicas,
		Duplicates:  c.Duplicates,
	}
}

// bucketConfig is the Object Store bucket the Snapshotter creates or updates.
func (c *Config) bucketConfig() jetstream.ObjectStoreConfig {
	return jetstream.ObjectStoreConfig{
		Bucket:      c.Bucket,
		Description: "kvroute KV index snapshots (package natsync/eventlog)",
		Storage:     jetstream.FileStorage,
		Replicas:    c.Replicas,
	}
}

// subject returns backend's subject.
func (c *Config) subject(backend string) string { return c.SubjectPrefix + "." + SubjectToken(backend) }

// SubjectToken returns backend's subject token: backend with every byte other than ASCII letters,
// digits, '-' and '_' written as '~' and two lowercase hex digits ("10.0.0.1:8000" becomes
// "10~2e0~2e0~2e1~3a8000"), and "~" for the empty name. It is injective, so that the subject
// names one backend, and a token NATS accepts (no '.', '*', '>' or white space).
func SubjectToken(backend string) string {
	if backend == "" {
		return "~"
	}
	plain := true
	for i := range len(backend) {
		if !plainByte(backend[i]) {
			plain = false
			break
		}
	}
	if plain {
		return backend
	}
	const hex = "0123456789abcdef"
	var sb strings.Builder
	sb.Grow(len(backend) + 8)
	for i := range len(backend) {
		c := backend[i]
		if plainByte(c) {
			sb.WriteByte(c)
			continue
		}
		sb.WriteByte('~')
		sb.WriteByte(hex[c>>4])
		sb.WriteByte(hex[c&15])
	}
	return sb.String()
}

// ParseSubjectToken inverts SubjectToken; ok is false for a token SubjectToken does not return.
func ParseSubjectToken(tok string) (backend string, ok bool) {
	if tok == "~" {
		return "", true
	}
	if tok == "" {
		return "", false
	}
	var sb strings.Builder
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if plainByte(c) {
			sb.WriteByte(c)
			continue
		}
		if c != '~' || i+2 >= len(tok) {
			return "", false
		}
		hi, ok1 := unhex(tok[i+1])
		lo, ok2 := unhex(tok[i+2])
		if !ok1 || !ok2 || plainByte(hi<<4|lo) {
			return "", false
		}
		sb.WriteByte(hi<<4 | lo)
		i += 2
	}
	return sb.String(), true
}

func plainByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

// sleepCtx waits d or until ctx or stop ends; it reports whether the wait completed.
func sleepCtx(ctx context.Context, stop <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-stop:
		return false
	}
}

// counterSpec is one observable counter or gauge of a part's metrics.
type counterSpec struct {
	name, desc, unit string
	gauge            bool
	value            func() int64
}

// registerMetrics registers specs on mp's meter for scopeName, with attrs on every observation;
// the registration is unregistered by the part's Close.
func registerMetrics(mp metric.MeterProvider, opt metric.ObserveOption, specs []counterSpec) (metric.Registration, error) {
	meter := mp.Meter(scopeName)
	obs := make([]metric.Observable, len(specs))
	for i, s := range specs {
		var err error
		if s.gauge {
			obs[i], err = meter.Int64ObservableGauge(s.name, metric.WithDescription(s.desc), metric.WithUnit(s.unit))
		} else {
			obs[i], err = meter.Int64ObservableCounter(s.name, metric.WithDescription(s.desc), metric.WithUnit(s.unit))
		}
		if err != nil {
			return nil, fmt.Errorf("eventlog: metric %s: %w", s.name, err)
		}
	}
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for i, s := range specs {
			switch inst := obs[i].(type) {
			case metric.Int64ObservableGauge:
				o.ObserveInt64(inst, s.value(), opt)
			case metric.Int64ObservableCounter:
				o.ObserveInt64(inst, s.value(), opt)
			}
		}
		return nil
	}, obs...)
	if err != nil {
		return nil, fmt.Errorf("eventlog: metric callback: %w", err)
	}
	return reg, nil
}
