package respcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
	"net/http"
)

// Domain-separation prefixes of the tenant digests: a credential tenant and a header tenant, or
// the tenants of two different headers, never share a value.
const (
	credentialTenantDomain = "kvroute/respcache/tenant/credential/v1\x00"
	headerTenantDomain     = "kvroute/respcache/tenant/header/v1\x00"
)

// CredentialTenant names the tenant of r by the credential it carries: the 64 lowercase hex digits
// of a SHA-256 digest over r's Authorization, X-Api-Key (Anthropic's, OpenAI-compatible SDKs')
// and api-key (Azure OpenAI's) header values, or "" — the one anonymous tenant, shared by every
// request without a credential — when r has none of them. It is the tenant a Cache uses when
// Config.Tenant is nil (and Config.SharedAcrossTenants is false). It is safe for concurrent use,
// reads only r's headers and costs one SHA-256 of them.
//
// The raw credential never leaves the function: only its digest names the tenant, and the cache
// key is itself a digest of that. Every header is hashed, every value of each, so that a client
// sending a placeholder "Authorization: Bearer none" beside its real X-Api-Key (as some SDKs do)
// is not pooled with every other client sending the same placeholder. The digest's input, with
// str(s) = le64(len(s)) ‖ s and values in the order they arrived:
//
//	SHA-256( "kvroute/respcache/tenant/credential/v1" ‖ 0x00
//	         ‖ le64(#Authorization values) ‖ str(value)… ‖ le64(#X-Api-Key values) ‖ str(value)…
//	         [ ‖ le64(#api-key values) ‖ str(value)… ] )
//
// The api-key part is present only when the request carries an api-key header, so that the
// tenants of requests without one are those of kvroute 0.1.0, whose digest stopped after
// X-Api-Key (and a request with api-key alone, anonymous there, has its own tenant now). Each
// list is self-delimiting, so that an input with the api-key part never equals one without.
//
// Gateways that authenticate callers some other way (cookies, client certificates, a key in the
// query string, a header of their own) must set Config.Tenant, for example to HeaderTenant of a
// header they set after authentication.
func CredentialTenant(r *http.Request) string {
	auth, key, azure := r.Header.Values("Authorization"), r.Header.Values("X-Api-Key"), r.Header.Values("Api-Key")
	if len(auth) == 0 && len(key) == 0 && len(azure) == 0 {
		return ""
	}
	h := sha256.New()
	h.Write([]byte(credentialTenantDomain))
	writeValues(h, auth)
	writeValues(h, key)
	if len(azure) > 0 {
		writeValues(h, azure)
	}
	return hexDigest(h)
}

// HeaderTenant returns a Config.Tenant function that names the tenant of a request by the header
// name, typically one an authenticating gateway in front of the cache sets (X-Tenant-Id): the 64
// lowercase hex digits of a SHA-256 digest over the header's canonical name and its values, or ""
// — the one anonymous tenant — when the request does not carry the header. Requests with the same
// values share entries whatever their credentials; the value is hashed, never used as it is, so
// that a header carrying a secret (even Authorization itself) is safe to name. The digest's input,
// with str as in CredentialTenant:
//
//	SHA-256( "kvroute/respcache/tenant/header/v1" ‖ 0x00 ‖ str(canonical name)
//	         ‖ le64(#values) ‖ str(value)… )
//
// The returned function is safe for concurrent use and reads only the request's headers.
// HeaderTenant panics when name is not a valid header field name (an RFC 9110 token): that is a
// programmer error.
func HeaderTenant(name string) func(*http.Request) string {
	if !validHeaderName(name) {
		panic(fmt.Sprintf("respcache: HeaderTenant: %q is not a valid header name", name))
	}
	name = http.CanonicalHeaderKey(name)
	return func(r *http.Request) string {
		vs := r.Header.Values(name)
		if len(vs) == 0 {
			return ""
		}
		h := sha256.New()
		h.Write([]byte(headerTenantDomain))
		writeValues(h, []string{name})
		writeValues(h, vs)
		return hexDigest(h)
	}
}

// validHeaderName reports whether name is a valid HTTP header field name: a non-empty RFC 9110
// token (letters, digits and !#$%&'*+-.^_`|~).
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '!', c == '#', c == '$', c == '%', c == '&', c == '\'', c == '*', c == '+', c == '-',
			c == '.', c == '^', c == '_', c == '`', c == '|', c == '~':
		default:
			return false
		}
	}
	return true
}

// writeValues writes le64(len(vs)) and then each value as str(v).
func writeValues(h hash.Hash, vs []string) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(vs)))
	h.Write(n[:])
	for _, v := range vs {
		binary.LittleEndian.PutUint64(n[:], uint64(len(v)))
		h.Write(n[:])
		h.Write(stringBytes(v))
	}
}

// hexDigest returns h's digest as 64 lowercase hex digits.
func hexDigest(h hash.Hash) string {
	var sum [sha256.Size]byte
	var out [2 * sha256.Size]byte
	hex.Encode(out[:], h.Sum(sum[:0]))
	return string(out[:])
}
