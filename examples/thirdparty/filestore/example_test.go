package filestore_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/respcache"

	"example.com/thirdparty/filestore"
)

// A response stored under a request's cache key, read back after the Store was reopened, as after
// a restart of the gateway.
func Example() {
	tmp, err := os.MkdirTemp("", "filestore-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(tmp)
	dir := filepath.Join(tmp, "responses")
	ctx := context.Background()

	req, err := prefixkey.ParseOpenAIChat([]byte(`{"model":"m","temperature":0,"messages":[{"role":"user","content":"2+2?"}]}`))
	if err != nil {
		panic(err)
	}
	key := respcache.KeyFor(req)

	store, err := filestore.New(filestore.Config{Dir: dir})
	if err != nil {
		panic(err)
	}
	if err := store.Set(ctx, key, []byte(`{"content":"4"}`), time.Hour); err != nil {
		panic(err)
	}
	store.Close()

	store, err = filestore.New(filestore.Config{Dir: dir})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	v, ok, err := store.Get(ctx, key)
	fmt.Println(string(v), ok, err)
	fmt.Println(store.Stats(ctx).Entries, "entry")
	// Output:
	// {"content":"4"} true <nil>
	// 1 entry
}
