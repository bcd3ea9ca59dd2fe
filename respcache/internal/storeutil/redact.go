package storeutil

import (
	"net/url"
	"strings"
)

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

// Redact wraps err so that its message cannot carry any of secrets; nil stays nil, and err is
// returned as is when there is no secret. It is a pure function, safe for concurrent use.
func Redact(err error, secrets []string) error {
	if err == nil || len(secrets) == 0 {
		return err
	}
	return &redactedError{err: err, secrets: secrets}
}

// Secrets returns the non-empty secrets, for Redact; nil when there is none.
func Secrets(secrets ...string) []string {
	var out []string
	for _, s := range secrets {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// Presence describes a secret without revealing it: `""` when it is empty, "[REDACTED]"
// otherwise.
func Presence(secret string) string {
	if secret == "" {
		return `""`
	}
	return "[REDACTED]"
}

// RedactURL returns u with any password replaced; a URL that does not parse is not echoed at all.
func RedactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "[unparsable URL]"
	}
	return p.Redacted()
}
