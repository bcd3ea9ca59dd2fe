package redisstore

import (
	"errors"
	"net/url"
	"strings"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/respcache"
)

// errorType is respcache.ErrorTypeOf with rueidis' errors: a server reply meaning "not ready"
// (LOADING, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, BUSY) and a closing client are connection errors,
// any other server reply is "other". It returns "" for the caller's cancellation.
func errorType(err error) string {
	switch typ := respcache.ErrorTypeOf(err); typ {
	case "", respcache.ErrorTypeTimeout:
		return typ
	}
	var re *rueidis.RedisError
	if errors.As(err, &re) && re != nil && !re.IsNil() {
		// A server that is up but cannot serve yet is an outage, not a bad request.
		msg := re.Error()
		for _, p := range [...]string{"LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "BUSY "} {
			if strings.HasPrefix(msg, p) {
				return respcache.ErrorTypeConnection
			}
		}
		return respcache.ErrorTypeOther
	}
	if errors.Is(err, rueidis.ErrClosing) {
		return respcache.ErrorTypeConnection
	}
	return respcache.ErrorTypeOf(err)
}

// unavailable reports whether an error type means Redis cannot be reached (connection or timeout).
func unavailable(typ string) bool {
	return typ == respcache.ErrorTypeConnection || typ == respcache.ErrorTypeTimeout
}

// redactedError hides a password that a dependency might echo in an error message. Error replaces
// each secret with "[REDACTED]"; Unwrap keeps errors.Is/As working.
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
