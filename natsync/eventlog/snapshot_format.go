package eventlog

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"time"

	"github.com/kvroute/kvroute/kvindex"
)

// Snapshot format, version 2: the layout of version 1, with block keys of prefixkey.KeySpace 2
// (a snapshot of version 1 holds keys of the first block-key function, which an index of this
// version must not restore: Restore refuses it with ErrSnapshotMismatch, and the replica replays
// the stream). A snapshot is written and read as a stream of frames, so that
// neither side holds more than a frame (at most maxFrame bytes) of it:
//
//	"KVSNAP" 0x02
//	frames: uv payload length (≤ maxFrame), payload, CRC-32C of the payload (4 bytes LE)
//
// The first frame's payload is the header: str stream, str fleet, uv sequence, sv creation time
// (Unix ns), uv block size (0: unknown). The payloads of the next frames are records, each
// whole within its frame:
//
//	'b' str backend                         the records after it are the backend's
//	'k' key, parent (8 bytes each), 1 byte tiers, sv expiry (Unix ns, 0: none)
//	'h' hash (8 bytes), uv n (1..maxKeysPerHash), n × key (8 bytes)
//	'p' str prefix, uv tokens, 1 byte tiers, sv expiry
//	'e' uv record count                     the end; nothing may follow its frame
//
// A reader checks each frame's CRC before it restores any of its records, and counts the
// records against the end record: a truncated or corrupt snapshot is an error, though records of
// the frames before the damage may have been restored by then.
const (
	snapMagic       = "KVSNAP"
	snapVersion     = 2 // the version whose block keys are prefixkey.KeySpace 2
	maxFrame        = 256 << 10
	frameTarget     = 32 << 10 // a writer ends a frame past this
	maxKeysPerHash  = 4096
	restoreChunkLen = 4096 // records per Restorer.Restore call
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// SnapshotHeader describes a snapshot: the stream it follows, the fleet, the last stream sequence
// applied to the index before it was exported (a replica that restores it replays from Seq+1),
// when it was made, and the index's block size (0: unknown).
type SnapshotHeader struct {
	Stream    string    `json:"stream"`
	Fleet     string    `json:"fleet"`
	Seq       uint64    `json:"seq"`
	Created   time.Time `json:"created"`
	BlockSize int       `json:"block_size,omitempty"`
}

// SnapshotCounts counts what a snapshot holds.
type SnapshotCounts struct {
	Backends     int   `json:"backends"`
	Blocks       int   `json:"blocks"`
	EngineHashes int   `json:"engine_hashes"`
	Prefixes     int   `json:"prefixes"`
	Skipped      int   `json:"skipped,omitempty"` // records not written: beyond the format's limits
	Bytes        int64 `json:"bytes"`
}

// snapWriter frames records onto a buffered writer.
type snapWriter struct {
	w       *bufio.Writer
	buf     []byte
	n       int64
	counts  SnapshotCounts
	records uint64
}

func (s *snapWriter) flushFrame(force bool) error {
	if len(s.buf) == 0 || (!force && len(s.buf) < frameTarget) {
		return nil
	}
	var hdr [binary.MaxVarintLen64]byte
	k := binary.PutUvarint(hdr[:], uint64(len(s.buf)))
	if _, err := s.w.Write(hdr[:k]); err != nil {
		return err
	}
	if _, err := s.w.Write(s.buf); err != nil {
		return err
	}
	var sum [4]byte
	binary.LittleEndian.PutUint32(sum[:], crc32.Checksum(s.buf, crcTable))
	if _, err := s.w.Write(sum[:]); err != nil {
		return err
	}
	s.n += int64(k + len(s.buf) + 4)
	s.buf = s.buf[:0]
	return nil
}

func appendTime(dst []byte, t time.Time) []byte {
	if t.IsZero() {
		return binary.AppendVarint(dst, 0)
	}
	return binary.AppendVarint(dst, t.UnixNano())
}

// WriteSnapshot writes a snapshot of ex's state with header h to w, record by record as Export
// lists them (a frame of about 32 KiB at a time): it never holds the whole snapshot. It returns
// what it wrote; the error is Export's, w's, or ctx's.
func WriteSnapshot(ctx context.Context, w io.Writer, h SnapshotHeader, ex kvindex.Exporter) (SnapshotCounts, error) {
	s := &snapWriter{w: bufio.NewWriterSize(w, 64<<10), buf: make([]byte, 0, frameTarget+maxKeysPerHash*8+64)}
	if _, err := s.w.WriteString(snapMagic); err != nil {
		return s.counts, err
	}
	if err := s.w.WriteByte(snapVersion); err != nil {
		return s.counts, err
	}
	s.n = int64(len(snapMagic) + 1)
	s.buf = appendString(s.buf, h.Stream)
	s.buf = appendString(s.buf, h.Fleet)
	s.buf = binary.AppendUvarint(s.buf, h.Seq)
	s.buf = appendTime(s.buf, h.Created)
	s.buf = binary.AppendUvarint(s.buf, uint64(max(h.BlockSize, 0)))
	if err := s.flushFrame(true); err != nil {
		return s.counts, err
	}
	backend, first := "", true
	err := ex.Export(ctx, func(b string, r *kvindex.StateRecord) error {
		if len(b) > MaxStringBytes || len(r.Prefix) > MaxStringBytes || len(r.Keys) > maxKeysPerHash {
			s.counts.Skipped++
			return nil
		}
		if first || b != backend {
			if err := s.flushFrame(true); err != nil {
				return err
			}
			backend, first = b, false
			s.buf = append(s.buf, 'b')
			s.buf = appendString(s.buf, b)
			s.counts.Backends++
			s.records++
		}
		switch r.Kind {
		case kvindex.StateBlock:
			s.buf = append(s.buf, 'k')
			s.buf = binary.LittleEndian.AppendUint64(s.buf, r.Key)
			s.buf = binary.LittleEndian.AppendUint64(s.buf, r.Parent)
			s.buf = append(s.buf, byte(r.Tiers))
			s.buf = appendTime(s.buf, r.Expires)
			s.counts.Blocks++
		case kvindex.StateEngineHash:
			if len(r.Keys) == 0 {
				s.counts.Skipped++
				return nil
			}
			s.buf = append(s.buf, 'h')
			s.buf = binary.LittleEndian.AppendUint64(s.buf, r.Hash)
			s.buf = appendUint64s(s.buf, r.Keys)
			s.counts.EngineHashes++
		case kvindex.StatePrefix:
			s.buf = append(s.buf, 'p')
			s.buf = appendString(s.buf, r.Prefix)
			s.buf = binary.AppendUvarint(s.buf, uint64(max(r.Tokens, 0)))
			s.buf = append(s.buf, byte(r.Tiers))
			s.buf = appendTime(s.buf, r.Expires)
			s.counts.Prefixes++
		default:
			s.counts.Skipped++
			return nil
		}
		s.records++
		return s.flushFrame(false)
	})
	if err != nil {
		return s.counts, err
	}
	if err := s.flushFrame(true); err != nil {
		return s.counts, err
	}
	s.buf = append(s.buf, 'e')
	s.buf = binary.AppendUvarint(s.buf, s.records)
	if err := s.flushFrame(true); err != nil {
		return s.counts, err
	}
	s.counts.Bytes = s.n
	return s.counts, s.w.Flush()
}

// snapReader reads frames.
type snapReader struct {
	r     *bufio.Reader
	frame []byte
	n     int64
}

// next reads the next frame's payload; io.EOF at a clean end of input.
func (s *snapReader) next() ([]byte, error) {
	size, err := binary.ReadUvarint(s.r)
	if err == io.EOF {
		return nil, io.EOF
	}
	if err != nil {
		return nil, fmt.Errorf("%w: snapshot frame length: %v", ErrMalformed, err)
	}
	if size == 0 || size > maxFrame {
		return nil, fmt.Errorf("%w: snapshot frame of %d bytes", ErrMalformed, size)
	}
	if cap(s.frame) < int(size)+4 {
		s.frame = make([]byte, int(size)+4)
	}
	f := s.frame[:size+4]
	if _, err := io.ReadFull(s.r, f); err != nil {
		return nil, fmt.Errorf("%w: snapshot frame: %v", ErrMalformed, err)
	}
	payload := f[:size]
	if crc32.Checksum(payload, crcTable) != binary.LittleEndian.Uint32(f[size:]) {
		return nil, fmt.Errorf("%w: snapshot frame checksum mismatch", ErrMalformed)
	}
	s.n += int64(size) + 4 + int64(uvarintLen(size))
	return payload, nil
}

func uvarintLen(v uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], v)
}

func readTime(r *reader, what string) time.Time {
	ns := r.varint(what)
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// readSnapshotHeader reads a snapshot's magic and header frame.
func readSnapshotHeader(s *snapReader) (SnapshotHeader, error) {
	var magic [len(snapMagic) + 1]byte
	if _, err := io.ReadFull(s.r, magic[:]); err != nil {
		return SnapshotHeader{}, fmt.Errorf("%w: snapshot header: %v", ErrMalformed, err)
	}
	if string(magic[:len(snapMagic)]) != snapMagic {
		return SnapshotHeader{}, fmt.Errorf("%w: not a snapshot", ErrMalformed)
	}
	if v := magic[len(snapMagic)]; v != snapVersion {
		if v == 1 {
			return SnapshotHeader{}, fmt.Errorf("%w: snapshot version %d holds block keys of another key space (this router's: %d)", ErrSnapshotMismatch, v, snapVersion)
		}
		return SnapshotHeader{}, fmt.Errorf("%w: snapshot version %d, want %d", ErrMalformed, v, snapVersion)
	}
	s.n = int64(len(magic))
	payload, err := s.next()
	if err == io.EOF {
		err = fmt.Errorf("%w: snapshot without a header", ErrMalformed)
	}
	if err != nil {
		return SnapshotHeader{}, err
	}
	r := reader{b: payload}
	h := SnapshotHeader{
		Stream: string(r.bytes("stream")),
		Fleet:  string(r.bytes("fleet")),
		Seq:    r.uvarint("seq"),
	}
	h.Created = readTime(&r, "created")
	bs := r.uvarint("block size")
	if bs > MaxBlockSize {
		r.fail("block size %d", bs)
	}
	h.BlockSize = int(bs)
	if r.err == nil && len(r.b) != 0 {
		r.fail("header: %d trailing bytes", len(r.b))
	}
	return h, r.err
}

// readSnapshotRecords reads the records after the header and restores them into rs, a chunk of
// at most restoreChunkLen records of one backend at a time, each frame checked before any of its
// records is restored. touched is called with each backend before its first Restore.
func readSnapshotRecords(ctx context.Context, s *snapReader, rs kvindex.Restorer, touched func(string)) (SnapshotCounts, error) {
	var counts SnapshotCounts
	var records uint64
	var chunk []kvindex.StateRecord
	var keys []uint64
	backend, haveBackend := "", false
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		err := rs.Restore(ctx, backend, chunk)
		chunk, keys = chunk[:0], keys[:0]
		return err
	}
	for {
		if err := ctx.Err(); err != nil {
			return counts, err
		}
		payload, err := s.next()
		if err == io.EOF {
			return counts, fmt.Errorf("%w: snapshot truncated (no end record)", ErrMalformed)
		}
		if err != nil {
			return counts, err
		}
		r := reader{b: payload}
		for len(r.b) > 0 && r.err == nil {
			kind := r.byte("record kind")
			if kind != 'b' && kind != 'e' && !haveBackend {
				r.fail("record %q before a backend", kind)
				break
			}
			var rec kvindex.StateRecord
			switch kind {
			case 'b':
				name := r.str("backend", backend)
				if r.err != nil {
					break
				}
				if err := flush(); err != nil {
					return counts, err
				}
				backend, haveBackend = name, true
				touched(backend)
				counts.Backends++
				records++
				continue
			case 'k':
				rec = kvindex.StateRecord{Kind: kvindex.StateBlock, Key: r.uint64("key"), Parent: r.uint64("parent"),
					Tiers: kvindex.TierSet(r.byte("tiers"))}
				rec.Expires = readTime(&r, "expires")
				counts.Blocks++
			case 'h':
				rec = kvindex.StateRecord{Kind: kvindex.StateEngineHash, Hash: r.uint64("hash")}
				n := r.count("keys", 8)
				if r.err == nil && (n == 0 || n > maxKeysPerHash) {
					r.fail("engine hash with %d keys", n)
				}
				from := len(keys)
				for range n {
					keys = append(keys, r.uint64("key"))
				}
				rec.Keys = keys[from:len(keys):len(keys)]
				counts.EngineHashes++
			case 'p':
				rec = kvindex.StateRecord{Kind: kvindex.StatePrefix, Prefix: string(r.bytes("prefix"))}
				tokens := r.uvarint("tokens")
				if tokens > 1<<40 {
					r.fail("prefix of %d tokens", tokens)
				}
				rec.Tokens = int(tokens)
				rec.Tiers = kvindex.TierSet(r.byte("tiers"))
				rec.Expires = readTime(&r, "expires")
				counts.Prefixes++
			case 'e':
				n := r.uvarint("record count")
				switch {
				case r.err != nil:
				case len(r.b) != 0:
					r.fail("%d bytes after the end record", len(r.b))
				case n != records:
					r.fail("end record counts %d records, read %d", n, records)
				}
				if r.err != nil {
					return counts, r.err
				}
				if err := flush(); err != nil {
					return counts, err
				}
				if _, err := s.r.ReadByte(); err != io.EOF {
					return counts, fmt.Errorf("%w: data after the end of the snapshot", ErrMalformed)
				}
				counts.Bytes = s.n
				return counts, nil
			default:
				r.fail("unknown record kind %q", kind)
			}
			if r.err != nil {
				break
			}
			records++
			chunk = append(chunk, rec)
			if len(chunk) == restoreChunkLen {
				// Keys point into keys: restore before reusing it.
				if err := flush(); err != nil {
					return counts, err
				}
			}
		}
		if r.err != nil {
			return counts, r.err
		}
		// The frame checked out whole: its records may be restored.
		if err := flush(); err != nil {
			return counts, err
		}
	}
}

// ReadSnapshot reads a snapshot from rd (as WriteSnapshot writes it) and restores its records
// into rs, a frame at a time: it holds at most one frame and restoreChunkLen records. It returns
// the header and what it read. The error wraps ErrMalformed for input that is not a whole, intact
// snapshot of a known version; or is rs's, or ctx's. After an error, rs may hold the records of
// the frames read before it.
func ReadSnapshot(ctx context.Context, rd io.Reader, rs kvindex.Restorer) (SnapshotHeader, SnapshotCounts, error) {
	s := &snapReader{r: bufio.NewReaderSize(rd, 64<<10)}
	h, err := readSnapshotHeader(s)
	if err != nil {
		return h, SnapshotCounts{}, err
	}
	counts, err := readSnapshotRecords(ctx, s, rs, func(string) {})
	return h, counts, err
}
