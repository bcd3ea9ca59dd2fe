package enginesim

import (
	"encoding/binary"
	"math"
)

// A minimal msgpack writer for KV-event batches (msgpack spec, github.com/msgpack/msgpack
// spec.md): integers in their smallest encoding, as msgspec and vLLM write them.

func mpArray(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func mpMap(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xde, byte(n>>8), byte(n))
	default:
		return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func mpStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func mpBin(b []byte, p []byte) []byte {
	n := len(p)
	switch {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xc5, byte(n>>8), byte(n))
	default:
		b = append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, p...)
}

func mpNil(b []byte) []byte { return append(b, 0xc0) }

func mpUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
	}
}

func mpInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return mpUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return append(b, 0xd1, byte(v>>8), byte(v))
	case v >= math.MinInt32:
		return append(b, 0xd2, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
	}
}

func mpFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}

// batchEncoder writes KV-event batches in vLLM's wire format.
type batchEncoder struct {
	mapForm   bool
	hashes    HashEncoding
	blockSize int
	dpRank    int
}

func (e *batchEncoder) hash(b []byte, h uint64) []byte {
	switch e.hashes {
	case HashInt:
		return mpInt(b, int64(h))
	case HashBytes:
		var d [32]byte
		binary.BigEndian.PutUint64(d[0:], h^0x5851f42d4c957f2d) // filler: any bytes; only the last 8 count
		binary.BigEndian.PutUint64(d[8:], h*0x9e3779b97f4a7c15)
		binary.BigEndian.PutUint64(d[16:], ^h)
		binary.BigEndian.PutUint64(d[24:], h)
		return mpBin(b, d[:])
	default:
		return mpUint(b, h)
	}
}

func (e *batchEncoder) hashList(b []byte, hs []uint64) []byte {
	b = mpArray(b, len(hs))
	for _, h := range hs {
		b = e.hash(b, h)
	}
	return b
}

// appendBatch appends one batch, [ts, events, data_parallel_rank] or {"ts", "events",
// "data_parallel_rank"}, holding ops as events.
func (e *batchEncoder) appendBatch(b []byte, ts float64, ops []op) []byte {
	if e.mapForm {
		b = mpMap(b, 3)
		b = mpStr(b, "ts")
		b = mpFloat64(b, ts)
		b = mpStr(b, "events")
	} else {
		b = mpArray(b, 3)
		b = mpFloat64(b, ts)
	}
	b = mpArray(b, len(ops))
	for i := range ops {
		b = e.appendEvent(b, &ops[i])
	}
	if e.mapForm {
		b = mpStr(b, "data_parallel_rank")
	}
	return mpInt(b, int64(e.dpRank))
}

// appendEvent writes one event. Array form (msgspec array_like, tag first, trailing defaults
// omitted):
//
//	["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
//	["BlockRemoved", block_hashes, medium]
//	["AllBlocksCleared"]
//
// Map form: the same fields by name with "type" first (BlockStored also with "lora_name": nil).
func (e *batchEncoder) appendEvent(b []byte, o *op) []byte {
	switch o.kind {
	case opStored:
		if e.mapForm {
			b = mpMap(b, 8)
			b = mpStr(b, "type")
			b = mpStr(b, "BlockStored")
			b = mpStr(b, "block_hashes")
		} else {
			b = mpArray(b, 7)
			b = mpStr(b, "BlockStored")
		}
		b = e.hashList(b, o.hashes)
		if e.mapForm {
			b = mpStr(b, "parent_block_hash")
		}
		if o.hasParent {
			b = e.hash(b, o.parent)
		} else {
			b = mpNil(b)
		}
		if e.mapForm {
			b = mpStr(b, "token_ids")
		}
		b = mpArray(b, len(o.tokens))
		for _, t := range o.tokens {
			b = mpUint(b, uint64(t))
		}
		if e.mapForm {
			b = mpStr(b, "block_size")
		}
		b = mpUint(b, uint64(e.blockSize))
		if e.mapForm {
			b = mpStr(b, "lora_id")
		}
		b = mpNil(b)
		if e.mapForm {
			b = mpStr(b, "medium")
		}
		b = mpStr(b, o.tier.String())
		if e.mapForm {
			b = mpStr(b, "lora_name")
			b = mpNil(b)
		}
	case opRemoved:
		if e.mapForm {
			b = mpMap(b, 3)
			b = mpStr(b, "type")
			b = mpStr(b, "BlockRemoved")
			b = mpStr(b, "block_hashes")
		} else {
			b = mpArray(b, 3)
			b = mpStr(b, "BlockRemoved")
		}
		b = e.hashList(b, o.hashes)
		if e.mapForm {
			b = mpStr(b, "medium")
		}
		b = mpStr(b, o.tier.String())
	default:
		if e.mapForm {
			b = mpMap(b, 1)
			b = mpStr(b, "type")
		} else {
			b = mpArray(b, 1)
		}
		b = mpStr(b, "AllBlocksCleared")
	}
	return b
}
