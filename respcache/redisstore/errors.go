package redisstore

import (
	"errors"
	"strings"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// errorType is respcache.ErrorTypeOf with rueidis' errors: a server reply meaning "not ready"
// (LOADING, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, BUSY) and a closing client are connection errors,
// any other server reply is "other". It returns "" for the caller's cancellation.
func errorType(err error) string { return storeutil.ErrorType(err, rueidisErrorType) }

// rueidisErrorType sorts the errors of rueidis (see errorType); "" for any other error.
func rueidisErrorType(err error) string {
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
	return ""
}
