package disagg

import (
	"encoding/json"
	"log/slog"
	"strconv"
	"strings"
)

// Redacted replaces every credential when an ExternalStorage is printed, logged or marshalled.
const Redacted = "[REDACTED]"

// ExternalStorage is where KV tensors transit between prefill and decode backends, and where
// engines offload them: the configuration's external_storage (per backend) and
// default_external_storage. Two backends share KV through storage when their Endpoint and
// Namespace are equal (SameLocation); credentials do not take part.
//
// Credentials never leave the value through its methods: String, GoString, LogValue and
// MarshalJSON show Redacted in their place (an empty credential stays empty, so that a log shows
// whether one is set). Read the fields themselves to use them. The type is a plain value, safe to
// copy and to read concurrently.
type ExternalStorage struct {
	// Endpoint is the storage's URL, e.g. "http://kv-store:8080".
	Endpoint string
	// Namespace is the key prefix (the configuration's kv_namespace), e.g. "inference/kv-cache".
	Namespace string
	// Credentials is an opaque credential string (the configuration's credentials); optional when
	// the storage allows anonymous access.
	Credentials string
	// AccessKey and SecretKey are S3-style credentials, for storage reached through an S3 API.
	AccessKey string
	SecretKey string
}

// IsZero reports whether no location is set (no endpoint and no namespace).
func (s ExternalStorage) IsZero() bool { return s.Endpoint == "" && s.Namespace == "" }

// SameLocation reports whether s and o name the same storage location: equal Endpoint and
// Namespace, ignoring a trailing "/" on the endpoint and surrounding "/" on the namespace. Two
// zero locations are the same (no storage: the engines transfer KV directly).
func (s ExternalStorage) SameLocation(o ExternalStorage) bool {
	return strings.TrimRight(s.Endpoint, "/") == strings.TrimRight(o.Endpoint, "/") &&
		strings.Trim(s.Namespace, "/") == strings.Trim(o.Namespace, "/")
}

// redacted returns a copy with every non-empty credential replaced by Redacted.
func (s ExternalStorage) redacted() ExternalStorage {
	for _, f := range []*string{&s.Credentials, &s.AccessKey, &s.SecretKey} {
		if *f != "" {
			*f = Redacted
		}
	}
	return s
}

// String returns "endpoint=… namespace=…" followed by the credentials that are set, each shown as
// Redacted.
func (s ExternalStorage) String() string {
	r := s.redacted()
	var b strings.Builder
	b.WriteString("endpoint=")
	b.WriteString(strconv.Quote(r.Endpoint))
	b.WriteString(" namespace=")
	b.WriteString(strconv.Quote(r.Namespace))
	for _, kv := range [...][2]string{{"credentials", r.Credentials}, {"access_key", r.AccessKey}, {"secret_key", r.SecretKey}} {
		if kv[1] != "" {
			b.WriteString(" " + kv[0] + "=" + kv[1])
		}
	}
	return b.String()
}

// GoString implements fmt.GoStringer (the %#v verb) with the credentials redacted.
func (s ExternalStorage) GoString() string {
	r := s.redacted()
	return "disagg.ExternalStorage{Endpoint:" + strconv.Quote(r.Endpoint) + ", Namespace:" + strconv.Quote(r.Namespace) +
		", Credentials:" + strconv.Quote(r.Credentials) + ", AccessKey:" + strconv.Quote(r.AccessKey) +
		", SecretKey:" + strconv.Quote(r.SecretKey) + "}"
}

// LogValue implements slog.LogValuer: a group of endpoint, namespace and the credentials that are
// set, redacted.
func (s ExternalStorage) LogValue() slog.Value {
	r := s.redacted()
	attrs := []slog.Attr{slog.String("endpoint", r.Endpoint), slog.String("namespace", r.Namespace)}
	for _, kv := range [...][2]string{{"credentials", r.Credentials}, {"access_key", r.AccessKey}, {"secret_key", r.SecretKey}} {
		if kv[1] != "" {
			attrs = append(attrs, slog.String(kv[0], kv[1]))
		}
	}
	return slog.GroupValue(attrs...)
}

// storageJSON is ExternalStorage's JSON form, in the configuration's field names.
type storageJSON struct {
	Endpoint    string `json:"endpoint"`
	Namespace   string `json:"kv_namespace"`
	Credentials string `json:"credentials,omitempty"`
	AccessKey   string `json:"access_key,omitempty"`
	SecretKey   string `json:"secret_key,omitempty"`
}

// MarshalJSON implements json.Marshaler with the configuration's field names (endpoint,
// kv_namespace, credentials, access_key, secret_key) and the credentials redacted. There is no
// UnmarshalJSON: a marshalled value is for display and cannot restore the credentials.
func (s ExternalStorage) MarshalJSON() ([]byte, error) {
	r := s.redacted()
	return json.Marshal(storageJSON(r))
}
