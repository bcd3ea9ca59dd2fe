package s3store

import (
	"errors"

	"github.com/minio/minio-go/v7"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// errorType is respcache.ErrorTypeOf with S3's error responses: 502, 503 and 504 (a gateway or a
// server that cannot serve now) are connection errors, any other status is "other". It returns ""
// for the caller's cancellation.
func errorType(err error) string { return storeutil.ErrorType(err, s3ErrorType) }

// s3ErrorType sorts S3's error responses (see errorType); "" for any other error.
func s3ErrorType(err error) string {
	var er minio.ErrorResponse
	if errors.As(err, &er) && er.StatusCode != 0 {
		if er.StatusCode == 502 || er.StatusCode == 503 || er.StatusCode == 504 {
			return respcache.ErrorTypeConnection
		}
		return respcache.ErrorTypeOther
	}
	return ""
}
