package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvroute/kvroute/benchmarks/internal/benchenv"
)

// errInterrupted is measure's error when its context ends (SIGINT or SIGTERM) before the table.
var errInterrupted = errors.New("interrupted: no table")

// measure runs the whole measurement of o and writes the table to stdout; progress goes to
// stderr. Everything it starts is stopped before it returns.
func measure(ctx context.Context, o options, stdout, stderr io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // kills the children (exec.CommandContext) whatever happens below
	progress := func(format string, a ...any) { fmt.Fprintf(stderr, "overhead: "+format+"\n", a...) }

	repo, err := benchenv.ModuleRoot(ctx, o.repo)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding this program to run the engine and the relay: %w", err)
	}
	dir, err := os.MkdirTemp("", "kvroute-overhead-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	proxyBin, proxyDesc := o.proxy, "the binary "+o.proxy
	if proxyBin == "" {
		before := benchenv.GitDescribe(ctx, repo)
		progress("building ./examples/proxy in %s", repo)
		proxyBin = filepath.Join(dir, "proxy")
		if err := benchenv.BuildProxy(ctx, repo, proxyBin); err != nil {
			return err
		}
		proxyDesc = "go build ./examples/proxy at " + before
		if after := benchenv.GitDescribe(ctx, repo); after != before {
			proxyDesc += " (" + after + " when the build ended)"
		}
	}
	goVersion, err := goVersion(ctx)
	if err != nil {
		return err
	}

	var children []*child
	defer func() {
		for _, c := range children {
			c.Stop()
		}
	}()
	start := func(name, bin string, args []string, banner string, isURL bool) (*child, error) {
		c, err := startChild(ctx, name, dir, bin, args, banner, isURL)
		if err == nil {
			children = append(children, c)
		}
		return c, err
	}
	engine, err := start("engine", self, []string{engineCommand}, engineBanner, false)
	if err != nil {
		return err
	}
	eng, err := parseEngineInfo(engine.announce)
	if err != nil {
		return err
	}
	relayArgs := []string{relayCommand, "-upstream", eng.URL, "-max-idle", strconv.Itoa(2 * o.conns)}
	if o.profDir != "" {
		relayArgs = append(relayArgs, "-pprof", "127.0.0.1:0")
	}
	relay, err := start("relay", self, relayArgs, relayBanner, true)
	if err != nil {
		return err
	}
	var proxies [2]*child
	for i, all := range []bool{false, true} {
		name := [2]string{"proxy-tier1", "proxy-all-tiers"}[i]
		cfgPath := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(cfgPath, []byte(proxyConfig(eng, all, o.tokenizer)), 0o600); err != nil {
			return err
		}
		args := []string{"-config", cfgPath, "-addr", "127.0.0.1:0"}
		if o.profDir != "" {
			args = append(args, "-pprof", "127.0.0.1:0")
		}
		if proxies[i], err = start(name, proxyBin, args, proxyBanner, true); err != nil {
			return err
		}
	}
	// kvroute-epp's targets: a picker and a gateway in front of it for each of (f) to (h).
	var pickers, gateways []*child
	if o.epp {
		for i, name := range []string{"picker-noop", "picker-tier1", "picker-kv-index"} {
			args := []string{pickerCommand, "-noop", hostPort(eng.URL)}
			if i > 0 {
				cfgPath := filepath.Join(dir, name+".yaml")
				if err := os.WriteFile(cfgPath, []byte(pickerConfig(eng, i == 2, o.tokenizer)), 0o600); err != nil {
					return err
				}
				args = []string{pickerCommand, "-config", cfgPath}
			}
			if o.profDir != "" {
				args = append(args, "-pprof", "127.0.0.1:0")
			}
			p, err := start(name, self, args, pickerBanner, false)
			if err != nil {
				return err
			}
			g, err := start("gateway-"+strings.TrimPrefix(name, "picker-"), self, []string{gatewayCommand,
				"-extproc", p.announce, "-max-idle", strconv.Itoa(2 * o.conns)}, gatewayBanner, true)
			if err != nil {
				return err
			}
			pickers, gateways = append(pickers, p), append(gateways, g)
		}
	}
	// The processes whose CPU time the table gives: the load generator (0), the engine, the relay,
	// the proxies, then the pickers and their gateways; targets[i].front indexes it.
	pids := []int{0, engine.cmd.Process.Pid, relay.cmd.Process.Pid, proxies[0].cmd.Process.Pid, proxies[1].cmd.Process.Pid}
	for _, c := range slices.Concat(pickers, gateways) {
		pids = append(pids, c.cmd.Process.Pid)
	}
	var prof *profiler
	if o.profDir != "" {
		if err := os.MkdirAll(o.profDir, 0o755); err != nil {
			return err
		}
		prof = &profiler{dir: o.profDir, addr: make([]string, len(pids))}
		for i, c := range slices.Concat([]*child{relay, proxies[0], proxies[1]}, pickers) {
			if prof.addr[2+i], err = pprofAddr(ctx, c); err != nil {
				return err
			}
		}
	}

	const path = "/v1/chat/completions"
	targets := []*target{
		{id: "a", name: "engine direct", url: eng.URL + path, body: chatBody(eng.Model, "a", o.maxTokens, true), front: 1},
		{id: "b", name: "bare relay (ReverseProxy)", url: relay.url + path, body: chatBody(eng.Model, "b", o.maxTokens, true), front: 2},
		{id: "c", name: "proxy, tier 1", url: proxies[0].url + path, body: chatBody(eng.Model, "c", o.maxTokens, true), front: 3},
		{id: "d", name: "proxy, cache + KV index, MISS", url: proxies[1].url + path, body: chatBody(eng.Model, "d", o.maxTokens, true), xcache: "MISS", front: 4},
		{id: "e", name: "proxy, cache HIT", url: proxies[1].url + path, body: chatBody(eng.Model, "e", o.maxTokens, false), xcache: "HIT", front: 4},
	}
	if o.epp {
		targets = append(targets,
			&target{id: "f", name: "envoysim + no-op ext_proc", url: gateways[0].url + path, body: chatBody(eng.Model, "f", o.maxTokens, true), front: 5},
			&target{id: "g", name: "envoysim + kvroute-epp, tier 1", url: gateways[1].url + path, body: chatBody(eng.Model, "g", o.maxTokens, true), front: 6},
			&target{id: "h", name: "envoysim + kvroute-epp, KV index", url: gateways[2].url + path, body: chatBody(eng.Model, "h", o.maxTokens, true), front: 7},
		)
	}
	cpu := newCPUMeter(pids)
	for _, t := range targets {
		t.clients = newClients(max(o.conns, 1))
	}
	defer closeClients(targets)
	if err := ready(ctx, targets); err != nil {
		if ctx.Err() != nil {
			return errInterrupted
		}
		return errors.Join(err, childrenExited(children))
	}

	loads := []load{
		{name: "1 connection, closed loop", conns: 1},
		{name: fmt.Sprintf("%d connections, open loop at %g req/s", o.conns, o.rate), conns: o.conns, rate: o.rate},
	}
	res := newResults(targets, loads, o.rounds)
	loadBefore := loadAverage()
	if o.warmup > 0 {
		progress("warming up: %v per target and load", o.warmup)
		for _, l := range loads {
			for _, t := range targets {
				s := l.run(ctx, t, o.warmup)
				if ctx.Err() != nil {
					return errInterrupted
				}
				if s.errors > 0 {
					return errors.Join(fmt.Errorf("warm-up, (%s) %s, %s: %d requests failed, the first: %v",
						t.id, t.name, l.name, s.errors, s.firstErr), childrenExited(children))
				}
			}
		}
	}
	for r := range o.rounds {
		progress("round %d of %d", r+1, o.rounds)
		for li, l := range loads {
			for k := range targets {
				ti := (k + r) % len(targets) // the order rotates each round
				profiled := prof.start(ctx, targets[ti], o.duration, fmt.Sprintf("%s-%dconn-round%d.pprof", targets[ti].id, l.conns, r+1))
				cpu.begin()
				s := l.run(ctx, targets[ti], o.duration)
				s.cpu = cpu.end()
				res.add(li, ti, r, s)
				if ctx.Err() != nil {
					return errInterrupted
				}
				if err := profiled(); err != nil {
					return fmt.Errorf("profile of (%s): %w", targets[ti].id, err)
				}
			}
		}
		if err := childrenExited(children); err != nil {
			return err
		}
	}

	env := describeEnv(goVersion, o, proxyDesc, loadBefore)
	res.write(stdout, env, o)
	if n := res.errors(); n > 0 {
		return fmt.Errorf("%d requests failed (see the table's errors column); the first: %v", n, res.firstErr())
	}
	return nil
}

// ready sends each target requests until one succeeds, for up to childStartTimeout: the proxies
// serve once their tiers have started. For (e) the first answer, a MISS, fills the response cache
// and a later one is the HIT it waits for.
func ready(ctx context.Context, ts []*target) error {
	deadline := time.Now().Add(childStartTimeout)
	for _, t := range ts {
		for {
			err := t.do(ctx, t.clients[0])
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("(%s) %s at %s: not ready within %v: %w", t.id, t.name, t.url, childStartTimeout, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

// childrenExited returns an error describing the children that have exited, if any.
func childrenExited(cs []*child) error {
	var errs []error
	for _, c := range cs {
		errs = append(errs, c.exited())
	}
	return errors.Join(errs...)
}
