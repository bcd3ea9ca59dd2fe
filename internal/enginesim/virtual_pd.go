package enginesim

import (
	"fmt"
	"math"
	"time"

	"github.com/kvroute/kvroute/events"
)

// VirtualStorage is the external KV storage of prefill/decode disaggregation for VirtualEngines:
// the Engine's storage handoff (see the package doc, "Prefill/decode disaggregation") in virtual
// time, without a bucket. A prefill engine writes a prompt's full blocks (Write) and announces
// them on the storage tier; a decode engine reads the blocks of a prompt it lacks (Submit) and
// places them on its GPU before its prefill. Blocks are keyed by their storage keys, as the
// Engine's objects are, so that every engine of the model and block size finds the same blocks
// whatever its hash seed; they are never deleted (the Engine's objects are not either).
//
// Moving b bytes takes b / BandwidthBytesPerSec of virtual time, a block being BlockSize ×
// BytesPerToken bytes; each transfer has the whole bandwidth (transfers do not contend, as the
// Engine's do not). A read happens after the request's admission and before its prefill, which
// starts when the read is over and the engine's compute is free; a write happens after the
// prefill, and the caller accounts for its time (VirtualTransfer.Time).
//
// A VirtualStorage is not safe for concurrent use: a simulation drives it and its engines from one
// goroutine, with non-decreasing times.
type VirtualStorage struct {
	model string
	bs    int
	bpt   int64
	bw    float64
	keys  map[uint64]struct{}
	// announced: per engine, the storage keys it announced (the Engine's written set).
	announced map[*VirtualEngine]map[uint64]struct{}
	// loads: per decode engine, the read time of each submitted request not yet started.
	loads map[*VirtualEngine]map[uint64]VirtualTransfer
	stats VirtualStorageStats
}

// VirtualStorageStats counts a VirtualStorage's traffic.
type VirtualStorageStats struct {
	BlocksWritten, BlocksSkipped, BlocksRead uint64
	BytesWritten, BytesRead                  int64
	WriteTime, ReadTime                      time.Duration
}

// VirtualTransfer is one write or read: the blocks moved, their simulated size and virtual time.
type VirtualTransfer struct {
	Blocks int
	Bytes  int64
	Time   time.Duration
}

// NewVirtualStorage returns an empty storage for engines serving model with blockSize-token
// blocks. bytesPerToken and bandwidth (bytes per second) of 0 mean DefaultBytesPerToken and
// DefaultStorageBandwidth; negative, NaN or infinite values, or a blockSize < 1, are errors
// wrapping ErrInvalidConfig.
func NewVirtualStorage(model string, blockSize int, bytesPerToken int64, bandwidth float64) (*VirtualStorage, error) {
	switch {
	case blockSize < 1:
		return nil, fmt.Errorf("%w: block size %d", ErrInvalidConfig, blockSize)
	case bytesPerToken < 0:
		return nil, fmt.Errorf("%w: BytesPerToken %d: want ≥ 0", ErrInvalidConfig, bytesPerToken)
	case bandwidth < 0, math.IsNaN(bandwidth), math.IsInf(bandwidth, 0):
		return nil, fmt.Errorf("%w: BandwidthBytesPerSec %v: want a finite value ≥ 0", ErrInvalidConfig, bandwidth)
	}
	if bytesPerToken == 0 {
		bytesPerToken = DefaultBytesPerToken
	}
	if bandwidth == 0 {
		bandwidth = DefaultStorageBandwidth
	}
	return &VirtualStorage{model: model, bs: blockSize, bpt: bytesPerToken, bw: bandwidth,
		keys: make(map[uint64]struct{}), announced: make(map[*VirtualEngine]map[uint64]struct{}),
		loads: make(map[*VirtualEngine]map[uint64]VirtualTransfer)}, nil
}

// Stats returns the traffic counters.
func (s *VirtualStorage) Stats() VirtualStorageStats { return s.stats }

// Stored returns how many leading full blocks of tokens the storage holds.
func (s *VirtualStorage) Stored(tokens []uint32) int {
	n := 0
	for _, k := range storageKeys(make([]uint64, 0, len(tokens)/s.bs), s.model, s.bs, tokens) {
		if _, ok := s.keys[k]; !ok {
			break
		}
		n++
	}
	return n
}

func (s *VirtualStorage) transfer(blocks int) VirtualTransfer {
	b := int64(blocks) * int64(s.bs) * s.bpt
	return VirtualTransfer{Blocks: blocks, Bytes: b, Time: transferTime(b, s.bw)}
}

// Write is a prefill engine's handoff of tokens, as Engine does after a do_remote_decode prefill:
// every full block not yet in storage is written (blocks stored by any engine are skipped), and
// every block v has not announced before is announced as a storage-tier BlockStored event with v's
// own block hashes (TakeEvents returns it). It returns the blocks written and their time, which
// the caller adds after the prefill. v's block size must be the storage's.
func (s *VirtualStorage) Write(v *VirtualEngine, tokens []uint32) VirtualTransfer {
	keys := storageKeys(make([]uint64, 0, len(tokens)/s.bs), s.model, s.bs, tokens)
	ann := s.announced[v]
	if ann == nil {
		ann = make(map[uint64]struct{})
		s.announced[v] = ann
	}
	var todo []int
	written := 0
	for i, k := range keys {
		if _, ok := ann[k]; ok {
			continue
		}
		todo = append(todo, i)
		if _, ok := s.keys[k]; ok {
			s.stats.BlocksSkipped++
			continue
		}
		s.keys[k] = struct{}{}
		written++
	}
	t := s.transfer(written)
	s.stats.BlocksWritten += uint64(written)
	s.stats.BytesWritten += t.Bytes
	s.stats.WriteTime += t.Time
	if len(todo) == 0 {
		return t
	}
	v.cache.storageOps(tokens, todo)
	for _, i := range todo {
		ann[keys[i]] = struct{}{}
	}
	return t
}

// Submit is VirtualEngine.Submit for a decode engine reading from s, as Engine does for
// do_remote_prefill and on the storage path: the prompt's full blocks beyond those v holds (GPU or
// CPU tier), up to the last block a hit may cover ((n−1)/BlockSize), are read in order up to the
// first one s lacks, and placed on v's GPU as cached blocks (GPU BlockStored events) before the
// request is planned, so that they count in its hit. The read's time is spent after admission:
// the request's prefill starts at max(admission + read, v's compute free), and its first token
// and finish follow. The returned VirtualTransfer is the read (zero when nothing was read); the
// error is Submit's. Requests of v started by a later Finish must go through s.Finish, so that
// their read time applies.
func (s *VirtualStorage) Submit(v *VirtualEngine, now time.Time, id uint64, in Input, dst []VirtualStart) ([]VirtualStart, VirtualTransfer, error) {
	var t VirtualTransfer
	bs := s.bs
	if len(in.Tokens) > 0 && len(in.Tokens)+in.OutputTokens <= v.cfg.MaxModelLen {
		to := (len(in.Tokens) - 1) / bs
		_, held := v.cache.lookup(in.Tokens)
		if held < to {
			keys := storageKeys(make([]uint64, 0, to), s.model, bs, in.Tokens[:to*bs])
			n := held
			for n < to {
				if _, ok := s.keys[keys[n]]; !ok {
					break
				}
				n++
			}
			if n > held {
				v.cache.insertLoaded(in.Tokens, held, n)
				t = s.transfer(n - held) // read whether or not the cache had room to place it all
			}
		}
	}
	mark := len(dst)
	saved := append([]time.Time(nil), v.units...)
	dst, err := v.Submit(now, id, in, dst)
	if err != nil {
		return dst, VirtualTransfer{}, err
	}
	s.stats.BlocksRead += uint64(t.Blocks)
	s.stats.BytesRead += t.Bytes
	s.stats.ReadTime += t.Time
	if t.Time > 0 {
		m := s.loads[v]
		if m == nil {
			m = make(map[uint64]VirtualTransfer)
			s.loads[v] = m
		}
		m[id] = t
	}
	s.retime(v, saved, dst[mark:])
	return dst, t, nil
}

// Finish is VirtualEngine.Finish for a decode engine that s.Submit fed: the requests it starts
// spend their read time before their prefill.
func (s *VirtualStorage) Finish(v *VirtualEngine, now time.Time, id uint64, dst []VirtualStart) []VirtualStart {
	mark := len(dst)
	saved := append([]time.Time(nil), v.units...)
	dst = v.Finish(now, id, dst)
	s.retime(v, saved, dst[mark:])
	return dst
}

// retime redoes the compute-unit schedule of the requests v just started (units restored to
// saved, their state before the call), with each request's read between its admission and its
// prefill.
func (s *VirtualStorage) retime(v *VirtualEngine, saved []time.Time, starts []VirtualStart) {
	m := s.loads[v]
	if len(starts) == 0 || len(m) == 0 {
		return
	}
	copy(v.units, saved)
	for i := range starts {
		st := &starts[i]
		ld := m[st.ID]
		delete(m, st.ID)
		enq := st.PrefillStart.Add(-st.Result.Queued)
		pre := st.Start.Add(ld.Time)
		if len(v.units) > 0 {
			u := 0
			for j := range v.units {
				if v.units[j].Before(v.units[u]) {
					u = j
				}
			}
			if v.units[u].After(pre) {
				pre = v.units[u]
			}
			v.units[u] = pre.Add(st.Result.Prefill)
		}
		st.Result.StorageLoad, st.Result.StorageTokens = ld.Time, ld.Blocks*s.bs
		st.Result.Queued = pre.Sub(enq)
		st.PrefillStart = pre
		st.FirstToken = pre.Add(st.Result.Prefill)
		st.Finish = st.FirstToken.Add(st.Result.Decode)
	}
}

// TakeEvents is TakeBatch with the storage tier: the BlockStored events of VirtualStorage.Write
// carry events.TierStorage (medium STORAGE), as the Engine publishes them. An engine that writes
// to a VirtualStorage must be drained with TakeEvents rather than TakeBatch.
func (v *VirtualEngine) TakeEvents(now time.Time) (events.Batch, bool) {
	var storage []int
	for i := range v.cache.ops {
		if v.cache.ops[i].tier == TierStorage {
			storage = append(storage, i)
		}
	}
	b, ok := v.TakeBatch(now)
	for _, i := range storage {
		b.Events[i].Tier = events.TierStorage
	}
	return b, ok
}
