package config

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/kvroute/kvroute/internal/testenv"
	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/redisstore"
)

// redisConnections returns the number of connections of each client name in names that the
// Redis at addr has open (CLIENT LIST): a rueidis client to a single server pipelines every
// command over one connection, so it counts the clients using that name.
func redisConnections(t *testing.T, addr string, names ...string) map[string]int {
	t.Helper()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	list, err := c.Do(context.Background(), c.B().ClientList().Build()).ToString()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, line := range strings.Split(list, "\n") {
		for _, n := range names {
			if strings.Contains(line, " name="+n+" ") {
				got[n]++
			}
		}
	}
	return got
}

// indexWorks speculates three blocks on backend a and finds them. Speculate and Lookup run on the
// routing path, under the index's 50 ms command timeout: the first commands of a fresh client
// (connecting, loading the scripts) can miss it on a loaded machine, so a call that fails with
// kvindex.ErrUnavailable is tried again for up to 5 s; any other error fails at once.
func indexWorks(t *testing.T, ix kvindex.KvCacheIndex) {
	t.Helper()
	ctx := context.Background()
	keys := []uint64{1, 2, 3}
	retry := func(what string, call func() error) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			err := call()
			if err == nil {
				return
			}
			if !errors.Is(err, kvindex.ErrUnavailable) || time.Now().After(deadline) {
				t.Fatalf("%s: %v", what, err)
			}
		}
	}
	retry("Speculate", func() error { return ix.(kvindex.Speculator).Speculate(ctx, "a", keys, time.Minute) })
	var m []kvindex.Match
	retry("Lookup", func() (err error) {
		m, err = ix.Lookup(ctx, keys, []string{"a"}, make([]kvindex.Match, 1))
		return err
	})
	if len(m) != 1 || m[0].Blocks != 3 {
		t.Fatalf("Lookup: %+v", m)
	}
}

// The response cache and the KV index on one Redis URL share one client, on two URLs each has its
// own; both work either way, and closeAll closes the shared client last. The clients are counted
// on the server by the client_name of their URL: with client_cache a client uses one connection
// per server, so one connection under the response cache's name is one client for both; without
// it a client may pipeline over up to four, and the test checks that the index opened none of
// its own.
func TestNewStoresRedisClients(t *testing.T) {
	addr := testenv.RedisAddr(t)
	for _, tc := range []struct {
		name   string
		kv     string // kv_cache_index.redis.url; "" inherits response_cache.redis.url
		extra  string // more response_cache.redis settings
		shared bool
	}{
		{name: "index URL unset, client cache", extra: ", client_cache: true, client_cache_ttl_seconds: 30", shared: true},
		{name: "index URL equal, client cache", kv: "redis://ADDR/0?client_name=RC", extra: ", client_cache: true", shared: true},
		{name: "index URL unset", shared: true},
		{name: "two URLs", kv: "redis://ADDR/0?client_name=KV"},
		{name: "two URLs, client cache", kv: "redis://ADDR/0?client_name=KV", extra: ", client_cache: true"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rcName, kvName := "kvroute-test-rc-"+testenv.RandHex(), "kvroute-test-kv-"+testenv.RandHex()
			kv := strings.NewReplacer("ADDR", addr, "RC", rcName, "KV", kvName).Replace(tc.kv)
			yaml := minimalBackends + `
response_cache:
  enabled: true
  backend: redis
  redis: {url: "redis://${REDIS_ADDR}/0?client_name=${RC}", key_prefix: "kvroute-test:stores:${P}:"` + tc.extra + `}
kv_cache_index:
  enabled: true
  backend: redis
  redis: {url: "${KV}", key_prefix: "kvroute-test:stores:${P}:kv:"}
`
			cfg := mustParse(t, yaml, map[string]string{"REDIS_ADDR": addr, "RC": rcName, "KV": kv, "P": testenv.RandHex()})
			if got := cfg.SharesRedis(); got != tc.shared {
				t.Errorf("SharesRedis %v, want %v", got, tc.shared)
			}
			cache, ix, closeAll, err := cfg.NewStores(Options{})
			if err != nil {
				t.Fatal(err)
			}
			missThenHit(t, cache)
			indexWorks(t, ix)
			clientCache := strings.Contains(tc.extra, "client_cache: true")
			got := redisConnections(t, addr, rcName, kvName)
			switch {
			case clientCache && got[rcName] != 1:
				t.Errorf("%d connections under the response cache's client name, want 1 (one client, client cache on)", got[rcName])
			case got[rcName] < 1 || got[rcName] > 4:
				t.Errorf("%d connections under the response cache's client name, want 1 to 4 (one client)", got[rcName])
			case tc.shared && got[kvName] != 0, !tc.shared && got[kvName] < 1:
				t.Errorf("%d connections under the index's own client name (shared %v)", got[kvName], tc.shared)
			}
			if clientCache {
				c, _ := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
				list, _ := c.Do(context.Background(), c.B().ClientList().Build()).ToString()
				c.Close()
				if !trackingOn(list, rcName) {
					t.Errorf("the response cache's client does not track keys (client-side caching off):\n%s", list)
				}
			}
			if err := closeAll(); err != nil {
				t.Error(err)
			}
			if err := closeAll(); err != nil {
				t.Errorf("second closeAll: %v", err)
			}
			waitConnections(t, addr, rcName, kvName)
		})
	}
}

// trackingOn reports whether the connection named name has CLIENT TRACKING on (flag t).
func trackingOn(list, name string) bool {
	for _, line := range strings.Split(list, "\n") {
		if !strings.Contains(line, " name="+name+" ") {
			continue
		}
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "flags="); ok && strings.Contains(v, "t") {
				return true
			}
		}
	}
	return false
}

// waitConnections waits until no connection carries any of names: closeAll closed every client.
func waitConnections(t *testing.T, addr string, names ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := redisConnections(t, addr, names...)
		if len(got) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("connections left open after closeAll: %v", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Without Redis in both, NewStores builds what NewResponseCache and NewKVIndex build; a shared
// client to a Redis that is down starts the store in fallback, and fails with fallback off.
func TestNewStoresWithoutSharing(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		cfg := mustParse(t, minimalBackends+`
response_cache: {enabled: true}
kv_cache_index: {enabled: true}
`, nil)
		cache, ix, closeAll, err := cfg.NewStores(Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAll()
		if cfg.SharesRedis() || cache == nil || ix == nil {
			t.Fatalf("shares %v, cache %v, index %v", cfg.SharesRedis(), cache, ix)
		}
		missThenHit(t, cache)
		indexWorks(t, ix)
	})
	t.Run("off", func(t *testing.T) {
		cache, ix, closeAll, err := mustParse(t, minimalBackends, nil).NewStores(Options{})
		if err != nil || cache != nil || ix != nil || closeAll() != nil {
			t.Fatalf("%v %v %v", cache, ix, err)
		}
	})
	down := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	shared := minimalBackends + `
response_cache: {enabled: true, backend: redis, redis: {url: "redis://` + down + `", connect_timeout_ms: 200, fallback_to_memory: FALLBACK}}
kv_cache_index: {enabled: true, backend: redis}
`
	t.Run("redis down, fallback on", func(t *testing.T) {
		cfg := mustParse(t, strings.Replace(shared, "FALLBACK", "true", 1), nil)
		cache, ix, closeAll, err := cfg.NewStores(Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAll()
		missThenHit(t, cache) // served by the store's in-memory fallback
		if _, err := ix.Stats(context.Background()); err == nil {
			t.Error("the index answers with Redis down")
		}
	})
	t.Run("redis down, fallback off", func(t *testing.T) {
		cfg := mustParse(t, strings.Replace(shared, "FALLBACK", "false", 1), nil)
		_, _, _, err := cfg.NewStores(Options{})
		if err == nil || !strings.HasPrefix(err.Error(), "response_cache.redis (redis://"+down+"): ") ||
			!errors.Is(err, respcache.ErrUnavailable) {
			t.Fatalf("err = %v", err)
		}
	})
}

// The client NewStores shares is the one redisstore.New would create.
func TestClientOptionMatchesNew(t *testing.T) {
	cfg := mustParse(t, minimalBackends+`
response_cache: {enabled: true, backend: redis, redis: {url: "redis://u:pw@127.0.0.1:6390/2", pool_size: 3, client_cache: true, client_cache_bytes: 4096}}
`, nil)
	opt, err := redisstore.ClientOption(cfg.redisConnection(redisstore.Config{}))
	if err != nil {
		t.Fatal(err)
	}
	if opt.InitAddress[0] != "127.0.0.1:6390" || opt.SelectDB != 2 || opt.Password != "pw" || opt.BlockingPoolSize != 3 ||
		opt.DisableCache || opt.CacheSizeEachConn != 4096 || opt.PipelineMultiplex != -1 || !opt.DisableRetry {
		t.Errorf("options %+v", opt)
	}
}
