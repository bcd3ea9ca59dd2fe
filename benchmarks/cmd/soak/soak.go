package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvroute/kvroute/benchmarks/internal/benchenv"
)

// model is the model every engine serves.
const model = "meta-llama/Llama-3.1-8B-Instruct"

// fleet is the processes of one soak and the relays in front of replica 0's event sources.
type fleet struct {
	dir       string
	engines   []*proc
	names     []string
	relays    [][2]*relay // per engine: its ZMQ publisher's, its replay socket's
	redis     *proc
	redisAddr string
	nats      *proc
	proxies   []*proc
	proxyURLs []string
}

// stop kills every process and closes the relays.
func (f *fleet) stop() {
	for _, p := range f.proxies {
		p.kill()
	}
	for _, p := range f.engines {
		p.kill()
	}
	for _, r := range f.relays {
		r[0].Close()
		r[1].Close()
	}
	if f.redis != nil {
		f.redis.kill()
	}
	if f.nats != nil {
		f.nats.kill()
	}
}

// soak runs the whole soak of o and writes the report to stdout; progress goes to stderr.
func soak(ctx context.Context, o options, stdout, stderr io.Writer) error {
	progress := func(format string, a ...any) { fmt.Fprintf(stderr, "soak: "+format+"\n", a...) }
	sched, err := newSchedule(o.faults, o.warmup, o.duration, o.longestFault())
	if err != nil {
		return err
	}
	repo, err := benchenv.ModuleRoot(ctx, o.repo)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	redisBin, err := exec.LookPath("redis-server")
	if err != nil {
		return fmt.Errorf("the soak runs a Redis server of its own: %w", err)
	}
	dir, err := os.MkdirTemp("", "kvroute-soak-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	env := runEnv{commit: benchenv.GitDescribe(ctx, repo), cpu: benchenv.CPUModel(), command: "go run ./benchmarks/cmd/soak " + strings.Join(o.args, " ")}
	if out, err := exec.CommandContext(ctx, "go", "version").Output(); err == nil {
		env.goVersion = strings.TrimSpace(string(out))
	}
	progress("building ./examples/proxy and ./examples/enginesim in %s", repo)
	proxyBin, engineBin := filepath.Join(dir, "proxy"), filepath.Join(dir, "enginesim")
	if err := benchenv.BuildProxy(ctx, repo, proxyBin); err != nil {
		return err
	}
	if err := benchenv.Build(ctx, repo, "./examples/enginesim", engineBin); err != nil {
		return err
	}

	f := &fleet{dir: dir}
	defer f.stop()
	if err := f.startAll(ctx, o, self, redisBin, engineBin, proxyBin); err != nil {
		return err
	}
	progress("fleet up: %d engines, %d proxies, Redis %s; load for %v at %v req/s", o.engines, len(f.proxies), f.redisAddr, o.duration, o.rate)

	t0 := time.Now()
	l := newLoader(f.proxyURLs, model, o.seed, t0)
	smp := &sampler{fleet: f, t0: t0}
	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	var bg sync.WaitGroup
	bg.Go(func() { smp.run(runCtx) })
	var faults []faultRecord
	bg.Go(func() { faults = f.inject(runCtx, o, sched, t0, progress) })
	l.runLoad(ctx, o.rate, o.hugeEvery, o.duration)
	cancelRun()
	bg.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	progress("load done: %d requests", len(l.outcomes))

	a := analyze(o, sched, faults, l.outcomes, smp.samples, len(f.proxies))
	a.env = env
	var md strings.Builder
	a.markdown(&md)
	fmt.Fprint(stdout, md.String())
	if o.out != "" {
		if err := a.writeFiles(o.out, md.String()); err != nil {
			return err
		}
		progress("wrote soak.md, soak.csv and soak.svg in %s", o.out)
	}
	if !a.pass() {
		return fmt.Errorf("failed: %s", strings.Join(a.failures(), "; "))
	}
	return nil
}

// startAll starts Redis, NATS, the engines with their relays, and the proxies.
func (f *fleet) startAll(ctx context.Context, o options, self, redisBin, engineBin, proxyBin string) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	f.redisAddr = "127.0.0.1:" + strconv.Itoa(port)
	f.redis = &proc{name: "redis", bin: redisBin, log: filepath.Join(f.dir, "redis.log"), ready: redisReady(f.redisAddr),
		args: []string{"--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no"}}
	if err := f.redis.start(ctx); err != nil {
		return err
	}
	natsURL := ""
	if o.replicas > 1 {
		if port, err = freePort(); err != nil {
			return err
		}
		addr := "127.0.0.1:" + strconv.Itoa(port)
		natsURL = "nats://" + addr
		f.nats = &proc{name: "nats", bin: self, log: filepath.Join(f.dir, "nats.log"), ready: tcpReady(addr),
			args: []string{natsCommand, "-port", strconv.Itoa(port), "-store", filepath.Join(f.dir, "jetstream")}}
		if err := f.nats.start(ctx); err != nil {
			return err
		}
	}
	var backends []backendInfo
	for i := range o.engines {
		ports := [3]int{}
		for j := range ports {
			if ports[j], err = freePort(); err != nil {
				return err
			}
		}
		name := fmt.Sprintf("engine-%d", i)
		url := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
		zmq, replay := fmt.Sprintf("127.0.0.1:%d", ports[1]), fmt.Sprintf("127.0.0.1:%d", ports[2])
		p := &proc{name: name, bin: engineBin, log: filepath.Join(f.dir, name+".log"), ready: httpReady(url + "/health"),
			args: []string{"-addr", fmt.Sprintf("127.0.0.1:%d", ports[0]), "-name", name, "-model", model,
				"-zmq-endpoint", "tcp://" + zmq, "-zmq-bind", "-replay-endpoint", "tcp://" + replay, "-shutdown-timeout", "1s"}}
		if err := p.start(ctx); err != nil {
			return err
		}
		rz, err := newRelay(zmq)
		if err != nil {
			return err
		}
		rr, err := newRelay(replay)
		if err != nil {
			return err
		}
		f.engines, f.names, f.relays = append(f.engines, p), append(f.names, name), append(f.relays, [2]*relay{rz, rr})
		backends = append(backends, backendInfo{name: name, url: url, zmq: "tcp://" + rz.addr(), replay: "tcp://" + rr.addr()})
	}
	for i := range o.replicas {
		if port, err = freePort(); err != nil {
			return err
		}
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		cfg := filepath.Join(f.dir, fmt.Sprintf("proxy-%d.yaml", i))
		y := proxyConfig(proxySettings{replica: i, replicas: o.replicas, port: port, redisAddr: f.redisAddr,
			natsURL: natsURL, index: o.index, backends: backends})
		if err := os.WriteFile(cfg, []byte(y), 0o600); err != nil {
			return err
		}
		p := &proc{name: fmt.Sprintf("proxy-%d", i), bin: proxyBin, log: filepath.Join(f.dir, fmt.Sprintf("proxy-%d.log", i)),
			ready: httpReady(url + "/healthz"), args: []string{"-config", cfg, "-log-format", "json"}}
		if err := p.start(ctx); err != nil {
			return err
		}
		f.proxies, f.proxyURLs = append(f.proxies, p), append(f.proxyURLs, url)
	}
	return nil
}

// backendInfo is what a proxy's configuration says of an engine.
type backendInfo struct{ name, url, zmq, replay string }

type proxySettings struct {
	replica, replicas, port int
	redisAddr, natsURL      string
	index                   string
	backends                []backendInfo
}

// proxyConfig returns the YAML of replica s.replica: the Redis response cache (memory fallback),
// the KV index with replica 0 subscribed to the engines' events, tokenization by the engines,
// probes every second, and with two replicas the NATS sync and (memory index) the event log.
func proxyConfig(s proxySettings) string {
	q := strconv.Quote
	var b strings.Builder
	fmt.Fprintf(&b, "server:\n  bind_address: \"127.0.0.1\"\n  port: %d\n", s.port)
	b.WriteString("log_level: warn\n")
	b.WriteString("prefix_routing:\n  enabled: true\n")
	fmt.Fprintf(&b, "response_cache:\n  enabled: true\n  backend: redis\n  ttl: \"1h\"\n  redis:\n    url: %s\n", q("redis://"+s.redisAddr))
	b.WriteString("    key_prefix: \"soak:resp:\"\n    fallback_to_memory: true\n    connect_timeout_ms: 1000\n    command_timeout_ms: 500\n")
	// The tokenizers' caches are kept small (4 MiB each, about 250 of the load's prompts) so that
	// they are full within the warm-up: a cache still filling reads as growth in RSS.
	fmt.Fprintf(&b, "kv_cache_index:\n  enabled: true\n  backend: %s\n  block_size: 16\n  tokenizer: engine\n  tokenize_cache_bytes: %d\n", s.index, 4<<20)
	if s.index == "redis" {
		fmt.Fprintf(&b, "  redis:\n    url: %s\n    key_prefix: \"soak:kv:\"\n", q("redis://"+s.redisAddr))
	}
	if s.replica == 0 {
		b.WriteString("  event_sources:\n")
		for _, e := range s.backends {
			fmt.Fprintf(&b, "    - {backend_name: %s, endpoint: %s, replay_endpoint: %s}\n", q(e.name), q(e.zmq), q(e.replay))
		}
	}
	b.WriteString("backends:\n")
	for _, e := range s.backends {
		fmt.Fprintf(&b, "  - {name: %s, url: %s, model: %s}\n", q(e.name), q(e.url), q(model))
	}
	b.WriteString("health_checks:\n  interval: \"1s\"\n  timeout: \"1s\"\n  unhealthy_threshold: 2\n  healthy_threshold: 1\n")
	b.WriteString("circuit_breaker:\n  enabled: true\n  failure_threshold: 3\n  recovery_timeout: \"3s\"\n")
	if s.replicas > 1 {
		fmt.Fprintf(&b, "replicas:\n  enabled: true\n  nats_url: %s\n  group: soak\n  replica_id: %s\n  heartbeat: \"1s\"\n  peer_timeout: \"3s\"\n",
			q(s.natsURL), q(fmt.Sprintf("soak-%d", s.replica)))
		if s.index == "memory" {
			b.WriteString("  event_log:\n    enabled: true\n    snapshot_interval: \"20s\"\n")
		}
	}
	return b.String()
}

// faultRecord is one injected fault as it happened.
type faultRecord struct {
	slot
	label      string
	start, end time.Duration // injected; over (the process restarted, the stream restored, the attack over)
	ready      time.Duration // the fault's own sign of recovery, from the start of the load; -1: none seen
	note       string
}

// inject runs the schedule from t0 and returns what happened.
func (f *fleet) inject(ctx context.Context, o options, sched []slot, t0 time.Time, progress func(string, ...any)) []faultRecord {
	var recs []faultRecord
	since := func() time.Duration { return time.Since(t0) }
	for _, s := range sched {
		select {
		case <-ctx.Done():
			return recs
		case <-time.After(time.Until(t0.Add(s.at))):
		}
		r := faultRecord{slot: s, start: since(), ready: -1}
		deadline := t0.Add(s.slotEnd)
		sleep := func(d time.Duration) {
			select {
			case <-ctx.Done():
			case <-time.After(d):
			}
		}
		switch s.fault {
		case faultEngine:
			p := f.engines[s.target%len(f.engines)]
			r.label = "engine " + p.name + " killed"
			p.kill()
			sleep(o.downtime)
			if err := p.start(ctx); err != nil {
				r.note = "restart failed: " + err.Error()
			}
			r.end = since()
		case faultRedis:
			keys, _ := redisCommand(f.redisAddr, "DBSIZE")
			r.label = "Redis killed"
			r.note = "Redis held " + keys + " keys"
			f.redis.kill()
			sleep(o.downtime)
			if err := f.redis.start(ctx); err != nil {
				r.note += "; restart failed: " + err.Error()
			}
			r.end = since()
			r.ready = pollUntil(ctx, deadline, t0, func() bool {
				n, err := redisCommand(f.redisAddr, "DBSIZE")
				return err == nil && n != "0"
			})
		case faultNATS:
			r.label = "NATS killed"
			if f.nats == nil {
				r.note = "no NATS (one replica)"
				r.end, r.ready = since(), since()
				break
			}
			f.nats.kill()
			sleep(o.downtime)
			if err := f.nats.start(ctx); err != nil {
				r.note = "restart failed: " + err.Error()
			}
			r.end = since()
			r.ready = pollUntil(ctx, deadline, t0, func() bool { return f.replicasConnected(ctx) })
		case faultEvents:
			i := s.target % len(f.engines)
			r.label = "events of " + f.names[i] + " cut"
			f.relays[i][0].setCut(true)
			f.relays[i][1].setCut(true)
			sleep(o.downtime)
			before := f.eventsReceived(ctx, f.names[i])
			f.relays[i][0].setCut(false)
			f.relays[i][1].setCut(false)
			r.end = since()
			r.ready = pollUntil(ctx, deadline, t0, func() bool { return f.eventsReceived(ctx, f.names[i]) > before })
		case faultStall:
			r.label = fmt.Sprintf("%d stalled bodies", o.stallConns)
			addr := strings.TrimPrefix(f.proxyURLs[0], "http://")
			closed, last := stalled(ctx, addr, o.stallConns, o.stallFor)
			r.end = since()
			r.note = fmt.Sprintf("proxy closed %d of %d", closed, o.stallConns)
			if closed > 0 {
				r.note += fmt.Sprintf(", the last after %.1f s", last.Seconds())
			}
		}
		progress("%5.1fs %s (over at %.1fs) %s", r.start.Seconds(), r.label, r.end.Seconds(), r.note)
		recs = append(recs, r)
	}
	return recs
}

// pollUntil polls cond every 200 ms until it holds (its time from t0) or deadline (-1).
func pollUntil(ctx context.Context, deadline, t0 time.Time, cond func() bool) time.Duration {
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if cond() {
			return time.Since(t0)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return -1
}

var adminClient = &http.Client{Timeout: 2 * time.Second}

// get GETs url with client and returns the body of its 200 answer (any other status is an error).
func get(ctx context.Context, client *http.Client, url string) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return resp.Body, nil
}

func getJSON(ctx context.Context, url string, v any) error {
	body, err := get(ctx, adminClient, url)
	if err != nil {
		return err
	}
	defer body.Close()
	return json.NewDecoder(body).Decode(v)
}

// replicasConnected reports whether every replica is connected to NATS and sees the others.
func (f *fleet) replicasConnected(ctx context.Context) bool {
	for _, u := range f.proxyURLs {
		var v struct {
			Sync struct {
				Connected bool              `json:"connected"`
				Peers     []json.RawMessage `json:"peers"`
			} `json:"sync"`
		}
		if getJSON(ctx, u+"/admin/replicas/stats", &v) != nil || !v.Sync.Connected || len(v.Sync.Peers) < len(f.proxyURLs)-1 {
			return false
		}
	}
	return true
}

// eventsReceived returns the events replica 0 received from backend's sources.
func (f *fleet) eventsReceived(ctx context.Context, backend string) uint64 {
	var v struct {
		Backends []struct {
			Name   string `json:"backend_name"`
			Events struct {
				Received uint64 `json:"received"`
			} `json:"events"`
		} `json:"backends"`
	}
	if getJSON(ctx, f.proxyURLs[0]+"/admin/kv-index/backends", &v) != nil {
		return 0
	}
	for _, b := range v.Backends {
		if b.Name == backend {
			return b.Events.Received
		}
	}
	return 0
}

// sample is one second's reading of every proxy.
type sample struct {
	at      time.Duration
	proxies []proxySample
}

type proxySample struct {
	up              bool
	rss             int64
	fds, goroutines int
	kvAware         float64 // kvroute_kv_index_routing_decisions_total{decision="kv_aware"}
	kvTotal         float64 // the same, every decision
}

// sampler reads the proxies every second.
type sampler struct {
	fleet   *fleet
	t0      time.Time
	samples []sample
}

func (s *sampler) run(ctx context.Context) {
	for k := 1; ; k++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(s.t0.Add(time.Duration(k) * time.Second))):
		}
		sm := sample{at: time.Since(s.t0)}
		for i, p := range s.fleet.proxies {
			var ps proxySample
			if pid := p.pid(); pid != 0 {
				if rss, fds, err := procStats(pid); err == nil {
					ps.rss, ps.fds = rss, fds
					ps.up = scrape(ctx, s.fleet.proxyURLs[i]+"/metrics", &ps) == nil
				}
			}
			sm.proxies = append(sm.proxies, ps)
		}
		s.samples = append(s.samples, sm)
	}
}

// scrape reads go_goroutines and the tier-4 decision counters from a Prometheus text page.
func scrape(ctx context.Context, url string, ps *proxySample) error {
	body, err := get(ctx, adminClient, url)
	if err != nil {
		return err
	}
	defer body.Close()
	return parseMetrics(body, ps)
}

// parseMetrics fills ps's goroutines and decision counters from a Prometheus text exposition.
func parseMetrics(r io.Reader, ps *proxySample) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	seen := false
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		if sp < 0 {
			continue
		}
		name, value := line[:sp], line[sp+1:]
		switch {
		case name == "go_goroutines":
			n, err := strconv.ParseFloat(value, 64)
			if err != nil {
				return fmt.Errorf("go_goroutines %q: %w", value, err)
			}
			ps.goroutines, seen = int(n), true
		case strings.HasPrefix(name, "kvroute_kv_index_routing_decisions_total{"):
			n, err := strconv.ParseFloat(value, 64)
			if err != nil {
				return fmt.Errorf("%s %q: %w", name, value, err)
			}
			ps.kvTotal += n
			if strings.Contains(name, `decision="kv_aware"`) {
				ps.kvAware += n
			}
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if !seen {
		return fmt.Errorf("no go_goroutines in the metrics")
	}
	return nil
}
