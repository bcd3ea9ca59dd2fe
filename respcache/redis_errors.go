package respcache

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/minio/minio-go/v7"
	"github.com/redis/rueidis"
)

// This file holds what the remote stores (Redis, S3) and the tiered store share: the error
// classification behind StoreStats.Errors and the errors metrics, and secret redaction.

// Error types, the keys of StoreStats.Errors and RedisStats.Errors and the values of the errors
// metrics' "type" attribute.
const (
	ErrorTypeConnection = "connection" // refused, reset, closed, DNS, server not ready (LOADING…)
	ErrorTypeTimeout    = "timeout"    // a store's own deadline (command or operation timeout)
	ErrorTypeOther      = "other"      // everything else: a server error reply, a bad response
)

// errKind classifies a store error. kindCanceled is the caller's cancellation: never counted, never a
// reason to fall back.
type errKind uint8

const (
	kindNone errKind = iota
	kindConnection
	kindTimeout
	kindOther
	kindCanceled
	numKinds
)

func (k errKind) String() string {
	switch k {
	case kindConnection:
		return ErrorTypeConnection
	case kindTimeout:
		return ErrorTypeTimeout
	case kindOther:
		return ErrorTypeOther
	case kindCanceled:
		return "canceled"
	}
	return ""
}

// unavailable reports whether the error means the store cannot be reached (connection or timeout).
func (k errKind) unavailable() bool { return k == kindConnection || k == kindTimeout }

// classify sorts err into an errKind. Order matters: a caller's cancellation first, then deadlines
// (net timeouts included), then server replies (Redis error replies and S3 error responses are
// "other" unless they say the server is not ready), then transport failures.
func classify(err error) errKind {
	if err == nil {
		return kindNone
	}
	if errors.Is(err, context.Canceled) {
		return kindCanceled
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return kindTimeout
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return kindTimeout
	}
	if re, ok := rueidis.IsRedisErr(err); ok {
		// A server that is up but cannot serve yet is an outage, not a bad request.
		msg := re.Error()
		for _, p := range [...]string{"LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "BUSY "} {
			if strings.HasPrefix(msg, p) {
				return kindConnection
			}
		}
		return kindOther
	}
	var er minio.ErrorResponse
	if errors.As(err, &er) && er.StatusCode != 0 {
		if er.StatusCode == 502 || er.StatusCode == 503 || er.StatusCode == 504 {
			return kindConnection
		}
		return kindOther
	}
	if errors.Is(err, ErrUnavailable) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, rueidis.ErrClosing) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH) {
		return kindConnection
	}
	var oe *net.OpError
	var de *net.DNSError
	if errors.As(err, &oe) || errors.As(err, &de) {
		return kindConnection
	}
	return kindOther
}

// errCounts counts errors by kind; safe for concurrent use.
type errCounts [numKinds]atomic.Uint64

func (c *errCounts) add(k errKind) {
	if k != kindNone && k != kindCanceled {
		c[k].Add(1)
	}
}

// snapshot returns the counts as the Errors map of StoreStats (every type present, zeros included).
func (c *errCounts) snapshot() map[string]uint64 {
	return map[string]uint64{
		ErrorTypeConnection: c[kindConnection].Load(),
		ErrorTypeTimeout:    c[kindTimeout].Load(),
		ErrorTypeOther:      c[kindOther].Load(),
	}
}

// redactedError hides secrets (a password, S3 keys) that a dependency might echo in an error
// message. Error replaces each secret with "[REDACTED]"; Unwrap keeps errors.Is/As working.
type redactedError struct {
	err     error
	secrets []string
}

func (e *redactedError) Error() string {
	msg := e.err.Error()
	for _, s := range e.secrets {
		if s != "" {
			msg = strings.ReplaceAll(msg, s, "[REDACTED]")
		}
	}
	return msg
}

func (e *redactedError) Unwrap() error { return e.err }

// redact wraps err so that its message cannot carry any of secrets; nil stays nil, and err is
// returned as is when there is no secret.
func redact(err error, secrets []string) error {
	if err == nil || len(secrets) == 0 {
		return err
	}
	return &redactedError{err: err, secrets: secrets}
}

// secretList returns the non-empty secrets.
func secretList(secrets ...string) []string {
	var out []string
	for _, s := range secrets {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// presence describes a secret without revealing it.
func presence(secret string) string {
	if secret == "" {
		return `""`
	}
	return "[REDACTED]"
}
