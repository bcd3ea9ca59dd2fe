package zmqevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
)

// errFrameTooLarge is returned by frameGuard for a message above the size cap.
var errFrameTooLarge = errors.New("zmq message exceeds MaxMessageSize")

// frameGuard follows the ZMTP 3 framing of the bytes read through it and fails the read that
// announces a frame (or a multi-frame message) larger than max, or a message of more than
// zmtpMaxFrames frames — before the codec allocates a buffer of the announced size.
type frameGuard struct {
	net.Conn
	max      uint64
	greeting int // greeting bytes still to pass through

	state  uint8 // 0 flags, 1 size, 2 body
	long   bool
	more   bool
	size   [8]byte
	sizeN  int
	remain uint64
	total  uint64 // bytes of the current message so far
	frames int    // frames of the current message so far
	err    error  // sticky: the cap was exceeded
}

// Read reads from the connection and checks the frame headers it saw. Once a header is over
// the cap every read fails, returning no bytes (io.ReadFull would drop an error that came with
// a full buffer).
func (g *frameGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.Conn.Read(p)
	if g.err = g.scan(p[:n]); g.err != nil {
		return 0, g.err
	}
	return n, err
}

func (g *frameGuard) scan(b []byte) error {
	for len(b) > 0 {
		switch {
		case g.greeting > 0:
			k := min(g.greeting, len(b))
			g.greeting -= k
			b = b[k:]
		case g.state == 0:
			flags := b[0]
			g.long, g.more = flags&0x02 != 0, flags&0x01 != 0 && flags&0x04 == 0
			g.state, g.sizeN = 1, 0
			if g.frames++; g.frames > zmtpMaxFrames {
				return fmt.Errorf("%w: more than %d frames", errFrameTooLarge, zmtpMaxFrames)
			}
			b = b[1:]
		case g.state == 1:
			need := 1
			if g.long {
				need = 8
			}
			k := copy(g.size[g.sizeN:need], b)
			g.sizeN += k
			b = b[k:]
			if g.sizeN < need {
				continue
			}
			size := uint64(g.size[0])
			if g.long {
				size = binary.BigEndian.Uint64(g.size[:])
			}
			if size > g.max || g.total+size > g.max {
				return fmt.Errorf("%w: frame of %d bytes (cap %d)", errFrameTooLarge, size, g.max)
			}
			g.total += size
			g.remain, g.state = size, 2
			if size == 0 {
				g.endFrame()
			}
		default:
			k := min(g.remain, uint64(len(b)))
			g.remain -= k
			b = b[k:]
			if g.remain == 0 {
				g.endFrame()
			}
		}
	}
	return nil
}

func (g *frameGuard) endFrame() {
	g.state = 0
	if !g.more {
		g.total, g.frames = 0, 0
	}
}
