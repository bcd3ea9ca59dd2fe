// Package admin guards a gateway's administrative endpoints (kvroute's stats, cache invalidation,
// index clearing), which must never be open to the network by default.
//
// With a token, a caller must send "Authorization: Bearer <token>" (the scheme in any case, RFC
// 9110 section 11.1); the token is compared in constant time on SHA-256 digests, so that neither
// its bytes nor its length leak: 401 otherwise. Without a token, only an operator on the host is
// answered: a loopback client (403 otherwise) whose request nothing marks as a web page's. A
// loopback address alone does not keep a browser on the same host out: a page can send a
// cross-site POST without asking first, and a DNS-rebinding page can read the answers under its
// own host name. So the request must name a loopback host or localhost, carry no cross-site
// Origin or Sec-Fetch-Site, and POST only JSON (which a cross-site page cannot send without a
// CORS preflight, which the guard never grants). Behind a reverse proxy on the same host every
// client looks local: set a token there.
//
//	mux.Handle("POST /admin/cache/clear", admin.Guard(cfg.AdminToken, clearHandler))
//
// It also serves the read-only introspection endpoints whose logic is not a gateway's own:
// ProbeHandler (POST /admin/route/probe, what the Router would decide for a request body) and
// DumpHandler (GET /admin/kv-index/dump, the KV index's entries for a backend as JSON lines).
//
//	mux.Handle("POST /admin/route/probe", admin.Guard(token, admin.ProbeHandler(router.Probe, 4<<20)))
//	mux.Handle("GET /admin/kv-index/dump", admin.Guard(token, admin.DumpHandler(index)))
//
// And it holds the JSON bodies of the stats endpoints, built from one kvroute.Stats snapshot
// (DefaultRouter.Stats) and what only the gateway knows, its configuration as it reports it and
// its KV event sources: NewPrefixRoutingStats (GET /admin/prefix-routing/stats), NewKVIndexStats
// (GET /admin/kv-index/stats), NewDisaggStats (GET /admin/disaggregation/stats) and NewPeerStats
// (the "peers" of GET /admin/replicas/stats). Their keys and formats are the endpoints', which
// is why some values are strings ("overflow_rate": "0.0123", "prefill_timeout": "30s").
//
//	st, err := router.Stats(ctx)
//	body := admin.NewKVIndexStats(st, err, admin.KVIndexConfig{MaxEntries: 100_000}, consumer.Status())
//	_ = json.NewEncoder(w).Encode(body)
package admin

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"mime"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Guard returns h behind the access check the package doc describes: token (none when empty)
// or, without one, a loopback operator. Refusals are JSON {"error": "..."} with 401 or 403. The
// handler is safe for concurrent use when h is.
func Guard(token string, h http.Handler) http.Handler {
	digest := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token == "" {
			if !LoopbackClient(r) {
				refuse(w, http.StatusForbidden, "forbidden: admin endpoints answer only loopback clients while no admin token is set")
				return
			}
			if why := BrowserRequest(r); why != "" {
				refuse(w, http.StatusForbidden, "forbidden: "+why+" (without an admin token, admin endpoints refuse what a web page could send)")
				return
			}
		} else {
			scheme, cred, _ := strings.Cut(r.Header.Get("Authorization"), " ")
			got := sha256.Sum256([]byte(strings.TrimSpace(cred)))
			if !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare(got[:], digest[:]) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvroute admin"`)
				refuse(w, http.StatusUnauthorized, "unauthorized: send Authorization: Bearer <admin token>")
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}

func refuse(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// BrowserRequest says why r may come from a web page rather than an operator's tool, "" when
// nothing suggests it: a Host that is not a loopback address or localhost, a cross-site Origin
// or Sec-Fetch-Site, or a POST that is not application/json.
func BrowserRequest(r *http.Request) string {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if !loopbackHost(strings.Trim(host, "[]")) {
		return "the Host header names " + strconv.Quote(r.Host) + ", not a loopback address"
	}
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return "a " + site + " request"
	}
	if o := r.Header.Get("Origin"); o != "" {
		if u, err := url.Parse(o); err != nil || !loopbackHost(u.Hostname()) {
			return "a request from the origin " + strconv.Quote(o)
		}
	}
	if r.Method == http.MethodPost {
		if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt != "application/json" {
			return "a POST without Content-Type: application/json"
		}
	}
	return ""
}

// LoopbackClient reports whether r came from a loopback address (RemoteAddr; forwarding headers
// are not trusted).
func LoopbackClient(r *http.Request) bool {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	return err == nil && ap.Addr().Unmap().IsLoopback()
}

// loopbackHost reports whether host is a loopback address or localhost.
func loopbackHost(host string) bool {
	if a, err := netip.ParseAddr(host); err == nil {
		return a.Unmap().IsLoopback()
	}
	return strings.EqualFold(host, "localhost")
}
