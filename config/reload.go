package config

import (
	"reflect"
	"strings"
)

// LiveSettings returns the settings a running gateway can take from a new configuration without a
// restart, as YAML paths (a path covers every setting under it). The reference proxy applies them
// on SIGHUP by building a new Router, health monitor and handler over the running response
// cache, KV index and event consumers, and swapping them in whole: a request keeps the ones it
// started with. Every other setting (the listener, the stores, the index and its event sources,
// the cache's other settings…) needs a restart. The slice is the caller's.
func LiveSettings() []string {
	return []string{
		"admin",
		"server.memory_limit",
		"selection_strategy",
		"prefix_routing",
		"response_cache.ttl",
		"kv_cache_index.tokenizer",
		"kv_cache_index.tokenize_timeout",
		"kv_cache_index.tokenize_cache_bytes",
		"kv_cache_index.speculation",
		"kv_cache_index.scoring.scorer",
		"kv_cache_index.scoring.overlap_weight",
		"kv_cache_index.scoring.load_weight",
		"kv_cache_index.scoring.health_weight",
		"kv_cache_index.scoring.cache_weight",
		"kv_cache_index.scoring.attention_cost",
		"kv_cache_index.scoring.min_overlap_threshold",
		"kv_cache_index.scoring.load_factor_epsilon",
		"backends",
		"health_checks",
		"circuit_breaker",
		"disaggregated_serving",
		"log_level",
	}
}

// ReloadPlan is what moving a running gateway from one configuration to another changes: see
// PlanReload.
type ReloadPlan struct {
	// Next is the configuration to run from now on: the new configuration's live settings over the
	// running configuration's other settings. It shares values with both; treat it as read-only.
	Next *Config
	// Live are the changed live settings (LiveSettings), which Next has, as YAML paths in schema order
	// (e.g. "admin.auth_token", "backends", "kv_cache_index.scoring.min_overlap_threshold").
	Live []string
	// Restart are the changed settings that need a restart (e.g. "server.port"); Next keeps their
	// running values.
	Restart []string
}

// PlanReload compares the running configuration with a new one (both valid: Parse, Load, or
// ApplyDefaults then Validate) and says which changes apply at once (LiveSettings) and which need a
// restart. One live setting is held back: a new configuration without admin.auth_token
// where the running one has a token keeps the token in force (listed in Restart), since removing
// it would open the admin endpoints to loopback clients — every client, behind a reverse proxy on
// the same host — without anyone restarting on purpose. Slices and maps compare whole: a change in one backend is a change of "backends".
// When neither list has entries, nothing changed. PlanReload only reads running and next; it is
// safe for concurrent use.
func PlanReload(running, next *Config) ReloadPlan {
	merged := *next
	p := ReloadPlan{Next: &merged}
	p.diff("", reflect.ValueOf(running).Elem(), reflect.ValueOf(next).Elem(), reflect.ValueOf(&merged).Elem())
	return p
}

// diff walks the struct values old and neu (of the same type), recording each changed leaf under
// prefix and setting merged's restart-only leaves back to old's.
func (p *ReloadPlan) diff(prefix string, old, neu, merged reflect.Value) {
	t := old.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		o, n := old.Field(i), neu.Field(i)
		switch {
		case reflect.DeepEqual(o.Interface(), n.Interface()):
		case f.Type.Kind() == reflect.Struct:
			p.diff(path, o, n, merged.Field(i))
		case path == "admin.auth_token" && o.String() != "" && n.String() == "":
			// Removing the token opens the admin endpoints to loopback clients, and behind a
			// reverse proxy on the same host every client is one: never from a reload.
			p.Restart = append(p.Restart, path)
			merged.Field(i).Set(o)
		case isLive(path):
			p.Live = append(p.Live, path)
		default:
			p.Restart = append(p.Restart, path)
			merged.Field(i).Set(o)
		}
	}
}

// isLive reports whether path is one of LiveSettings or under one.
func isLive(path string) bool {
	for _, l := range LiveSettings() {
		if path == l || strings.HasPrefix(path, l+".") {
			return true
		}
	}
	return false
}
