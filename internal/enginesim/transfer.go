package enginesim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// KVTransferParams is the kv_transfer_params object of prefill/decode disaggregation, in requests
// and in a prefill's response (field names as vLLM's disaggregated serving). See the package doc
// for the protocol.
type KVTransferParams struct {
	// DoRemotePrefill, in a decode request: the prompt's KV was computed by a prefill engine and
	// is in storage; load RemoteBlockKeys.
	DoRemotePrefill bool `json:"do_remote_prefill"`
	// DoRemoteDecode, in a prefill request: decoding happens elsewhere; write the prompt's KV to
	// storage and answer with the parameters of the decode request.
	DoRemoteDecode bool `json:"do_remote_decode"`
	// RemoteEngineID is the name of the engine that wrote the blocks.
	RemoteEngineID string `json:"remote_engine_id"`
	// RemoteStorage is where the blocks are (no credentials).
	RemoteStorage *RemoteStorage `json:"remote_storage"`
	// RemoteBlockKeys are the storage keys of the prompt's full blocks, in prompt order, as 16
	// lowercase hex digits: object <namespace>/<model>/<key>.
	RemoteBlockKeys []string `json:"remote_block_keys"`
	// NumPromptTokens is the prompt's length in tokens.
	NumPromptTokens int `json:"num_prompt_tokens"`
}

// RemoteStorage locates the blocks of a KVTransferParams.
type RemoteStorage struct {
	Endpoint  string `json:"endpoint"`
	Bucket    string `json:"bucket"`
	Namespace string `json:"namespace"`
}

// storageLoad is what a request read from storage: blocks from to from+n−1 of its prompt.
type storageLoad struct {
	from, n int
	time    time.Duration
}

// storageWindow is the most storage requests one request has in flight.
const storageWindow = 8

// maxWrittenKeys bounds the set of storage keys an engine remembers as stored; beyond it the set
// is cleared (storage is then asked again, and blocks announced again).
const maxWrittenKeys = 1 << 20

// lookupOn reports whether requests without kv_transfer_params take the storage path.
func (e *Engine) lookupOn() bool {
	if e.store == nil || e.cfg.Role == RolePrefill {
		return false
	}
	switch e.cfg.Storage.Lookup {
	case StorageLookupOn:
		return true
	case StorageLookupOff:
		return false
	}
	return e.cfg.Role == RoleDecode
}

// begin reads what the request needs from storage, then admits it.
func (e *Engine) begin(ctx context.Context, in Input) (*job, error) {
	kv := in.KVTransfer
	handoff := kv != nil && kv.DoRemoteDecode && e.cfg.Role != RoleDecode && e.store != nil
	e.mu.Lock()
	usable := !e.closed && !e.killed && !e.down
	e.mu.Unlock()
	var ld *storageLoad
	switch {
	case !usable:
	case kv != nil && kv.DoRemotePrefill && e.cfg.Role != RolePrefill:
		ld = e.loadBlocks(ctx, in.Tokens, kv, true)
	case (kv == nil || (!kv.DoRemotePrefill && !kv.DoRemoteDecode)) && e.lookupOn():
		ld = e.loadBlocks(ctx, in.Tokens, nil, false)
	}
	j, err := e.admit(ctx, in, ld)
	if err != nil {
		return nil, err
	}
	j.handoff = handoff
	if ld != nil {
		j.res.StorageLoad = ld.time
	}
	return j, nil
}

// loadBlocks reads from storage the blocks of tokens the engine does not hold (on either tier),
// up to the last block a hit may cover ((n−1)/BlockSize blocks), in prompt order, stopping at the
// first missing or unreadable one. With listed (kv_transfer_params), only the blocks listed in
// RemoteBlockKeys whose keys match the prompt's are read, and those not loaded are counted
// missing. It returns nil when nothing was read.
func (e *Engine) loadBlocks(ctx context.Context, tokens []uint32, kv *KVTransferParams, listed bool) *storageLoad {
	bs := e.cfg.BlockSize
	maxHit := 0
	if len(tokens) > 0 {
		maxHit = (len(tokens) - 1) / bs
	}
	to := maxHit
	var keys []uint64
	if listed {
		to = min(to, len(kv.RemoteBlockKeys))
		e.mu.Lock()
		e.stats.DecodeHandoffs++
		e.mu.Unlock()
	}
	e.mu.Lock()
	_, held := e.cache.lookup(tokens)
	e.mu.Unlock()
	if held >= to {
		return nil // the engine holds the prefix already: no read
	}
	wanted := to // blocks the caller asked for, up to the last usable one
	if e.store != nil && listed && !e.sameLocation(kv.RemoteStorage) {
		to = held // another bucket or namespace than this engine's: nothing can be read
	}
	if e.store == nil {
		to = held
	}
	if to > held {
		keys = storageKeys(make([]uint64, 0, len(tokens)/bs), e.cfg.Model, bs, tokens)
		if listed {
			for i := held; i < to; i++ {
				if k, ok := parseKey(kv.RemoteBlockKeys[i]); !ok || k != keys[i] {
					to = i // listed blocks that are not this prompt's
					break
				}
			}
		}
	}
	n, errs := 0, 0
	queried := to > held
	if queried {
		window := 1 // the storage path probes before it reads in parallel
		if listed {
			window = storageWindow
		}
		n, errs = e.fetchRange(ctx, keys, tokens, held, to, window)
	}
	bytes := int64(n) * int64(bs) * e.storageBytesPerToken()
	ld := &storageLoad{from: held, n: n, time: e.transferTime(bytes)}
	e.mu.Lock()
	if queried {
		e.stats.StorageLookups++
	}
	e.stats.StorageBlocksRead += uint64(n)
	e.stats.StorageBytesRead += uint64(bytes)
	e.stats.StorageReadTime += ld.time
	e.stats.StorageErrors += uint64(errs)
	if listed {
		e.stats.StorageMissingBlocks += uint64(wanted - held - n)
	}
	e.mu.Unlock()
	if n == 0 {
		return nil
	}
	return ld
}

// sameLocation reports whether rs names this engine's bucket and namespace (or is absent). The
// endpoint is not compared: engines may reach one server under different addresses.
func (e *Engine) sameLocation(rs *RemoteStorage) bool {
	if rs == nil {
		return true
	}
	sc := e.cfg.Storage
	return rs.Bucket == sc.Bucket && trimSlashes(rs.Namespace) == sc.Namespace
}

func trimSlashes(s string) string {
	for len(s) > 0 && s[0] == '/' {
		s = s[1:]
	}
	for len(s) > 0 && s[len(s)-1] == '/' {
		s = s[:len(s)-1]
	}
	return s
}

// fetchRange reads blocks from to to−1 in windows (starting at window requests, doubling up to
// storageWindow) and returns how many leading ones were read and matched the prompt, and the
// number of storage errors met (at most one counts: reading stops there).
func (e *Engine) fetchRange(ctx context.Context, keys []uint64, tokens []uint32, from, to, window int) (n, errs int) {
	bs := e.cfg.BlockSize
	type result struct {
		ok  bool
		err error
	}
	res := make([]result, storageWindow)
	for i := from; i < to; {
		w := min(window, to-i)
		var wg sync.WaitGroup
		for k := range w {
			wg.Go(func() {
				b := i + k
				obj, found, err := e.store.get(ctx, keys[b])
				if err == nil && found {
					err = checkBlock(obj, keys, b, tokens[b*bs:(b+1)*bs])
				}
				res[k] = result{ok: err == nil && found, err: err}
			})
		}
		wg.Wait()
		for k := range w {
			if !res[k].ok {
				if res[k].err != nil && ctx.Err() == nil {
					e.log.Debug("enginesim: storage read failed; computing locally", "engine", e.cfg.Name,
						"block", i+k, "error", res[k].err.Error())
					errs = 1
				}
				return n, errs
			}
			n++
		}
		i += w
		window = min(2*window, storageWindow)
	}
	return n, 0
}

func (e *Engine) storageBytesPerToken() int64 {
	if e.cfg.Storage == nil {
		return 0
	}
	return e.cfg.Storage.BytesPerToken
}

func (e *Engine) transferTime(bytes int64) time.Duration {
	if e.cfg.Storage == nil {
		return 0
	}
	return transferTime(bytes, e.cfg.Storage.BandwidthBytesPerSec)
}

// handOff, for a do_remote_decode prefill (j.handoff), writes every full block of tokens that is
// not known to be stored to storage (a HEAD first: blocks stored by any engine are not rewritten),
// announces the blocks on the storage tier (BlockStored, medium STORAGE, the engine's own block
// hashes), sleeps the write's transfer time and sets j.res.KVTransfer. Errors wrap
// ErrStorageUnavailable, or are ctx's or ErrClosed.
func (j *job) handOff(ctx context.Context, tokens []uint32) error {
	if !j.handoff {
		return nil
	}
	e := j.e
	bs := e.cfg.BlockSize
	keys := storageKeys(make([]uint64, 0, len(tokens)/bs), e.cfg.Model, bs, tokens)
	e.mu.Lock()
	var todo []int
	for i, k := range keys {
		if _, ok := e.written[k]; !ok {
			todo = append(todo, i)
		}
	}
	e.mu.Unlock()

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(j.ctx, cancel) // Kill and Close abort the writes
	defer stop()
	wrote := make([]bool, len(todo))
	errs := make([]error, len(todo))
	for lo := 0; lo < len(todo); lo += storageWindow {
		hi := min(lo+storageWindow, len(todo))
		var wg sync.WaitGroup
		for t := lo; t < hi; t++ {
			wg.Go(func() {
				i := todo[t]
				ok, err := e.store.exists(sctx, keys[i])
				if err == nil && !ok {
					err = e.store.put(sctx, keys[i], encodeBlock(keys, i, tokens[i*bs:(i+1)*bs]))
					wrote[t] = err == nil
				}
				errs[t] = err
			})
		}
		wg.Wait()
		if errors.Join(errs[lo:hi]...) != nil {
			break
		}
	}
	err := errors.Join(errs...)
	written := 0
	for _, w := range wrote {
		if w {
			written++
		}
	}
	bytes := int64(written) * int64(bs) * e.cfg.Storage.BytesPerToken
	store := e.transferTime(bytes)

	e.mu.Lock()
	e.stats.StorageBlocksWritten += uint64(written)
	e.stats.StorageBytesWritten += uint64(bytes)
	e.stats.StorageWriteTime += store
	if err != nil {
		if j.ctx.Err() != nil {
			e.mu.Unlock()
			return ErrClosed
		}
		if ctx.Err() != nil {
			e.mu.Unlock()
			return ctx.Err()
		}
		e.stats.StorageErrors++
		e.mu.Unlock()
		return fmt.Errorf("%w: writing the prompt's KV blocks: %w", ErrStorageUnavailable, err)
	}
	e.stats.StorageBlocksSkipped += uint64(len(todo) - written)
	e.stats.PrefillHandoffs++
	if j.gen == e.gen && !e.closed && !e.killed {
		e.announceLocked(tokens, keys, todo)
	}
	e.mu.Unlock()

	j.res.StorageStore = store
	sc := e.cfg.Storage
	p := &KVTransferParams{DoRemotePrefill: true, RemoteEngineID: e.cfg.Name,
		RemoteStorage:   &RemoteStorage{Endpoint: sc.Endpoint, Bucket: sc.Bucket, Namespace: sc.Namespace},
		RemoteBlockKeys: make([]string, len(keys)), NumPromptTokens: len(tokens)}
	for i, k := range keys {
		p.RemoteBlockKeys[i] = formatKey(k)
	}
	if err := j.sleep(ctx, store, false); err != nil {
		return err
	}
	j.res.KVTransfer = p
	return nil
}

// announceLocked records blocks idx of tokens (storage keys keys) as stored and publishes them on
// the storage tier, in runs of consecutive blocks, each with its parent's engine hash.
func (e *Engine) announceLocked(tokens []uint32, keys []uint64, idx []int) {
	if len(e.written)+len(idx) > maxWrittenKeys {
		clear(e.written)
	}
	e.cache.storageOps(tokens, idx)
	for _, i := range idx {
		e.written[keys[i]] = struct{}{}
	}
	e.stepLocked()
}
