package stack

import "github.com/kvroute/kvroute/config"

// MetricsTargets maps each backend of cfg to its engine's metrics URL, the scrape targets of
// engine_metrics: the backend's metrics_url, or its url with engine_metrics.path appended (one
// slash between them). It only reads cfg.
func MetricsTargets(cfg *config.Config) map[string]string {
	out := make(map[string]string, len(cfg.Backends))
	for _, b := range cfg.Backends {
		if b.MetricsURL != "" {
			out[b.Name] = b.MetricsURL
			continue
		}
		out[b.Name] = joinURLPath(b.URL, cfg.EngineMetrics.Path)
	}
	return out
}

// joinURLPath appends path to base's path.
func joinURLPath(base, path string) string {
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	return base + path
}

// natsIDPart keeps the letters, digits, - and _ of s (at most 40), for a replica id.
func natsIDPart(s string) string {
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s) && len(b) < 40; i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b = append(b, c)
		}
	}
	if len(b) == 0 {
		return "kvroute"
	}
	return string(b)
}
