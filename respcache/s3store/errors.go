package s3store

import (
	"errors"
	"log/slog"
	"net/url"
	"strings"

	"github.com/minio/minio-go/v7"

	"github.com/kvroute/kvroute/respcache"
)

// errorType is respcache.ErrorTypeOf with S3's error responses: 502, 503 and 504 (a gateway or a
// server that cannot serve now) are connection errors, any other status is "other". It returns ""
// for the caller's cancellation.
func errorType(err error) string {
	switch typ := respcache.ErrorTypeOf(err); typ {
	case "", respcache.ErrorTypeTimeout:
		return typ
	}
	var er minio.ErrorResponse
	if errors.As(err, &er) && er.StatusCode != 0 {
		if er.StatusCode == 502 || er.StatusCode == 503 || er.StatusCode == 504 {
			return respcache.ErrorTypeConnection
		}
		return respcache.ErrorTypeOther
	}
	return respcache.ErrorTypeOf(err)
}

// unavailable reports whether an error type means S3 cannot be reached (connection or timeout).
func unavailable(typ string) bool {
	return typ == respcache.ErrorTypeConnection || typ == respcache.ErrorTypeTimeout
}

// redactedError hides secrets (the S3 keys) that a dependency might echo in an error message.
// Error replaces each secret with "[REDACTED]"; Unwrap keeps errors.Is/As working.
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

// redactURL returns u with any password replaced; a URL that does not parse is not echoed at all.
func redactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "[unparsable URL]"
	}
	return p.Redacted()
}

func discardIfNil(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}
