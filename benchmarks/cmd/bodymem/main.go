// Command bodymem measures the reference proxy's memory under large request bodies: it builds
// ./examples/proxy, runs it as a child on 127.0.0.1 in front of one in-process backend, sends a
// burst of concurrent OpenAI chat requests of about -size bytes each, and reports the child's peak
// resident set size (VmHWM, Linux only) and the statuses it answered.
//
//	go run ./benchmarks/cmd/bodymem -n 32 -size 8388608
//
// The proxy holds at most server.max_inflight_body_bytes of request bodies at once (default 128
// MiB) and answers 503 beyond it, so that a burst of large prompts cannot take its memory: the
// statuses show how many requests that turned away. All traffic stays on 127.0.0.1; the run is
// bounded by -timeout and the child is killed when the command ends.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute/benchmarks/internal/benchenv"
)

// config is what one run measures.
type config struct {
	n           int           // concurrent requests
	size        int           // bytes per request body
	maxInflight int64         // server.max_inflight_body_bytes; 0: the proxy's default
	repo        string        // the kvroute module's root; "": the current module
	timeout     time.Duration // bound on the whole run
	heapProfile string        // where to write the child's heap profile taken at its largest heap in use; "": none
	goMemLimit  string        // the child's GOMEMLIMIT environment variable; "": not set
	plain       bool          // prose without JSON escapes (no newlines, quotes or tabs)
}

// result is what one run saw.
type result struct {
	bodyBytes   int
	idleHWM     int64       // the child's VmHWM before the burst, bytes
	peakHWM     int64       // the child's VmHWM after it, bytes
	statuses    map[int]int // HTTP status -> count
	errs        []string    // transport errors, deduplicated
	elapsed     time.Duration
	goVersion   string
	cpuModel    string
	commandLine string
	heapInuse   uint64 // the largest HeapInuse seen while sampling the child (with -heap-profile)
	heapSamples int    // how many times it was sampled
}

func main() {
	var c config
	flag.IntVar(&c.n, "n", 32, "concurrent requests")
	flag.IntVar(&c.size, "size", 8<<20-4<<10, "bytes per request body (the proxy's default limit is 8 MiB)")
	flag.Int64Var(&c.maxInflight, "max-inflight", 0, "server.max_inflight_body_bytes for the proxy (0: its default, 128 MiB)")
	flag.StringVar(&c.repo, "repo", "", "root of the kvroute module (default: the module of the working directory)")
	flag.DurationVar(&c.timeout, "timeout", 3*time.Minute, "bound on the whole run, build included")
	flag.StringVar(&c.heapProfile, "heap-profile", "", "sample the proxy's heap (net/http/pprof, -pprof) during the burst and write "+
		"a heap profile taken at its largest heap in use to this file (read it with go tool pprof -sample_index=inuse_space); "+
		"each profile forces a collection, so the peak RSS of such a run is lower than without it")
	flag.BoolVar(&c.plain, "plain", false, "bodies of prose written without JSON escapes (no newlines, quotes or tabs), "+
		"which the proxy's parser keeps as views into the body rather than decoding into a copy")
	flag.StringVar(&c.goMemLimit, "gomemlimit", "", "the proxy's GOMEMLIMIT environment variable (e.g. off, 300MiB); unset when empty")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	r, err := run(ctx, c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bodymem:", err)
		os.Exit(1)
	}
	r.commandLine = "go run ./benchmarks/cmd/bodymem " + strings.Join(os.Args[1:], " ")
	report(os.Stdout, c, r)
}

// run builds and starts the proxy, sends the burst and measures. It kills the child before
// returning.
func run(ctx context.Context, c config) (*result, error) {
	if c.n < 1 || c.size < 256 {
		return nil, errors.New("-n must be at least 1 and -size at least 256")
	}
	repo, err := benchenv.ModuleRoot(ctx, c.repo)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "bodymem-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)

	r := &result{statuses: map[int]int{}, cpuModel: benchenv.CPUModel()}
	if out, err := exec.CommandContext(ctx, "go", "version").Output(); err == nil {
		r.goVersion = strings.TrimSpace(string(out))
	}
	bin := filepath.Join(dir, "proxy")
	if err := benchenv.BuildProxy(ctx, repo, bin); err != nil {
		return nil, err
	}

	backend := httptest.NewServer(http.HandlerFunc(answer))
	defer backend.Close()
	cfgPath := filepath.Join(dir, "proxy.yaml")
	if err := os.WriteFile(cfgPath, []byte(proxyConfig(c, backend.URL)), 0o600); err != nil {
		return nil, err
	}
	var env []string
	if c.goMemLimit != "" {
		env = append(env, "GOMEMLIMIT="+c.goMemLimit)
	}
	child, err := startChild(ctx, bin, cfgPath, c.heapProfile != "", env)
	if err != nil {
		return nil, err
	}
	defer child.stop()

	bodies := make([][]byte, c.n)
	for i := range bodies {
		bodies[i] = chatBody(i, c.size, c.plain)
	}
	r.bodyBytes = len(bodies[0])
	if r.idleHWM, err = peakRSS(child.pid()); err != nil {
		return nil, err
	}
	start := time.Now()
	var sampled chan error
	stopSampling := make(chan struct{})
	if c.heapProfile != "" {
		sampled = make(chan error, 1)
		go func() { sampled <- sampleHeap(ctx, child.pprofAddr, c.heapProfile, stopSampling, r) }()
	}
	burst(ctx, "http://"+child.addr+"/v1/chat/completions", bodies, r)
	r.elapsed = time.Since(start)
	close(stopSampling)
	if sampled != nil {
		if err := <-sampled; err != nil {
			return nil, err
		}
	}
	if r.peakHWM, err = peakRSS(child.pid()); err != nil {
		return nil, err
	}
	return r, nil
}

// sampleHeap reads the child's heap statistics from its pprof listener at addr until stop is
// closed, and writes to path the heap profile taken when HeapInuse was at its largest. It records
// that largest HeapInuse and the number of samples in r. Sampling costs the child a little CPU:
// a run with it is not the same run as one without.
func sampleHeap(ctx context.Context, addr, path string, stop <-chan struct{}, r *result) error {
	client := &http.Client{Timeout: 10 * time.Second}
	get := func(query string) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/debug/pprof/heap"+query, nil)
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("GET /debug/pprof/heap%s: status %d", query, resp.StatusCode)
		}
		return io.ReadAll(resp.Body)
	}
	var best []byte
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		text, err := get("?debug=1")
		if err != nil {
			return fmt.Errorf("sampling the heap: %w", err)
		}
		r.heapSamples++
		if inuse := heapInuse(text); inuse > r.heapInuse || best == nil {
			// gc=1: a collection first, so that the profile shows what is live now rather
			// than at the last collection (which perturbs the run: see the flag).
			if best, err = get("?gc=1"); err != nil {
				return fmt.Errorf("sampling the heap: %w", err)
			}
			r.heapInuse = max(r.heapInuse, inuse)
		}
		select {
		case <-stop:
			return os.WriteFile(path, best, 0o644)
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// heapInuse returns the "# HeapInuse = N" line's N of a heap profile in its debug=1 text form.
func heapInuse(text []byte) uint64 {
	for line := range strings.Lines(string(text)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "# HeapInuse = "); ok {
			n, _ := strconv.ParseUint(v, 10, 64)
			return n
		}
	}
	return 0
}

// answer is the backend: it reads the whole body and answers a small chat completion.
func answer(w http.ResponseWriter, r *http.Request) {
	n, _ := io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"chatcmpl-bodymem","object":"chat.completion","created":0,"model":"m",`+
		`"choices":[{"index":0,"message":{"role":"assistant","content":"read %d bytes"},"finish_reason":"stop"}],`+
		`"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}`, n)
}

// proxyConfig is the proxy's YAML: tier 1 only, no health checks, one backend at url.
func proxyConfig(c config, url string) string {
	var b strings.Builder
	b.WriteString("server:\n  bind_address: \"127.0.0.1\"\n")
	fmt.Fprintf(&b, "  max_body_bytes: %d\n", max(8<<20, c.size+4<<10))
	if c.maxInflight > 0 {
		fmt.Fprintf(&b, "  max_inflight_body_bytes: %d\n", c.maxInflight)
	}
	b.WriteString("selection_strategy: round_robin\n")
	b.WriteString("prefix_routing:\n  enabled: true\n  max_prefix_length: 1024\n")
	fmt.Fprintf(&b, "backends:\n  - name: sink\n    url: %q\n    model: m\n", url)
	b.WriteString("health_checks:\n  enabled: false\n")
	return b.String()
}

// chatBody returns an OpenAI chat body of about size bytes: a system prompt naming request i
// (so that the bodies differ) and user turns of prose, with quotes, tabs and newlines (JSON
// escapes) unless plain.
func chatBody(i, size int, plain bool) []byte {
	para := "The proxy reads each request body, parses it and routes it by its prompt's prefix. " +
		"This paragraph stands for a long pasted document, with \"quotes\", tabs\tand newlines.\n"
	if plain {
		para = "The proxy reads each request body, parses it and routes it by its prompt's prefix. " +
			"This paragraph stands for a long pasted document written on one line. "
	}
	var b bytes.Buffer
	b.Grow(size + 1024)
	fmt.Fprintf(&b, `{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"You are assistant %d."}`, i)
	for turn := 0; ; turn++ {
		prefix := fmt.Sprintf(`,{"role":"user","content":"Document %d:\n`, turn)
		if plain {
			prefix = fmt.Sprintf(`,{"role":"user","content":"Document %d: `, turn)
		}
		room := size - b.Len() - len(prefix) - len(`"}]}`)
		if room <= 0 {
			break
		}
		b.WriteString(prefix)
		text, _ := json.Marshal(strings.Repeat(para, min(room, 64<<10)/len(para)+1))
		text = text[1 : len(text)-1] // without the quotes
		if len(text) > room {
			text = text[:room]
			for len(text) > 0 && text[len(text)-1] == '\\' { // do not cut an escape
				text = text[:len(text)-1]
			}
		}
		b.Write(text)
		b.WriteString(`"}`)
	}
	b.WriteString(`]}`)
	return b.Bytes()
}

// burst sends all bodies at once and records the statuses in r.
func burst(ctx context.Context, url string, bodies [][]byte, r *result) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: len(bodies)}}
	defer client.CloseIdleConnections()
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		gate = make(chan struct{})
	)
	for _, body := range bodies {
		wg.Go(func() {
			<-gate
			status, err := post(ctx, client, url, body)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if !slices.Contains(r.errs, err.Error()) {
					r.errs = append(r.errs, err.Error())
				}
				r.statuses[0]++
				return
			}
			r.statuses[status]++
		})
	}
	close(gate)
	wg.Wait()
}

func post(ctx context.Context, client *http.Client, url string, body []byte) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, err
}

// report writes the result as Markdown.
func report(w io.Writer, c config, r *result) {
	fmt.Fprintf(w, "## bodymem\n\n")
	fmt.Fprintf(w, "- command: `%s`\n", r.commandLine)
	fmt.Fprintf(w, "- %s; CPU: %s (%d logical CPUs)\n", r.goVersion, r.cpuModel, runtime.NumCPU())
	inflight := "default (128 MiB)"
	if c.maxInflight > 0 {
		inflight = strconv.FormatInt(c.maxInflight, 10) + " bytes"
	}
	prose := "prose with JSON escapes (newlines, quotes, tabs)"
	if c.plain {
		prose = "prose without JSON escapes"
	}
	fmt.Fprintf(w, "- %d concurrent chat requests of %d bytes (%.2f MiB) each, %s; server.max_inflight_body_bytes: %s\n",
		c.n, r.bodyBytes, float64(r.bodyBytes)/(1<<20), prose, inflight)
	if c.goMemLimit != "" {
		fmt.Fprintf(w, "- the proxy's GOMEMLIMIT: %s\n", c.goMemLimit)
	}
	fmt.Fprintf(w, "- burst took %v\n\n", r.elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "| proxy VmHWM | MB |\n|---|---:|\n| before the burst | %.1f |\n| after the burst (peak) | %.1f |\n\n",
		float64(r.idleHWM)/1e6, float64(r.peakHWM)/1e6)
	if r.heapSamples > 0 {
		fmt.Fprintf(w, "Largest HeapInuse of %d samples (net/http/pprof, every 50 ms): %.1f MB; its heap profile: %s\n\n",
			r.heapSamples, float64(r.heapInuse)/1e6, c.heapProfile)
	}
	codes := make([]int, 0, len(r.statuses))
	for code := range r.statuses {
		codes = append(codes, code)
	}
	slices.Sort(codes)
	fmt.Fprintf(w, "| status | requests |\n|---|---:|\n")
	for _, code := range codes {
		name := strconv.Itoa(code)
		if code == 0 {
			name = "transport error"
		}
		fmt.Fprintf(w, "| %s | %d |\n", name, r.statuses[code])
	}
	for _, e := range r.errs {
		fmt.Fprintf(w, "\ntransport error: %s\n", e)
	}
}
