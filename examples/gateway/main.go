// Command gateway is the smallest net/http gateway built on kvroute: NewGateway (gateway.go), a
// kvhttp.Handler, reads a request, routes it by its prompt prefix, forwards it with
// httputil.ReverseProxy, and reports the request's whole lifecycle to the Router (FirstToken on the
// first byte of a successful answer, then Done once with its Outcome: success, failure, refusal, or
// cancelled when the client left). Its kvroute-specific code is the Router's construction below and
// one line in gateway.go.
// examples/proxy is the full reference proxy (response cache, KV events, health, retries, admin);
// this one shows what composing kvroute into a handler you already have takes.
//
//	go run ./examples/gateway -backends vllm-1=http://10.0.0.1:8000,vllm-2=http://10.0.0.2:8000
package main

import (
	"flag"
	"log"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/kvroute/kvroute"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:8080", "address to serve on")
	list := flag.String("backends", "", "name=url pairs, comma-separated")
	flag.Parse()
	cfg := kvroute.Config{}
	urls := map[string]*url.URL{}
	for pair := range strings.SplitSeq(*list, ",") {
		name, raw, ok := strings.Cut(pair, "=")
		u, err := url.Parse(raw)
		if !ok || err != nil || u.Host == "" {
			log.Fatalf("-backends: %q is not name=url", pair)
		}
		urls[name] = u
		cfg.Backends = append(cfg.Backends, kvroute.Backend{Name: name})
	}
	router, err := kvroute.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/", NewGateway(router, urls)) // chat/completions, completions, messages; 404 for the rest
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute}
	log.Printf("gateway on http://%s to %d backends", *addr, len(urls))
	log.Fatal(srv.ListenAndServe())
}
