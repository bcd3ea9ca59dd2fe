package kvroutecaddy

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"
)

// UnmarshalCaddyfile sets up the handler from the kvroute directive:
//
//	kvroute [<upstreams...>] {
//		backends <upstreams...>
//		backend <upstream> {
//			weight <weight>
//			model  <model>
//			url    <engine HTTP root, for /tokenize>
//			zmq    <events endpoint> [<replay endpoint>]
//		}
//		max_body_size      <size>
//		selection_strategy round_robin|least_loaded|random|least_latency
//		prefix_routing off
//		prefix_routing {
//			max_prefix_length   <bytes>
//			load_factor_epsilon <ε>
//			virtual_nodes       <n>
//		}
//		kv_index [memory|redis [<redis url>]] {
//			block_size            <tokens>
//			max_entries           <n>
//			entry_ttl             <duration>
//			min_overlap_threshold <fraction>
//			load_factor_epsilon   <ε>
//			speculation           speculate|approximate|off
//		}
//		tokenizer engine|estimate|none [<timeout>]
//		response_cache [memory|redis [<redis url>]] {
//			capacity          <entries>
//			ttl               <duration>
//			max_response_size <size>
//			tenant_header     <header>
//		}
//		response_headers off
//	}
//
// The upstreams are the reverse_proxy's, written the same way.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive's name
	for d.NextArg() {
		h.Backends = append(h.Backends, Backend{Address: d.Val()})
	}
	for d.NextBlock(0) {
		var err error
		switch d.Val() {
		case "backends":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			for _, a := range args {
				h.Backends = append(h.Backends, Backend{Address: a})
			}
		case "backend":
			err = h.unmarshalBackend(d)
		case "max_body_size":
			var s string
			if s, err = oneArg(d); err == nil {
				var n uint64
				if n, err = humanize.ParseBytes(s); err != nil || n == 0 || n > 1<<40 {
					return d.Errf("max_body_size %q: want a size such as 8MiB", s)
				}
				h.MaxBodySize = int64(n)
			}
		case "selection_strategy":
			h.SelectionStrategy, err = oneArg(d)
		case "prefix_routing":
			err = h.unmarshalPrefixRouting(d)
		case "kv_index":
			err = h.unmarshalKVIndex(d)
		case "tokenizer":
			args := d.RemainingArgs()
			if len(args) < 1 || len(args) > 2 {
				return d.ArgErr()
			}
			h.Tokenizer = &Tokenizer{Mode: args[0]}
			if len(args) == 2 {
				h.Tokenizer.Timeout, err = duration(d, args[1])
			}
		case "response_cache":
			err = h.unmarshalResponseCache(d)
		case "response_headers":
			var s string
			if s, err = oneArg(d); err == nil && s != "off" {
				return d.Errf("response_headers %q: the only value is off", s)
			}
			h.DisableResponseHeaders = true
		default:
			return d.Errf("unrecognized kvroute option '%s'", d.Val())
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (h *Handler) unmarshalBackend(d *caddyfile.Dispenser) error {
	addr, err := oneArg(d)
	if err != nil {
		return err
	}
	b := Backend{Address: addr}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "weight":
			b.Weight, err = floatArg(d)
		case "model":
			b.Model, err = oneArg(d)
		case "url":
			b.URL, err = oneArg(d)
		case "zmq":
			args := d.RemainingArgs()
			if len(args) < 1 || len(args) > 2 {
				return d.ArgErr()
			}
			b.ZMQEndpoint = args[0]
			if len(args) == 2 {
				b.ZMQReplayEndpoint = args[1]
			}
		default:
			return d.Errf("unrecognized backend option '%s'", d.Val())
		}
		if err != nil {
			return err
		}
	}
	h.Backends = append(h.Backends, b)
	return nil
}

func (h *Handler) unmarshalPrefixRouting(d *caddyfile.Dispenser) error {
	p := new(PrefixRouting)
	h.PrefixRouting = p
	if d.NextArg() {
		if d.Val() != "off" {
			return d.Errf("prefix_routing %q: the only argument is off", d.Val())
		}
		p.Disabled = true
		if d.NextArg() {
			return d.ArgErr()
		}
		return nil
	}
	var err error
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "max_prefix_length":
			p.MaxPrefixLength, err = intArg(d)
		case "load_factor_epsilon":
			p.LoadFactorEpsilon, err = floatArg(d)
		case "virtual_nodes":
			p.VirtualNodes, err = intArg(d)
		default:
			return d.Errf("unrecognized prefix_routing option '%s'", d.Val())
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (h *Handler) unmarshalKVIndex(d *caddyfile.Dispenser) error {
	x := new(KVIndex)
	h.KVIndex = x
	args := d.RemainingArgs()
	if len(args) > 2 || len(args) == 2 && args[0] != "redis" {
		return d.ArgErr()
	}
	if len(args) > 0 {
		x.Backend = args[0]
	}
	if len(args) == 2 {
		x.RedisURL = args[1]
	}
	var err error
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "block_size":
			x.BlockSize, err = intArg(d)
		case "max_entries":
			x.MaxEntries, err = intArg(d)
		case "entry_ttl":
			var s string
			if s, err = oneArg(d); err == nil {
				x.EntryTTL, err = duration(d, s)
			}
		case "min_overlap_threshold":
			x.MinOverlapThreshold, err = floatArg(d)
		case "load_factor_epsilon":
			x.LoadFactorEpsilon, err = floatArg(d)
		case "speculation":
			x.Speculation, err = oneArg(d)
		default:
			return d.Errf("unrecognized kv_index option '%s'", d.Val())
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (h *Handler) unmarshalResponseCache(d *caddyfile.Dispenser) error {
	rc := new(ResponseCache)
	h.ResponseCache = rc
	args := d.RemainingArgs()
	if len(args) > 2 || len(args) == 2 && args[0] != "redis" {
		return d.ArgErr()
	}
	if len(args) > 0 {
		rc.Backend = args[0]
	}
	if len(args) == 2 {
		rc.RedisURL = args[1]
	}
	var err error
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "capacity":
			rc.Capacity, err = intArg(d)
		case "ttl":
			var s string
			if s, err = oneArg(d); err == nil {
				rc.TTL, err = duration(d, s)
			}
		case "max_response_size":
			var s string
			if s, err = oneArg(d); err == nil {
				var n uint64
				if n, err = humanize.ParseBytes(s); err != nil || n > 1<<40 {
					return d.Errf("max_response_size %q: want a size such as 1MiB", s)
				}
				rc.MaxResponseSize = int(n)
			}
		case "tenant_header":
			rc.TenantHeader, err = oneArg(d)
		default:
			return d.Errf("unrecognized response_cache option '%s'", d.Val())
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// oneArg returns the option's one argument.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return v, nil
}

func intArg(d *caddyfile.Dispenser) (int, error) {
	s, err := oneArg(d)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, d.Errf("%q: want an integer", s)
	}
	return n, nil
}

func floatArg(d *caddyfile.Dispenser) (float64, error) {
	s, err := oneArg(d)
	if err != nil {
		return 0, err
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, d.Errf("%q: want a number", s)
	}
	return f, nil
}

func duration(d *caddyfile.Dispenser, s string) (caddy.Duration, error) {
	v, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, d.Errf("%q: want a duration such as 5m (%v)", s, err)
	}
	return caddy.Duration(v), nil
}

// Interface guard.
var _ caddyfile.Unmarshaler = (*Handler)(nil)
