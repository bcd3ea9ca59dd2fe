// Package mapindex shows a kvindex.KvCacheIndex written outside kvroute: the KV-block index as Go
// maps behind one mutex, a few hundred lines a reader can check against the rules, where
// kvindex.MemoryIndex is built for speed. It takes the engines' KV events (events.Sink), answers
// Lookup and LookupPrefix, takes Speculate's predicted entries and reports Stats.
//
// It re-keys events with the rules package kvindex exports for indexes of one's own, and with
// nothing else of kvroute's: kvindex.CheckStored validates a BlockStored and gives the index
// blocks per engine block; kvindex.StoredRoot and a per-backend map from engine hash to index keys
// give the parent of the event's first block; kvindex.AppendStoredKeys gives the chained block
// keys, those prefixkey.AppendBlockKeys gives a request with the same tokens; kvindex.EventTier
// and kvindex.PrefixRule give the tiers; kvindex.Mutation and kvindex.DropReason name the Stats
// counters. The package passes kvroute's conformance suite, package kvindex/indextest.
//
// One rule it adds, as kvindex.MemoryIndex has it but the exported rules do not say: an engine
// that stores a child block holds the chain before it, so a BlockStored with a parent holds the
// parent's blocks, and theirs, for EntryTTL again; a hot prefix the engine keeps without
// announcing it again does not expire under its fresh continuations.
//
// Memory: every (block, backend) membership is a map entry, and expired ones stay until Sweep,
// which the owner calls on its own schedule (there is no goroutine); nothing else bounds the
// index. Lookups share a read lock; events, Speculate and Sweep take the write lock.
//
//	ix, err := mapindex.New(mapindex.Config{DefaultModel: "llama-3-8b"})
//	if err != nil {
//		return err
//	}
//	r, err := kvroute.New(kvroute.Config{Backends: backends, KV: &kvroute.KVConfig{Index: ix}})
//	// feed ix from the engines' events (events/zmqevents), and call ix.Sweep every minute or so
package mapindex
