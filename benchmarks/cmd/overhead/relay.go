package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/http/pprof"
	"net/url"
	"sync"
	"time"
)

// relayCommand is the first argument that makes the program the bare relay (b):
//
//	overhead relay -upstream http://127.0.0.1:8001 [-addr 127.0.0.1:0] [-max-idle 256] [-pprof ADDR]
//
// It prints "relay listening on http://HOST:PORT" on stdout and serves until killed or
// interrupted. The measurement starts it as its child.
const relayCommand = "relay"

// relayBanner opens the line that gives a child's address (the proxy prints the same words).
const relayBanner = "relay listening on "

// relayMain serves the bare relay until ctx ends.
func relayMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("overhead relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	upstream := fs.String("upstream", "", "the upstream's HTTP root, e.g. http://127.0.0.1:8001 (required)")
	addr := fs.String("addr", "127.0.0.1:0", "listen address")
	maxIdle := fs.Int("max-idle", 2*DefaultConns, "idle upstream connections kept (MaxIdleConnsPerHost): at least the clients' connections")
	pprofAddr := fs.String("pprof", "", "serve net/http/pprof on this address (logged on stderr as the proxy does); off when empty")
	if err := fs.Parse(args); err != nil {
		return err
	}
	u, err := url.Parse(*upstream)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return fmt.Errorf("-upstream %q: want http://host:port", *upstream)
	}
	if *maxIdle < 1 {
		return fmt.Errorf("-max-idle %d: want ≥ 1", *maxIdle)
	}
	return serveChild(ctx, *addr, *pprofAddr, relayBanner+"http://", stdout, stderr, httpServe(newRelayServer(u, *maxIdle, stderr)))
}

// serveChild is a child's listening part: it listens on addr (and serves net/http/pprof on
// pprofAddr unless empty), prints banner and the address on stdout, and serves with serve until
// ctx ends; serve's stop, called then, ends it.
func serveChild(ctx context.Context, addr, pprofAddr, banner string, stdout, stderr io.Writer,
	serve func(net.Listener) (run func() error, stop func() error)) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	if pprofAddr != "" {
		stopPprof, err := servePprof(ctx, pprofAddr, stderr)
		if err != nil {
			ln.Close()
			return err
		}
		defer stopPprof()
	}
	run, stop := serve(ln)
	fmt.Fprintf(stdout, "%s%s\n", banner, ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- run() }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	return errors.Join(stop(), <-errc)
}

// httpServe serves srv for serveChild, and shuts it down within 5 s.
func httpServe(srv *http.Server) func(net.Listener) (func() error, func() error) {
	return func(ln net.Listener) (func() error, func() error) {
		run := func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		}
		stop := func() error {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(sctx)
		}
		return run, stop
	}
}

// newRelayServer returns the relay (b): an http.Server whose handler is a ReverseProxy to
// upstream, with nothing a proxy could skip — no routing, no body inspection, no X-Forwarded-*
// headers — over a Transport that keeps maxIdle connections to the upstream.
func newRelayServer(upstream *url.URL, maxIdle int, errLog io.Writer) *http.Server {
	rp := &httputil.ReverseProxy{
		Rewrite:    func(r *httputil.ProxyRequest) { r.SetURL(upstream) },
		Transport:  upstreamTransport(maxIdle),
		BufferPool: &bufferPool{},
		ErrorLog:   log.New(errLog, "relay: ", log.LstdFlags),
	}
	return &http.Server{
		Handler:           rp,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          log.New(errLog, "relay: ", log.LstdFlags),
	}
}

// upstreamTransport returns the Transport the relay and the gateways reach the engine with: no
// environment proxy (the engine is on loopback), no compression, maxIdle idle connections kept.
func upstreamTransport(maxIdle int) *http.Transport {
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          maxIdle,
		MaxIdleConnsPerHost:   maxIdle,
		IdleConnTimeout:       2 * time.Minute,
		DisableCompression:    true,
		ResponseHeaderTimeout: time.Minute,
	}
}

// servePprof serves net/http/pprof's profiles on their own listener at addr and logs its address
// as the proxy does ("msg=pprof addr=HOST:PORT"). The returned function stops it.
func servePprof(ctx context.Context, addr string, stderr io.Writer) (func(), error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	slog.New(slog.NewTextHandler(stderr, nil)).Info("pprof", "addr", ln.Addr().String())
	return func() { srv.Close() }, nil
}

// bufferPool is the ReverseProxy's copy buffers, reused: 32 KiB each, as io.Copy would allocate
// per response. Safe for concurrent use; the zero value is ready.
type bufferPool struct{ p sync.Pool }

var _ httputil.BufferPool = (*bufferPool)(nil)

func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32<<10)
}

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }
