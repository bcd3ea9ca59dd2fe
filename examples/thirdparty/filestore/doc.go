// Package filestore shows a respcache.CacheStore written outside kvroute: the response cache on
// the local filesystem, one file per entry under a directory, so that cached responses survive a
// restart of the gateway and may outgrow its memory.
//
// Each entry is a file named by the SHA-256 of its key in hex (64 digits and ".kvr"), whatever
// the key holds: a key cannot name a path ("../x", "/etc/passwd", "a\x00b", "CON" all become
// digests), and every file operation goes through an os.Root, which refuses any path, or symbolic
// link, leading out of the directory. The file holds a header (a magic number, the expiry, the
// key) and the value; Get checks all three, so a file renamed onto another entry's name reads as
// corrupt, not as that entry. A Set writes a temporary file and renames it over the entry, so a
// reader sees the old or the new value, never a mix, and a crash leaves at most a temporary file,
// removed by the next New.
//
// Limits: MaxEntries files and MaxBytes bytes in all, evicting about the least recently used entry
// (sampled, as Redis does) when a Set goes over; a file of more than MaxEntryBytes (header, key and
// value) is refused with respcache.ErrTooLarge. Expired entries are misses; they are removed when
// a Get finds them, when eviction samples them, and by New. There is no goroutine.
//
// Threat model: whoever can write into the directory can plant entries and so serve any response
// to any tenant (cache poisoning), so New refuses, outside Windows, a directory that its group or
// others may write, and creates a missing one with mode 0700 and files with mode 0600 (responses
// are private to their tenants). One Store owns its directory: two Stores, or two processes, on
// one directory keep separate accounts of it and may exceed the limits or count wrongly.
//
// What it shows of the plug point: a CacheStore's Get returns (value, true, nil) for a hit, whose
// value the caller owns, (nil, false, nil) for a miss and (nil, false, err) when it cannot answer;
// ttl ≤ 0 means the store's default; Clear counts what it removed; Stats never fails and reports
// errors by respcache.ErrorTypeOf's types. The package passes kvroute's conformance suite,
// package respcache/cachetest.
//
//	store, err := filestore.New(filestore.Config{Dir: "/var/cache/kvroute", MaxBytes: 10 << 30})
//	if err != nil {
//		return err
//	}
//	defer store.Close()
//	cache, err := respcache.New(respcache.Config{Store: store, TTL: time.Hour})
//	…
//	http.Handle("/v1/", cache.Middleware(proxy))
package filestore
