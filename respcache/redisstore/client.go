package redisstore

import "github.com/redis/rueidis"

// ClientOption returns the rueidis options New would create its client with from cfg's connection
// fields (URL, TLS, TLSConfig, Username, Password, PoolSize, ConnectTimeout, CommandTimeout,
// ClientSideCaching, ClientCacheBytes; zero values mean their defaults): retries off, so that a
// failure falls back at once, and with ClientSideCaching one connection per server, so that the
// store reads its own writes. Build a client from them to share with another user of the same
// server (a redisindex.Index) and pass it to NewWithClient with the connection fields zeroed.
// Errors wrap respcache.ErrInvalidConfig; they never echo the password. ClientOption is a pure
// function, safe for concurrent use.
func ClientOption(cfg Config) (rueidis.ClientOption, error) {
	if err := normalise(&cfg); err != nil {
		return rueidis.ClientOption{}, err
	}
	applyClientDefaults(&cfg)
	return clientOptions(cfg)
}
